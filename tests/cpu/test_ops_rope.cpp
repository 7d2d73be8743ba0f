// RoPE: inverse frequencies (plain and llama3, against STEP35.md's derived divisors and an independent float32
// spelling of HF's arithmetic), the host cos/sin table, the NeoX rotation of a partial rotary slice (HF's
// formula bit for bit, float64 within tolerance), pass-through dims, errors, thread and batch invariance.
#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/ops_rope.h"
#include "cpu/ops_test_util.h"

namespace memra::cpu::test {
namespace {

const RopeLlama3 kStepLlama3{2.0, 1.0, 32.0, 131072.0};

TEST(OpsRope, PlainInverseFrequencies) {
    for (auto [rot, theta] : {std::pair<int64_t, double>{128, 1e4}, {64, 5e6}, {6, 10.0}}) {
        auto inv = rope_inv_freq(rot, theta, nullptr);
        ASSERT_TRUE(inv) << inv.error().message;
        ASSERT_EQ(static_cast<int64_t>(inv->size()), rot / 2);
        for (int64_t j = 0; j < rot / 2; ++j) {
            // Independent float32 spelling: e = float(2j) / float(rot); 1 / float(pow(theta, e)).
            const float e = static_cast<float>(2 * j) / static_cast<float>(rot);
            const float p = static_cast<float>(std::pow(theta, static_cast<double>(e)));
            EXPECT_EQ(bits((*inv)[j]), bits(1.0f / p)) << j;
            const double exact = std::pow(theta, -2.0 * static_cast<double>(j) / static_cast<double>(rot));
            EXPECT_NEAR((*inv)[j], exact, 4e-7 * exact) << j;
        }
        EXPECT_EQ((*inv)[0], 1.0f);
    }
}

TEST(OpsRope, Llama3ScalingMatchesStep35Divisors) {
    auto plain = rope_inv_freq(64, 5e6, nullptr);
    auto scaled = rope_inv_freq(64, 5e6, &kStepLlama3);
    ASSERT_TRUE(plain && scaled);
    ASSERT_EQ(scaled->size(), 32u);
    const std::vector<float> &f = *plain;
    const std::vector<float> &g = *scaled;
    for (int j = 0; j <= 13; ++j) EXPECT_EQ(bits(g[j]), bits(f[j])) << "j = " << j << " must be unchanged";
    const double divisors[] = {1.1384, 1.3745, 1.5764, 1.7337, 1.8476, 1.9257, 1.9773};  // STEP35.md 4.3 item 4
    for (int j = 14; j <= 20; ++j) {
        EXPECT_NEAR(static_cast<double>(f[j]) / g[j], divisors[j - 14], 1e-4) << "j = " << j;
    }
    for (int j = 21; j <= 31; ++j) EXPECT_EQ(bits(g[j]), bits(f[j] / 2.0f)) << "j = " << j << " must be halved";

    // Independent float32 spelling of HF's _compute_llama3_parameters, all entries bit for bit.
    const float two_pi = static_cast<float>(2.0 * std::numbers::pi);
    for (int j = 0; j < 32; ++j) {
        const float wavelen = (1.0f / f[j]) * two_pi;
        const float base = wavelen > 131072.0f ? f[j] / 2.0f : f[j];
        const float sf = ((1.0f / wavelen) * 131072.0f - 1.0f) / 31.0f;
        const float smooth = ((1.0f - sf) * base) / 2.0f + sf * base;
        const float expect = (wavelen >= 4096.0f && wavelen <= 131072.0f) ? smooth : base;
        EXPECT_EQ(bits(g[j]), bits(expect)) << j;
    }
}

TEST(OpsRope, RejectsBadParameters) {
    auto r = rope_inv_freq(63, 1e4, nullptr);
    ASSERT_FALSE(r);
    EXPECT_NE(r.error().message.find("rot_dim: expected a positive even number, found 63"), std::string::npos);
    r = rope_inv_freq(64, 0.0, nullptr);
    ASSERT_FALSE(r);
    EXPECT_NE(r.error().message.find("theta: expected a finite value > 0, found 0"), std::string::npos);
    RopeLlama3 bad = kStepLlama3;
    bad.high_freq_factor = 1.0;
    r = rope_inv_freq(64, 5e6, &bad);
    ASSERT_FALSE(r);
    EXPECT_NE(r.error().message.find("low_freq_factor < high_freq_factor"), std::string::npos) << r.error().message;
    bad = kStepLlama3;
    bad.factor = -1.0;
    r = rope_inv_freq(64, 5e6, &bad);
    ASSERT_FALSE(r);
    EXPECT_NE(r.error().message.find("rope_scaling.factor"), std::string::npos);
    bad = kStepLlama3;
    bad.original_max_position_embeddings = 0.0;
    r = rope_inv_freq(64, 5e6, &bad);
    ASSERT_FALSE(r);
    EXPECT_NE(r.error().message.find("original_max_position_embeddings"), std::string::npos);

    ThreadPool pool(1);
    auto t = rope_table_build(pool, {}, 10);
    ASSERT_FALSE(t);
    EXPECT_NE(t.error().message.find("at least one inverse frequency"), std::string::npos);
    t = rope_table_build(pool, {1.0f}, 0);
    ASSERT_FALSE(t);
    EXPECT_NE(t.error().message.find("n_positions: expected 1..16777216, found 0"), std::string::npos);
}

TEST(OpsRope, TableIsFloatAngleCosSin) {
    auto inv = rope_inv_freq(64, 5e6, &kStepLlama3);
    ASSERT_TRUE(inv);
    ThreadPool pool(3);
    auto table = rope_table_build(pool, *inv, 3000);
    ASSERT_TRUE(table) << table.error().message;
    EXPECT_EQ(table->half, 32);
    EXPECT_EQ(table->n_positions, 3000);
    for (int64_t p : {0, 1, 2, 511, 2999}) {
        for (int64_t j = 0; j < 32; ++j) {
            const float angle = static_cast<float>(p) * (*inv)[j];
            const float c = table->cos[p * 32 + j], s = table->sin[p * 32 + j];
            EXPECT_EQ(bits(c), bits(static_cast<float>(std::cos(static_cast<double>(angle)))));
            EXPECT_EQ(bits(s), bits(static_cast<float>(std::sin(static_cast<double>(angle)))));
            // The float angle differs from the exact one by at most half an ulp of the angle.
            const double exact = static_cast<double>(p) * (*inv)[j];
            EXPECT_NEAR(c, std::cos(exact), 1e-6 + 1e-7 * exact);
        }
    }
    EXPECT_EQ(table->cos[0], 1.0f);
    EXPECT_EQ(table->sin[0], 0.0f);
}

// Rotation helper for the tests: x [n_tokens, stride] with n_heads heads of head_dim.
struct RopeCase {
    int64_t n_tokens = 0, n_heads = 0, head_dim = 0, stride = 0;
    std::vector<float> x;
    std::vector<int64_t> pos;
};

RopeCase make_case(int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t extra, uint32_t seed) {
    RopeCase c{n_tokens, n_heads, head_dim, n_heads * head_dim + extra, {}, {}};
    c.x = random_floats(static_cast<size_t>(n_tokens * c.stride), seed, -3.0f, 3.0f);
    for (int64_t t = 0; t < n_tokens; ++t) c.pos.push_back((t * 37 + 5) % 1000);
    return c;
}

TEST(OpsRope, PartialRotaryMatchesHfFormulaAndFloat64) {
    auto inv = rope_inv_freq(64, 5e6, &kStepLlama3);  // head_dim 128, partial factor 0.5
    ASSERT_TRUE(inv);
    ThreadPool pool(2);
    auto table = rope_table_build(pool, *inv, 1000);
    ASSERT_TRUE(table);
    const RopeCase c = make_case(7, 3, 128, 8, 41);
    std::vector<float> y = c.x;
    ASSERT_TRUE(rope_apply(pool, *table, y.data(), c.n_tokens, c.stride, c.n_heads, c.head_dim, c.pos.data()));
    const int64_t half = 32;
    for (int64_t t = 0; t < c.n_tokens; ++t) {
        const float *cs = table->cos.data() + c.pos[t] * half;
        const float *sn = table->sin.data() + c.pos[t] * half;
        for (int64_t h = 0; h < c.n_heads; ++h) {
            const float *in = c.x.data() + t * c.stride + h * c.head_dim;
            const float *out = y.data() + t * c.stride + h * c.head_dim;
            for (int64_t i = 0; i < 2 * half; ++i) {
                // HF: (x * cos) + (rotate_half(x) * sin), rotate_half(x) = cat(-x2, x1), cos/sin duplicated.
                const float rot = i < half ? -in[i + half] : in[i - half];
                const float expect = (in[i] * cs[i % half]) + (rot * sn[i % half]);
                ASSERT_EQ(bits(out[i]), bits(expect)) << t << " " << h << " " << i;
                // float64: rotation by the exact angle pos * inv_freq.
                const double angle = static_cast<double>(c.pos[t]) * (*inv)[static_cast<size_t>(i % half)];
                const double ref = in[i] * std::cos(angle) + static_cast<double>(rot) * std::sin(angle);
                // The fp32 angle is off by up to half its ulp (about angle * 6e-8), the rest by a few roundings.
                const double tol = (std::fabs(in[i]) + std::fabs(rot)) * (angle * 6e-8 + 2.5e-7);
                ASSERT_NEAR(out[i], ref, tol) << t << " " << h << " " << i;
            }
            for (int64_t i = 2 * half; i < c.head_dim; ++i) ASSERT_EQ(bits(out[i]), bits(in[i])) << "pass-through";
        }
        for (int64_t i = c.n_heads * c.head_dim; i < c.stride; ++i) ASSERT_EQ(bits(y[t * c.stride + i]), bits(c.x[t * c.stride + i]));
    }
}

TEST(OpsRope, PairsElementJWithJPlusHalf) {
    auto inv = rope_inv_freq(8, 1e4, nullptr);
    ASSERT_TRUE(inv);
    ThreadPool pool(1);
    auto table = rope_table_build(pool, *inv, 10);
    ASSERT_TRUE(table);
    for (int64_t j = 0; j < 4; ++j) {
        std::vector<float> x(10, 0.0f);  // head_dim 10, rot_dim 8: dims 8, 9 pass through
        x[j] = 1.0f;
        x[9] = 5.0f;
        const int64_t pos = 7;
        ASSERT_TRUE(rope_apply(pool, *table, x.data(), 1, 10, 1, 10, &pos));
        for (int64_t i = 0; i < 10; ++i) {
            float expect = 0.0f;
            if (i == j) expect = table->cos[pos * 4 + j];
            if (i == j + 4) expect = table->sin[pos * 4 + j];
            if (i == 9) expect = 5.0f;
            EXPECT_EQ(x[i], expect) << j << " " << i;
        }
    }
}

TEST(OpsRope, ThreadAndBatchInvariance) {
    auto inv = rope_inv_freq(128, 1e4, nullptr);
    ASSERT_TRUE(inv);
    ThreadPool build_pool(1);
    auto table = rope_table_build(build_pool, *inv, 1000);
    ASSERT_TRUE(table);
    const RopeCase c = make_case(23, 4, 128, 0, 51);
    std::vector<float> base = c.x;
    ASSERT_TRUE(rope_apply(build_pool, *table, base.data(), c.n_tokens, c.stride, c.n_heads, c.head_dim, c.pos.data()));
    for (int threads : kThreadCounts) {
        ThreadPool pool(threads);
        std::vector<float> y = c.x;
        ASSERT_TRUE(rope_apply(pool, *table, y.data(), c.n_tokens, c.stride, c.n_heads, c.head_dim, c.pos.data()));
        MEMRA_EXPECT_SAME_BITS(y, base) << threads;
        for (int64_t t : {0, 11, 22}) {
            std::vector<float> one(c.x.begin() + t * c.stride, c.x.begin() + (t + 1) * c.stride);
            ASSERT_TRUE(rope_apply(pool, *table, one.data(), 1, c.stride, c.n_heads, c.head_dim, &c.pos[t]));
            MEMRA_EXPECT_SAME_BITS(one, std::vector<float>(base.begin() + t * c.stride, base.begin() + (t + 1) * c.stride));
        }
    }
}

TEST(OpsRope, RejectsPositionsOutsideTheTable) {
    auto inv = rope_inv_freq(4, 1e4, nullptr);
    ASSERT_TRUE(inv);
    ThreadPool pool(1);
    auto table = rope_table_build(pool, *inv, 16);
    ASSERT_TRUE(table);
    std::vector<float> x(8, 1.0f);
    const std::vector<int64_t> pos = {3, 16};
    auto r = rope_apply(pool, *table, x.data(), 2, 4, 1, 4, pos.data());
    ASSERT_FALSE(r);
    EXPECT_NE(r.error().message.find("position of token 1: expected 0 <= position < 16 (table size), found 16"),
              std::string::npos)
        << r.error().message;
    for (float v : x) EXPECT_EQ(v, 1.0f);  // nothing written
    const std::vector<int64_t> neg = {-1};
    EXPECT_FALSE(rope_apply(pool, *table, x.data(), 1, 4, 1, 4, neg.data()));
}

}  // namespace
}  // namespace memra::cpu::test
