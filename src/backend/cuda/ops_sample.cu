// The sampling kernel (ops_sample.h): one block per row, reproducing Sampler::sample and token_logprobs.
//
// Why only a prefix of the sorted candidates matters. The CPU sorts the (top-k) candidates by (score
// descending, id ascending), sums their weights w = exp_f32(score - top) in that order, scans the top-p
// cumulative sum w / sum in that order, filters by min-p and takes the Gumbel arg-max. The first candidate is
// the top one with w = 1 exactly, so from then on sum >= 1 and the cumulative sum >= fl(1 / sum): a later
// w < 2^-24 cannot change the sum, and a later w < 2^-26 cannot change the cumulative sum (its quotient is below
// half an ulp of either). A candidate with score - top < -20 has w < 2.1e-9 < 2^-26, and its Gumbel key
// (score - top) + g < -20 + 16.64 (the largest noise) is below the top candidate's key 0 + g >= -2.82 (the
// smallest noise), so it can never be drawn either. The kernel therefore sorts only the "relevant" candidates
// R = {score - top >= -20} (a prefix of the CPU's order: score - top rounds monotonically), which is every id
// in the worst case (equal or narrow logits) and usually far fewer on a trained model's logits.
//
// The sort orders unique 64-bit keys (~orderable(score) << 32 | id), so its result does not depend on the order the
// atomics below placed them in. It runs only where the filters read a sorted prefix: top-p (its sums run over every
// relevant candidate) or a top-k that cuts. The relevant candidates are first bucketed by score over their range
// [lo, top]: bucket(s) = (top - s) * 2048 / (top - lo) truncated, monotone in s (every operation rounds
// monotonically), so bucket order is key order and only the buckets that hold that prefix need sorting, each on its
// own: a warp ranks a bucket of up to 256 keys against each other, the block sorts a larger one in shared memory,
// and a bucket of more than kSortChunk keys (equal or nearly equal scores) falls back to a bitonic network over every
// relevant key, its large distances in global memory. The kept set is then "relevant, key <= the last kept key", and
// the Gumbel draw skips the noise of any candidate that cannot beat the best key so far. The order-dependent sums
// (the weights, the top-p scan, the log-softmax denominator) are added by thread 0 from shared-memory tiles the
// block fills, in the CPU's order.
#include "backend/cuda/ops_sample.h"

#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "backend/cuda/arg_first.cuh"
#include "backend/cuda/launch.cuh"
#include "core/float_formats.h"
#include "core/math.h"

namespace memra::cuda {

namespace {

constexpr int kThreads = 512;
constexpr int kWarp = 32;
constexpr int kWarps = kThreads / kWarp;
constexpr int64_t kSortChunk = 4096;   // keys sorted in shared memory at once (32 KB)
constexpr float kRelevantGap = -20.0f;  // score - top below this: never drawn, no effect on any sum (above)
constexpr int64_t kSlotAlign = 256;

int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// The smallest power of two >= n (n >= 1).
__host__ __device__ int64_t pow2_at_least(int64_t n) {
    int64_t p = 1;
    while (p < n) p *= 2;
    return p;
}

int64_t work_bytes_for(int32_t vocab) { return round_up(static_cast<int64_t>(vocab) * 4, kSlotAlign); }

// Sets the caller's sticky error flag; many threads may set it, all to 1.
__device__ void raise_flag(int32_t *flag) {
    if (flag != nullptr) atomicExch(flag, 1);
}

__device__ float neg_inf() { return u32_as_f32(0xff800000u); }

__device__ bool is_finite(float x) { return (f32_as_u32(x) & 0x7f800000u) != 0x7f800000u; }

// A logit as the sampler reads it: NaN counts as -Inf.
struct NanAsNegInf {
    __device__ float operator()(float l) const { return l != l ? neg_inf() : l; }
};

// ---- Block arg-max under (value descending, id ascending) ------------------------------------------------

struct Best {
    float v;
    int32_t id;
};

// The first of every thread's (v, id) in the order above; every thread gets it. Contains two __syncthreads.
__device__ Best block_best(float v, int32_t id, float *s_v, int32_t *s_id) {
    warp_first(v, id);
    const int warp = static_cast<int>(threadIdx.x) / kWarp;
    if (threadIdx.x % kWarp == 0) {
        s_v[warp] = v;
        s_id[warp] = id;
    }
    __syncthreads();
    Best b{s_v[0], s_id[0]};
    for (int w = 1; w < kWarps; ++w) {
        if (first_before(s_v[w], s_id[w], b.v, b.id)) b = Best{s_v[w], s_id[w]};
    }
    __syncthreads();  // s_v / s_id are free for the next call
    return b;
}

// ---- Bitonic sort of unique u64 keys, ascending -------------------------------------------------------------

// Sort key of candidate (score, id): ascending keys = score descending (+0 and -0 equal), then id ascending.
__device__ uint64_t candidate_key(float score, int32_t id) {
    uint32_t u = f32_as_u32(score);
    if (u == 0x80000000u) u = 0;                            // -0 sorts as +0: the CPU compares them equal
    const uint32_t ascending = (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);  // unsigned order = float order
    return (static_cast<uint64_t>(~ascending) << 32) | static_cast<uint32_t>(id);
}

// The score of a key: candidate_key's inverse, except that a -0 score comes back +0. Nothing the sampler derives from
// it tells the two apart: every compare treats them as equal, a nonzero noise added to either gives the same sum, and
// exp_f32 returns 1 for both (score - top is +-0 only where top is +-0 too).
__device__ int32_t key_id(uint64_t key) { return static_cast<int32_t>(static_cast<uint32_t>(key)); }

__device__ float key_score(uint64_t key) {
    const uint32_t ascending = ~static_cast<uint32_t>(key >> 32);
    return u32_as_f32((ascending & 0x80000000u) != 0 ? (ascending & 0x7fffffffu) : ~ascending);
}

// Pair t of a network step with distance j: i has bit j clear, its partner is i + j.
__device__ int64_t pair_low(int64_t t, int64_t j) { return ((t & ~(j - 1)) << 1) | (t & (j - 1)); }

// One step (k, j) of the bitonic network over a[0, n) whose element 0 is global index `base`: element i and
// i + j go ascending when global bit k of i is clear, else descending.
__device__ void bitonic_step(uint64_t *a, int64_t n, int64_t base, int64_t k, int64_t j) {
    for (int64_t t = threadIdx.x; t < n / 2; t += kThreads) {
        const int64_t i = pair_low(t, j);
        const uint64_t x = a[i];
        const uint64_t y = a[i + j];
        const bool ascending = ((base + i) & k) == 0;
        if (ascending ? x > y : x < y) {
            a[i] = y;
            a[i + j] = x;
        }
    }
}

// Stages k_lo..k_hi (powers of two) of the network over s[0, len) in shared memory, element 0 being global index
// base: the steps of distance < len of each stage (every step, for stages k <= len). Every thread of the block calls
// it.
__device__ void shared_stages(uint64_t *s, int64_t len, int64_t base, int64_t k_lo, int64_t k_hi) {
    for (int64_t k = k_lo; k <= k_hi; k *= 2) {
        for (int64_t j = (k < len ? k : len) / 2; j > 0; j /= 2) {
            bitonic_step(s, len, base, k, j);
            __syncthreads();
        }
    }
}

// Sorts keys[0, p) ascending (p a power of two) with the bitonic network: steps of distance < chunk run on
// chunks in shared memory, larger ones in global memory. Every thread of the block calls it.
__device__ void bitonic_sort(uint64_t *keys, int64_t p, uint64_t *s_chunk) {
    const int64_t chunk = p < kSortChunk ? p : kSortChunk;
    const auto in_chunks = [&](int64_t k_lo, int64_t k_hi) {
        for (int64_t base = 0; base < p; base += chunk) {
            for (int64_t i = threadIdx.x; i < chunk; i += kThreads) s_chunk[i] = keys[base + i];
            __syncthreads();
            shared_stages(s_chunk, chunk, base, k_lo, k_hi);
            for (int64_t i = threadIdx.x; i < chunk; i += kThreads) keys[base + i] = s_chunk[i];
            __syncthreads();
        }
    };
    in_chunks(2, chunk);
    for (int64_t k = 2 * chunk; k <= p; k *= 2) {
        for (int64_t j = k / 2; j >= chunk; j /= 2) {
            bitonic_step(keys, p, 0, k, j);
            __syncthreads();
        }
        in_chunks(k, k);
    }
}

// Sorts keys[0, len) ascending, len <= kSortChunk, in shared memory (padded with ~0, which no candidate key equals:
// its id would be -1).
__device__ void sort_run(uint64_t *keys, int64_t len, uint64_t *s_chunk) {
    const int64_t p = pow2_at_least(len);
    for (int64_t i = threadIdx.x; i < p; i += kThreads) s_chunk[i] = i < len ? keys[i] : ~uint64_t{0};
    __syncthreads();
    shared_stages(s_chunk, p, 0, 2, p);
    for (int64_t i = threadIdx.x; i < len; i += kThreads) keys[i] = s_chunk[i];
    __syncthreads();
}

// ---- The kernel ---------------------------------------------------------------------------------------------

constexpr int kBuckets = 2048;  // score buckets of the relevant candidates
static_assert(kBuckets % kThreads == 0);

struct Shared {
    union {
        uint64_t chunk[kSortChunk];              // the sorts' chunk
        alignas(16) float tile[2 * kSortChunk];  // the ordered sums' terms
        int32_t cursor[kBuckets];                // the bucket scatter's next free slot per bucket
    };
    int32_t bucket_start[kBuckets + 1];  // the first key of every bucket; [kBuckets]: the relevant count
    int32_t warp_total[kWarps];
    uint32_t large_mask[kWarps];
    float best_v[kWarps];
    int32_t best_id[kWarps];
    int32_t count;
    float value;
};

// a[0, kBuckets] = the exclusive prefix sums of a[0, kBuckets) (a[kBuckets]: the total); integer sums, so any order
// gives the same values. Every thread calls it; contains __syncthreads.
__device__ void exclusive_scan_buckets(int32_t *a, int32_t *warp_total) {
    constexpr int kPer = kBuckets / kThreads;
    const int tid = static_cast<int>(threadIdx.x);
    int32_t v[kPer];
    int32_t own = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
        v[j] = a[tid * kPer + j];
        own += v[j];
    }
    int32_t inclusive = own;  // over this warp's threads up to this one
#pragma unroll
    for (int d = 1; d < kWarp; d *= 2) {
        const int32_t o = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (tid % kWarp >= d) inclusive += o;
    }
    if (tid % kWarp == kWarp - 1) warp_total[tid / kWarp] = inclusive;
    __syncthreads();
    int32_t before = inclusive - own;
    for (int w = 0; w < tid / kWarp; ++w) before += warp_total[w];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
        a[tid * kPer + j] = before;
        before += v[j];
    }
    if (tid == kThreads - 1) a[kBuckets] = before;
    __syncthreads();
}

// The last index b in [0, kBuckets] whose start[b] satisfies below(start[b]) (start is non-decreasing, below
// monotone from true to false, and below(start[0]) holds).
template <class Below>
__device__ int last_start(const int32_t *start, Below below) {
    int lo = 0;
    int hi = kBuckets;  // the answer is in [lo, hi]
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (below(start[mid])) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// Calls use(i, f(src[i])) for every i in [0, n) of this thread, reading several values before it uses any: one at a
// time, each load would wait on the uses before it, and a row of the vocabulary is hundreds of loads per thread. A
// 16-byte aligned float src is read as float4 (thread t takes the quadruples t + j * kThreads), kVecLoads of them in
// flight; the rest one element at a time, kScanLoads in flight. The order of the calls is not defined.
constexpr int kScanLoads = 16;
constexpr int kVecLoads = 8;
template <class T, class F, class Use>
__device__ void batched_pass(int64_t n, const T *src, F f, Use use) {
    int64_t done = 0;
    if constexpr (std::is_same_v<T, float>) {
        if (reinterpret_cast<uintptr_t>(src) % 16 == 0) {
            const int64_t n4 = n / 4;
            const auto *src4 = reinterpret_cast<const float4 *>(src);
            for (int64_t base = threadIdx.x; base < n4; base += int64_t{kThreads} * kVecLoads) {
                float4 x[kVecLoads];
#pragma unroll
                for (int j = 0; j < kVecLoads; ++j) {
                    const int64_t q = base + int64_t{j} * kThreads;
                    x[j] = q < n4 ? src4[q] : float4{};
                }
#pragma unroll
                for (int j = 0; j < kVecLoads; ++j) {
                    const int64_t q = base + int64_t{j} * kThreads;
                    if (q < n4) {
                        use(4 * q, f(x[j].x));
                        use(4 * q + 1, f(x[j].y));
                        use(4 * q + 2, f(x[j].z));
                        use(4 * q + 3, f(x[j].w));
                    }
                }
            }
            done = n4 * 4;
        }
    }
    for (int64_t base = done + threadIdx.x; base < n; base += int64_t{kThreads} * kScanLoads) {
        float x[kScanLoads];
#pragma unroll
        for (int j = 0; j < kScanLoads; ++j) {
            const int64_t i = base + int64_t{j} * kThreads;
            x[j] = i < n ? f(src[i]) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kScanLoads; ++j) {
            const int64_t i = base + int64_t{j} * kThreads;
            if (i < n) use(i, x[j]);
        }
    }
}

// The first under (value descending, id ascending) of f(src[i]) over the i in [0, n) that take(f(src[i]), i) accepts
// (id -1 where it takes none); every thread gets it. The order is strict and total over distinct ids, so the order
// of the compares does not show.
template <class F, class Take>
__device__ Best block_scan(int64_t n, const float *src, F f, Take take, Shared &sh) {
    float v = 0.0f;
    int32_t id = -1;
    batched_pass(n, src, f, [&](int64_t i, float x) {
        const auto c = static_cast<int32_t>(i);
        if (take(x, c) && first_before(x, c, v, id)) {
            v = x;
            id = c;
        }
    });
    return block_best(v, id, sh.best_v, sh.best_id);
}

// acc += t[i] for i = 0, 1, ... in turn (IEEE single additions, the CPU's `+=`), stopping after the first i whose
// sum reaches `stop` where kStop: returns that i, or -1 after all len terms. t is a 16-byte aligned shared-memory
// tile of terms >= 0 (so the running sum never falls): the terms come in batches of 16 (as float4), the next batch
// loaded while one is added, and a batch whose end reaches `stop` is added again one term at a time from its start
// to find the term. The additions' own latency is the loop's pace.
template <bool kStop>
__device__ int64_t serial_add(float &acc, const float *t, int64_t len, float stop) {
    const auto *t4 = reinterpret_cast<const float4 *>(t);
    const int64_t batches = len / 16;
    float4 next[4];
    const auto load = [&](int64_t b) {
#pragma unroll
        for (int j = 0; j < 4; ++j) next[j] = t4[4 * b + j];
    };
    if (batches > 0) load(0);
    for (int64_t b = 0; b < batches; ++b) {
        const float x[16] = {next[0].x, next[0].y, next[0].z, next[0].w, next[1].x, next[1].y, next[1].z, next[1].w,
                             next[2].x, next[2].y, next[2].z, next[2].w, next[3].x, next[3].y, next[3].z, next[3].w};
        if (b + 1 < batches) load(b + 1);
        const float before = acc;
#pragma unroll
        for (int j = 0; j < 16; ++j) acc = __fadd_rn(acc, x[j]);
        if (kStop && acc >= stop) {
            acc = before;
            for (int j = 0; j < 16; ++j) {
                acc = __fadd_rn(acc, x[j]);
                if (acc >= stop) return 16 * b + j;
            }
        }
    }
    for (int64_t i = 16 * batches; i < len; ++i) {
        acc = __fadd_rn(acc, t[i]);
        if (kStop && acc >= stop) return i;
    }
    return -1;
}

// Sorts keys[0, len) ascending, 2 <= len <= kRankMax, on one warp: the keys are staged in sw[0, len) (the warp's
// own shared memory) and each goes to its rank, the count of smaller keys (keys are unique, so the ranks are a
// permutation). kPer: keys per lane, ceil(len / 32). Every lane of the warp calls it.
constexpr int kRankMax = kSortChunk / kWarps;  // 256 keys: the warps' shares of the shared chunk
template <int kPer>
__device__ void rank_sort_warp(uint64_t *keys, int len, uint64_t *sw) {
    const int lane = static_cast<int>(threadIdx.x) % kWarp;
    uint64_t x[kPer];
    int rank[kPer];
#pragma unroll
    for (int t = 0; t < kPer; ++t) {
        const int j = lane + t * kWarp;
        x[t] = j < len ? keys[j] : ~uint64_t{0};
        if (j < len) sw[j] = x[t];
        rank[t] = 0;
    }
    __syncwarp();
    for (int k = 0; k < len; ++k) {
        const uint64_t y = sw[k];
#pragma unroll
        for (int t = 0; t < kPer; ++t) rank[t] += y < x[t] ? 1 : 0;
    }
#pragma unroll
    for (int t = 0; t < kPer; ++t) {
        if (lane + t * kWarp < len) keys[rank[t]] = x[t];
    }
    __syncwarp();  // sw is free for the warp's next bucket
}

// rank_sort_warp with the fewest keys per lane that hold len.
template <int kPer = 1>
__device__ void rank_sort_bucket(uint64_t *keys, int len, uint64_t *sw) {
    if constexpr (kPer < kRankMax / kWarp) {
        if (len > kPer * kWarp) {
            rank_sort_bucket<kPer + 1>(keys, len, sw);
            return;
        }
    }
    rank_sort_warp<kPer>(keys, len, sw);
}

// Sorts the buckets that hold keys[0, need) (need >= 1; start: the bucket starts, start[kBuckets] = n_relevant
// keys): each bucket of at most kRankMax keys on one warp by rank, larger ones on the whole block in shared memory;
// where one holds more than kSortChunk keys, a bitonic network over all n_relevant keys instead. Every thread of the
// block calls it.
__device__ void sort_bucket_prefix(uint64_t *keys, int64_t need, Shared &sh) {
    const int32_t *start = sh.bucket_start;
    const int tid = static_cast<int>(threadIdx.x);
    const int warp = tid / kWarp;
    const int b_last = last_start(start, [&](int64_t st) { return st < need; });  // start[b_last] < need
    const auto len = [&](int b) { return start[b + 1] - start[b]; };
    int over = 0;
    for (int b = tid; b <= b_last; b += kThreads) over |= len(b) > kSortChunk ? 1 : 0;
    if (__syncthreads_or(over) != 0) {
        const int64_t n_relevant = start[kBuckets];
        const int64_t padded = pow2_at_least(n_relevant);
        for (int64_t i = n_relevant + tid; i < padded; i += kThreads) keys[i] = ~uint64_t{0};
        __syncthreads();
        bitonic_sort(keys, padded, sh.chunk);
        return;
    }
    for (int b = warp; b <= b_last; b += kWarps) {
        const int l = len(b);
        if (l >= 2 && l <= kRankMax) rank_sort_bucket(keys + start[b], l, sh.chunk + warp * kRankMax);
    }
    __syncthreads();
    // The larger buckets, kThreads at a time: each warp's ballot of them in a mask, walked by the whole block.
    for (int b0 = 0; b0 <= b_last; b0 += kThreads) {
        const int b = b0 + tid;
        const unsigned large = __ballot_sync(0xffffffffu, b <= b_last && len(b) > kRankMax);
        if (tid % kWarp == 0) sh.large_mask[warp] = large;
        __syncthreads();
        for (int w = 0; w < kWarps; ++w) {
            for (unsigned m = sh.large_mask[w]; m != 0; m &= m - 1) {
                const int bb = b0 + w * kWarp + __ffs(static_cast<int>(m)) - 1;
                sort_run(keys + start[bb], len(bb), sh.chunk);
            }
        }
        __syncthreads();  // large_mask is rewritten next round
    }
}

// The smallest of every thread's v (the same on every thread). Contains two __syncthreads.
__device__ float block_min(float v, Shared &sh) {
#pragma unroll
    for (int d = kWarp / 2; d > 0; d /= 2) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, d));
    if (threadIdx.x % kWarp == 0) sh.best_v[threadIdx.x / kWarp] = v;
    __syncthreads();
    float m = sh.best_v[0];
    for (int w = 1; w < kWarps; ++w) m = fminf(m, sh.best_v[w]);
    __syncthreads();
    return m;
}

// Thread 0's sum of term(i) over i in [0, n), added in increasing i (the CPU loop's order and operation): the
// block computes the terms into shared-memory tiles, thread 0 adds them. Every thread calls it; only thread 0's
// result is the sum. Contains __syncthreads.
template <class Term>
__device__ float ordered_sum(int64_t n, Term term, Shared &sh) {
    constexpr int64_t kTile = 2 * kSortChunk;
    float sum = 0.0f;
    for (int64_t base = 0; base < n; base += kTile) {
        const int64_t len = n - base < kTile ? n - base : kTile;
        for (int64_t i = threadIdx.x; i < len; i += kThreads) sh.tile[i] = term(base + i);
        __syncthreads();
        if (threadIdx.x == 0) serial_add<false>(sum, sh.tile, len, 0.0f);
        __syncthreads();
    }
    return sum;
}

// Sampler::sample for one row (every thread returns the id). gwork: [n] f32 scratch; gkeys: [pow2 >= n] u64.
// gbias: the row's [r.bias_len] entries (sorted unique ids, checked by the kernel).
__device__ int32_t sample_row(const float *glogits, int32_t n, const SampleRow &r, const int32_t *ghistory,
                              const LogitBias *gbias, int32_t vocab, float *gwork, uint64_t *gkeys, Shared &sh,
                              int32_t *flag) {
    const int tid = static_cast<int>(threadIdx.x);
    const SamplingParams &p = r.params;
    const int64_t window = p.penalty_context(r.history_len);
    // 0. Greedy with neither bias nor penalties: the first index of the largest logit (NaN -> -Inf), read in place.
    if (p.temperature == 0.0f && r.bias_len == 0 && window == 0) {
        return block_scan(
                   n, glogits, NanAsNegInf{}, [](float, int32_t) { return true; }, sh)
            .id;
    }
    // 1. Penalised logits (NaN -> -Inf), the bias added (each id once: no two threads touch one logit), then the
    //    penalties of the window's distinct tokens: counts in gkeys as i32 (zeroed, counted, then taken by
    //    exactly one thread per token with an exchange). With neither, the logits themselves are read (work).
    const bool in_place = r.bias_len == 0 && window == 0;
    const float *work = in_place ? glogits : gwork;
    if (!in_place) batched_pass(n, glogits, NanAsNegInf{}, [&](int64_t i, float l) { gwork[i] = l; });
    if (r.bias_len > 0) {
        __syncthreads();
        for (int64_t j = tid; j < r.bias_len; j += kThreads) {
            const LogitBias b = gbias[j];
            if (b.id < n) gwork[b.id] = gwork[b.id] + b.value;
        }
    }
    if (window > 0) {
        const int32_t *recent = ghistory + r.history_begin + (r.history_len - window);
        auto *count = reinterpret_cast<int32_t *>(gkeys);
        for (int64_t j = tid; j < window; j += kThreads) {
            const int32_t t = recent[j];
            if (t >= 0 && t < n) {
                count[t] = 0;
            } else if (t < 0 || t >= vocab) {
                raise_flag(flag);
            }
        }
        __syncthreads();
        for (int64_t j = tid; j < window; j += kThreads) {
            const int32_t t = recent[j];
            if (t >= 0 && t < n) atomicAdd(&count[t], 1);
        }
        __syncthreads();
        for (int64_t j = tid; j < window; j += kThreads) {
            const int32_t t = recent[j];
            if (t < 0 || t >= n) continue;
            const int32_t c = atomicExch(&count[t], 0);
            if (c == 0) continue;  // another entry of the same token took its count
            float l = gwork[t];
            l = l > 0.0f ? l / p.repetition_penalty : l * p.repetition_penalty;
            l = l - static_cast<float>(c) * p.frequency_penalty - p.presence_penalty;
            gwork[t] = l;
        }
    }
    __syncthreads();

    // 2. Greedy: the first index of the largest non-NaN value (Sampler::greedy's scan; a NaN at id 0 keeps 0).
    const auto not_nan = [](float x, int32_t) { return x == x; };
    if (p.temperature == 0.0f) {
        const Best b = block_scan(
            n, gwork, [](float w) { return w; }, not_nan, sh);
        const float w0 = gwork[0];
        return w0 != w0 || b.id < 0 ? 0 : b.id;
    }

    // 3. The top score (the CPU's order_[0]; a non-finite one is the answer itself) and, in the same pass, the
    //    lowest score, where step 4's buckets start.
    const float temperature = p.temperature;
    const auto scaled = [=](float w) { return NanAsNegInf{}(w) / temperature; };  // the CPU's score_
    float best_s = 0.0f;
    int32_t best_id = -1;
    float low_s = u32_as_f32(0x7f800000u);
    batched_pass(n, work, scaled, [&](int64_t i, float s) {
        const auto c = static_cast<int32_t>(i);
        if (s == s && first_before(s, c, best_s, best_id)) {
            best_s = s;
            best_id = c;
        }
        low_s = s < low_s ? s : low_s;
    });
    const Best top_b = block_best(best_s, best_id, sh.best_v, sh.best_id);
    low_s = block_min(low_s, sh);
    if (top_b.id < 0) return 0;  // every score NaN: outside the contract (ops_sample.h)
    const float top = top_b.v;
    if (!is_finite(top)) return top_b.id;

    // 4. Where the filters read a sorted prefix (top-p, or a top-k that cuts): the relevant candidates' keys in their
    //    score buckets (counted, the counts scanned into bucket starts, each key placed in its bucket), then the
    //    buckets that hold that prefix, sorted. kth: the last kept key (~0: every relevant candidate).
    const int64_t n_cand = p.top_k > 0 && p.top_k < n ? p.top_k : n;
    uint64_t kth = ~uint64_t{0};
    int64_t kept_keys = -1;  // where step 4 ran: the kept candidates are gkeys[0, kept_keys)
    if (p.top_p < 1.0f || n_cand < n) {
        // The buckets span the relevant scores [lo, top]: bucket(s) = (top - s) * kBuckets / (top - lo), truncated
        // (a monotone function of s whatever lo is: lo only spreads the keys over the buckets).
        const float gap_floor = top + kRelevantGap;
        const float lo = low_s > gap_floor ? low_s : gap_floor;
        const float range = top - lo;  // >= 0; a tiny one puts every key in bucket 0
        const float scale = range > 1e-30f ? static_cast<float>(kBuckets) / range : 0.0f;
        const auto bucket = [&](float s) {
            const float t = (top - s) * scale;  // in [0, ~kBuckets]
            return t < static_cast<float>(kBuckets) ? static_cast<int32_t>(t) : kBuckets - 1;
        };
        for (int b = tid; b < kBuckets; b += kThreads) sh.bucket_start[b] = 0;
        __syncthreads();
        batched_pass(n, work, scaled, [&](int64_t, float s) {
            if (s - top >= kRelevantGap) atomicAdd(&sh.bucket_start[bucket(s)], 1);
        });
        __syncthreads();
        exclusive_scan_buckets(sh.bucket_start, sh.warp_total);
        for (int b = tid; b < kBuckets; b += kThreads) sh.cursor[b] = sh.bucket_start[b];
        __syncthreads();
        batched_pass(n, work, scaled, [&](int64_t i, float s) {
            if (s - top >= kRelevantGap) {
                gkeys[atomicAdd(&sh.cursor[bucket(s)], 1)] = candidate_key(s, static_cast<int32_t>(i));
            }
        });
        __syncthreads();
        const int64_t n_relevant = sh.bucket_start[kBuckets];  // >= 1: the top one
        const int64_t m = n_relevant < n_cand ? n_relevant : n_cand;
        const int64_t need = p.top_p < 1.0f || m < n_relevant ? m : 0;
        if (need > 0) sort_bucket_prefix(gkeys, need, sh);

        // 5. Top-p over the first m candidates in the CPU's order: the sum of their weights exp_f32(score - top) and
        //    the cut, each added on one thread in the CPU's order and operations (the weights and the quotients
        //    w / sum are computed by the block: the same IEEE operations).
        int64_t keep = m;
        if (p.top_p < 1.0f) {
            const auto weight = [&](int64_t i) { return exp_f32(key_score(gkeys[i]) - top); };
            const float sum_part = ordered_sum(m, weight, sh);
            if (tid == 0) {
                sh.value = sum_part;
                sh.count = -1;  // the cut, once found
            }
            __syncthreads();
            const float sum = sh.value;
            constexpr int64_t kTile = 2 * kSortChunk;
            float cumulative = 0.0f;  // thread 0's
            for (int64_t base = 0; base < m; base += kTile) {
                const int64_t len = m - base < kTile ? m - base : kTile;
                for (int64_t i = tid; i < len; i += kThreads) sh.tile[i] = weight(base + i) / sum;
                __syncthreads();
                if (tid == 0) {
                    const int64_t at = serial_add<true>(cumulative, sh.tile, len, p.top_p);
                    if (at >= 0) sh.count = static_cast<int32_t>(base + at + 1);
                }
                __syncthreads();
                if (sh.count >= 0) break;  // the same for every thread
            }
            keep = sh.count >= 0 ? sh.count : m;  // no cut: every relevant candidate (the rest cannot be drawn)
        }
        if (keep < n_relevant) kth = gkeys[keep - 1];
        kept_keys = keep;
    }

    // 6. Gumbel-max over the kept candidates (relevant, key <= kth, min-p on their weights), the order-free arg-max of
    //    the CPU's loop. A candidate whose (score - top) + kGumbelNoiseMax rounds below the best key so far cannot be
    //    drawn and costs no noise; the top candidate (always kept: weight 1, the first key) is drawn first. Few kept
    //    keys (a quarter of the ids at most) are walked as keys; otherwise every id is, in id order four at a time
    //    (one Philox block serves four ids), the block sharing its best key after every tile.
    float v = (scaled(work[top_b.id]) - top) + gumbel_noise_unchecked(p.seed, r.choice, r.position, top_b.id);
    int32_t id = top_b.id;
    const auto draw = [&](int32_t c, float d, float u) {
        const float key = d + gumbel_from_uniform(u);
        if (first_before(key, c, v, id)) {
            v = key;
            id = c;
        }
    };
    const auto weighty = [&](float d) { return p.min_p == 0.0f || exp_f32(d) >= p.min_p; };
    if (kept_keys >= 0 && kept_keys * 4 <= n) {
        for (int64_t i = tid; i < kept_keys; i += kThreads) {
            const uint64_t key = gkeys[i];
            const float d = key_score(key) - top;
            const int32_t c = key_id(key);
            if (!(d + kGumbelNoiseMax < v) && weighty(d)) {
                draw(c, d, philox_uniform_unchecked(p.seed, r.choice, r.position, c));
            }
        }
        return block_best(v, id, sh.best_v, sh.best_id).id;
    }
    const auto wanted = [&](int32_t c, float s) {
        const float d = s - top;
        return d >= kRelevantGap && !(d + kGumbelNoiseMax < v) && (kth == ~uint64_t{0} || candidate_key(s, c) <= kth) &&
               weighty(d);
    };
    const int64_t n4 = n / 4;
    const auto *work4 = reinterpret_cast<const float4 *>(work);
    const bool aligned = reinterpret_cast<uintptr_t>(work) % 16 == 0;
    constexpr int kDrawLoads = 4;
    constexpr int64_t kDrawTile = int64_t{kThreads} * kDrawLoads;  // quads per tile
    float4 w[kDrawLoads];
    const auto load_tile = [&](int64_t base) {
#pragma unroll
        for (int j = 0; j < kDrawLoads; ++j) {
            const int64_t q = base + int64_t{j} * kThreads + tid;
            if (q >= n4) {
                w[j] = float4{};
            } else if (aligned) {
                w[j] = work4[q];
            } else {
                w[j] = float4{work[4 * q], work[4 * q + 1], work[4 * q + 2], work[4 * q + 3]};
            }
        }
    };
    load_tile(0);
    for (int64_t base = 0; base < n4; base += kDrawTile) {
        float4 cur[kDrawLoads];
#pragma unroll
        for (int j = 0; j < kDrawLoads; ++j) cur[j] = w[j];
        if (base + kDrawTile < n4) load_tile(base + kDrawTile);  // in flight across the compares and the barrier
#pragma unroll
        for (int j = 0; j < kDrawLoads; ++j) {
            const int64_t q = base + int64_t{j} * kThreads + tid;
            if (q >= n4) continue;
            const auto c0 = static_cast<int32_t>(4 * q);
            const float s[4] = {scaled(cur[j].x), scaled(cur[j].y), scaled(cur[j].z), scaled(cur[j].w)};
            bool take[4];
            bool any = false;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                take[k] = wanted(c0 + k, s[k]);
                any = any || take[k];
            }
            if (!any) continue;
            float u[4];
            philox_uniform_quad(p.seed, r.choice, r.position, static_cast<uint32_t>(q), u);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                if (take[k]) draw(c0 + k, s[k] - top, u[k]);
            }
        }
        const Best b = block_best(v, id, sh.best_v, sh.best_id);  // the same count of calls on every thread
        v = b.v;
        id = b.id;
    }
    for (int64_t i = 4 * n4 + tid; i < n; i += kThreads) {  // the last n % 4 ids
        const auto c = static_cast<int32_t>(i);
        const float s = scaled(work[i]);
        if (wanted(c, s)) draw(c, s - top, philox_uniform_unchecked(p.seed, r.choice, r.position, c));
    }
    return block_best(v, id, sh.best_v, sh.best_id).id;
}

// token_logprobs for one row and the chosen id; thread 0 writes *glp.
__device__ void logprobs_row(const float *glogits, int32_t n, int32_t chosen, int32_t n_top, Shared &sh,
                             TokenLogprobs *glp) {
    const int tid = static_cast<int>(threadIdx.x);
    const auto value = [&](int64_t i) { return NanAsNegInf{}(glogits[i]); };
    // The largest value, the one at its lowest id (the CPU's running max keeps the first of equals: +-0).
    const float top = block_scan(
                          n, glogits, NanAsNegInf{}, [](float, int32_t) { return true; }, sh)
                          .v;
    const bool finite = is_finite(top);
    // log(sum of exp(l - top)), the sum on one thread in increasing id order.
    if (finite) {
        const float sum = ordered_sum(n, [&](int64_t i) { return exp_f32(value(i) - top); }, sh);
        if (tid == 0) sh.value = log_f32(sum);
        __syncthreads();
    }
    const float log_sum = finite ? sh.value : 0.0f;
    const auto logprob = [&](int32_t i) { return finite ? (value(i) - top) - log_sum : neg_inf(); };
    if (tid == 0) {
        glp->chosen = logprob(chosen);
        glp->n_top = n_top < n ? n_top : n;
    }
    // The n_top first ids of the order (value descending, id ascending): round j takes the first after j - 1's.
    float prev_v = 0.0f;
    int32_t prev_id = -1;
    for (int32_t j = 0; j < n_top && j < n; ++j) {
        const Best b = block_scan(
            n, glogits, NanAsNegInf{},
            [&](float x, int32_t c) { return prev_id < 0 || first_before(prev_v, prev_id, x, c); }, sh);
        if (tid == 0) {
            glp->top_ids[j] = b.id;
            glp->top_logprobs[j] = logprob(b.id);
        }
        prev_v = b.v;
        prev_id = b.id;
    }
}

// glogits: [n_logit_rows, row_stride] f32; grows: [n_rows]; ghistory: [history_size] i32; gout: [n_rows].
// gworkspace: one slot of slot_bytes per block: [work_bytes] f32 penalised logits, then the u64 keys.
__global__ void __launch_bounds__(kThreads, 1)
    sample_kernel(const float *glogits, int64_t n_logit_rows, int64_t row_stride, int32_t n_valid,
                  const SampleRow *grows, int64_t n_rows, const int32_t *ghistory, int64_t history_size,
                  const LogitBias *gbias, int64_t bias_size, SampledToken *gout, unsigned char *gworkspace,
                  int64_t slot_bytes, int64_t work_bytes, int32_t vocab, int32_t *flag) {
    pdl_enter();
    __shared__ Shared sh;
    unsigned char *slot = gworkspace + static_cast<int64_t>(blockIdx.x) * slot_bytes;
    auto *gwork = reinterpret_cast<float *>(slot);
    auto *gkeys = reinterpret_cast<uint64_t *>(slot + work_bytes);
    for (int64_t ri = blockIdx.x; ri < n_rows; ri += gridDim.x) {
        const SampleRow r = grows[ri];
        SampledToken *o = gout + ri;
        const bool bad = r.logit_row < 0 || r.logit_row >= n_logit_rows || r.history_begin < 0 ||
                         r.history_len < 0 || static_cast<int64_t>(r.history_begin) + r.history_len > history_size ||
                         r.position < 0 || r.position > int64_t{0xffffffff} || r.top_logprobs < -1 ||
                         r.top_logprobs > kMaxTopLogprobs || r.bias_begin < 0 || r.bias_len < 0 ||
                         static_cast<int64_t>(r.bias_begin) + r.bias_len > bias_size;
        // The bias entries: ids in [0, vocab), ascending and unique (every thread checks a share; all agree).
        int bad_bias = 0;
        if (!bad) {
            for (int64_t j = threadIdx.x; j < r.bias_len; j += kThreads) {
                const int32_t id = gbias[r.bias_begin + j].id;
                if (id < 0 || id >= vocab || (j > 0 && gbias[r.bias_begin + j - 1].id >= id)) bad_bias = 1;
            }
        }
        if (__syncthreads_or(bad_bias) != 0 || bad) {  // the same for every thread: the whole block skips the row
            if (threadIdx.x == 0) {
                o->id = -1;
                o->has_logprobs = 0;
                raise_flag(flag);
            }
            continue;
        }
        const float *glogit_row = glogits + static_cast<int64_t>(r.logit_row) * row_stride;
        const int32_t id =
            sample_row(glogit_row, n_valid, r, ghistory, gbias + r.bias_begin, vocab, gwork, gkeys, sh, flag);
        __syncthreads();  // every thread is done with sample_row's shared state
        if (r.top_logprobs >= 0) logprobs_row(glogit_row, n_valid, id, r.top_logprobs, sh, &o->logprobs);
        if (threadIdx.x == 0) {
            o->id = id;
            o->has_logprobs = r.top_logprobs >= 0 ? 1 : 0;
        }
        __syncthreads();  // the next row reuses the slot and the shared state
    }
}

}  // namespace

int64_t sample_workspace_slot_bytes(int32_t vocab) {
    if (vocab < 1) return 0;
    return round_up(work_bytes_for(vocab) + 8 * pow2_at_least(vocab), kSlotAlign);
}

int64_t sample_workspace_bytes(int32_t vocab, int64_t slots) {
    if (vocab < 1 || slots < 1) return 0;
    return sample_workspace_slot_bytes(vocab) * slots;
}

cudaError_t sample(const float *logits, int64_t n_logit_rows, int64_t row_stride, int32_t n_valid,
                   const SampleRow *rows, int64_t n_rows, const int32_t *history, int64_t history_size,
                   const LogitBias *bias, int64_t bias_size, SampledToken *out, void *workspace,
                   int64_t workspace_bytes, int32_t workspace_vocab, int32_t *error_flag, cudaStream_t stream) {
    if (n_rows < 0 || n_logit_rows < 0 || history_size < 0 || bias_size < 0 || n_valid < 1 || row_stride < n_valid ||
        workspace_vocab < n_valid) {
        return cudaErrorInvalidValue;
    }
    if (n_rows == 0) return cudaSuccess;
    const int64_t slot_bytes = sample_workspace_slot_bytes(workspace_vocab);
    const int64_t slots = workspace_bytes / slot_bytes;
    if (logits == nullptr || rows == nullptr || out == nullptr || workspace == nullptr || slots < 1 ||
        (history == nullptr && history_size > 0) || (bias == nullptr && bias_size > 0)) {
        return cudaErrorInvalidValue;
    }
    if (reinterpret_cast<uintptr_t>(rows) % alignof(SampleRow) != 0 ||
        reinterpret_cast<uintptr_t>(bias) % alignof(LogitBias) != 0 ||
        reinterpret_cast<uintptr_t>(out) % alignof(SampledToken) != 0 ||
        reinterpret_cast<uintptr_t>(workspace) % kSlotAlign != 0) {
        return cudaErrorInvalidValue;
    }
    const int64_t blocks = n_rows < slots ? n_rows : slots;
    const int64_t grid = blocks < INT32_MAX ? blocks : INT32_MAX;
    launch_kernel(sample_kernel, static_cast<unsigned>(grid), kThreads, 0, stream, logits, n_logit_rows, row_stride,
                  n_valid, rows, n_rows, history, history_size, bias, bias_size, out,
                  static_cast<unsigned char *>(workspace), slot_bytes, work_bytes_for(workspace_vocab), workspace_vocab,
                  error_flag);
    return cudaGetLastError();
}

}  // namespace memra::cuda
