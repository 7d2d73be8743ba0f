// KV write, query rounding and blocked paged attention on the GPU (see ops_attention.h). Every value goes
// through the CPU's MEMRA_HD code, and every reduction is formed in the CPU's order: the q.k dot in the 16 lanes
// and fixed tree of core/math.h (a half-warp per score, a shfl_xor butterfly), the block max as a fold over
// increasing positions (a warp reduction that keeps the first maximum), the block sum of e_p, and each value
// accumulator over increasing positions sequentially (one thread per (head, d)), the split merge left to right.
// fmt turns its constexpr support off under nvcc, and its C++20 consteval format strings then fail to compile
// (core/result.h, core/tensor.h). Host compilers get FMT_USE_CONSTEXPR = 1; so does this file, so that it can
// use the CPU's types (cpu::PagedLayer, KvFormat, RowRounding) and stays consistent with the host objects.
#ifndef FMT_USE_CONSTEXPR
#define FMT_USE_CONSTEXPR 1
#endif

#include "backend/cuda/ops_attention.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/float_formats.h"
#include "core/kv_format.h"
#include "core/kv_page.h"
#include "core/math.h"
#include "core/quant_blocks.h"

namespace memra::cuda {
namespace {

// The blocked order's geometry (cpu ops_attention.cpp): blocks of 128 positions and splits of 512, both aligned
// to position 0, and work items of up to 8 query heads sharing one kv head.
constexpr int64_t kBlockRows = 128;
constexpr int kSplitRows = 512;
constexpr int kHeadBatch = 8;
constexpr int64_t kMaxHeadDim = 512;

// One CTA per work item: 8 warps, warp j keeps the softmax statistics of head j of the batch.
constexpr int kAttnThreads = 32 * kHeadBatch;
// Value rows decoded into shared memory at a time.
constexpr int kVChunk = 32;
// Dynamic shared memory a CTA may use without opting in.
constexpr int64_t kDefaultSmemBytes = 48 * 1024;

constexpr int kRowThreads = 128;       // kv_write: one CTA per row
constexpr int kElemThreads = 256;      // round_rows: grid-stride loops
constexpr int64_t kMaxBlocks = 65536;  // the grid-stride loop covers anything larger
constexpr int64_t kMaxGrid = 2147483647;  // grid.x limit

constexpr unsigned kFullMask = 0xffffffffu;

__device__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

__device__ float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// Bytes of n values in a KV format, or -1 when a block format cannot cut them.
int64_t format_bytes(KvFormat f, int64_t n) {
    switch (f) {
        case KvFormat::kF32: return 4 * n;
        case KvFormat::kBf16: return 2 * n;
        case KvFormat::kQ8_0:
            return n % kQuantBlock == 0 ? n / kQuantBlock * static_cast<int64_t>(sizeof(BlockQ8_0)) : -1;
        case KvFormat::kQ5_1:
            return n % kQuantBlock == 0 ? n / kQuantBlock * static_cast<int64_t>(sizeof(BlockQ5_1)) : -1;
    }
    return -1;
}

bool valid_format(KvFormat f) {
    return f == KvFormat::kF32 || f == KvFormat::kBf16 || f == KvFormat::kQ8_0 || f == KvFormat::kQ5_1;
}

// ---------------------------------------------------------------------------------------------
// KV write.

// kv_encode of n values x into `out`, by the threads of the CTA: f32 copies the bits, bf16 rounds each value,
// the block formats quantize one block of 32 per thread (2-byte aligned: every row and block offset is even).
__device__ void encode_row(KvFormat f, const float *x, int64_t n, std::byte *out) {
    switch (f) {
        case KvFormat::kF32: {
            const uint32_t *gx = reinterpret_cast<const uint32_t *>(x);
            uint32_t *gout = reinterpret_cast<uint32_t *>(out);
            for (int64_t e = threadIdx.x; e < n; e += blockDim.x) gout[e] = gx[e];
            return;
        }
        case KvFormat::kBf16: {
            uint16_t *gout = reinterpret_cast<uint16_t *>(out);
            for (int64_t e = threadIdx.x; e < n; e += blockDim.x) gout[e] = f32_to_bf16(x[e]);
            return;
        }
        case KvFormat::kQ8_0: {
            BlockQ8_0 *gout = reinterpret_cast<BlockQ8_0 *>(out);
            for (int64_t b = threadIdx.x; b < n / kQuantBlock; b += blockDim.x) {
                BlockQ8_0 block;
                quantize_block_q8_0(x + b * kQuantBlock, block);
                gout[b] = block;
            }
            return;
        }
        case KvFormat::kQ5_1: {
            BlockQ5_1 *gout = reinterpret_cast<BlockQ5_1 *>(out);
            for (int64_t b = threadIdx.x; b < n / kQuantBlock; b += blockDim.x) {
                BlockQ5_1 block;
                quantize_block_q5_1(x + b * kQuantBlock, block);
                gout[b] = block;
            }
            return;
        }
    }
}

// One CTA per row i: gk, gv [n, row_elems] f32 -> the K and V bytes of slot gslots[i].
__global__ void kv_write_kernel(const cpu::PagedLayer layer, int64_t row_elems, const float *gk, const float *gv,
                                const int32_t *gslots, int32_t *error_flag) {
    const int64_t i = blockIdx.x;
    const int64_t slot = gslots[i];
    if (slot < 0 || slot >= layer.n_pages * kKvPageRows) {
        if (threadIdx.x == 0 && error_flag != nullptr) atomicExch(error_flag, 1);
        return;
    }
    std::byte *page = layer.base + (slot / kKvPageRows) * layer.page_bytes;
    const int64_t r = slot % kKvPageRows;
    encode_row(layer.k_format, gk + i * row_elems, row_elems, page + layer.k_offset + r * layer.k_row_bytes);
    encode_row(layer.v_format, gv + i * row_elems, row_elems, page + layer.v_offset + r * layer.v_row_bytes);
}

// ---------------------------------------------------------------------------------------------
// Query rounding.

__device__ int64_t first_index() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }

__device__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// gx: [n] f32, each value to bf16 and back.
__global__ void round_bf16_kernel(float *gx, int64_t n) {
    for (int64_t e = first_index(); e < n; e += grid_stride()) gx[e] = round_bf16(gx[e]);
}

// gx: [n_blocks, 32] f32, each block through q8_0 and back in place (cpu::round_rows).
__global__ void round_q8_kernel(float *gx, int64_t n_blocks) {
    for (int64_t b = first_index(); b < n_blocks; b += grid_stride()) {
        float *x = gx + b * kQuantBlock;
        BlockQ8_0 block;
        quantize_block_q8_0(x, block);
        q8_0_dequant_block(block, x);
    }
}

int64_t grid_for(int64_t n) {
    const int64_t blocks = (n + kElemThreads - 1) / kElemThreads;
    return blocks < kMaxBlocks ? blocks : kMaxBlocks;
}

// ---------------------------------------------------------------------------------------------
// Paged attention.

struct AttentionArgs {
    const float *q;  // [n_q, q_stride]
    int64_t q_stride;
    const int64_t *q_pos;         // [n_q]
    const int32_t *q_seq;         // [n_q]
    const int32_t *block_tables;  // [n_seqs, bt_stride]
    int64_t bt_stride;
    int64_t n_seqs;
    int64_t first_pos;
    const float *gate;  // [n_q, gate_stride] or nullptr
    int64_t gate_stride;
    float *out;  // [n_q, n_heads, head_dim]
    int32_t *error_flag;
    cpu::PagedLayer layer;
    int64_t n_heads;
    int64_t n_kv_heads;
    int64_t head_dim;
    int64_t window;
    int64_t group;    // query heads per kv head
    int64_t batches;  // work items per (query, kv head)
    int64_t k_head_bytes;
    int64_t v_head_bytes;
    float scale;
    bool round_keys;  // f32 and bf16 keys are rounded to bf16 when read
    float *split_ws;     // kSplit / kMerge: [n_items, max_splits, split_state_floats(head_dim)]
    int64_t max_splits;  // splits of an item's range at most (the grid's y of kSplit)
};

// How a launch covers a work item's splits. kWhole: one CTA runs every split of its item, merging as it goes.
// kSplit: CTA (item, k) runs split k of its item alone and stores its state (m, l, acc) in the workspace; kMerge:
// one CTA per item then merges the stored states left to right and writes the output. Both give the same bits:
// each split's state is formed the same way, and the merge is the same left fold over the same states.
enum class AttnMode { kWhole, kSplit, kMerge };

// A stored split state: m[kHeadBatch], l[kHeadBatch], acc[kHeadBatch][head_dim].
__host__ __device__ int64_t split_state_floats(int64_t head_dim) { return 2 * kHeadBatch + kHeadBatch * head_dim; }

// Value d of one head's row as kv_decode gives it (the block formats' *_dequant_one equal their block forms).
__device__ float decode_value(KvFormat f, const std::byte *row, int64_t d) {
    switch (f) {
        case KvFormat::kF32: return reinterpret_cast<const float *>(row)[d];
        case KvFormat::kBf16: return bf16_to_f32(reinterpret_cast<const uint16_t *>(row)[d]);
        case KvFormat::kQ8_0:
            return q8_0_dequant_one(reinterpret_cast<const BlockQ8_0 *>(row)[d / kQuantBlock],
                                    static_cast<int>(d % kQuantBlock));
        case KvFormat::kQ5_1:
            return q5_1_dequant_one(reinterpret_cast<const BlockQ5_1 *>(row)[d / kQuantBlock],
                                    static_cast<int>(d % kQuantBlock));
    }
    return 0.0f;
}

// Shared memory of a CTA, in floats: the batch's queries, the split's scores, the split's and the running
// accumulators, and a chunk of decoded values.
int64_t attention_smem_floats(int64_t head_dim) {
    return 3 * kHeadBatch * head_dim + kHeadBatch * kSplitRows + kVChunk * head_dim;
}

// One CTA per work item (query i, kv head g, query heads [h0, h0 + nh)), numbered as the CPU numbers them.
// Per split of the row's visible range [lo, hi] (left to right):
//   scores: a half-warp per position, lane l summing d = l, l + 16, ... (dot_f32's lane l), then the
//           butterfly 1, 2, 4, 8 (its tree: lane 0 adds lane w at level w, as reduce_lanes_tree), times scale;
//   per 128-block: warp j folds head j's block max (first maximum kept, NaN skipped), exponentiates, and its
//           lane 0 sums e_p in increasing p and rounds them to bf16 in place; then thread (j, d) scales acc by
//           alpha and adds P_p * v[p, d] over increasing p, the values decoded a chunk at a time;
//   merge:  thread j merges head j's (m, l) into (M, L), thread (j, d) its accumulator into ACC.
// Finally out = ACC / L, times the sigmoid gate. kMode (AttnMode) splits this between two launches.
template <AttnMode kMode>
__global__ void __launch_bounds__(kAttnThreads) paged_attention_kernel(const AttentionArgs a) {
    extern __shared__ float smem[];
    const int64_t head_dim = a.head_dim;
    float *sq = smem;                              // [kHeadBatch, head_dim] the batch's query heads
    float *ss = sq + kHeadBatch * head_dim;        // [kHeadBatch, kSplitRows] s_p, then e_p, then P_p
    float *sacc = ss + kHeadBatch * kSplitRows;    // [kHeadBatch, head_dim] the split's acc
    float *sacc_run = sacc + kHeadBatch * head_dim;  // [kHeadBatch, head_dim] the running ACC
    float *sv = sacc_run + kHeadBatch * head_dim;  // [kVChunk, head_dim] values of a chunk, rounded to bf16
    __shared__ float s_m[kHeadBatch];      // the split's running max
    __shared__ float s_l[kHeadBatch];      // the split's running sum
    __shared__ float s_alpha[kHeadBatch];  // the current block's rescale of acc
    __shared__ int s_live[kHeadBatch];     // the current block has a finite max
    __shared__ float s_run_m[kHeadBatch];  // the merged M
    __shared__ float s_run_l[kHeadBatch];  // the merged L
    __shared__ float s_a[kHeadBatch];      // the merge's factor of ACC
    __shared__ float s_b[kHeadBatch];      // the merge's factor of the split's acc

    const float neg_inf = u32_as_f32(0xff800000u);
    const int tid = static_cast<int>(threadIdx.x);
    const int warp = tid / 32;
    const int lane = tid % 32;

    const int64_t item = blockIdx.x;
    const int64_t i = item / (a.n_kv_heads * a.batches);
    const int64_t g = (item / a.batches) % a.n_kv_heads;
    const int64_t h0 = g * a.group + (item % a.batches) * kHeadBatch;
    const int nh = static_cast<int>(imin(kHeadBatch, (g + 1) * a.group - h0));
    const int64_t n_pairs = nh * head_dim;  // (head j, dim d) pairs, e = j * head_dim + d
    float *gout = a.out + (i * a.n_heads + h0) * head_dim;  // [nh, head_dim]

    // The CPU's refusals, as NaN outputs and the error flag: a bad sequence or position, a visible block
    // without a page or with a page outside the pool.
    const int64_t hi = a.q_pos[i];
    const int64_t seq = a.q_seq[i];
    int bad = seq < 0 || seq >= a.n_seqs || hi < a.first_pos || hi / kKvPageRows >= a.bt_stride;
    int64_t lo = a.first_pos;
    const int32_t *bt = a.block_tables + (bad ? 0 : seq) * a.bt_stride;  // [bt_stride]
    if (!bad) {
        lo = a.window > 0 ? imax(a.first_pos, hi - a.window + 1) : a.first_pos;
        for (int64_t b = lo / kKvPageRows + tid; b <= hi / kKvPageRows; b += kAttnThreads) {
            if (bt[b] < 0 || bt[b] >= a.layer.n_pages) bad = 1;
        }
    }
    if (__syncthreads_or(bad)) {
        if constexpr (kMode != AttnMode::kSplit) {  // the merge launch reports it
            if (tid == 0 && a.error_flag != nullptr) atomicExch(a.error_flag, 1);
            for (int64_t e = tid; e < n_pairs; e += kAttnThreads) gout[e] = u32_as_f32(0x7fc00000u);
        }
        return;
    }
    const int64_t first_split = lo / kSplitRows;
    // kSplit / kMerge: the item's stored split states.
    float *ws_item =
        kMode == AttnMode::kWhole ? nullptr : a.split_ws + item * a.max_splits * split_state_floats(head_dim);

    const std::byte *k_base = a.layer.base + a.layer.k_offset + g * a.k_head_bytes;
    const std::byte *v_base = a.layer.base + a.layer.v_offset + g * a.v_head_bytes;
    auto k_row = [&](int64_t p) {
        return k_base + static_cast<int64_t>(bt[p / kKvPageRows]) * a.layer.page_bytes +
               (p % kKvPageRows) * a.layer.k_row_bytes;
    };
    auto v_row = [&](int64_t p) {
        return v_base + static_cast<int64_t>(bt[p / kKvPageRows]) * a.layer.page_bytes +
               (p % kKvPageRows) * a.layer.v_row_bytes;
    };

    if constexpr (kMode != AttnMode::kMerge) {
        const float *gq = a.q + i * a.q_stride + h0 * head_dim;  // [nh, head_dim], the heads are contiguous
        for (int64_t e = tid; e < n_pairs; e += kAttnThreads) sq[e] = gq[e];
    }

    const int half = tid / 16;  // the score phase's half-warp
    const int hl = tid % 16;    // its lane: dot_f32's lane index
    // One split [s0, s1] of the range into the split state (sacc, s_m, s_l), ending behind a __syncthreads.
    const auto run_split = [&](int64_t s0, int64_t s1) {
        const int n_s = static_cast<int>(s1 - s0 + 1);
        // A fresh state for the split. Every earlier reader of these is behind a __syncthreads (the merge's),
        // except the merge's own thread, which is this one.
        for (int64_t e = tid; e < n_pairs; e += kAttnThreads) sacc[e] = 0.0f;
        if (tid < nh) {
            s_m[tid] = neg_inf;
            s_l[tid] = 0.0f;
        }
        __syncthreads();  // sq is loaded (first split)

        // Scores: half-warp `half` takes positions s0 + r, r = half, half + 16, ...; every lane runs every round
        // so the shuffles see the whole warp.
        for (int r_base = 0; r_base < n_s; r_base += kAttnThreads / 16) {
            const int r = r_base + half;
            float part[kHeadBatch];
#pragma unroll
            for (int j = 0; j < kHeadBatch; ++j) part[j] = 0.0f;
            if (r < n_s) {
                const std::byte *row = k_row(s0 + r);
                for (int64_t d = hl; d < head_dim; d += 16) {
                    float kd = decode_value(a.layer.k_format, row, d);
                    if (a.round_keys) kd = round_bf16(kd);
#pragma unroll
                    for (int j = 0; j < kHeadBatch; ++j) {
                        if (j < nh) part[j] = part[j] + sq[j * head_dim + d] * kd;
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < kHeadBatch; ++j) {
                if (j >= nh) continue;  // uniform over the CTA
                float t = part[j];
                for (int w = 1; w < 16; w *= 2) t = t + __shfl_xor_sync(kFullMask, t, w);
                if (hl == 0 && r < n_s) ss[j * kSplitRows + r] = t * a.scale;
            }
        }
        __syncthreads();

        for (int64_t b0 = s0; b0 <= s1;) {
            const int64_t b1 = imin(s1, (b0 / kBlockRows + 1) * kBlockRows - 1);  // block [b0, b1]
            const int r0 = static_cast<int>(b0 - s0);
            const int r1 = static_cast<int>(b1 - s0);
            // The block's statistics: warp j for head j.
            if (warp < nh) {
                float *sj = ss + warp * kSplitRows;  // [kSplitRows]
                // The max of the fold bm = s > bm ? s : bm over increasing positions: each lane folds its
                // positions, then the lanes combine keeping the larger value and, on equal values (+0 and -0),
                // the earlier position, which is the fold's result bit for bit. NaN scores are never taken.
                float bm = neg_inf;
                int bi = 0x7fffffff;
                for (int r = r0 + lane; r <= r1; r += 32) {
                    const float s = sj[r];
                    if (s > bm) {
                        bm = s;
                        bi = r;
                    }
                }
                for (int w = 16; w >= 1; w /= 2) {
                    const float ov = __shfl_xor_sync(kFullMask, bm, w);
                    const int oi = __shfl_xor_sync(kFullMask, bi, w);
                    if (ov > bm || (ov == bm && oi < bi)) {
                        bm = ov;
                        bi = oi;
                    }
                }
                const float m = s_m[warp];
                const float m_new = bm > m ? bm : m;
                const bool live = m_new != neg_inf;
                if (live) {
                    for (int r = r0 + lane; r <= r1; r += 32) sj[r] = exp_f32(sj[r] - m_new);
                    __syncwarp();
                    if (lane == 0) {
                        const float alpha = m == neg_inf ? 0.0f : exp_f32(m - m_new);
                        float b_sum = 0.0f;
                        for (int r = r0; r <= r1; ++r) {
                            b_sum = b_sum + sj[r];
                            sj[r] = round_bf16(sj[r]);
                        }
                        s_l[warp] = s_l[warp] * alpha + b_sum;
                        s_alpha[warp] = alpha;
                        s_m[warp] = m_new;
                    }
                }
                if (lane == 0) s_live[warp] = live ? 1 : 0;
            }
            __syncthreads();

            // The values: thread (j, d) rescales, then adds P_p * v[p, d] over increasing p.
            bool any_live = false;
            for (int j = 0; j < nh; ++j) any_live = any_live || s_live[j] != 0;
            for (int64_t e = tid; e < n_pairs; e += kAttnThreads) {
                const int64_t j = e / head_dim;
                if (s_live[j]) sacc[e] = sacc[e] * s_alpha[j];
            }
            for (int64_t c0 = b0; any_live && c0 <= b1; c0 += kVChunk) {
                const int n_c = static_cast<int>(imin(kVChunk, b1 - c0 + 1));
                for (int64_t e = tid; e < n_c * head_dim; e += kAttnThreads) {
                    const int64_t rr = e / head_dim;
                    sv[e] = round_bf16(decode_value(a.layer.v_format, v_row(c0 + rr), e - rr * head_dim));
                }
                __syncthreads();
                for (int64_t e = tid; e < n_pairs; e += kAttnThreads) {
                    const int64_t j = e / head_dim;
                    if (!s_live[j]) continue;
                    const int64_t d = e - j * head_dim;
                    const float *pj = ss + j * kSplitRows + (c0 - s0);  // [n_c] P_p of the chunk
                    float acc = sacc[e];
                    for (int rr = 0; rr < n_c; ++rr) acc = acc + pj[rr] * sv[rr * head_dim + d];
                    sacc[e] = acc;
                }
                __syncthreads();  // sv is read before the next chunk overwrites it
            }
            __syncthreads();  // s_live, s_alpha and ss are read before the next block's statistics
            b0 = b1 + 1;
        }
    };
    // Merges the split state into the running state (s_run_m, s_run_l, sacc_run), left to right.
    const auto merge_split = [&](bool first) {
        if (tid < nh) {
            const int j = tid;
            if (first) {
                s_run_m[j] = s_m[j];
                s_run_l[j] = s_l[j];
            } else {
                const float m = s_m[j];
                const float run_m = s_run_m[j];
                const float m_next = m > run_m ? m : run_m;
                const float fa = exp_f32(run_m - m_next);
                const float fb = exp_f32(m - m_next);
                s_run_l[j] = s_run_l[j] * fa + s_l[j] * fb;
                s_run_m[j] = m_next;
                s_a[j] = fa;
                s_b[j] = fb;
            }
        }
        __syncthreads();
        for (int64_t e = tid; e < n_pairs; e += kAttnThreads) {
            const int64_t j = e / head_dim;
            sacc_run[e] = first ? sacc[e] : sacc_run[e] * s_a[j] + sacc[e] * s_b[j];
        }
    };
    const auto write_out = [&] {
        // s_run_l was written before the last merge's __syncthreads; each thread reads back only its own pairs.
        for (int64_t e = tid; e < n_pairs; e += kAttnThreads) {
            const int64_t j = e / head_dim;
            float o = sacc_run[e] / s_run_l[j];
            if (a.gate != nullptr) o = o * sigmoid_f32(a.gate[i * a.gate_stride + h0 + j]);
            gout[e] = o;
        }
    };

    if constexpr (kMode == AttnMode::kMerge) {
        const int64_t state = split_state_floats(head_dim);
        const int64_t n_k = hi / kSplitRows - first_split + 1;
        for (int64_t k = 0; k < n_k; ++k) {
            const float *st = ws_item + k * state;
            for (int64_t e = tid; e < n_pairs; e += kAttnThreads) sacc[e] = st[2 * kHeadBatch + e];
            if (tid < nh) {
                s_m[tid] = st[tid];
                s_l[tid] = st[kHeadBatch + tid];
            }
            __syncthreads();  // the previous merge's readers of s_a and s_b are done
            merge_split(k == 0);
        }
        write_out();
    } else if constexpr (kMode == AttnMode::kSplit) {
        const int64_t k = blockIdx.y;
        const int64_t s0 = k == 0 ? lo : (first_split + k) * kSplitRows;
        if (s0 > hi) return;  // the item has fewer splits
        run_split(s0, imin(hi, (first_split + k + 1) * kSplitRows - 1));
        float *st = ws_item + k * split_state_floats(head_dim);
        for (int64_t e = tid; e < n_pairs; e += kAttnThreads) st[2 * kHeadBatch + e] = sacc[e];
        if (tid < nh) {
            st[tid] = s_m[tid];
            st[kHeadBatch + tid] = s_l[tid];
        }
    } else {
        for (int64_t s0 = lo; s0 <= hi;) {
            const int64_t s1 = imin(hi, (s0 / kSplitRows + 1) * kSplitRows - 1);  // split [s0, s1]
            run_split(s0, s1);
            merge_split(s0 == lo);
            s0 = s1 + 1;
        }
        write_out();
    }
}

}  // namespace

cudaError_t kv_write(const cpu::PagedLayer &layer, int64_t row_elems, const float *k, const float *v,
                     const int32_t *slots, int64_t n, int32_t *error_flag, cudaStream_t stream) {
    if (n < 0 || n > kMaxGrid || row_elems <= 0 || !valid_format(layer.k_format) || !valid_format(layer.v_format)) {
        return cudaErrorInvalidValue;
    }
    if (format_bytes(layer.k_format, row_elems) != layer.k_row_bytes ||
        format_bytes(layer.v_format, row_elems) != layer.v_row_bytes) {
        return cudaErrorInvalidValue;
    }
    if (n == 0) return cudaSuccess;
    if (layer.base == nullptr || k == nullptr || v == nullptr || slots == nullptr) return cudaErrorInvalidValue;
    kv_write_kernel<<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(layer, row_elems, k, v, slots,
                                                                          error_flag);
    return cudaGetLastError();
}

cudaError_t round_rows(float *x, int64_t n_rows, int64_t d, RowRounding r, cudaStream_t stream) {
    if (n_rows < 0 || d <= 0 || (r == RowRounding::kQ8 && d % kQuantBlock != 0)) return cudaErrorInvalidValue;
    if (r == RowRounding::kNone || n_rows == 0) return cudaSuccess;
    if (x == nullptr) return cudaErrorInvalidValue;
    const int64_t n = n_rows * d;
    if (r == RowRounding::kBf16) {
        round_bf16_kernel<<<static_cast<unsigned>(grid_for(n)), kElemThreads, 0, stream>>>(x, n);
    } else {
        const int64_t n_blocks = n / kQuantBlock;
        round_q8_kernel<<<static_cast<unsigned>(grid_for(n_blocks)), kElemThreads, 0, stream>>>(x, n_blocks);
    }
    return cudaGetLastError();
}

namespace {

// The splits of 512 positions a row's visible range can span: within the block table's positions, and within the
// window when there is one.
int64_t attention_max_splits(const cpu::AttentionShape &shape, int64_t bt_stride) {
    const int64_t table = (bt_stride * kKvPageRows - 1) / kSplitRows + 1;
    return shape.window > 0 ? std::min(table, (shape.window - 1) / kSplitRows + 2) : table;
}

}  // namespace

int64_t paged_attention_split_floats(const cpu::AttentionShape &shape, int64_t n_q, int64_t bt_stride) {
    if (shape.n_heads <= 0 || shape.n_kv_heads <= 0 || shape.n_heads % shape.n_kv_heads != 0 || shape.head_dim <= 0 ||
        shape.head_dim > kMaxHeadDim || n_q <= 0 || bt_stride < 1 || bt_stride > (int64_t{1} << 40)) {
        return 0;
    }
    const int64_t splits = attention_max_splits(shape, bt_stride);
    if (splits < 2 || splits > 65535) return 0;
    const int64_t batches = (shape.n_heads / shape.n_kv_heads + kHeadBatch - 1) / kHeadBatch;
    const int64_t per_row = shape.n_kv_heads * batches * splits * split_state_floats(shape.head_dim);
    return n_q > (int64_t{1} << 62) / per_row ? 0 : n_q * per_row;
}

cudaError_t paged_attention(const cpu::AttentionShape &shape, const float *q, int64_t q_stride, const int64_t *q_pos,
                            const int32_t *q_seq, int64_t n_q, const cpu::PagedLayer &layer,
                            const int32_t *block_tables, int64_t bt_stride, int64_t n_seqs, int64_t first_pos,
                            const float *gate, int64_t gate_stride, float *out, int32_t *error_flag,
                            cudaStream_t stream, float *split_ws, int64_t split_ws_floats) {
    const int64_t n_heads = shape.n_heads;
    const int64_t n_kv_heads = shape.n_kv_heads;
    const int64_t head_dim = shape.head_dim;
    if (!shape.blocked || n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 || head_dim <= 0 ||
        head_dim > kMaxHeadDim || shape.window < 0 || first_pos < 0) {
        return cudaErrorInvalidValue;
    }
    if (q_stride < n_heads * head_dim || n_q < 0 || bt_stride < 1 || n_seqs < 1 ||
        (gate != nullptr && gate_stride < n_heads)) {
        return cudaErrorInvalidValue;
    }
    if (!valid_format(layer.k_format) || !valid_format(layer.v_format)) return cudaErrorInvalidValue;
    const int64_t k_head_bytes = format_bytes(layer.k_format, head_dim);
    const int64_t v_head_bytes = format_bytes(layer.v_format, head_dim);
    if (k_head_bytes < 0 || v_head_bytes < 0 || layer.k_row_bytes != n_kv_heads * k_head_bytes ||
        layer.v_row_bytes != n_kv_heads * v_head_bytes) {
        return cudaErrorInvalidValue;
    }
    const int64_t group = n_heads / n_kv_heads;
    const int64_t batches = (group + kHeadBatch - 1) / kHeadBatch;
    if (n_q > kMaxGrid / (n_kv_heads * batches)) return cudaErrorInvalidValue;
    const int64_t n_items = n_q * n_kv_heads * batches;
    if (n_items == 0) return cudaSuccess;
    if (q == nullptr || q_pos == nullptr || q_seq == nullptr || layer.base == nullptr || block_tables == nullptr ||
        out == nullptr) {
        return cudaErrorInvalidValue;
    }

    AttentionArgs a{};
    a.q = q;
    a.q_stride = q_stride;
    a.q_pos = q_pos;
    a.q_seq = q_seq;
    a.block_tables = block_tables;
    a.bt_stride = bt_stride;
    a.n_seqs = n_seqs;
    a.first_pos = first_pos;
    a.gate = gate;
    a.gate_stride = gate_stride;
    a.out = out;
    a.error_flag = error_flag;
    a.layer = layer;
    a.n_heads = n_heads;
    a.n_kv_heads = n_kv_heads;
    a.head_dim = head_dim;
    a.window = shape.window;
    a.group = group;
    a.batches = batches;
    a.k_head_bytes = k_head_bytes;
    a.v_head_bytes = v_head_bytes;
    a.scale = shape.scale;
    a.round_keys = layer.k_format == KvFormat::kF32 || layer.k_format == KvFormat::kBf16;

    // Split-KV when the workspace holds every (item, split) state (none needed: one split at most).
    const int64_t split_floats = paged_attention_split_floats(shape, n_q, bt_stride);
    const bool split = split_ws != nullptr && split_floats > 0 && split_floats <= split_ws_floats;
    a.split_ws = split ? split_ws : nullptr;
    a.max_splits = attention_max_splits(shape, bt_stride);

    const int64_t smem_bytes = attention_smem_floats(head_dim) * static_cast<int64_t>(sizeof(float));
    const auto launch = [&](auto kernel, dim3 grid) {
        if (smem_bytes > kDefaultSmemBytes) {
            const cudaError_t err =
                cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
            if (err != cudaSuccess) return err;
        }
        kernel<<<grid, kAttnThreads, static_cast<size_t>(smem_bytes), stream>>>(a);
        return cudaGetLastError();
    };
    if (!split) return launch(paged_attention_kernel<AttnMode::kWhole>, dim3(static_cast<unsigned>(n_items)));
    const cudaError_t err = launch(paged_attention_kernel<AttnMode::kSplit>,
                                   dim3(static_cast<unsigned>(n_items), static_cast<unsigned>(a.max_splits)));
    if (err != cudaSuccess) return err;
    return launch(paged_attention_kernel<AttnMode::kMerge>, dim3(static_cast<unsigned>(n_items)));
}

}  // namespace memra::cuda
