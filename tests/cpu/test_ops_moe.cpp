// MoE ops: router tie-breaking, selection-only bias, slot order, renormalisation and scaling (bits against an
// independent spelling, float64 within tolerance); the stable counting sort of (token, slot) pairs; the
// permute; the slot-order combine, shown to differ from other orders and from a fused multiply-add.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/ops_moe.h"
#include "core/math.h"
#include "cpu/ops_test_util.h"

namespace memra::cpu::test {
namespace {

struct Routed {
    std::vector<int32_t> ids;
    std::vector<float> weights;
};

Routed route(ThreadPool &pool, const RouterParams &p, const std::vector<float> &logits, const float *bias) {
    const int64_t n_tokens = static_cast<int64_t>(logits.size()) / p.n_experts;
    Routed r{std::vector<int32_t>(static_cast<size_t>(n_tokens * p.top_k)),
             std::vector<float>(static_cast<size_t>(n_tokens * p.top_k))};
    router_topk(pool, p, logits.data(), bias, n_tokens, r.ids.data(), r.weights.data());
    return r;
}

// Independent spelling: sort expert indices by (score descending, index ascending), take top_k.
Routed route_reference(const RouterParams &p, const std::vector<float> &logits, const float *bias) {
    const int64_t n_tokens = static_cast<int64_t>(logits.size()) / p.n_experts;
    Routed r;
    for (int64_t t = 0; t < n_tokens; ++t) {
        std::vector<float> prob(static_cast<size_t>(p.n_experts)), score(static_cast<size_t>(p.n_experts));
        for (int64_t e = 0; e < p.n_experts; ++e) {
            prob[e] = sigmoid_f32(logits[t * p.n_experts + e]);
            score[e] = bias != nullptr ? prob[e] + bias[e] : prob[e];
        }
        std::vector<int32_t> order(static_cast<size_t>(p.n_experts));
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return score[a] > score[b]; });
        float sum = 0.0f;
        for (int64_t k = 0; k < p.top_k; ++k) sum += prob[order[k]];
        for (int64_t k = 0; k < p.top_k; ++k) {
            r.ids.push_back(order[k]);
            const float w = p.renormalize ? prob[order[k]] / sum : prob[order[k]];
            r.weights.push_back(w * p.scaling_factor);
        }
    }
    return r;
}

TEST(OpsRouter, MatchesIndependentSpellingAndFloat64) {
    const RouterParams p{288, 8, true, 3.0f};
    const int64_t n_tokens = 21;
    const std::vector<float> logits = random_floats(static_cast<size_t>(n_tokens * 288), 1, -6.0f, 6.0f);
    const std::vector<float> bias = random_floats(288, 2, -0.3f, 0.3f);
    ThreadPool ref_pool(1);
    const Routed base = route(ref_pool, p, logits, bias.data());
    const Routed ref = route_reference(p, logits, bias.data());
    EXPECT_EQ(base.ids, ref.ids);
    MEMRA_EXPECT_SAME_BITS(base.weights, ref.weights);
    for (int64_t t = 0; t < n_tokens; ++t) {
        double sum = 0.0;
        for (int k = 0; k < 8; ++k) sum += 1.0 / (1.0 + std::exp(-static_cast<double>(logits[t * 288 + base.ids[t * 8 + k]])));
        for (int k = 0; k < 8; ++k) {
            const double pk = 1.0 / (1.0 + std::exp(-static_cast<double>(logits[t * 288 + base.ids[t * 8 + k]])));
            ASSERT_NEAR(base.weights[t * 8 + k], 3.0 * pk / sum, 2e-6);
        }
    }
    for (int threads : kThreadCounts) {
        ThreadPool pool(threads);
        const Routed r = route(pool, p, logits, bias.data());
        EXPECT_EQ(r.ids, base.ids) << threads;
        MEMRA_EXPECT_SAME_BITS(r.weights, base.weights) << threads;
        // Batch invariance: token 13 alone.
        const std::vector<float> one(logits.begin() + 13 * 288, logits.begin() + 14 * 288);
        const Routed r1 = route(pool, p, one, bias.data());
        EXPECT_EQ(r1.ids, std::vector<int32_t>(base.ids.begin() + 13 * 8, base.ids.begin() + 14 * 8));
        MEMRA_EXPECT_SAME_BITS(r1.weights, std::vector<float>(base.weights.begin() + 13 * 8, base.weights.begin() + 14 * 8));
    }
}

TEST(OpsRouter, TiesGoToTheLowerIndexAndSlotsAreInDescendingScore) {
    ThreadPool pool(1);
    const RouterParams p{8, 4, false, 1.0f};
    // Experts 1, 3, 6 tie at the top, 0 and 7 tie next.
    const std::vector<float> logits = {1.0f, 2.0f, -1.0f, 2.0f, 0.0f, -3.0f, 2.0f, 1.0f};
    const Routed r = route(pool, p, logits, nullptr);
    EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3, 6, 0}));
    for (int k = 0; k < 4; ++k) EXPECT_EQ(bits(r.weights[k]), bits(sigmoid_f32(logits[r.ids[k]])));
    // All equal: the first top_k experts, in index order.
    const std::vector<float> flat(8, 0.5f);
    EXPECT_EQ(route(pool, p, flat, nullptr).ids, (std::vector<int32_t>{0, 1, 2, 3}));
    // A NaN logit counts as the lowest score.
    std::vector<float> with_nan(8, 0.0f);
    with_nan[0] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_EQ(route(pool, p, with_nan, nullptr).ids, (std::vector<int32_t>{1, 2, 3, 4}));
}

TEST(OpsRouter, BiasSelectsButDoesNotWeight) {
    ThreadPool pool(1);
    const RouterParams p{6, 2, true, 3.0f};
    const std::vector<float> logits = {3.0f, 2.0f, 1.0f, 0.0f, -1.0f, -2.0f};
    // Without bias: experts 0, 1. A bias of +1 on experts 4 and 5 selects them (5 after 4: s4 > s5).
    const Routed plain = route(pool, p, logits, nullptr);
    EXPECT_EQ(plain.ids, (std::vector<int32_t>{0, 1}));
    const std::vector<float> bias = {0.0f, 0.0f, 0.0f, 0.0f, 1.0f, 1.0f};
    const Routed biased = route(pool, p, logits, bias.data());
    EXPECT_EQ(biased.ids, (std::vector<int32_t>{4, 5}));
    const float p4 = sigmoid_f32(-1.0f), p5 = sigmoid_f32(-2.0f);
    const float sum = p4 + p5;
    EXPECT_EQ(bits(biased.weights[0]), bits((p4 / sum) * 3.0f));
    EXPECT_EQ(bits(biased.weights[1]), bits((p5 / sum) * 3.0f));
    EXPECT_NEAR(biased.weights[0] + biased.weights[1], 3.0f, 1e-6f);
    // Renormalisation off: weights are p * scaling.
    const RouterParams no_norm{6, 2, false, 3.0f};
    const Routed raw = route(pool, no_norm, logits, bias.data());
    EXPECT_EQ(raw.ids, biased.ids);
    EXPECT_EQ(bits(raw.weights[0]), bits(p4 * 3.0f));
    EXPECT_EQ(bits(raw.weights[1]), bits(p5 * 3.0f));
}

struct Sorted {
    std::vector<int32_t> offsets, sorted_pair, row_of_pair;
};

Sorted sort_pairs(const std::vector<int32_t> &ids, int64_t top_k, int64_t n_experts) {
    const int64_t n_pairs = static_cast<int64_t>(ids.size());
    Sorted s{std::vector<int32_t>(static_cast<size_t>(n_experts + 1), -1),
             std::vector<int32_t>(static_cast<size_t>(n_pairs), -1), std::vector<int32_t>(static_cast<size_t>(n_pairs), -1)};
    moe_sort_pairs(ids.data(), n_pairs / top_k, top_k, n_experts, s.offsets.data(), s.sorted_pair.data(),
                   s.row_of_pair.data());
    return s;
}

TEST(OpsMoeSort, SmallExample) {
    // 3 tokens, top-2, 4 experts: pairs q = 0..5 with experts 2,0 | 2,3 | 0,2. Expert 1 gets nothing.
    const Sorted s = sort_pairs({2, 0, 2, 3, 0, 2}, 2, 4);
    EXPECT_EQ(s.offsets, (std::vector<int32_t>{0, 2, 2, 5, 6}));
    EXPECT_EQ(s.sorted_pair, (std::vector<int32_t>{1, 4, 0, 2, 5, 3}));
    EXPECT_EQ(s.row_of_pair, (std::vector<int32_t>{2, 0, 3, 5, 1, 4}));
}

TEST(OpsMoeSort, StableCountingSortOnRandomRouting) {
    const int64_t n_tokens = 300, top_k = 8, n_experts = 288;
    ThreadPool pool(2);
    const std::vector<float> logits = random_floats(static_cast<size_t>(n_tokens * n_experts), 5, -4.0f, 4.0f);
    const Routed r = route(pool, RouterParams{n_experts, top_k, true, 3.0f}, logits, nullptr);
    const Sorted s = sort_pairs(r.ids, top_k, n_experts);
    const int64_t n_pairs = n_tokens * top_k;
    EXPECT_EQ(s.offsets.front(), 0);
    EXPECT_EQ(s.offsets.back(), n_pairs);
    for (int64_t e = 0; e < n_experts; ++e) {
        const int64_t count = std::count(r.ids.begin(), r.ids.end(), static_cast<int32_t>(e));
        ASSERT_EQ(s.offsets[e + 1] - s.offsets[e], count) << e;
        for (int32_t row = s.offsets[e]; row < s.offsets[e + 1]; ++row) {
            ASSERT_EQ(r.ids[s.sorted_pair[row]], e);
            if (row > s.offsets[e]) {
                ASSERT_LT(s.sorted_pair[row - 1], s.sorted_pair[row]) << "not stable";
            }
        }
    }
    for (int64_t q = 0; q < n_pairs; ++q) ASSERT_EQ(s.sorted_pair[s.row_of_pair[q]], q);
    for (int64_t row = 0; row < n_pairs; ++row) ASSERT_EQ(s.row_of_pair[s.sorted_pair[row]], row);
}

TEST(OpsMoePermute, GathersTokenRowsInSortedOrder) {
    const int64_t d = 19, top_k = 2;
    const std::vector<float> x = random_floats(3 * d, 6);
    const Sorted s = sort_pairs({2, 0, 2, 3, 0, 2}, top_k, 4);
    for (int threads : kThreadCounts) {
        ThreadPool pool(threads);
        std::vector<float> xs(static_cast<size_t>(6 * d));
        moe_permute(pool, x.data(), d, s.sorted_pair.data(), 6, top_k, xs.data());
        for (int64_t row = 0; row < 6; ++row) {
            const int64_t t = s.sorted_pair[row] / top_k;
            for (int64_t j = 0; j < d; ++j) ASSERT_EQ(bits(xs[row * d + j]), bits(x[t * d + j]));
        }
    }
}

TEST(OpsMoeCombine, SlotOrderThenSharedThenResidual) {
    const int64_t n_tokens = 17, top_k = 8, n_experts = 32, d = 40;
    ThreadPool ref_pool(1);
    const std::vector<float> logits = random_floats(static_cast<size_t>(n_tokens * n_experts), 7, -4.0f, 4.0f);
    const Routed r = route(ref_pool, RouterParams{n_experts, top_k, true, 3.0f}, logits, nullptr);
    const Sorted s = sort_pairs(r.ids, top_k, n_experts);
    const std::vector<float> y = random_floats(static_cast<size_t>(n_tokens * top_k * d), 8, -5.0f, 5.0f);
    const std::vector<float> h = random_floats(static_cast<size_t>(n_tokens * d), 9, -5.0f, 5.0f);
    const std::vector<float> shared = random_floats(static_cast<size_t>(n_tokens * d), 10, -5.0f, 5.0f);
    std::vector<float> expect(h.size()), expect_no_shared(h.size());
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t j = 0; j < d; ++j) {
            float routed = 0.0f;
            double routed64 = 0.0;
            for (int64_t k = 0; k < top_k; ++k) {
                const float yk = y[s.row_of_pair[t * top_k + k] * d + j];
                const float prod = r.weights[t * top_k + k] * yk;
                routed = routed + prod;
                routed64 += static_cast<double>(r.weights[t * top_k + k]) * yk;
            }
            expect[t * d + j] = h[t * d + j] + (routed + shared[t * d + j]);
            expect_no_shared[t * d + j] = h[t * d + j] + routed;
            const double ref = h[t * d + j] + (routed64 + shared[t * d + j]);
            ASSERT_NEAR(expect[t * d + j], ref, 1e-5 * (1.0 + std::fabs(ref)));
        }
    }
    for (int threads : kThreadCounts) {
        ThreadPool pool(threads);
        std::vector<float> out(h.size());
        moe_combine(pool, h.data(), y.data(), s.row_of_pair.data(), r.weights.data(), shared.data(), n_tokens, top_k,
                    d, out.data());
        MEMRA_EXPECT_SAME_BITS(out, expect) << threads;
        std::vector<float> in_place = h;
        moe_combine(pool, in_place.data(), y.data(), s.row_of_pair.data(), r.weights.data(), nullptr, n_tokens, top_k,
                    d, in_place.data());
        MEMRA_EXPECT_SAME_BITS(in_place, expect_no_shared) << threads;
    }
}

TEST(OpsMoeCombine, OrderIsObservable) {
    // One token, top-3, d = 1, expert rows in (token, slot) order (identity map).
    ThreadPool pool(1);
    const std::vector<int32_t> identity = {0, 1, 2};
    const std::vector<float> w = {1.0f, 1.0f, 1.0f};
    const float big = 16777216.0f;  // 2^24
    // Slot order: (2^24 + 1) + -2^24 = 0 (2^24 + 1 rounds to 2^24); expert-index or reversed order gives 1.
    const std::vector<float> y = {big, 1.0f, -big};
    const float zero = 0.0f;
    float out = -1.0f;
    moe_combine(pool, &zero, y.data(), identity.data(), w.data(), nullptr, 1, 3, 1, &out);
    EXPECT_EQ(out, 0.0f);
    EXPECT_EQ((-big + 1.0f) + big, 1.0f);  // the reversed order would differ
    // h + (routed + shared) vs (h + routed) + shared: h = 1, routed = 2^24, shared = -2^24.
    const std::vector<float> y2 = {big, 0.0f, 0.0f};
    const float h = 1.0f, shared = -big;
    moe_combine(pool, &h, y2.data(), identity.data(), w.data(), &shared, 1, 3, 1, &out);
    EXPECT_EQ(out, 1.0f);
    EXPECT_EQ((h + big) + shared, 0.0f);
    // Separately rounded multiply and add, never a fused multiply-add: w * y is rounded before the add.
    const float wk = 1.0f + std::ldexp(1.0f, -12), yk = 1.0f + std::ldexp(1.0f, -12);
    const float acc0 = -1.0f;  // slot 0 contributes -1 (w = 1, y = -1), slot 1 contributes wk * yk
    const std::vector<float> w3 = {1.0f, wk, 0.0f};
    const std::vector<float> y3 = {acc0, yk, 0.0f};
    const float zero_h = 0.0f;
    moe_combine(pool, &zero_h, y3.data(), identity.data(), w3.data(), nullptr, 1, 3, 1, &out);
    const float separate = acc0 + wk * yk;
    const float fused = std::fma(wk, yk, acc0);
    ASSERT_NE(bits(separate), bits(fused));  // the case distinguishes the two
    EXPECT_EQ(bits(out), bits(separate));
}

}  // namespace
}  // namespace memra::cpu::test
