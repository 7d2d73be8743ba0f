// RMSNorm family: float64 reference within tolerance, an independent spelling of the documented order (bits),
// BF16/F32 weights and the GGUF (1 + w)-stored form, per-head and fused variants equal the plain op, thread
// and batch invariance.
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/ops_elementwise.h"
#include "backend/cpu/ops_norm.h"
#include "cpu/ops_test_util.h"

namespace memra::cpu::test {
namespace {

constexpr float kEps = 1e-5f;

// Independent order: squares, canonical sum, / d, + eps, 1 / sqrt, then (x * inv) * (1 + w).
std::vector<float> reference_bits(const std::vector<float> &x, int64_t d, const std::vector<float> &w, bool add_one,
                                  float eps) {
    std::vector<float> y(x.size());
    for (size_t r = 0; r < x.size() / static_cast<size_t>(d); ++r) {
        const float *row = x.data() + r * static_cast<size_t>(d);
        std::vector<float> sq(static_cast<size_t>(d));
        for (int64_t i = 0; i < d; ++i) sq[static_cast<size_t>(i)] = row[i] * row[i];
        const float mean = canonical_sum(sq) / static_cast<float>(d);
        const float inv = 1.0f / std::sqrt(mean + eps);
        for (int64_t i = 0; i < d; ++i) {
            const float f = add_one ? 1.0f + w[static_cast<size_t>(i)] : w[static_cast<size_t>(i)];
            y[r * static_cast<size_t>(d) + static_cast<size_t>(i)] = (row[i] * inv) * f;
        }
    }
    return y;
}

// Weights as stored (bf16 bit patterns and their exact float values).
struct Weights {
    std::vector<uint16_t> bf16;
    std::vector<float> values;  // exact f32 values of the bf16 weights
};

Weights make_weights(int64_t d, uint32_t seed) {
    Weights w;
    for (float v : random_floats(static_cast<size_t>(d), seed, -0.5f, 0.5f)) {
        w.bf16.push_back(to_bf16_trunc(v));
        w.values.push_back(bf16_value(w.bf16.back()));
    }
    return w;
}

TEST(OpsNorm, RmsNormMatchesDocumentedOrderAndFloat64) {
    ThreadPool pool(2);
    for (int64_t d : {1, 7, 16, 17, 128, 1000, 4096}) {
        const int64_t rows = 5;
        std::vector<float> x = random_floats(static_cast<size_t>(rows * d), 100 + static_cast<uint32_t>(d), -4.0f, 4.0f);
        x[0] = 0.0f;  // zero entries are fine
        const Weights w = make_weights(d, 7);
        for (bool bf16 : {true, false}) {
            const NormWeight nw{bf16 ? static_cast<const void *>(w.bf16.data()) : w.values.data(),
                                bf16 ? DType::kBF16 : DType::kF32, true};
            std::vector<float> y(x.size());
            rms_norm(pool, x.data(), rows, d, nw, kEps, y.data());
            MEMRA_EXPECT_SAME_BITS(y, reference_bits(x, d, w.values, true, kEps));
            for (int64_t r = 0; r < rows; ++r) {
                double ss = 0.0;
                for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(x[r * d + i]) * x[r * d + i];
                const double inv = 1.0 / std::sqrt(ss / static_cast<double>(d) + static_cast<double>(kEps));
                for (int64_t i = 0; i < d; ++i) {
                    const double ref = static_cast<double>(x[r * d + i]) * inv * (1.0 + w.values[i]);
                    ASSERT_NEAR(y[r * d + i], ref, 1e-6 * std::fabs(ref) + 1e-7) << d << " " << r << " " << i;
                }
            }
        }
    }
}

TEST(OpsNorm, StoredOnePlusWeightAndInPlace) {
    ThreadPool pool(1);
    const int64_t d = 48;
    const std::vector<float> x = random_floats(3 * d, 5, -2.0f, 2.0f);
    const Weights w = make_weights(d, 8);
    // GGUF stores (1 + w): add_one = false with that vector gives the same bits as add_one = true with w
    // whenever 1 + w is exact in the stored dtype (here: f32 of bf16 values near 0, exact).
    std::vector<float> one_plus(static_cast<size_t>(d));
    for (int64_t i = 0; i < d; ++i) one_plus[i] = 1.0f + w.values[i];
    std::vector<float> a(x.size()), b(x.size());
    rms_norm(pool, x.data(), 3, d, NormWeight{w.values.data(), DType::kF32, true}, kEps, a.data());
    rms_norm(pool, x.data(), 3, d, NormWeight{one_plus.data(), DType::kF32, false}, kEps, b.data());
    MEMRA_EXPECT_SAME_BITS(a, b);
    MEMRA_EXPECT_SAME_BITS(b, reference_bits(x, d, one_plus, false, kEps));
    std::vector<float> in_place = x;
    rms_norm(pool, in_place.data(), 3, d, NormWeight{w.bf16.data(), DType::kBF16, true}, kEps, in_place.data());
    MEMRA_EXPECT_SAME_BITS(in_place, a);
}

TEST(OpsNorm, ThreadAndBatchInvariance) {
    const int64_t rows = 37, d = 300;
    const std::vector<float> x = random_floats(rows * d, 11, -3.0f, 3.0f);
    const Weights w = make_weights(d, 12);
    const NormWeight nw{w.bf16.data(), DType::kBF16, true};
    std::vector<float> base(x.size());
    {
        ThreadPool pool(1);
        rms_norm(pool, x.data(), rows, d, nw, kEps, base.data());
    }
    for (int threads : kThreadCounts) {
        ThreadPool pool(threads);
        std::vector<float> y(x.size());
        rms_norm(pool, x.data(), rows, d, nw, kEps, y.data());
        MEMRA_EXPECT_SAME_BITS(y, base) << threads;
        // Each row alone equals its row inside the batch.
        for (int64_t r : {int64_t{0}, int64_t{17}, rows - 1}) {
            std::vector<float> one(static_cast<size_t>(d));
            rms_norm(pool, x.data() + r * d, 1, d, nw, kEps, one.data());
            MEMRA_EXPECT_SAME_BITS(one, std::vector<float>(base.begin() + r * d, base.begin() + (r + 1) * d)) << r;
        }
    }
}

TEST(OpsNorm, PerHeadNormEqualsRowNormAndKeepsOtherColumns) {
    const int64_t n_tokens = 9, n_heads = 6, head_dim = 32, stride = n_heads * head_dim + 40;
    std::vector<float> x = random_floats(static_cast<size_t>(n_tokens * stride), 21, -5.0f, 5.0f);
    const Weights w = make_weights(head_dim, 22);
    const NormWeight nw{w.bf16.data(), DType::kBF16, true};
    // Expected: each head as one rms_norm row.
    std::vector<float> heads(static_cast<size_t>(n_tokens * n_heads * head_dim));
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t i = 0; i < n_heads * head_dim; ++i) heads[t * n_heads * head_dim + i] = x[t * stride + i];
    }
    std::vector<float> expect(heads.size());
    {
        ThreadPool pool(1);
        rms_norm(pool, heads.data(), n_tokens * n_heads, head_dim, nw, kEps, expect.data());
    }
    MEMRA_EXPECT_SAME_BITS(expect, reference_bits(heads, head_dim, w.values, true, kEps));
    for (int threads : kThreadCounts) {
        ThreadPool pool(threads);
        std::vector<float> y = x;
        rms_norm_heads(pool, y.data(), n_tokens, stride, n_heads, head_dim, nw, kEps);
        std::vector<float> got(heads.size());
        for (int64_t t = 0; t < n_tokens; ++t) {
            for (int64_t i = 0; i < n_heads * head_dim; ++i) got[t * n_heads * head_dim + i] = y[t * stride + i];
            for (int64_t i = n_heads * head_dim; i < stride; ++i) {
                ASSERT_EQ(bits(y[t * stride + i]), bits(x[t * stride + i])) << "column outside the heads changed";
            }
        }
        MEMRA_EXPECT_SAME_BITS(got, expect) << threads;
    }
}

TEST(OpsNorm, FusedAddNormEqualsSeparateOps) {
    const int64_t rows = 13, d = 257;
    const std::vector<float> x = random_floats(rows * d, 31, -2.0f, 2.0f);
    const std::vector<float> r = random_floats(rows * d, 32, -2.0f, 2.0f);
    const Weights w = make_weights(d, 33);
    const NormWeight nw{w.values.data(), DType::kF32, true};
    ThreadPool ref_pool(1);
    std::vector<float> h_sep(x.size()), y_sep(x.size());
    residual_add(ref_pool, x.data(), r.data(), rows, d, h_sep.data());
    rms_norm(ref_pool, h_sep.data(), rows, d, nw, kEps, y_sep.data());
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(bits(h_sep[i]), bits(x[i] + r[i]));
    for (int threads : kThreadCounts) {
        ThreadPool pool(threads);
        std::vector<float> h(x.size()), y(x.size());
        add_rms_norm(pool, x.data(), r.data(), rows, d, nw, kEps, h.data(), y.data());
        MEMRA_EXPECT_SAME_BITS(h, h_sep);
        MEMRA_EXPECT_SAME_BITS(y, y_sep);
        // h may overwrite the residual stream in place.
        std::vector<float> h_in_place = x;
        std::vector<float> y2(x.size());
        add_rms_norm(pool, h_in_place.data(), r.data(), rows, d, nw, kEps, h_in_place.data(), y2.data());
        MEMRA_EXPECT_SAME_BITS(h_in_place, h_sep);
        MEMRA_EXPECT_SAME_BITS(y2, y_sep);
    }
}

}  // namespace
}  // namespace memra::cpu::test
