// backend/cuda/ops_route: the router, the pair sort, the permute and the source rows against the CPU functions
// they reproduce (backend/cpu/ops_moe.h), raw bits: random logits and adversarial ones (exact ties, +-Inf,
// huge, subnormal and signed-zero logits, a bias that reorders), top_k 1..8 over 8..288 experts,
// renormalisation on and off; random routings with empty experts and several tiles of pairs; the permute and
// the source rows over 1, 2, 4 and 8 owners; the error flag for out-of-range inputs; and the fused route against
// the router product and the four launchers, raw bits, 1 to 300 tokens.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/ops_moe.h"
#include "backend/cuda/ops_matmul.h"
#include "backend/cuda/ops_route.h"
#include "core/float_formats.h"
#include "core/math.h"
#include "core/thread_pool.h"
#include "cuda/cuda_test_util.h"

namespace memra {
namespace {

// Bit mismatches between float vectors; a NaN matches any NaN (x86 and NVIDIA make different NaN payloads).
int64_t float_mismatches(const std::vector<float> &got, const std::vector<float> &want) {
    if (got.size() != want.size()) return -1;
    int64_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::isnan(want[i]) && std::isnan(got[i])) continue;
        bad += f32_as_u32(got[i]) != f32_as_u32(want[i]) ? 1 : 0;
    }
    return bad;
}

int32_t read_flag(const DeviceBuffer &flag) { return from_device<int32_t>(flag, 1)[0]; }

DeviceBuffer zero_flag() { return to_device(std::vector<int32_t>{0}); }

// ---- Router -----------------------------------------------------------------------------------------------

struct Routed {
    std::vector<int32_t> ids;
    std::vector<float> weights;
};

Routed cpu_route(const cpu::RouterParams &p, const std::vector<float> &logits, const std::vector<float> *bias) {
    const int64_t n_tokens = static_cast<int64_t>(logits.size()) / p.n_experts;
    Routed r{std::vector<int32_t>(static_cast<size_t>(n_tokens * p.top_k)),
             std::vector<float>(static_cast<size_t>(n_tokens * p.top_k))};
    ThreadPool pool(1);
    cpu::router_topk(pool, p, logits.data(), bias != nullptr ? bias->data() : nullptr, n_tokens, r.ids.data(),
                     r.weights.data());
    return r;
}

Routed gpu_route(const cpu::RouterParams &p, const std::vector<float> &logits, const std::vector<float> *bias) {
    const int64_t n_tokens = static_cast<int64_t>(logits.size()) / p.n_experts;
    const auto n_out = static_cast<size_t>(n_tokens * p.top_k);
    DeviceBuffer d_logits = to_device(logits);
    DeviceBuffer d_bias = to_device(bias != nullptr ? *bias : std::vector<float>{0.0f});
    DeviceBuffer d_ids(n_out * 4), d_w(n_out * 4);
    EXPECT_EQ(cuda::router_topk(d_logits.as<float>(), bias != nullptr ? d_bias.as<float>() : nullptr, n_tokens,
                                p.n_experts, p.top_k, p.renormalize, p.scaling_factor, d_ids.as<int32_t>(),
                                d_w.as<float>(), nullptr),
              cudaSuccess);
    return Routed{from_device<int32_t>(d_ids, n_out), from_device<float>(d_w, n_out)};
}

void expect_same_routing(const cpu::RouterParams &p, const std::vector<float> &logits,
                         const std::vector<float> *bias) {
    const Routed want = cpu_route(p, logits, bias);
    const Routed got = gpu_route(p, logits, bias);
    EXPECT_EQ(got.ids, want.ids) << p.n_experts << " experts, top " << p.top_k << (bias ? ", bias" : "");
    EXPECT_EQ(float_mismatches(got.weights, want.weights), 0)
        << p.n_experts << " experts, top " << p.top_k << (bias ? ", bias" : "");
}

TEST(CudaRouter, RandomLogitsEveryTopKExpertCountAndMode) {
    MEMRA_SKIP_WITHOUT_GPU();
    uint32_t seed = 1;
    for (int64_t n_experts : {8, 17, 64, 100, 288}) {
        for (int64_t n_tokens : {1, 7, 45}) {
            std::mt19937 rng(seed++);
            std::uniform_real_distribution<float> dist(-6.0f, 6.0f);
            std::vector<float> logits(static_cast<size_t>(n_tokens * n_experts));
            for (float &x : logits) x = dist(rng);
            std::vector<float> bias(static_cast<size_t>(n_experts));
            std::uniform_real_distribution<float> bdist(-0.3f, 0.3f);
            for (float &b : bias) b = bdist(rng);
            for (int64_t top_k = 1; top_k <= 8 && top_k <= n_experts; ++top_k) {
                for (bool renorm : {true, false}) {
                    const cpu::RouterParams p{n_experts, top_k, renorm, renorm ? 3.0f : 1.0f};
                    expect_same_routing(p, logits, &bias);
                    expect_same_routing(p, logits, nullptr);
                }
            }
        }
    }
}

TEST(CudaRouter, ExactTiesGoToTheLowerIndex) {
    MEMRA_SKIP_WITHOUT_GPU();
    // Logits from five values and a bias from three: many experts share a selection score, at and across the
    // top-k boundary, so only the lower-index rule decides.
    const int64_t n_experts = 288;
    const int64_t n_tokens = 33;
    std::mt19937 rng(7);
    std::vector<float> logits(static_cast<size_t>(n_tokens * n_experts));
    for (float &x : logits) x = static_cast<float>(static_cast<int>(rng() % 5) - 2);
    std::vector<float> bias(static_cast<size_t>(n_experts));
    for (float &b : bias) b = 0.125f * static_cast<float>(rng() % 3);
    // Token 0: every expert equal; token 1: equal except two.
    for (int64_t e = 0; e < n_experts; ++e) logits[static_cast<size_t>(e)] = 0.5f;
    for (int64_t e = 0; e < n_experts; ++e) logits[static_cast<size_t>(n_experts + e)] = -1.0f;
    logits[static_cast<size_t>(n_experts + 200)] = 2.0f;
    logits[static_cast<size_t>(n_experts + 100)] = 2.0f;
    const std::vector<float> zero_bias(static_cast<size_t>(n_experts), 0.0f);
    for (int64_t top_k : {1, 2, 5, 8}) {
        for (bool renorm : {true, false}) {
            const cpu::RouterParams p{n_experts, top_k, renorm, 2.5f};
            expect_same_routing(p, logits, &bias);
            expect_same_routing(p, logits, &zero_bias);
            expect_same_routing(p, logits, nullptr);
        }
    }
    // The inputs really tie: token 0 takes experts 0..7, token 1 takes 100, 200, then 0..5.
    const Routed r = gpu_route(cpu::RouterParams{n_experts, 8, true, 1.0f}, logits, nullptr);
    EXPECT_EQ(std::vector<int32_t>(r.ids.begin(), r.ids.begin() + 8), (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
    EXPECT_EQ(std::vector<int32_t>(r.ids.begin() + 8, r.ids.begin() + 16),
              (std::vector<int32_t>{100, 200, 0, 1, 2, 3, 4, 5}));
}

TEST(CudaRouter, AdversarialLogitsAndABiasThatReorders) {
    MEMRA_SKIP_WITHOUT_GPU();
    const float inf = std::numeric_limits<float>::infinity();
    const std::vector<float> specials = {inf,     -inf,   1e30f,     -1e30f,    88.0f,   -88.0f, 104.0f,
                                         -104.0f, 0.0f,   -0.0f,     1e-40f,    -1e-40f, 1e-7f,  -1e-7f,
                                         16.0f,   -16.0f, 17.5f,     -17.5f,    3.0f,    u32_as_f32(1u)};
    for (int64_t n_experts : {8, 31, 288}) {
        const int64_t n_tokens = 19;
        std::mt19937 rng(static_cast<uint32_t>(n_experts));
        std::vector<float> logits(static_cast<size_t>(n_tokens * n_experts));
        for (float &x : logits) x = specials[rng() % specials.size()];
        // Token 0: all -Inf (every probability 0: renormalised weights are 0 / 0 = NaN on both sides).
        for (int64_t e = 0; e < n_experts; ++e) logits[static_cast<size_t>(e)] = -inf;
        std::vector<float> bias(static_cast<size_t>(n_experts));
        for (float &b : bias) b = (rng() % 2 == 0 ? 1.0f : -1.0f) * static_cast<float>(rng() % 4) * 0.5f;
        for (int64_t top_k : {1, 3, 8}) {
            for (bool renorm : {true, false}) {
                const cpu::RouterParams p{n_experts, top_k, renorm, 3.0f};
                expect_same_routing(p, logits, &bias);
                expect_same_routing(p, logits, nullptr);
            }
        }
    }
    // The bias selects but never weights: a large bias on expert 5 picks it over a larger logit.
    std::vector<float> logits = {4.0f, 3.0f, 2.0f, 1.0f, 0.0f, -3.0f, -4.0f, -5.0f};
    std::vector<float> bias(8, 0.0f);
    bias[5] = 10.0f;
    const cpu::RouterParams p{8, 2, false, 1.0f};
    const Routed r = gpu_route(p, logits, &bias);
    EXPECT_EQ(r.ids, (std::vector<int32_t>{5, 0}));
    EXPECT_EQ(f32_as_u32(r.weights[0]), f32_as_u32(sigmoid_f32(-3.0f)));
}

TEST(CudaRouter, RejectsBadArguments) {
    MEMRA_SKIP_WITHOUT_GPU();
    DeviceBuffer d(4096);
    EXPECT_EQ(cuda::router_topk(d.as<float>(), nullptr, 1, 8, 0, true, 1.0f, d.as<int32_t>(), d.as<float>(), nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::router_topk(d.as<float>(), nullptr, 1, 8, 9, true, 1.0f, d.as<int32_t>(), d.as<float>(), nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::router_topk(d.as<float>(), nullptr, -1, 8, 2, true, 1.0f, d.as<int32_t>(), d.as<float>(),
                                nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::router_topk(nullptr, nullptr, 1, 8, 2, true, 1.0f, d.as<int32_t>(), d.as<float>(), nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::router_topk(d.as<float>(), nullptr, 1, cuda::kRouterMaxExperts + 1, 2, true, 1.0f,
                                d.as<int32_t>(), d.as<float>(), nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::router_topk(nullptr, nullptr, 0, 8, 2, true, 1.0f, nullptr, nullptr, nullptr), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// ---- Pair sort ----------------------------------------------------------------------------------------------

struct Sorted {
    std::vector<int32_t> offsets, sorted_pair, row_of_pair;
};

Sorted cpu_sort(const std::vector<int32_t> &ids, int64_t top_k, int64_t n_experts) {
    const auto n_pairs = static_cast<int64_t>(ids.size());
    Sorted s{std::vector<int32_t>(static_cast<size_t>(n_experts + 1)), std::vector<int32_t>(ids.size()),
             std::vector<int32_t>(ids.size())};
    cpu::moe_sort_pairs(ids.data(), n_pairs / top_k, top_k, n_experts, s.offsets.data(), s.sorted_pair.data(),
                        s.row_of_pair.data());
    return s;
}

// Expert ids of n_tokens x top_k pairs drawn from a subset of the experts (the rest stay empty), skewed toward
// a few of them; with `distinct` each token's experts differ, as the router makes them.
std::vector<int32_t> random_routing(int64_t n_tokens, int64_t top_k, int64_t n_experts, uint32_t seed, bool distinct) {
    std::mt19937 rng(seed);
    std::vector<int32_t> pool;
    for (int64_t e = 0; e < n_experts; ++e) {
        if (rng() % 3 != 0) pool.push_back(static_cast<int32_t>(e));  // about a third of the experts stay empty
    }
    if (static_cast<int64_t>(pool.size()) < top_k) {  // too few left for a token's distinct experts: all of them
        pool.clear();
        for (int64_t e = 0; e < n_experts; ++e) pool.push_back(static_cast<int32_t>(e));
    }
    std::vector<int32_t> ids;
    for (int64_t t = 0; t < n_tokens; ++t) {
        std::vector<int32_t> mine;
        while (static_cast<int64_t>(mine.size()) < top_k) {
            // Skewed: half the draws come from the first eighth of the pool.
            const size_t span = rng() % 2 == 0 ? std::max<size_t>(1, pool.size() / 8) : pool.size();
            const int32_t e = pool[rng() % span];
            if (distinct && std::find(mine.begin(), mine.end(), e) != mine.end()) {
                if (span < pool.size()) continue;
                // Fall back to the first free one so the loop ends.
                for (int32_t f : pool) {
                    if (std::find(mine.begin(), mine.end(), f) == mine.end()) {
                        mine.push_back(f);
                        break;
                    }
                }
                continue;
            }
            mine.push_back(e);
        }
        ids.insert(ids.end(), mine.begin(), mine.end());
    }
    return ids;
}

Sorted gpu_sort(const std::vector<int32_t> &ids, int64_t top_k, int64_t n_experts, int32_t *flag_out = nullptr) {
    const int64_t n_pairs = static_cast<int64_t>(ids.size());
    DeviceBuffer d_ids = to_device(ids.empty() ? std::vector<int32_t>{0} : ids);
    DeviceBuffer d_off(static_cast<size_t>(n_experts + 1) * 4);
    DeviceBuffer d_sorted(ids.size() * 4), d_row(ids.size() * 4);
    // Sentinels: anything the kernel leaves alone stays -7.
    std::vector<int32_t> sentinel(ids.size(), -7);
    if (!ids.empty()) {
        d_sorted.upload(sentinel.data());
        d_row.upload(sentinel.data());
    }
    DeviceBuffer d_flag = zero_flag();
    EXPECT_EQ(cuda::moe_sort_pairs(d_ids.as<int32_t>(), n_pairs / top_k, top_k, n_experts, d_off.as<int32_t>(),
                                   d_sorted.as<int32_t>(), d_row.as<int32_t>(), d_flag.as<int32_t>(), nullptr),
              cudaSuccess);
    Sorted s{from_device<int32_t>(d_off, static_cast<size_t>(n_experts + 1)),
             ids.empty() ? std::vector<int32_t>{} : from_device<int32_t>(d_sorted, ids.size()),
             ids.empty() ? std::vector<int32_t>{} : from_device<int32_t>(d_row, ids.size())};
    const int32_t flag = read_flag(d_flag);
    if (flag_out != nullptr) *flag_out = flag;
    return s;
}

TEST(CudaMoeSort, RandomRoutingsWithEmptyExpertsAndManyTiles) {
    MEMRA_SKIP_WITHOUT_GPU();
    uint32_t seed = 100;
    for (int64_t n_experts : {8, 33, 288}) {
        for (int64_t top_k : {1, 2, 8}) {
            if (top_k > n_experts) continue;
            for (int64_t n_tokens : {0, 1, 3, 64, 517, 5000}) {  // 5000 x 8 pairs: ten tiles of the placement
                for (bool distinct : {true, false}) {
                    const std::vector<int32_t> ids = random_routing(n_tokens, top_k, n_experts, seed++, distinct);
                    const Sorted want = cpu_sort(ids, top_k, n_experts);
                    int32_t flag = -1;
                    const Sorted got = gpu_sort(ids, top_k, n_experts, &flag);
                    EXPECT_EQ(flag, 0);
                    EXPECT_EQ(got.offsets, want.offsets) << n_experts << " experts, " << n_tokens << " x " << top_k;
                    EXPECT_EQ(got.sorted_pair, want.sorted_pair)
                        << n_experts << " experts, " << n_tokens << " x " << top_k;
                    EXPECT_EQ(got.row_of_pair, want.row_of_pair)
                        << n_experts << " experts, " << n_tokens << " x " << top_k;
                }
            }
        }
    }
}

TEST(CudaMoeSort, AllPairsOnOneExpertAndEveryExpertOnce) {
    MEMRA_SKIP_WITHOUT_GPU();
    // One expert holds all 9000 pairs (every warp round is one match group); then each expert exactly once.
    const std::vector<int32_t> one(9000, 287);
    const Sorted want1 = cpu_sort(one, 1, 288);
    const Sorted got1 = gpu_sort(one, 1, 288);
    EXPECT_EQ(got1.offsets, want1.offsets);
    EXPECT_EQ(got1.sorted_pair, want1.sorted_pair);
    EXPECT_EQ(got1.row_of_pair, want1.row_of_pair);
    std::vector<int32_t> each(288);
    for (int32_t e = 0; e < 288; ++e) each[static_cast<size_t>(e)] = 287 - e;
    const Sorted want2 = cpu_sort(each, 8, 288);
    const Sorted got2 = gpu_sort(each, 8, 288);
    EXPECT_EQ(got2.offsets, want2.offsets);
    EXPECT_EQ(got2.sorted_pair, want2.sorted_pair);
    EXPECT_EQ(got2.row_of_pair, want2.row_of_pair);
}

TEST(CudaMoeSort, OutOfRangeExpertIsLeftOutAndFlagged) {
    MEMRA_SKIP_WITHOUT_GPU();
    // Pairs 2 and 5 name experts outside [0, 4): they get row -1, the rest sort as without them.
    const std::vector<int32_t> ids = {2, 0, 9, 3, 0, -1, 2, 1};
    int32_t flag = 0;
    const Sorted got = gpu_sort(ids, 2, 4, &flag);
    EXPECT_EQ(flag, 1);
    EXPECT_EQ(got.offsets, (std::vector<int32_t>{0, 2, 3, 5, 6}));
    EXPECT_EQ(got.row_of_pair, (std::vector<int32_t>{3, 0, -1, 5, 1, -1, 4, 2}));
    EXPECT_EQ(got.sorted_pair, (std::vector<int32_t>{1, 4, 7, 0, 6, 3, -7, -7}));  // the last two untouched
}

TEST(CudaMoeSort, RejectsBadArguments) {
    MEMRA_SKIP_WITHOUT_GPU();
    DeviceBuffer d(4096);
    int32_t *p = d.as<int32_t>();
    EXPECT_EQ(cuda::moe_sort_pairs(p, 4, 0, 8, p, p, p, nullptr, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::moe_sort_pairs(p, 4, 2, 0, p, p, p, nullptr, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::moe_sort_pairs(p, 4, 2, cuda::kSortMaxExperts + 1, p, p, p, nullptr, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::moe_sort_pairs(p, 4, 2, 8, nullptr, p, p, nullptr, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::moe_sort_pairs(nullptr, 4, 2, 8, p, p, p, nullptr, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::moe_sort_pairs(p, int64_t{1} << 31, 2, 8, p, p, p, nullptr, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// ---- Permute and source rows --------------------------------------------------------------------------------

constexpr uint32_t kSentinelBits = 0x7fc01234u;  // a NaN payload no copy makes: rows left alone keep it

TEST(CudaMoePermute, OwnersCopyTheirRowsAndLeaveTheRestUntouched) {
    MEMRA_SKIP_WITHOUT_GPU();
    const int64_t n_experts = 64;
    const int64_t top_k = 4;
    for (int64_t n_tokens : {1, 13, 200}) {
        for (int64_t d : {1, 7, 128, 300}) {
            const std::vector<int32_t> ids =
                random_routing(n_tokens, top_k, n_experts, static_cast<uint32_t>(n_tokens * 31 + d), true);
            const Sorted s = cpu_sort(ids, top_k, n_experts);
            std::mt19937 rng(static_cast<uint32_t>(d));
            std::vector<float> x(static_cast<size_t>(n_tokens * d));
            for (float &v : x) v = u32_as_f32(static_cast<uint32_t>(rng()));  // any bits, NaNs included
            DeviceBuffer d_x = to_device(x);
            DeviceBuffer d_sorted = to_device(s.sorted_pair);
            DeviceBuffer d_off = to_device(s.offsets);
            for (int64_t n_owners : {1, 2, 4, 8}) {
                const int64_t per = n_experts / n_owners;
                for (int64_t o = 0; o < n_owners; ++o) {
                    const int64_t r0 = s.offsets[static_cast<size_t>(o * per)];
                    const int64_t r1 = s.offsets[static_cast<size_t>((o + 1) * per)];
                    const int64_t rows = r1 - r0 + 3;  // capacity with three spare rows
                    std::vector<float> want(static_cast<size_t>(rows * d), u32_as_f32(kSentinelBits));
                    ThreadPool pool(1);
                    cpu::moe_permute(pool, x.data(), d, s.sorted_pair.data() + r0, r1 - r0, top_k, want.data());
                    DeviceBuffer d_own = to_device(std::vector<float>(want.size(), u32_as_f32(kSentinelBits)));
                    DeviceBuffer d_flag = zero_flag();
                    ASSERT_EQ(cuda::moe_permute(d_x.as<float>(), n_tokens, d, d_sorted.as<int32_t>(),
                                                d_off.as<int32_t>(), n_experts, o * per, (o + 1) * per, top_k,
                                                d_own.as<float>(), rows, d_flag.as<int32_t>(), nullptr),
                              cudaSuccess);
                    const std::vector<float> got = from_device<float>(d_own, want.size());
                    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0)
                        << n_tokens << " tokens, d " << d << ", owner " << o << " of " << n_owners;
                    EXPECT_EQ(read_flag(d_flag), 0);
                }
            }
        }
    }
}

TEST(CudaMoePermute, OffsetsPastTheCapacityCopyNothingAndFlag) {
    MEMRA_SKIP_WITHOUT_GPU();
    const std::vector<int32_t> ids = {0, 1, 1, 0, 1, 1};  // 3 tokens, top 2: expert 1 owns 4 rows
    const Sorted s = cpu_sort(ids, 2, 2);
    const std::vector<float> x = {1.0f, 2.0f, 3.0f};
    DeviceBuffer d_x = to_device(x), d_sorted = to_device(s.sorted_pair), d_off = to_device(s.offsets);
    DeviceBuffer d_own = to_device(std::vector<float>(3, u32_as_f32(kSentinelBits)));
    DeviceBuffer d_flag = zero_flag();
    ASSERT_EQ(cuda::moe_permute(d_x.as<float>(), 3, 1, d_sorted.as<int32_t>(), d_off.as<int32_t>(), 2, 1, 2, 2,
                                d_own.as<float>(), 3, d_flag.as<int32_t>(), nullptr),
              cudaSuccess);
    for (float v : from_device<float>(d_own, 3)) EXPECT_EQ(f32_as_u32(v), kSentinelBits);
    EXPECT_EQ(read_flag(d_flag), 1);
    EXPECT_EQ(cuda::moe_permute(d_x.as<float>(), 3, 1, d_sorted.as<int32_t>(), d_off.as<int32_t>(), 2, 2, 1, 2,
                                d_own.as<float>(), 3, nullptr, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::moe_permute(d_x.as<float>(), 3, 1, d_sorted.as<int32_t>(), d_off.as<int32_t>(), 2, 0, 3, 2,
                                d_own.as<float>(), 3, nullptr, nullptr),
              cudaErrorInvalidValue);
}

TEST(CudaMoeSourceRows, OneTwoFourAndEightOwners) {
    MEMRA_SKIP_WITHOUT_GPU();
    const int64_t n_experts = 288;
    const int64_t top_k = 8;
    for (int64_t n_tokens : {1, 9, 300}) {
        const std::vector<int32_t> ids =
            random_routing(n_tokens, top_k, n_experts, static_cast<uint32_t>(n_tokens + 5), true);
        const Sorted s = cpu_sort(ids, top_k, n_experts);
        DeviceBuffer d_ids = to_device(ids), d_row = to_device(s.row_of_pair), d_off = to_device(s.offsets);
        for (int64_t n_owners : {1, 2, 4, 8}) {
            const int64_t per = n_experts / n_owners;
            int64_t capacity = 0;
            for (int64_t o = 0; o < n_owners; ++o) {
                capacity = std::max<int64_t>(capacity, s.offsets[static_cast<size_t>((o + 1) * per)] -
                                                           s.offsets[static_cast<size_t>(o * per)]);
            }
            capacity += n_owners;  // not the tightest: rows are placed by the capacity given
            std::vector<int32_t> want(ids.size());
            cpu::moe_source_rows(ids.data(), s.row_of_pair.data(), static_cast<int64_t>(ids.size()), s.offsets.data(),
                                 n_experts, n_owners, capacity, want.data());
            DeviceBuffer d_src(ids.size() * 4), d_flag = zero_flag();
            ASSERT_EQ(cuda::moe_source_rows(d_ids.as<int32_t>(), d_row.as<int32_t>(), static_cast<int64_t>(ids.size()),
                                            d_off.as<int32_t>(), n_experts, n_owners, capacity, d_src.as<int32_t>(),
                                            d_flag.as<int32_t>(), nullptr),
                      cudaSuccess);
            EXPECT_EQ(from_device<int32_t>(d_src, ids.size()), want)
                << n_tokens << " tokens, " << n_owners << " owners";
            EXPECT_EQ(read_flag(d_flag), 0);
        }
    }
}

TEST(CudaMoeSourceRows, RowsPastTheCapacityAreFlagged) {
    MEMRA_SKIP_WITHOUT_GPU();
    const std::vector<int32_t> ids = {0, 1, 1, 0, 1, 1, 7};  // expert 1 has 4 rows; expert 7 does not exist
    const std::vector<int32_t> row_of_pair = {0, 2, 3, 1, 4, 5, 0};
    const std::vector<int32_t> offsets = {0, 2, 6};
    DeviceBuffer d_ids = to_device(ids), d_row = to_device(row_of_pair), d_off = to_device(offsets);
    DeviceBuffer d_src(ids.size() * 4), d_flag = zero_flag();
    ASSERT_EQ(cuda::moe_source_rows(d_ids.as<int32_t>(), d_row.as<int32_t>(), 7, d_off.as<int32_t>(), 2, 2, 3,
                                    d_src.as<int32_t>(), d_flag.as<int32_t>(), nullptr),
              cudaSuccess);
    // Owner 1 (expert 1) has capacity 3: its 4th row does not fit.
    EXPECT_EQ(from_device<int32_t>(d_src, ids.size()), (std::vector<int32_t>{0, 3, 4, 1, 5, -1, -1}));
    EXPECT_EQ(read_flag(d_flag), 1);
    EXPECT_EQ(cuda::moe_source_rows(d_ids.as<int32_t>(), d_row.as<int32_t>(), 7, d_off.as<int32_t>(), 6, 4, 3,
                                    d_src.as<int32_t>(), nullptr, nullptr),
              cudaErrorInvalidValue);  // 6 experts over 4 owners
}

// ---- Fused route ------------------------------------------------------------------------------------------

// Everything cuda::moe_route writes, read back, and the error flag.
struct RouteOut {
    std::vector<float> logits;
    std::vector<int32_t> ids;
    std::vector<float> weights;
    std::vector<int32_t> offsets;
    std::vector<int32_t> sorted;
    std::vector<int32_t> row_of;
    std::vector<int32_t> src;
    int32_t flag = 0;
};

struct RouteCase {
    DType dtype;
    int64_t n_experts;
    int64_t top_k;
    int64_t k;
    int64_t chunk;
    int64_t n_tokens;
    int64_t n_owners;
    bool renormalize;
    bool bias = true;
    int64_t capacity = 0;  // 0: n_tokens * top_k, every pair fits whichever owner it goes to
};

// The router's rows: random, except that every fifth row repeats the row before it (equal logits: exact ties,
// which go to the lower expert).
std::vector<uint8_t> router_rows(DType dtype, int64_t rows, int64_t k, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.0f, 0.05f);
    const auto elem = static_cast<int64_t>(dtype == DType::kF32 ? 4 : 2);
    std::vector<uint8_t> w(static_cast<size_t>(rows * k * elem));
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < k; ++c) {
            const float v = r % 5 == 4 ? 0.0f : dist(rng);
            uint8_t *dst = w.data() + (r * k + c) * elem;
            if (r % 5 == 4) {
                std::memcpy(dst, dst - k * elem, static_cast<size_t>(elem));
            } else if (dtype == DType::kF32) {
                std::memcpy(dst, &v, 4);
            } else {
                const uint16_t b = f32_to_bf16(v);
                std::memcpy(dst, &b, 2);
            }
        }
    }
    return w;
}

std::vector<float> random_floats(int64_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> v(static_cast<size_t>(n));
    for (float &f : v) f = dist(rng);
    return v;
}

cuda::CudaMatrix route_matrix(const RouteCase &c, const DeviceBuffer &w) {
    return cuda::CudaMatrix{.dtype = c.dtype,
                            .data = w.as<void>(),
                            .rows = c.n_experts,
                            .cols = c.k,
                            .full_rows = c.n_experts,
                            .k_full = c.k,
                            .block_cols = c.chunk};
}

// The outputs of one routing, every byte 0xff before it runs (so a write left out shows).
struct RouteBuffers {
    DeviceBuffer logits, ids, wts, off, sorted, row_of, src, flag;
    explicit RouteBuffers(const RouteCase &c)
        : logits(static_cast<size_t>(c.n_tokens * c.n_experts) * 4),
          ids(pairs(c) * 4),
          wts(pairs(c) * 4),
          off(static_cast<size_t>(c.n_experts + 1) * 4),
          sorted(pairs(c) * 4),
          row_of(pairs(c) * 4),
          src(pairs(c) * 4),
          flag(zero_flag()) {
        const std::pair<const DeviceBuffer *, size_t> all[] = {
            {&logits, static_cast<size_t>(c.n_tokens * c.n_experts) * 4},
            {&ids, pairs(c) * 4},
            {&wts, pairs(c) * 4},
            {&off, static_cast<size_t>(c.n_experts + 1) * 4},
            {&sorted, pairs(c) * 4},
            {&row_of, pairs(c) * 4},
            {&src, pairs(c) * 4}};
        for (const auto &[b, bytes] : all) EXPECT_EQ(cudaMemset(b->as<void>(), 0xff, bytes), cudaSuccess);
    }
    static size_t pairs(const RouteCase &c) { return static_cast<size_t>(c.n_tokens * c.top_k); }
    cuda::MoeRouteBuffers views() const {
        return {logits.as<float>(),   ids.as<int32_t>(),    wts.as<float>(),  off.as<int32_t>(),
                sorted.as<int32_t>(), row_of.as<int32_t>(), src.as<int32_t>()};
    }
    RouteOut read(const RouteCase &c) const {
        const size_t n = pairs(c);
        return RouteOut{from_device<float>(logits, static_cast<size_t>(c.n_tokens * c.n_experts)),
                        from_device<int32_t>(ids, n),
                        from_device<float>(wts, n),
                        from_device<int32_t>(off, static_cast<size_t>(c.n_experts + 1)),
                        from_device<int32_t>(sorted, n),
                        from_device<int32_t>(row_of, n),
                        from_device<int32_t>(src, n),
                        read_flag(flag)};
    }
};

int64_t route_capacity(const RouteCase &c) { return c.capacity > 0 ? c.capacity : c.n_tokens * c.top_k; }

// The router product and the four launchers on the case's inputs.
RouteOut four_launchers(const RouteCase &c, const DeviceBuffer &w, const DeviceBuffer &x, const float *bias) {
    RouteBuffers b(c);
    const cuda::MoeRouteBuffers out = b.views();
    const int64_t n_pairs = c.n_tokens * c.top_k;
    EXPECT_EQ(cuda::cuda_matmul(route_matrix(c, w), x.as<float>(), c.n_tokens, out.logits, nullptr), cudaSuccess);
    EXPECT_EQ(cuda::router_topk(out.logits, bias, c.n_tokens, c.n_experts, c.top_k, c.renormalize, 2.5f, out.expert_ids,
                                out.weights, nullptr),
              cudaSuccess);
    EXPECT_EQ(cuda::moe_sort_pairs(out.expert_ids, c.n_tokens, c.top_k, c.n_experts, out.offsets, out.sorted_pair,
                                   out.row_of_pair, b.flag.as<int32_t>(), nullptr),
              cudaSuccess);
    EXPECT_EQ(cuda::moe_source_rows(out.expert_ids, out.row_of_pair, n_pairs, out.offsets, c.n_experts, c.n_owners,
                                    route_capacity(c), out.src_row, b.flag.as<int32_t>(), nullptr),
              cudaSuccess);
    return b.read(c);
}

void expect_same_route(const RouteOut &got, const RouteOut &want, const std::string &what) {
    EXPECT_EQ(float_mismatches(got.logits, want.logits), 0) << what;
    EXPECT_EQ(got.ids, want.ids) << what;
    EXPECT_EQ(float_mismatches(got.weights, want.weights), 0) << what;
    EXPECT_EQ(got.offsets, want.offsets) << what;
    EXPECT_EQ(got.sorted, want.sorted) << what;
    EXPECT_EQ(got.row_of, want.row_of) << what;
    EXPECT_EQ(got.src, want.src) << what;
    EXPECT_EQ(got.flag, want.flag) << what;
}

std::vector<int32_t> read_tickets(const DeviceBuffer &tickets) {
    return from_device<int32_t>(tickets, static_cast<size_t>(cuda::kRouteTickets));
}

TEST(CudaMoeRoute, OneLaunchGivesTheBitsOfTheProductAndTheFourLaunchers) {
    MEMRA_SKIP_WITHOUT_GPU();
    const std::vector<int32_t> zeros(static_cast<size_t>(cuda::kRouteTickets), 0);
    DeviceBuffer tickets = to_device(zeros);
    std::vector<RouteCase> cases;
    // Token counts around the 16-token tiles, one tile to many; K with a short last chunk; owners 1 to 8.
    for (int64_t n : {1, 2, 15, 16, 17, 33, 64, 65, 300}) {
        cases.push_back({DType::kF32, 128, 8, 4096, 128, n, n % 2 == 0 ? 2 : 1, true});
        cases.push_back({DType::kBF16, 288, 8, 1000, 128, n, 4, n % 3 != 0});
    }
    cases.push_back({DType::kF32, 8, 1, 256, 64, 40, 8, true});
    cases.push_back({DType::kF32, 512, 32, 512, 128, 70, 1, true});   // a full warp of slots
    cases.push_back({DType::kBF16, 64, 40, 384, 128, 20, 2, false});  // slots past one warp
    cases.push_back({DType::kF32, 16, 4, 100, 128, 5, 1, true});      // one chunk, shorter than the unrolled loop
    cases.push_back({DType::kF32, 16, 4, 40, 8, 18, 2, true});        // chunks narrower than the 16 lanes
    cases.push_back({DType::kF32, 32, 4, 4096, 8, 17, 1, true});      // 512 chunks: the area's limit
    cases.push_back({DType::kBF16, 24, 3, 256, 128, 9, 1, true, false});     // no bias
    cases.push_back({DType::kF32, 32, 8, 512, 128, 20, 4, true, true, 30});  // owners past their capacity: flagged
    uint32_t seed = 1;
    for (const RouteCase &c : cases) {
        ++seed;
        DeviceBuffer w = to_device(router_rows(c.dtype, c.n_experts, c.k, seed));
        std::vector<float> xh = random_floats(c.n_tokens * c.k, seed);
        if (c.n_tokens == 17) xh[static_cast<size_t>(3 * c.k + 5)] = std::numeric_limits<float>::quiet_NaN();
        if (c.n_tokens == 33) xh[static_cast<size_t>(c.k)] = std::numeric_limits<float>::infinity();
        DeviceBuffer x = to_device(xh);
        std::vector<float> bias_h(static_cast<size_t>(c.n_experts));
        std::mt19937 rng(seed);
        for (float &b : bias_h) b = static_cast<float>(rng() % 7) * 0.01f;  // reorders some, ties others
        DeviceBuffer bias = to_device(bias_h);
        const float *bias_p = c.bias ? bias.as<float>() : nullptr;
        const RouteOut want = four_launchers(c, w, x, bias_p);
        EXPECT_EQ(want.flag, c.capacity > 0 ? 1 : 0);
        for (int round = 0; round < 2; ++round) {  // the tickets are back at zero for the second launch
            RouteBuffers b(c);
            ASSERT_TRUE(cuda::moe_route_covers(route_matrix(c, w), c.n_tokens, c.top_k));
            EXPECT_EQ(cuda::moe_route(route_matrix(c, w), x.as<float>(), c.n_tokens, bias_p, c.top_k, c.renormalize,
                                      2.5f, c.n_owners, route_capacity(c), b.views(), tickets.as<int32_t>(),
                                      b.flag.as<int32_t>(), nullptr),
                      cudaSuccess);
            expect_same_route(b.read(c), want,
                              ::testing::PrintToString(c.n_experts) + " experts top " +
                                  ::testing::PrintToString(c.top_k) + ", K " + ::testing::PrintToString(c.k) + ", " +
                                  ::testing::PrintToString(c.n_tokens) + " tokens, round " +
                                  ::testing::PrintToString(round));
        }
        EXPECT_EQ(read_tickets(tickets), zeros);
    }
}

// Many launches back to back on one stream, no host wait between them, over 256 tiles (the arrival order varies
// from launch to launch); then the same launch captured in a graph and replayed. Every launch's outputs are kept
// and checked.
TEST(CudaMoeRoute, BackToBackLaunchesAndGraphReplaysKeepTheTickets) {
    MEMRA_SKIP_WITHOUT_GPU();
    const std::vector<int32_t> zeros(static_cast<size_t>(cuda::kRouteTickets), 0);
    DeviceBuffer tickets = to_device(zeros);
    const RouteCase c{DType::kF32, 128, 8, 1024, 128, 4096, 2, true};
    DeviceBuffer w = to_device(router_rows(c.dtype, c.n_experts, c.k, 99));
    DeviceBuffer bias = to_device(random_floats(c.n_experts, 98));
    constexpr int kLaunches = 6;
    std::vector<DeviceBuffer> xs;
    std::vector<std::unique_ptr<RouteBuffers>> outs;
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    for (int i = 0; i < kLaunches; ++i) {
        xs.push_back(to_device(random_floats(c.n_tokens * c.k, 200 + static_cast<uint32_t>(i))));
        outs.push_back(std::make_unique<RouteBuffers>(c));
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto launch = [&](int i) {
        return cuda::moe_route(route_matrix(c, w), xs[static_cast<size_t>(i)].as<float>(), c.n_tokens, bias.as<float>(),
                               c.top_k, c.renormalize, 2.5f, c.n_owners, route_capacity(c),
                               outs[static_cast<size_t>(i)]->views(), tickets.as<int32_t>(),
                               outs[static_cast<size_t>(i)]->flag.as<int32_t>(), stream);
    };
    for (int i = 0; i < kLaunches - 1; ++i) ASSERT_EQ(launch(i), cudaSuccess);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    ASSERT_EQ(launch(kLaunches - 1), cudaSuccess);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int r = 0; r < 3; ++r) ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    for (int i = 0; i < kLaunches; ++i) {
        const RouteOut want = four_launchers(c, w, xs[static_cast<size_t>(i)], bias.as<float>());
        expect_same_route(outs[static_cast<size_t>(i)]->read(c), want, "launch " + ::testing::PrintToString(i));
    }
    EXPECT_EQ(read_tickets(tickets), zeros);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
}

TEST(CudaMoeRoute, ShapesOutsideTheKernelAreLeftToTheFourLaunchers) {
    MEMRA_SKIP_WITHOUT_GPU();
    DeviceBuffer tickets = to_device(std::vector<int32_t>(static_cast<size_t>(cuda::kRouteTickets), 0));
    DeviceBuffer w(513 * 256 * 4), x(4 * 256 * 4), buf(513 * 4 * 4 + 4);
    const cuda::MoeRouteBuffers out{buf.as<float>(),   buf.as<int32_t>(), buf.as<float>(),  buf.as<int32_t>(),
                                    buf.as<int32_t>(), buf.as<int32_t>(), buf.as<int32_t>()};
    const cuda::CudaMatrix ok{
        .dtype = DType::kF32, .data = w.as<void>(), .rows = 8, .cols = 256, .full_rows = 8, .k_full = 256};
    cuda::CudaMatrix wide = ok;
    wide.rows = wide.full_rows = 513;
    cuda::CudaMatrix fp8 = ok;
    fp8.dtype = DType::kF8E4M3;
    cuda::CudaMatrix bf16_act = ok;
    bf16_act.dtype = DType::kBF16;
    bf16_act.act = cuda::ActRounding::kBf16;
    cuda::CudaMatrix window = ok;
    window.k_full = 512;  // a K window of a TP rank
    cuda::CudaMatrix many_chunks = ok;
    many_chunks.cols = many_chunks.k_full = 513 * 8;
    many_chunks.block_cols = 8;  // 513 chunks: more than the area holds
    EXPECT_TRUE(cuda::moe_route_covers(ok, 4, 2));
    EXPECT_TRUE(cuda::moe_route_covers(ok, cuda::kRouteMaxTokens, 8));
    for (const auto &[m, n, k] : {std::tuple{wide, 4, 2}, std::tuple{fp8, 4, 2}, std::tuple{bf16_act, 4, 2},
                                  std::tuple{window, 4, 2}, std::tuple{many_chunks, 4, 2}, std::tuple{ok, 0, 2},
                                  std::tuple{ok, int(cuda::kRouteMaxTokens + 1), 2}, std::tuple{ok, 4, 9}}) {
        EXPECT_FALSE(cuda::moe_route_covers(m, n, k));
        EXPECT_EQ(cuda::moe_route(m, x.as<float>(), n, nullptr, k, true, 1.0f, 1, 8, out, tickets.as<int32_t>(),
                                  nullptr, nullptr),
                  cudaErrorInvalidValue);
    }
    EXPECT_EQ(cuda::moe_route(ok, x.as<float>(), 4, nullptr, 2, true, 1.0f, 3, 8, out, tickets.as<int32_t>(), nullptr,
                              nullptr),
              cudaErrorInvalidValue);  // 8 experts over 3 owners
    EXPECT_EQ(cuda::moe_route(ok, x.as<float>(), 4, nullptr, 2, true, 1.0f, 1, 8, out, nullptr, nullptr, nullptr),
              cudaErrorInvalidValue);  // no tickets
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace memra
