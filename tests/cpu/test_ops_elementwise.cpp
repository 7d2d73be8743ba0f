// Embedding lookup (exact widening, errors for bad ids and dtypes), residual add, SwiGLU with the Step clamp
// and the per-head sigmoid gate: documented order (bits), float64 reference, thread and batch invariance.
#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/ops_elementwise.h"
#include "core/float_formats.h"
#include "core/math.h"
#include "cpu/ops_test_util.h"

namespace memra::cpu::test {
namespace {

TEST(OpsEmbedding, CopiesRowsExactlyForBf16AndF32) {
    const int64_t vocab = 50, d = 33;
    const std::vector<float> table_f32 = random_floats(vocab * d, 1, -2.0f, 2.0f);
    std::vector<uint16_t> table_bf16(table_f32.size());
    for (size_t i = 0; i < table_f32.size(); ++i) table_bf16[i] = to_bf16_trunc(table_f32[i]);
    const std::vector<int32_t> ids = {3, 0, 49, 3, 17};
    const int64_t n = static_cast<int64_t>(ids.size());
    for (int threads : kThreadCounts) {
        ThreadPool pool(threads);
        std::vector<float> out_f32(static_cast<size_t>(n * d)), out_bf16(static_cast<size_t>(n * d));
        ASSERT_TRUE(embedding_lookup(pool, table_f32.data(), DType::kF32, vocab, d, ids.data(), n, out_f32.data()));
        ASSERT_TRUE(embedding_lookup(pool, table_bf16.data(), DType::kBF16, vocab, d, ids.data(), n, out_bf16.data()));
        for (int64_t t = 0; t < n; ++t) {
            for (int64_t i = 0; i < d; ++i) {
                ASSERT_EQ(bits(out_f32[t * d + i]), bits(table_f32[ids[t] * d + i]));
                ASSERT_EQ(bits(out_bf16[t * d + i]), static_cast<uint32_t>(table_bf16[ids[t] * d + i]) << 16);
            }
        }
    }
}

TEST(OpsEmbedding, RejectsBadIdsAndDtypesWithoutWriting) {
    ThreadPool pool(2);
    const int64_t vocab = 10, d = 4;
    const std::vector<float> table(static_cast<size_t>(vocab * d), 1.0f);
    std::vector<float> out(12, -7.0f);
    const std::vector<int32_t> too_big = {1, 2, 10};
    auto r = embedding_lookup(pool, table.data(), DType::kF32, vocab, d, too_big.data(), 3, out.data());
    ASSERT_FALSE(r);
    EXPECT_NE(r.error().message.find("token id at index 2"), std::string::npos) << r.error().message;
    EXPECT_NE(r.error().message.find("expected 0 <= id < 10, found 10"), std::string::npos) << r.error().message;
    const std::vector<int32_t> negative = {-1};
    r = embedding_lookup(pool, table.data(), DType::kF32, vocab, d, negative.data(), 1, out.data());
    ASSERT_FALSE(r);
    EXPECT_NE(r.error().message.find("found -1"), std::string::npos) << r.error().message;
    for (float v : out) EXPECT_EQ(v, -7.0f);  // nothing written
    const std::vector<int32_t> ok = {1};
    r = embedding_lookup(pool, table.data(), DType::kF16, vocab, d, ok.data(), 1, out.data());
    ASSERT_FALSE(r);
    EXPECT_NE(r.error().message.find("embedding table: expected dtype F32 or BF16, found F16"), std::string::npos)
        << r.error().message;
}

TEST(OpsElementwise, ResidualAdd) {
    const int64_t rows = 11, d = 100;
    const std::vector<float> a = random_floats(rows * d, 3), b = random_floats(rows * d, 4);
    for (int threads : kThreadCounts) {
        ThreadPool pool(threads);
        std::vector<float> out(a.size());
        residual_add(pool, a.data(), b.data(), rows, d, out.data());
        for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(bits(out[i]), bits(a[i] + b[i]));
    }
}

TEST(OpsRoundRows, Bf16AndQ8MatchTheirFormatsAndNoneIsExact) {
    const int64_t rows = 7, d = 96;  // 3 q8 blocks per row
    std::vector<float> x = random_floats(rows * d, 5, -3.0f, 3.0f);
    x[5] = 0.0f;
    for (int64_t j = 32; j < 64; ++j) x[static_cast<size_t>(d + j)] = 0.0f;  // an all-zero block: d = 0
    // Expected values spelled from the storage formats: bf16 bits, GGML's q8_0 block (scale amax / 127 in f16,
    // codes roundf(x / d) with the reciprocal taken in f32).
    std::vector<float> want_bf16(x.size()), want_q8(x.size());
    for (size_t i = 0; i < x.size(); ++i) want_bf16[i] = bf16_to_f32(f32_to_bf16(x[i]));
    for (size_t b = 0; b < x.size(); b += 32) {
        float amax = 0.0f;
        for (size_t j = b; j < b + 32; ++j) amax = std::max(amax, std::fabs(x[j]));
        const float scale = amax / 127.0f;
        const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
        const float scale16 = f16_to_f32(f32_to_f16(scale));
        for (size_t j = b; j < b + 32; ++j) want_q8[j] = std::round(x[j] * inv) * scale16;
    }
    for (int threads : kThreadCounts) {
        ThreadPool pool(threads);
        std::vector<float> y = x;
        round_rows(pool, y.data(), rows, d, RowRounding::kNone);
        MEMRA_EXPECT_SAME_BITS(y, x);
        round_rows(pool, y.data(), rows, d, RowRounding::kBf16);
        MEMRA_EXPECT_SAME_BITS(y, want_bf16);
        y = x;
        round_rows(pool, y.data(), rows, d, RowRounding::kQ8);
        MEMRA_EXPECT_SAME_BITS(y, want_q8);
    }
    EXPECT_GT(bit_mismatches(want_q8, x), rows * d / 2);  // the rounding is real
}

// Independent spelling of the documented SwiGLU order.
float swiglu_ref(float g, float u, float limit) {
    float act = g * sigmoid_f32(g);
    if (limit > 0.0f) {
        if (act > limit) act = limit;
        if (u > limit) u = limit;
        if (u < -limit) u = -limit;
    }
    return act * u;
}

TEST(OpsSwiglu, OrderClampAndFloat64) {
    const int64_t rows = 7, d_ff = 301;
    const std::vector<float> g = random_floats(rows * d_ff, 5, -20.0f, 20.0f);
    const std::vector<float> u = random_floats(rows * d_ff, 6, -20.0f, 20.0f);
    for (float limit : {0.0f, 7.0f, 16.0f}) {
        for (int threads : kThreadCounts) {
            ThreadPool pool(threads);
            std::vector<float> out(g.size());
            swiglu(pool, g.data(), u.data(), d_ff, rows, d_ff, limit, out.data());
            for (size_t i = 0; i < g.size(); ++i) {
                ASSERT_EQ(bits(out[i]), bits(swiglu_ref(g[i], u[i], limit))) << limit << " " << i;
                const double gd = g[i];
                double act = gd / (1.0 + std::exp(-gd));
                double ud = u[i];
                if (limit > 0.0f) {
                    act = std::min(act, static_cast<double>(limit));
                    ud = std::max(std::min(ud, static_cast<double>(limit)), -static_cast<double>(limit));
                }
                ASSERT_NEAR(out[i], act * ud, 1e-6 * std::fabs(act * ud) + 1e-30) << limit << " " << i;
            }
        }
    }
    // The clamp is on silu's output (upper only) and symmetric on up: silu(-3) = -0.142 passes through.
    ThreadPool pool(1);
    const std::vector<float> g2 = {100.0f, -3.0f, 2.0f, 2.0f};
    const std::vector<float> u2 = {1.0f, 1.0f, 50.0f, -50.0f};
    std::vector<float> out(4);
    swiglu(pool, g2.data(), u2.data(), 4, 1, 4, 7.0f, out.data());
    EXPECT_EQ(out[0], 7.0f);
    EXPECT_EQ(bits(out[1]), bits(silu_f32(-3.0f)));
    EXPECT_EQ(out[2], silu_f32(2.0f) * 7.0f);
    EXPECT_EQ(out[3], silu_f32(2.0f) * -7.0f);
}

// Every instruction path gives the scalar definition's bits where the special cases decide: NaN and Inf
// gates and ups, exp overflow and underflow (|g| past 88 and 104, subnormal sigmoids), signed zeros,
// denormals, and the clamps catching Inf while letting NaN through.
TEST(OpsSwiglu, EveryPathGivesTheDefinitionOnSpecialValues) {
    const IsaGuard guard;
    const float inf = std::numeric_limits<float>::infinity();
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> g = {nan, -nan, inf, -inf, 0.0f, -0.0f, 1e-40f, -1e-40f, 88.5f, -88.5f, 89.5f, -89.5f,
                            103.9f, -103.9f, 104.5f, -104.5f, -95.0f, -100.0f, 7.0f, 7.5f, 20.0f, -20.0f, 3e38f, -3e38f};
    const std::vector<float> extra = random_floats(200, 12, -110.0f, 110.0f);
    g.insert(g.end(), extra.begin(), extra.end());
    const int64_t n = static_cast<int64_t>(g.size());
    std::vector<float> u(g.size());
    const float ups[] = {1.0f, -1.0f, nan, inf, -inf, 50.0f, -50.0f, 0.0f, -0.0f, 1e-40f, 3.0f};
    for (size_t i = 0; i < u.size(); ++i) u[i] = ups[(i * 7) % std::size(ups)];
    ThreadPool pool(1);
    for (const float limit : {0.0f, 7.0f}) {
        for (ProductIsa isa : supported_isas()) {
            ASSERT_TRUE(force_product_isa(isa));
            std::vector<float> out(g.size());
            swiglu(pool, g.data(), u.data(), n, 1, n, limit, out.data());
            for (int64_t i = 0; i < n; ++i) {
                const float want = swiglu_ref(g[i], u[i], limit);
                EXPECT_TRUE(std::isnan(want) ? std::isnan(out[i]) : bits(out[i]) == bits(want))
                    << product_isa_name(isa) << " limit " << limit << " g " << g[i] << " u " << u[i] << ": " << out[i]
                    << " want " << want;
            }
        }
    }
}

TEST(OpsSwiglu, FusedGateUpRowsEqualSeparateArrays) {
    const int64_t rows = 5, d_ff = 64;
    const std::vector<float> g = random_floats(rows * d_ff, 8, -9.0f, 9.0f);
    const std::vector<float> u = random_floats(rows * d_ff, 9, -9.0f, 9.0f);
    std::vector<float> fused(static_cast<size_t>(rows * 2 * d_ff));
    for (int64_t t = 0; t < rows; ++t) {
        for (int64_t j = 0; j < d_ff; ++j) {
            fused[t * 2 * d_ff + j] = g[t * d_ff + j];
            fused[t * 2 * d_ff + d_ff + j] = u[t * d_ff + j];
        }
    }
    ThreadPool pool(3);
    std::vector<float> a(g.size()), b(g.size());
    swiglu(pool, g.data(), u.data(), d_ff, rows, d_ff, 7.0f, a.data());
    swiglu(pool, fused.data(), fused.data() + d_ff, 2 * d_ff, rows, d_ff, 7.0f, b.data());
    MEMRA_EXPECT_SAME_BITS(a, b);
    // One row alone equals its row in the batch.
    std::vector<float> one(static_cast<size_t>(d_ff));
    swiglu(pool, fused.data() + 3 * 2 * d_ff, fused.data() + 3 * 2 * d_ff + d_ff, 2 * d_ff, 1, d_ff, 7.0f, one.data());
    MEMRA_EXPECT_SAME_BITS(one, std::vector<float>(a.begin() + 3 * d_ff, a.begin() + 4 * d_ff));
}

TEST(OpsHeadGate, ScalesEachHeadBySigmoidOfItsLogit) {
    const int64_t n_tokens = 6, n_heads = 5, head_dim = 24, gate_stride = 9;
    const std::vector<float> x = random_floats(n_tokens * n_heads * head_dim, 10, -3.0f, 3.0f);
    const std::vector<float> g = random_floats(n_tokens * gate_stride, 11, -6.0f, 6.0f);
    for (int threads : kThreadCounts) {
        ThreadPool pool(threads);
        std::vector<float> y = x;
        head_gate(pool, y.data(), n_tokens, n_heads, head_dim, g.data(), gate_stride);
        for (int64_t t = 0; t < n_tokens; ++t) {
            for (int64_t h = 0; h < n_heads; ++h) {
                const double sig = 1.0 / (1.0 + std::exp(-static_cast<double>(g[t * gate_stride + h])));
                for (int64_t i = 0; i < head_dim; ++i) {
                    const int64_t at = (t * n_heads + h) * head_dim + i;
                    ASSERT_EQ(bits(y[at]), bits(x[at] * sigmoid_f32(g[t * gate_stride + h])));
                    ASSERT_NEAR(y[at], x[at] * sig, 1e-6 * std::fabs(x[at] * sig) + 1e-30);
                }
            }
        }
    }
}

}  // namespace
}  // namespace memra::cpu::test
