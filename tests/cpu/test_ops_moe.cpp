// MoE ops: router tie-breaking, selection-only bias, slot order, renormalisation and scaling (bits against an
// independent spelling, float64 within tolerance); the stable counting sort of (token, slot) pairs; the
// permute, whole and over an owner's expert window; the owners' source rows; the slot-order combine through
// source rows, shown to differ from other orders and from a fused multiply-add.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
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

// The owners' source rows by a walk of their own: owner o's pairs, in sorted order, take rows o * capacity + 0,
// 1, 2, ... of the gathered buffer (experts [o * per, (o + 1) * per) are o's contiguous sorted rows).
std::vector<int32_t> source_rows_by_walk(const Sorted &s, int64_t n_experts, int64_t n_owners, int64_t capacity) {
    std::vector<int32_t> src(s.sorted_pair.size(), -1);
    const int64_t per = n_experts / n_owners;
    for (int64_t o = 0; o < n_owners; ++o) {
        int64_t j = 0;
        for (int32_t r = s.offsets[o * per]; r < s.offsets[(o + 1) * per]; ++r) {
            src[s.sorted_pair[r]] = static_cast<int32_t>(o * capacity + j++);
        }
    }
    return src;
}

std::vector<int32_t> source_rows(const std::vector<int32_t> &ids, const Sorted &s, int64_t n_experts,
                                 int64_t n_owners, int64_t capacity) {
    std::vector<int32_t> src(ids.size(), -1);
    moe_source_rows(ids.data(), s.row_of_pair.data(), static_cast<int64_t>(ids.size()), s.offsets.data(), n_experts,
                    n_owners, capacity, src.data());
    return src;
}

TEST(OpsMoeSourceRows, HandMadeRoutingOverOneTwoAndFourOwners) {
    // The SmallExample routing: pairs 0..5 to experts 2,0 | 2,3 | 0,2; offsets {0, 2, 2, 5, 6},
    // row_of_pair {2, 0, 3, 5, 1, 4}.
    const std::vector<int32_t> ids{2, 0, 2, 3, 0, 2};
    const Sorted s = sort_pairs(ids, 2, 4);
    // One owner, capacity n_pairs: the sorted rows themselves.
    EXPECT_EQ(source_rows(ids, s, 4, 1, 6), s.row_of_pair);
    EXPECT_EQ(source_rows(ids, s, 4, 1, 6), (std::vector<int32_t>{2, 0, 3, 5, 1, 4}));
    // Two owners (experts {0, 1} and {2, 3}), capacity 4: owner 0 holds pairs 1, 4 at rows 0, 1; owner 1 holds
    // pairs 0, 2, 5, 3 (sorted order) at rows 4 .. 7.
    EXPECT_EQ(source_rows(ids, s, 4, 2, 4), (std::vector<int32_t>{4, 0, 5, 7, 1, 6}));
    // Four owners (one expert each), capacity 3: expert 0 -> rows 0, 1; expert 2 -> rows 6, 7, 8; expert 3 -> 9.
    EXPECT_EQ(source_rows(ids, s, 4, 4, 3), (std::vector<int32_t>{6, 0, 7, 9, 1, 8}));
    for (int64_t owners : {1, 2, 4}) {
        const int64_t capacity = owners == 1 ? 6 : owners == 2 ? 4 : 3;
        EXPECT_EQ(source_rows(ids, s, 4, owners, capacity), source_rows_by_walk(s, 4, owners, capacity)) << owners;
    }
}

TEST(OpsMoeSourceRows, RandomRoutingMatchesTheOwnersWalk) {
    const int64_t n_tokens = 57, top_k = 8, n_experts = 288;
    ThreadPool pool(2);
    const std::vector<float> logits = random_floats(static_cast<size_t>(n_tokens * n_experts), 11, -4.0f, 4.0f);
    const Routed r = route(pool, RouterParams{n_experts, top_k, true, 3.0f}, logits, nullptr);
    const Sorted s = sort_pairs(r.ids, top_k, n_experts);
    for (int64_t owners : {1, 2, 4, 8}) {
        const int64_t per = n_experts / owners;
        int64_t capacity = 0;  // the busiest owner's pairs, plus slack: rows past an owner's count stay unread
        for (int64_t o = 0; o < owners; ++o) {
            capacity = std::max<int64_t>(capacity, s.offsets[(o + 1) * per] - s.offsets[o * per]);
        }
        capacity += 3;
        const std::vector<int32_t> got = source_rows(r.ids, s, n_experts, owners, capacity);
        EXPECT_EQ(got, source_rows_by_walk(s, n_experts, owners, capacity)) << owners;
        // Every pair gets its own row inside its expert's owner's slice.
        std::vector<int32_t> sorted_rows = got;
        std::sort(sorted_rows.begin(), sorted_rows.end());
        EXPECT_EQ(std::adjacent_find(sorted_rows.begin(), sorted_rows.end()), sorted_rows.end()) << owners;
        for (size_t q = 0; q < got.size(); ++q) ASSERT_EQ(got[q] / capacity, r.ids[q] / per) << owners << " " << q;
    }
}

TEST(OpsMoeSourceRowsDeathTest, PairPastTheCapacityIsAnInvariantViolation) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    const std::vector<int32_t> ids{2, 0, 2, 3, 0, 2};
    const Sorted s = sort_pairs(ids, 2, 4);
    std::vector<int32_t> src(6);
    // Owner 1 (experts 2, 3) holds 4 pairs; pair 3 is its row 3, past a capacity of 3.
    EXPECT_DEATH(moe_source_rows(ids.data(), s.row_of_pair.data(), 6, s.offsets.data(), 4, 2, 3, src.data()),
                 "moe_source_rows: pair 3 is row 3 of owner 1, capacity 3");
    EXPECT_DEATH(moe_source_rows(ids.data(), s.row_of_pair.data(), 6, s.offsets.data(), 4, 3, 6, src.data()),
                 "4 experts over 3 owners");
}

// ---- The MoE ops through the backend: the windowed permute and the combine through source rows. ----

TensorView to_backend(CpuBackend &be, const std::vector<float> &host, int64_t rows, int64_t cols) {
    auto v = be.alloc(DType::kF32, {rows, cols});
    EXPECT_TRUE(v.has_value());
    be.copy_from_host(host.data(), *v);
    return *v;
}

TensorView to_backend(CpuBackend &be, const std::vector<int32_t> &host) {
    auto v = be.alloc(DType::kI32, {static_cast<int64_t>(host.size())});
    EXPECT_TRUE(v.has_value());
    be.copy_from_host(host.data(), *v);
    return *v;
}

template <class T>
std::vector<T> to_host(CpuBackend &be, TensorView v) {
    std::vector<T> out(static_cast<size_t>(v.numel()));
    be.copy_to_host(v, out.data());
    return out;
}

TEST(MoeBackend, PermuteOverAnExpertWindowIsThatSliceOfTheWholePermute) {
    const int64_t n_tokens = 23, top_k = 4, n_experts = 16, d = 37;
    ThreadPool ref_pool(1);
    const std::vector<float> logits = random_floats(static_cast<size_t>(n_tokens * n_experts), 12, -4.0f, 4.0f);
    const Routed r = route(ref_pool, RouterParams{n_experts, top_k, true, 1.0f}, logits, nullptr);
    const Sorted s = sort_pairs(r.ids, top_k, n_experts);
    const int64_t n_pairs = n_tokens * top_k;
    const std::vector<float> x = random_floats(static_cast<size_t>(n_tokens * d), 13);
    CpuBackend be(3, Numerics::kExact);
    const TensorView xv = to_backend(be, x, n_tokens, d);
    const TensorView sorted_pair = to_backend(be, s.sorted_pair);
    const TensorView offsets = to_backend(be, s.offsets);
    auto all = be.alloc(DType::kF32, {n_pairs, d});
    be.moe_permute(xv, sorted_pair, offsets, 0, n_experts, top_k, *all);
    const std::vector<float> whole = to_host<float>(be, *all);
    for (int64_t row = 0; row < n_pairs; ++row) {
        const int64_t t = s.sorted_pair[row] / top_k;
        for (int64_t j = 0; j < d; ++j) ASSERT_EQ(bits(whole[row * d + j]), bits(x[t * d + j]));
    }
    // Owners of 1, 2, 4, 8 experts each, plus windows that are not owner-aligned and an empty one.
    std::vector<std::pair<int64_t, int64_t>> windows{{0, 16}, {5, 6}, {3, 11}, {7, 7}};
    for (int64_t per : {8, 4, 2, 1}) {
        for (int64_t e0 = 0; e0 < n_experts; e0 += per) windows.emplace_back(e0, e0 + per);
    }
    for (const auto &[e0, e1] : windows) {
        const int64_t r0 = s.offsets[e0], r1 = s.offsets[e1];
        // Two spare rows past the window's keep their sentinel.
        const std::vector<float> sentinel(static_cast<size_t>((r1 - r0 + 2) * d), -9.0f);
        const TensorView x_own = to_backend(be, sentinel, r1 - r0 + 2, d);
        be.reset_counters();
        be.moe_permute(xv, sorted_pair, offsets, e0, e1, top_k, x_own);
        EXPECT_EQ(be.counters().launches, 1);
        std::vector<float> want(whole.begin() + r0 * d, whole.begin() + r1 * d);
        want.resize(sentinel.size(), -9.0f);
        MEMRA_EXPECT_SAME_BITS(to_host<float>(be, x_own), want) << "experts [" << e0 << ", " << e1 << ")";
    }
}

TEST(MoeBackend, CombineThroughSourceRowsEqualsTheIdentityMapOverTokenSlotRows) {
    // The same expert outputs at arbitrary rows of a taller buffer (a random permutation, plus unread rows of
    // garbage), read through src_row, give the bits of the combine over the rows laid out in (token, slot)
    // order with the identity map.
    const int64_t n_tokens = 13, top_k = 6, d = 29;
    const int64_t n_pairs = n_tokens * top_k;
    const int64_t n_rows = n_pairs + 11;
    const std::vector<float> y_token_slot = random_floats(static_cast<size_t>(n_pairs * d), 14, -5.0f, 5.0f);
    const std::vector<float> weights = random_floats(static_cast<size_t>(n_pairs), 15, 0.0f, 3.0f);
    const std::vector<float> h = random_floats(static_cast<size_t>(n_tokens * d), 16, -5.0f, 5.0f);
    const std::vector<float> shared = random_floats(static_cast<size_t>(n_tokens * d), 17, -5.0f, 5.0f);
    std::vector<int32_t> perm(static_cast<size_t>(n_rows));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(18));
    std::vector<int32_t> src_row(static_cast<size_t>(n_pairs));
    std::vector<int32_t> identity(static_cast<size_t>(n_pairs));
    std::vector<float> y_scattered(static_cast<size_t>(n_rows * d), std::numeric_limits<float>::quiet_NaN());
    for (int64_t q = 0; q < n_pairs; ++q) {
        src_row[q] = perm[q];
        identity[q] = static_cast<int32_t>(q);
        std::copy(y_token_slot.begin() + q * d, y_token_slot.begin() + (q + 1) * d,
                  y_scattered.begin() + perm[q] * d);
    }
    for (int threads : {1, 3}) {
        CpuBackend be(threads, Numerics::kExact);
        const TensorView hv = to_backend(be, h, n_tokens, d);
        const TensorView wv = to_backend(be, weights, n_tokens, top_k);
        const TensorView sv = to_backend(be, shared, n_tokens, d);
        auto want = be.alloc(DType::kF32, {n_tokens, d});
        be.moe_combine(hv, to_backend(be, y_token_slot, n_pairs, d), to_backend(be, identity), wv, sv, *want);
        auto got = be.alloc(DType::kF32, {n_tokens, d});
        be.moe_combine(hv, to_backend(be, y_scattered, n_rows, d), to_backend(be, src_row), wv, sv, *got);
        const std::vector<float> want_h = to_host<float>(be, *want);
        MEMRA_EXPECT_SAME_BITS(to_host<float>(be, *got), want_h) << threads;
        // The kernel's own definition, spelled here: slot order, product rounded, then shared, then residual.
        std::vector<float> spelled(h.size());
        for (int64_t t = 0; t < n_tokens; ++t) {
            for (int64_t j = 0; j < d; ++j) {
                float routed = 0.0f;
                for (int64_t k = 0; k < top_k; ++k) {
                    const float prod = weights[t * top_k + k] * y_token_slot[(t * top_k + k) * d + j];
                    routed = routed + prod;
                }
                spelled[t * d + j] = h[t * d + j] + (routed + shared[t * d + j]);
            }
        }
        MEMRA_EXPECT_SAME_BITS(want_h, spelled) << threads;
        // Without the shared expert, in place over h.
        const TensorView in_place = to_backend(be, h, n_tokens, d);
        be.moe_combine(in_place, to_backend(be, y_scattered, n_rows, d), to_backend(be, src_row), wv, TensorView{},
                       in_place);
        auto plain = be.alloc(DType::kF32, {n_tokens, d});
        be.moe_combine(hv, to_backend(be, y_token_slot, n_pairs, d), to_backend(be, identity), wv, TensorView{},
                       *plain);
        MEMRA_EXPECT_SAME_BITS(to_host<float>(be, in_place), to_host<float>(be, *plain)) << threads;
    }
}

TEST(MoeBackend, OwnersGatheredOutputsThroughSourceRowsEqualTheSortedCombine) {
    // The expert-parallel path end to end on one backend: each owner permutes its experts' rows compactly,
    // computes them (here a per-row function of the row, standing in for the expert), the owners' buffers are
    // gathered [n_owners, capacity, d], and the combine reads them through moe_source_rows. Equals the
    // single-owner combine over the whole sorted buffer with row_of_pair, bit for bit.
    const int64_t n_tokens = 19, top_k = 4, n_experts = 16, d = 24;
    ThreadPool ref_pool(1);
    const std::vector<float> logits = random_floats(static_cast<size_t>(n_tokens * n_experts), 19, -4.0f, 4.0f);
    const Routed r = route(ref_pool, RouterParams{n_experts, top_k, true, 3.0f}, logits, nullptr);
    const int64_t n_pairs = n_tokens * top_k;
    const std::vector<float> x = random_floats(static_cast<size_t>(n_tokens * d), 20);
    const std::vector<float> h = random_floats(static_cast<size_t>(n_tokens * d), 21);
    CpuBackend be(2, Numerics::kExact);
    const TensorView ids = to_backend(be, r.ids);
    auto offsets = be.alloc(DType::kI32, {n_experts + 1});
    auto sorted_pair = be.alloc(DType::kI32, {n_pairs});
    auto row_of_pair = be.alloc(DType::kI32, {n_pairs});
    be.moe_sort_pairs(ids.reshaped({n_tokens, top_k}), n_experts, *offsets, *sorted_pair, *row_of_pair);
    const TensorView xv = to_backend(be, x, n_tokens, d);
    const TensorView hv = to_backend(be, h, n_tokens, d);
    const TensorView wv = to_backend(be, r.weights, n_tokens, top_k);
    const std::vector<float> scale = random_floats(static_cast<size_t>(d), 22, 0.5f, 2.0f);
    // A per-row stand-in for an expert (each row times a fixed vector, on the host): the test is about routing.
    auto expert = [&](TensorView rows) {
        std::vector<float> v = to_host<float>(be, rows);
        for (size_t i = 0; i < v.size(); ++i) v[i] = v[i] * scale[i % static_cast<size_t>(d)];
        be.copy_from_host(v.data(), rows);
    };
    auto sorted = be.alloc(DType::kF32, {n_pairs, d});
    be.moe_permute(xv, *sorted_pair, *offsets, 0, n_experts, top_k, *sorted);
    expert(*sorted);
    auto want = be.alloc(DType::kF32, {n_tokens, d});
    be.moe_combine(hv, *sorted, *row_of_pair, wv, TensorView{}, *want);
    const std::vector<float> want_h = to_host<float>(be, *want);
    const std::vector<int32_t> off = to_host<int32_t>(be, *offsets);
    for (int64_t owners : {1, 2, 4, 8}) {
        const int64_t per = n_experts / owners;
        const int64_t capacity = n_pairs;  // room for any routing
        auto gathered = be.alloc(DType::kF32, {owners * capacity, d});
        for (int64_t o = 0; o < owners; ++o) {
            const TensorView own = gathered->row_slice(o * capacity, (o + 1) * capacity);
            be.moe_permute(xv, *sorted_pair, *offsets, o * per, (o + 1) * per, top_k, own);
            expert(own.row_slice(0, off[(o + 1) * per] - off[o * per]));
        }
        auto src_row = be.alloc(DType::kI32, {n_pairs});
        be.moe_source_rows(ids, *row_of_pair, *offsets, owners, capacity, *src_row);
        auto got = be.alloc(DType::kF32, {n_tokens, d});
        be.moe_combine(hv, *gathered, *src_row, wv, TensorView{}, *got);
        MEMRA_EXPECT_SAME_BITS(to_host<float>(be, *got), want_h) << owners << " owners";
    }
}

TEST(MoeBackendDeathTest, CombineRefusesASourceRowOutsideTheBuffer) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    CpuBackend be(1, Numerics::kExact);
    const TensorView hv = to_backend(be, std::vector<float>(2 * 3, 1.0f), 2, 3);
    const TensorView wv = to_backend(be, std::vector<float>(2 * 2, 1.0f), 2, 2);
    const TensorView y = to_backend(be, std::vector<float>(5 * 3, 1.0f), 5, 3);
    auto out = be.alloc(DType::kF32, {2, 3});
    EXPECT_DEATH(be.moe_combine(hv, y, to_backend(be, std::vector<int32_t>{0, 4, 5, 1}), wv, TensorView{}, *out),
                 "moe_combine: pair 2 reads row 5 of 5");
    EXPECT_DEATH(be.moe_combine(hv, y, to_backend(be, std::vector<int32_t>{0, -1, 2, 1}), wv, TensorView{}, *out),
                 "moe_combine: pair 1 reads row -1 of 5");
}

}  // namespace
}  // namespace memra::cpu::test
