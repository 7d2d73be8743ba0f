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
// The sort is a bitonic network over unique 64-bit keys (~orderable(score) << 32 | id), so its result does not
// depend on the order the compaction's atomics placed them in; stages that fit in shared memory run there.
// The order-dependent sums (the weights, the top-p scan, the log-softmax denominator) are added by thread 0
// from shared-memory tiles the block fills, in the CPU's order.
#include "backend/cuda/ops_sample.h"

#include <cstdint>

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

__device__ int32_t key_id(uint64_t key) { return static_cast<int32_t>(static_cast<uint32_t>(key)); }

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

// Sorts keys[0, p) ascending (p a power of two) with the bitonic network: steps of distance < chunk run on
// chunks in shared memory, larger ones in global memory. Every thread of the block calls it.
__device__ void bitonic_sort(uint64_t *keys, int64_t p, uint64_t *s_chunk) {
    const int64_t chunk = p < kSortChunk ? p : kSortChunk;
    // Steps of distance < chunk for the stages k in [k_lo, k_hi] (and every distance for those k <= chunk).
    const auto in_chunks = [&](int64_t k_lo, int64_t k_hi) {
        for (int64_t base = 0; base < p; base += chunk) {
            for (int64_t i = threadIdx.x; i < chunk; i += kThreads) s_chunk[i] = keys[base + i];
            __syncthreads();
            for (int64_t k = k_lo; k <= k_hi; k *= 2) {
                for (int64_t j = (k < chunk ? k : chunk) / 2; j > 0; j /= 2) {
                    bitonic_step(s_chunk, chunk, base, k, j);
                    __syncthreads();
                }
            }
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

// ---- The kernel ---------------------------------------------------------------------------------------------

struct Shared {
    union {
        uint64_t chunk[kSortChunk];   // the bitonic sort's chunk
        float tile[2 * kSortChunk];   // then the ordered sums' terms
    };
    float best_v[kWarps];
    int32_t best_id[kWarps];
    int32_t count;
    float value;
};

// Calls use(i, value(i)) for every i in [0, n) of this thread (i = threadIdx.x + j * kThreads), reading kScanLoads
// values before it uses any: one at a time, each load would wait on the uses before it, and a row of the vocabulary
// is hundreds of loads per thread.
constexpr int kScanLoads = 16;
template <class Value, class Use>
__device__ void batched_pass(int64_t n, Value value, Use use) {
    for (int64_t base = threadIdx.x; base < n; base += int64_t{kThreads} * kScanLoads) {
        float x[kScanLoads];
#pragma unroll
        for (int j = 0; j < kScanLoads; ++j) {
            const int64_t i = base + int64_t{j} * kThreads;
            x[j] = i < n ? value(i) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kScanLoads; ++j) {
            const int64_t i = base + int64_t{j} * kThreads;
            if (i < n) use(i, x[j]);
        }
    }
}

// The first under (value descending, id ascending) of value(i) over the i in [0, n) that take(value(i), i) accepts
// (id -1 where it takes none); every thread gets it. The order is strict and total over distinct ids, so the order
// of the compares does not show.
template <class Value, class Take>
__device__ Best block_scan(int64_t n, Value value, Take take, Shared &sh) {
    float v = 0.0f;
    int32_t id = -1;
    batched_pass(n, value, [&](int64_t i, float x) {
        const auto c = static_cast<int32_t>(i);
        if (take(x, c) && first_before(x, c, v, id)) {
            v = x;
            id = c;
        }
    });
    return block_best(v, id, sh.best_v, sh.best_id);
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
        if (threadIdx.x == 0) {
            for (int64_t i = 0; i < len; ++i) sum += sh.tile[i];
        }
        __syncthreads();
    }
    return sum;
}

// The weight stored in the high half of a sorted key (after the weights pass).
__device__ float key_weight(uint64_t key) { return u32_as_f32(static_cast<uint32_t>(key >> 32)); }

// Sampler::sample for one row (every thread returns the id). gwork: [n] f32 scratch; gkeys: [pow2 >= n] u64.
// gbias: the row's [r.bias_len] entries (sorted unique ids, checked by the kernel).
__device__ int32_t sample_row(const float *glogits, int32_t n, const SampleRow &r, const int32_t *ghistory,
                              const LogitBias *gbias, int32_t vocab, float *gwork, uint64_t *gkeys, Shared &sh,
                              int32_t *flag) {
    const int tid = static_cast<int>(threadIdx.x);
    const SamplingParams &p = r.params;
    const auto logit = [&](int64_t i) {
        const float l = glogits[i];
        return l != l ? neg_inf() : l;
    };
    const int64_t window = p.penalty_context(r.history_len);
    // 0. Greedy with neither bias nor penalties: the first index of the largest logit (NaN -> -Inf), read in place.
    if (p.temperature == 0.0f && r.bias_len == 0 && window == 0) {
        return block_scan(n, logit, [](float, int32_t) { return true; }, sh).id;
    }
    // 1. Penalised logits (NaN -> -Inf), the bias added (each id once: no two threads touch one logit), then the
    //    penalties of the window's distinct tokens: counts in gkeys as i32 (zeroed, counted, then taken by
    //    exactly one thread per token with an exchange); batched_pass keeps kScanLoads logits in flight.
    batched_pass(n, logit, [&](int64_t i, float l) { gwork[i] = l; });
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
            n, [&](int64_t i) { return gwork[i]; }, not_nan, sh);
        const float w0 = gwork[0];
        return w0 != w0 || b.id < 0 ? 0 : b.id;
    }

    // 3. The top score (the CPU's order_[0]); a non-finite one is the answer itself.
    const float temperature = p.temperature;
    const Best top_b = block_scan(
        n, [&](int64_t i) { return gwork[i] / temperature; }, not_nan, sh);
    if (top_b.id < 0) return 0;  // every score NaN: outside the contract (ops_sample.h)
    const float top = top_b.v;
    if (!is_finite(top)) return top_b.id;

    // 4. The relevant candidates' keys, padded with ~0 to a power of two, sorted.
    if (tid == 0) sh.count = 0;
    __syncthreads();
    for (int64_t i = tid; i < n; i += kThreads) {
        const float s = gwork[i] / temperature;
        if (s - top >= kRelevantGap) gkeys[atomicAdd(&sh.count, 1)] = candidate_key(s, static_cast<int32_t>(i));
    }
    __syncthreads();
    const int64_t n_relevant = sh.count;  // >= 1: the top one
    const int64_t padded = pow2_at_least(n_relevant);
    for (int64_t i = n_relevant + tid; i < padded; i += kThreads) gkeys[i] = ~uint64_t{0};
    __syncthreads();
    bitonic_sort(gkeys, padded, sh.chunk);

    // 5. The first m candidates in the CPU's order, their weights exp_f32(score - top) into the keys' high halves.
    const int64_t n_cand = p.top_k > 0 && p.top_k < n ? p.top_k : n;
    const int64_t m = n_relevant < n_cand ? n_relevant : n_cand;
    for (int64_t i = tid; i < m; i += kThreads) {
        const int32_t c = key_id(gkeys[i]);
        const float w = exp_f32(gwork[c] / temperature - top);
        gkeys[i] = (static_cast<uint64_t>(f32_as_u32(w)) << 32) | static_cast<uint32_t>(c);
    }
    __syncthreads();

    // 6. The sum of the weights and the top-p cut, each added on one thread in the CPU's order and operations
    //    (the quotients w / sum are computed by the block: the same IEEE divisions).
    const float sum_part = ordered_sum(m, [&](int64_t i) { return key_weight(gkeys[i]); }, sh);
    if (tid == 0) sh.value = sum_part;
    __syncthreads();
    const float sum = sh.value;
    int64_t keep = m;
    if (p.top_p < 1.0f) {
        constexpr int64_t kTile = 2 * kSortChunk;
        if (tid == 0) sh.count = -1;  // the cut, once found
        float cumulative = 0.0f;      // thread 0's
        for (int64_t base = 0; base < m; base += kTile) {
            const int64_t len = m - base < kTile ? m - base : kTile;
            for (int64_t i = tid; i < len; i += kThreads) sh.tile[i] = key_weight(gkeys[base + i]) / sum;
            __syncthreads();
            if (tid == 0) {
                for (int64_t i = 0; i < len; ++i) {
                    cumulative += sh.tile[i];
                    if (cumulative >= p.top_p) {
                        sh.count = static_cast<int32_t>(base + i + 1);
                        break;
                    }
                }
            }
            __syncthreads();
            if (sh.count >= 0) break;  // the same for every thread
        }
        keep = sh.count >= 0 ? sh.count : m;  // no cut: every relevant candidate (the rest cannot be drawn)
    }

    // 7. Gumbel-max over the kept candidates (min-p on their weights); the order-free arg-max of the CPU's loop.
    float v = 0.0f;
    int32_t id = -1;
    for (int64_t i = tid; i < keep; i += kThreads) {
        const uint64_t key = gkeys[i];
        if (p.min_p > 0.0f && !(key_weight(key) >= p.min_p)) continue;
        const int32_t c = key_id(key);
        const float g = (gwork[c] / temperature - top) + gumbel_noise_unchecked(p.seed, r.choice, r.position, c);
        if (first_before(g, c, v, id)) {
            v = g;
            id = c;
        }
    }
    const Best drawn = block_best(v, id, sh.best_v, sh.best_id);
    return drawn.id;  // >= 0: the top candidate (weight 1) is always kept
}

// token_logprobs for one row and the chosen id; thread 0 writes *glp.
__device__ void logprobs_row(const float *glogits, int32_t n, int32_t chosen, int32_t n_top, Shared &sh,
                             TokenLogprobs *glp) {
    const int tid = static_cast<int>(threadIdx.x);
    const auto value = [&](int64_t i) {
        const float l = glogits[i];
        return l != l ? neg_inf() : l;
    };
    // The largest value, the one at its lowest id (the CPU's running max keeps the first of equals: +-0).
    const float top = block_scan(
                          n, value, [](float, int32_t) { return true; }, sh)
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
            n, value, [&](float x, int32_t c) { return prev_id < 0 || first_before(prev_v, prev_id, x, c); }, sh);
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
