// KV write, query rounding and blocked paged attention on the GPU (see ops_attention.h). Every value goes
// through the CPU's MEMRA_HD code (or, for bf16 rounding, a hardware conversion with its bits), and every
// reduction is formed in the CPU's order: the q.k dot in the 16 lanes and fixed tree of core/math.h (a half-warp
// per score, the tree as a reduce-scatter), the block max as a fold over increasing positions (a warp reduction
// that keeps the first maximum), the block sum of e_p, and each value accumulator over increasing positions
// sequentially (one thread per (head, d)), the split merge left to right.
// fmt turns its constexpr support off under nvcc, and its C++20 consteval format strings then fail to compile
// (core/result.h, core/tensor.h). Host compilers get FMT_USE_CONSTEXPR = 1; so does this file, so that it can
// use the CPU's types (cpu::PagedLayer, KvFormat, RowRounding) and stays consistent with the host objects.
#ifndef FMT_USE_CONSTEXPR
#define FMT_USE_CONSTEXPR 1
#endif

#include "backend/cuda/ops_attention.h"

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "backend/cuda/launch.cuh"
#include "core/float_formats.h"
#include "core/kv_format.h"
#include "core/kv_page.h"
#include "core/math.h"
#include "core/quant_blocks.h"

namespace memra::cuda {
namespace {

namespace cg = cooperative_groups;

// The blocked order's geometry (cpu ops_attention.cpp): blocks of 128 positions and splits of 512, both aligned
// to position 0, and work items of up to 8 query heads sharing one kv head.
constexpr int64_t kBlockRows = 128;
constexpr int kSplitRows = 512;
constexpr int kHeadBatch = 8;
constexpr int64_t kMaxHeadDim = 512;

// A cluster CTA: 8 warps, warp j folds the block max of head j of the batch.
constexpr int kAttnThreads = 32 * kHeadBatch;
// Dynamic shared memory a CTA may use without opting in.
constexpr int64_t kDefaultSmemBytes = 48 * 1024;

constexpr int kRowThreads = 128;       // kv_write: one CTA per row
constexpr int kElemThreads = 256;      // round_rows: grid-stride loops
constexpr int64_t kMaxBlocks = 65536;  // the grid-stride loop covers anything larger
constexpr int64_t kMaxGrid = 2147483647;  // grid.x limit

__device__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

// bf16_to_f32(f32_to_bf16(x)) for every x: the hardware's round-to-nearest-even conversion, with a NaN given
// f32_to_bf16's quiet NaN of the same sign (the hardware's has no sign). RoundBf16EveryHighHalf checks every sign,
// exponent and bf16 mantissa against the host with the rounding bits at each tie, above and below.
__device__ float round_bf16(float x) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return x != x ? u32_as_f32((f32_as_u32(x) & 0x80000000u) | 0x7fc00000u) : bf16_to_f32(h);
}

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

// Elements [0, n) of a row by the CTA's kRowThreads threads, kRowBatch loads in flight per thread before their
// stores: store(e, load(e)) (the pool and the rows may alias as far as the compiler knows, so it would not move a
// load above an earlier store by itself).
constexpr int kRowBatch = 8;

template <class Load, class Store>
__device__ void for_row_batches(int64_t n, Load load, Store store) {
    for (int64_t e0 = threadIdx.x; e0 < n; e0 += int64_t{kRowBatch} * kRowThreads) {
        decltype(load(e0)) v[kRowBatch];
#pragma unroll
        for (int u = 0; u < kRowBatch; ++u) {
            const int64_t e = e0 + int64_t{u} * kRowThreads;
            v[u] = e < n ? load(e) : decltype(load(e0)){};
        }
#pragma unroll
        for (int u = 0; u < kRowBatch; ++u) {
            const int64_t e = e0 + int64_t{u} * kRowThreads;
            if (e < n) store(e, v[u]);
        }
    }
}

// kv_encode of n values x into `out`, by the threads of the CTA: f32 copies the bits, bf16 rounds each value,
// the block formats quantize one block of 32 per thread (2-byte aligned: every row and block offset is even).
__device__ void encode_row(KvFormat f, const float *x, int64_t n, std::byte *out) {
    switch (f) {
        case KvFormat::kF32: {
            const uint32_t *gx = reinterpret_cast<const uint32_t *>(x);
            uint32_t *gout = reinterpret_cast<uint32_t *>(out);
            for_row_batches(n, [&](int64_t e) { return gx[e]; }, [&](int64_t e, uint32_t b) { gout[e] = b; });
            return;
        }
        case KvFormat::kBf16: {
            uint16_t *gout = reinterpret_cast<uint16_t *>(out);
            for_row_batches(n, [&](int64_t e) { return x[e]; }, [&](int64_t e, float v) { gout[e] = f32_to_bf16(v); });
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

// One CTA per row i and half (blockIdx.y 0: K, 1: V): gk, gv [n, row_elems] f32 -> the K and V bytes of slot
// gslots[i].
__global__ void kv_write_kernel(const cpu::PagedLayer layer, int64_t row_elems, const float *gk, const float *gv,
                                const int32_t *gslots, int32_t *error_flag) {
    pdl_enter();
    const int64_t i = blockIdx.x;
    const int64_t slot = gslots[i];
    if (slot < 0 || slot >= layer.n_pages * kKvPageRows) {
        if (blockIdx.y == 0 && threadIdx.x == 0 && error_flag != nullptr) atomicExch(error_flag, 1);
        return;
    }
    std::byte *page = layer.base + (slot / kKvPageRows) * layer.page_bytes;
    const int64_t r = slot % kKvPageRows;
    if (blockIdx.y == 0) {
        encode_row(layer.k_format, gk + i * row_elems, row_elems, page + layer.k_offset + r * layer.k_row_bytes);
    } else {
        encode_row(layer.v_format, gv + i * row_elems, row_elems, page + layer.v_offset + r * layer.v_row_bytes);
    }
}

// ---------------------------------------------------------------------------------------------
// Query rounding.

__device__ int64_t first_index() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }

__device__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// gx: [n] f32, each value to bf16 and back.
__global__ void round_bf16_kernel(float *gx, int64_t n) {
    pdl_enter();
    for (int64_t e = first_index(); e < n; e += grid_stride()) gx[e] = round_bf16(gx[e]);
}

// gx: [n_blocks, 32] f32, each block through q8_0 and back in place (cpu::round_rows).
__global__ void round_q8_kernel(float *gx, int64_t n_blocks) {
    pdl_enter();
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
    int head_dim;
    int64_t window;
    int64_t group;    // query heads per kv head
    int64_t batches;  // work items per (query, kv head)
    int64_t k_head_bytes;
    int64_t v_head_bytes;
    float scale;
    bool round_keys;     // f32 and bf16 keys are rounded to bf16 when read
    float *split_ws;     // kSplit and the merge: [n_items, max_splits, split_state_floats(head_dim)]
    int64_t max_splits;  // splits of an item's range at most (the grid's y of kSplit)
};

// How a launch covers a work item's splits. kWhole: one cluster runs every split of its item, merging as it goes.
// kSplit: cluster (item, k) runs split k of its item alone and stores its state (m, l, acc) in the workspace, and
// attention_merge_kernel then merges the stored states left to right. Both give the same bits: each split's state
// is formed the same way, and the merge is the same left fold over the same states.
enum class AttnMode { kWhole, kSplit };

// A stored split state: m[kHeadBatch], l[kHeadBatch], acc[kHeadBatch][head_dim]. A split whose pages the CPU
// would refuse stores m = NaN (a real m never is: NaN scores are never taken as a maximum).
__host__ __device__ int64_t split_state_floats(int64_t head_dim) { return 2 * kHeadBatch + kHeadBatch * head_dim; }

// The work item numbering (the CPU's): item -> query i, kv head g, query heads [h0, h0 + nh).
struct Item {
    int64_t i, g, h0;
    int nh;
};

__device__ Item item_of(const AttentionArgs &a, int64_t item) {
    Item it;
    it.i = item / (a.n_kv_heads * a.batches);
    it.g = (item / a.batches) % a.n_kv_heads;
    it.h0 = it.g * a.group + (item % a.batches) * kHeadBatch;
    it.nh = static_cast<int>(imin(kHeadBatch, (it.g + 1) * a.group - it.h0));
    return it;
}

// The visible range [lo, hi] of query i, or false for a sequence index or position the CPU would refuse.
__device__ bool visible_range(const AttentionArgs &a, int64_t i, int64_t &lo, int64_t &hi) {
    hi = a.q_pos[i];
    const int64_t seq = a.q_seq[i];
    if (seq < 0 || seq >= a.n_seqs || hi < a.first_pos || hi / kKvPageRows >= a.bt_stride) return false;
    lo = a.window > 0 ? imax(a.first_pos, hi - a.window + 1) : a.first_pos;
    return true;
}

// The blocked order on a cluster of kClusterCtas CTAs per (work item, split). A split's positions sit in a frame
// of kClusterCtas blocks of 128 aligned to position 0 (frame row r = position - split index * 512); CTA c of the
// cluster scores block c, and sums the values of dims [c * head_dim / 4, (c + 1) * head_dim / 4) over the split.
constexpr int kClusterCtas = static_cast<int>(kSplitRows / kBlockRows);
constexpr int kKeyRows = 32;                 // keys staged per pass: 16 half-warps x 2 positions
constexpr int kScoreStride = kSplitRows + 4;  // sp's row stride: float4 aligned, heads on distinct banks
constexpr int kSumStride = kBlockRows + 1;    // se's row stride: the 8 b_sum lanes read distinct banks
constexpr int kValueStride = kBlockRows + 4;  // sv's row stride: float4 aligned, 2-way store conflicts at most
constexpr int kQStride = kHeadBatch + 4;      // sq's: a quarter-warp's float4 loads of 8 dims hit distinct banks
constexpr int kMergeThreads = 128;
// Value chains (head, dim) of a CTA per thread: one up to head_dim 128 (8 heads x 32 dims over 256 threads), at
// most 4 (head_dim 512).
constexpr int kMaxChains = static_cast<int>(kHeadBatch * (kMaxHeadDim / kClusterCtas) / kAttnThreads);
__host__ __device__ int attention_chains(int head_dim) {
    return kHeadBatch * ((head_dim + kClusterCtas - 1) / kClusterCtas) <= kAttnThreads ? 1 : kMaxChains;
}

// A staged key row's stride: 16 mod 32 floats, so the two half-warps of a warp (rows r and r + 1) read disjoint
// banks.
__host__ __device__ int key_stride(int head_dim) { return (head_dim + 31) / 32 * 32 + 16; }

// Dynamic shared memory of a cluster CTA, in floats: the batch's queries [head_dim][kQStride], the split's scores
// (then P) [8][kScoreStride], the own block's e_p [8][kSumStride], and the staging area: keys
// [kKeyRows][key_stride] while scoring, decoded values [quarter dims][kValueStride] while summing.
__host__ __device__ int64_t attention_smem_floats(int head_dim) {
    const int64_t keys = int64_t{kKeyRows} * key_stride(head_dim);
    const int64_t values = int64_t{(head_dim + kClusterCtas - 1) / kClusterCtas} * kValueStride;
    return int64_t{head_dim} * kQStride + kHeadBatch * kScoreStride + kHeadBatch * kSumStride +
           (keys > values ? keys : values);
}

// The cluster kernel needs sm_90 (thread-block clusters and distributed shared memory): the compute_80 PTX build
// leaves its body, helpers and cluster shape out, and paged_attention refuses a device that would run that PTX
// (any but compute capability 9.0, the sm_90a code's) with cudaErrorNotSupported.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define MEMRA_ATTENTION_CLUSTERS 1
#define MEMRA_CLUSTER_DIMS __cluster_dims__(kClusterCtas, 1, 1)
#else
#define MEMRA_CLUSTER_DIMS
#endif

#ifdef MEMRA_ATTENTION_CLUSTERS
constexpr unsigned kFullMask = 0xffffffffu;

// The same rounding inside attention, where a NaN can only make NaN outputs (which compare as NaN): the bare
// conversion (round_bf16's instruction, so RoundBf16EveryHighHalf covers its bits for every other x).
__device__ float round_bf16_inner(float x) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return bf16_to_f32(h);
}

// A run of values [d, d + n) of one head's row (n <= kRun, not crossing a multiple of kRun; d and n even for the
// block formats, whose rows hold multiples of 32 values) as loaded, before decoding: bf16 codes, or code byte
// pairs and the block's header (f32 rows, a test format, are read when decoded: 16 words would not fit beside the
// rest in registers). Rows and blocks are 2-byte aligned (kv_page_layout), and nothing past the run is read. A
// thread issues all of a run's loads before it decodes any value, so their latencies overlap.
constexpr int kRun = 16;
constexpr unsigned kBlockValues = kQuantBlock;  // unsigned, so d / 32 and d % 32 are a shift and a mask

struct RawRun {
    uint32_t w[kRun / 2];  // bf16 code pairs or q8_0 / q5_1 code byte pairs, the first in the low half
    uint32_t head[2];      // q8_0: d; q5_1: d | m << 16, and qh
};

__device__ RawRun load_run(KvFormat f, const std::byte *row, unsigned d, int n) {
    RawRun r;
#pragma unroll
    for (int t = 0; t < kRun / 2; ++t) r.w[t] = 0u;
    r.head[0] = r.head[1] = 0u;
    switch (f) {
        case KvFormat::kF32: break;
        case KvFormat::kBf16: {
            const uint16_t *x = reinterpret_cast<const uint16_t *>(row) + d;
#pragma unroll
            for (int t = 0; t < kRun; ++t) {
                if (t < n) r.w[t / 2] |= static_cast<uint32_t>(x[t]) << (16 * (t % 2));
            }
            break;
        }
        case KvFormat::kQ8_0: {
            const BlockQ8_0 &b = reinterpret_cast<const BlockQ8_0 *>(row)[d / kBlockValues];
            r.head[0] = b.d;
            const uint16_t *pairs = reinterpret_cast<const uint16_t *>(b.qs + d % kBlockValues);
#pragma unroll
            for (int t = 0; t < kRun / 2; ++t) {
                if (2 * t < n) r.w[t] = pairs[t];
            }
            break;
        }
        case KvFormat::kQ5_1: {
            const BlockQ5_1 &b = reinterpret_cast<const BlockQ5_1 *>(row)[d / kBlockValues];
            const uint16_t *qh = reinterpret_cast<const uint16_t *>(b.qh);
            r.head[0] = static_cast<uint32_t>(b.d) | static_cast<uint32_t>(b.m) << 16;
            r.head[1] = static_cast<uint32_t>(qh[0]) | static_cast<uint32_t>(qh[1]) << 16;
            const uint16_t *pairs = reinterpret_cast<const uint16_t *>(b.qs + d % kBlockValues % 16);
#pragma unroll
            for (int t = 0; t < kRun / 2; ++t) {
                if (2 * t < n) r.w[t] = pairs[t];
            }
            break;
        }
    }
    return r;
}

// The run's values as kv_decode gives them (f32: read from row here), each rounded to bf16 when `round`, into
// out[t * stride] (t < n). A block's scales are widened once; each value is still its *_dequant_one formula.
__device__ void decode_run(KvFormat f, const RawRun &r, const std::byte *row, unsigned d, int n, bool round,
                           float *out, int stride) {
    float v[kRun];
    switch (f) {
        case KvFormat::kF32: {
            const float *x = reinterpret_cast<const float *>(row) + d;
#pragma unroll
            for (int t = 0; t < kRun; ++t) v[t] = t < n ? x[t] : 0.0f;
            break;
        }
        case KvFormat::kBf16: {
#pragma unroll
            for (int t = 0; t < kRun; ++t) v[t] = bf16_to_f32(static_cast<uint16_t>(r.w[t / 2] >> (16 * (t % 2))));
            break;
        }
        case KvFormat::kQ8_0: {
            const float scale = f16_to_f32(static_cast<uint16_t>(r.head[0]));
#pragma unroll
            for (int t = 0; t < kRun; t += 2) {
                const uint32_t pair = r.w[t / 2];
                v[t] = static_cast<float>(static_cast<int8_t>(pair & 0xffu)) * scale;
                v[t + 1] = static_cast<float>(static_cast<int8_t>(pair >> 8)) * scale;
            }
            break;
        }
        case KvFormat::kQ5_1: {
            // Code j = j0 + t: nibble j % 16 of the qs bytes (the high one for j >= 16), bit j of qh. A run never
            // crosses a multiple of 16, so its nibbles are all low or all high.
            const unsigned j0 = d % kBlockValues;
            const float scale = f16_to_f32(static_cast<uint16_t>(r.head[0] & 0xffffu));
            const float min = f16_to_f32(static_cast<uint16_t>(r.head[0] >> 16));
            const uint32_t high = r.head[1] >> j0;
            const int shift = j0 < 16 ? 0 : 4;
#pragma unroll
            for (int t = 0; t < kRun; t += 2) {
                const uint32_t pair = r.w[t / 2];
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    const uint32_t code = ((pair >> (8 * u + shift)) & 0xfu) | (((high >> (t + u)) & 1u) << 4);
                    const float scaled = scale * static_cast<float>(code);
                    v[t + u] = scaled + min;
                }
            }
            break;
        }
    }
    if (round) {
#pragma unroll
        for (int t = 0; t < kRun; ++t) v[t] = round_bf16_inner(v[t]);
    }
    if (n == kRun && stride == 1) {  // staged keys: a row's stride and d are multiples of 4
#pragma unroll
        for (int t = 0; t < kRun; t += 4) {
            *reinterpret_cast<float4 *>(out + t) = make_float4(v[t], v[t + 1], v[t + 2], v[t + 3]);
        }
        return;
    }
#pragma unroll
    for (int t = 0; t < kRun; ++t) {
        if (t < n) out[t * stride] = v[t];
    }
}

// p ? a : b as one selp, which keeps the compiler from turning a select between array elements into a select of
// addresses (and the array into local memory).
__device__ float select(bool p, float a, float b) {
    float r;
    asm("{\n\t.reg .pred q;\n\tsetp.ne.u32 q, %3, 0;\n\tselp.f32 %0, %1, %2, q;\n\t}"
        : "=f"(r)
        : "f"(a), "f"(b), "r"(static_cast<unsigned>(p)));
    return r;
}

// One level of the half-warp's reduce-scatter: lanes l and l ^ kW hold 2 * kN partial sums; the lane with bit kW
// set keeps the upper kN, the other the lower, each adding its partner's copy (the sums of two aligned lane groups).
template <int kN, int kW>
__device__ void reduce_level(float *v, int hl) {
    const bool up = (hl & kW) != 0;
#pragma unroll
    for (int x = 0; x < kN; ++x) {
        const float send = select(up, v[x], v[x + kN]);
        const float keep = select(up, v[x + kN], v[x]);
        v[x] = keep + __shfl_xor_sync(kFullMask, send, kW);
    }
}

// Steps (row, unit) through a row-major [rows, units] grid by kAttnThreads from thread tid, without divisions.
struct GridWalk {
    int row, unit, units;
    __device__ GridWalk(int tid, int units_per_row) : row(tid / units_per_row), unit(tid % units_per_row),
                                                      units(units_per_row) {}
    __device__ void next() {
        unit += kAttnThreads % units;
        row += kAttnThreads / units;
        if (unit >= units) {
            unit -= units;
            ++row;
        }
    }
};

#endif  // MEMRA_ATTENTION_CLUSTERS

// One cluster per (work item, split) (kSplit) or per work item (kWhole). Per split [s0, s1] of the row's visible
// range [lo, hi] (left to right), with c the CTA's rank and j a head of the batch:
//   scores (block c): keys staged 32 rows at a time, decoded (rounded to bf16 for f32 / bf16 keys); a half-warp
//           per position, lane l summing d = l, l + 16, ... (dot_f32's lane l), then the 16 lanes' fixed tree as a
//           reduce-scatter over the 16 (position, head) sums of the half-warp (each level adds the same aligned
//           lane groups as reduce_lanes_tree, so every sum has its bits), times scale;
//   block max: warp j folds block c's max (first maximum kept, NaN skipped); the cluster exchanges the 4 block
//           maxima and every CTA forms the running max m_b, live_b and alpha_b of each block;
//   e_p = exp(s_p - m_c) and P_p = bf16(e_p) over block c, and lane j sums e_p in increasing p (b_sum_c);
//   every CTA copies the other blocks' P and forms l = l * alpha_b + b_sum_b over the live blocks;
//   values: thread (j, d) of the CTA's dims scales acc by alpha_b and adds P_p * v[p, d] over increasing p,
//           block by block, the block's values decoded (to bf16) into shared memory.
// kWhole merges each split into the running state as the merge kernel does, then writes out = ACC / L times the
// sigmoid gate; kSplit stores the split's state. kChains: the value chains per thread (attention_chains). kSplit
// (decode) with one chain is held to 64 registers so that an SM runs 4 CTAs (32 warps for the latencies, and 8K
// positions' 512 CTAs in one wave), with 4 chains to 80 (3 CTAs), each spilling a few words outside the dot and
// value loops; kWhole (prefill, many items) takes 128.
template <AttnMode kMode, int kChains>
__global__ void MEMRA_CLUSTER_DIMS
    __launch_bounds__(kAttnThreads, kMode == AttnMode::kWhole ? 2 : (kChains == 1 ? 4 : 3))
    paged_attention_kernel(const AttentionArgs a) {
    pdl_enter();
#if defined(MEMRA_ATTENTION_CLUSTERS) && defined(__CUDA_ARCH__)
    extern __shared__ float4 smem4[];
    float *smem = reinterpret_cast<float *>(smem4);
    const int hd = a.head_dim;
    const int ks = key_stride(hd);
    float *sq = smem;                                 // [hd, kQStride] the batch's query heads by dim, zero past nh
    float *sp = sq + hd * kQStride;                   // [kHeadBatch, kScoreStride] s_p, then P_p, by frame row
    float *se = sp + kHeadBatch * kScoreStride;       // [kHeadBatch, kSumStride] e_p of block c
    float *sk = se + kHeadBatch * kSumStride;         // [kKeyRows, ks] staged keys
    float *sv = sk;                                   // [nd, kValueStride] a block's values of the CTA's dims
    __shared__ float s_bm[kHeadBatch];                // block c's max (read by the cluster)
    __shared__ float s_bsum[kHeadBatch];              // block c's b_sum (read by the cluster)
    __shared__ float s_mb[kClusterCtas][kHeadBatch];  // the running max after block b
    __shared__ float s_alpha[kClusterCtas][kHeadBatch];
    __shared__ int s_live[kClusterCtas][kHeadBatch];
    __shared__ float s_m[kHeadBatch];  // the split's m and l
    __shared__ float s_l[kHeadBatch];
    __shared__ float s_run_m[kHeadBatch];  // kWhole: the merged M and L, and the merge's factors
    __shared__ float s_run_l[kHeadBatch];
    __shared__ float s_fa[kHeadBatch];
    __shared__ float s_fb[kHeadBatch];

    cg::cluster_group cluster = cg::this_cluster();
    const float neg_inf = u32_as_f32(0xff800000u);
    const int tid = static_cast<int>(threadIdx.x);
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int c = static_cast<int>(cluster.block_rank());
    const int64_t item = blockIdx.x / kClusterCtas;
    const Item it = item_of(a, item);
    const int nh = it.nh;

    // The CPU's refusals: a bad sequence or position (the merge kernel reports those under kSplit), a visible
    // block without a page or with a page outside the pool (kWhole: the whole range; kSplit: this split's). Every
    // CTA of the cluster decides the same, so they return together.
    int64_t lo = 0, hi = 0;
    if (!visible_range(a, it.i, lo, hi)) {
        if constexpr (kMode == AttnMode::kWhole) {
            float *gout = a.out + (it.i * a.n_heads + it.h0) * hd;
            if (c == 0 && tid == 0 && a.error_flag != nullptr) atomicExch(a.error_flag, 1);
            for (int e = c * kAttnThreads + tid; e < nh * hd; e += kClusterCtas * kAttnThreads) {
                gout[e] = u32_as_f32(0x7fc00000u);
            }
        }
        return;
    }
    const int64_t first_split = lo / kSplitRows;
    int64_t split_k = 0;  // kSplit: the split this cluster runs, [p_lo, p_hi] of the range
    int64_t p_lo = lo, p_hi = hi;
    if constexpr (kMode == AttnMode::kSplit) {
        split_k = blockIdx.y;
        p_lo = split_k == 0 ? lo : (first_split + split_k) * kSplitRows;
        if (p_lo > hi) return;  // the item has fewer splits
        p_hi = imin(hi, (first_split + split_k + 1) * kSplitRows - 1);
    }
    const int32_t *bt = a.block_tables + a.q_seq[it.i] * a.bt_stride;  // [bt_stride]
    int bad = 0;
    for (int64_t b = p_lo / kKvPageRows + tid; b <= p_hi / kKvPageRows; b += kAttnThreads) {
        if (bt[b] < 0 || bt[b] >= a.layer.n_pages) bad = 1;
    }
    float *ws_item = kMode == AttnMode::kSplit ? a.split_ws + item * a.max_splits * split_state_floats(hd) : nullptr;
    if (__syncthreads_or(bad)) {
        if (c == 0 && tid == 0 && a.error_flag != nullptr) atomicExch(a.error_flag, 1);
        if constexpr (kMode == AttnMode::kSplit) {
            if (c == 0 && tid < nh) ws_item[split_k * split_state_floats(hd) + tid] = u32_as_f32(0x7fc00000u);
        } else {
            float *gout = a.out + (it.i * a.n_heads + it.h0) * hd;
            for (int e = c * kAttnThreads + tid; e < nh * hd; e += kClusterCtas * kAttnThreads) {
                gout[e] = u32_as_f32(0x7fc00000u);
            }
        }
        return;
    }

    const std::byte *k_base = a.layer.base + a.layer.k_offset + it.g * a.k_head_bytes;
    const std::byte *v_base = a.layer.base + a.layer.v_offset + it.g * a.v_head_bytes;
    // The split's pages (its frame's 8 block-table entries that the range uses), read once per split.
    constexpr int kPageRows = static_cast<int>(kKvPageRows);
    __shared__ int64_t s_page_base[kSplitRows / kPageRows];
    const auto row_offset = [&](int r, int64_t row_bytes) {  // frame row r's byte offset in the pool
        return s_page_base[r / kPageRows] + (r % kPageRows) * row_bytes;
    };

    {
        const float *gq = a.q + it.i * a.q_stride + it.h0 * hd;  // [nh, hd], the heads are contiguous
        for (int e = tid; e < kHeadBatch * hd; e += kAttnThreads) {
            const int j = e / hd;
            sq[(e - j * hd) * kQStride + j] = j < nh ? gq[e] : 0.0f;
        }
    }

    // The CTA's value chains: thread tid runs chains e = tid + k * kAttnThreads < nh * nd, head e / nd, dim
    // d0 + e % nd.
    const int d0 = c * hd / kClusterCtas;
    const int nd = (c + 1) * hd / kClusterCtas - d0;
    const int n_chains = nh * nd;
    const auto chain_j = [&](int k) { return (tid + k * kAttnThreads) / nd; };
    const auto chain_dc = [&](int k) { return (tid + k * kAttnThreads) % nd; };
    float acc[kChains], run[kChains];
#pragma unroll
    for (int k = 0; k < kChains; ++k) acc[k] = run[k] = 0.0f;

    const int hw = tid / 16;  // the score phase's half-warp: frame rows hw and hw + 16 of a staged chunk
    const int hl = tid % 16;  // its lane: dot_f32's lane index
    // Where the reduce-scatter leaves this lane's sum: (position, head) index 8 * bit0 + 4 * bit1 + 2 * bit2 + bit3.
    const int sum_idx = 8 * (hl & 1) + 4 * ((hl >> 1) & 1) + 2 * ((hl >> 2) & 1) + ((hl >> 3) & 1);
    const int sum_row = hw + 16 * (sum_idx / kHeadBatch);
    const int sum_head = sum_idx % kHeadBatch;

    // One split [s0, s1] into acc (this CTA's chains), s_m and s_l.
    const auto run_split = [&](int64_t s0, int64_t s1) {
        const int64_t frame = s0 / kSplitRows * kSplitRows;
        const int r_lo = static_cast<int>(s0 - frame);
        const int r_hi = static_cast<int>(s1 - frame);
        const auto blk_lo = [&](int b) { return max(r_lo, b * static_cast<int>(kBlockRows)); };
        const auto blk_hi = [&](int b) { return min(r_hi, (b + 1) * static_cast<int>(kBlockRows) - 1); };
        const int c_lo = blk_lo(c);
        const int c_hi = blk_hi(c);
        __syncthreads();  // the previous split's readers of the shared state are done
        if (tid < kSplitRows / kPageRows && tid >= r_lo / kPageRows && tid <= r_hi / kPageRows) {
            s_page_base[tid] = static_cast<int64_t>(bt[frame / kPageRows + tid]) * a.layer.page_bytes;
        }
        __syncthreads();  // sq and the pages are loaded

        // Scores of block c, kKeyRows rows at a time; a thread decodes a run of 16 dims of a key row, runs fastest.
        for (int ch = c_lo; ch <= c_hi; ch += kKeyRows) {
            const int n_c = min(kKeyRows, c_hi - ch + 1);
            for (GridWalk w(tid, (hd + kRun - 1) / kRun); w.row < n_c; w.next()) {
                const unsigned d = kRun * w.unit;
                const int n = min(kRun, hd - kRun * w.unit);
                const std::byte *row = k_base + row_offset(ch + w.row, a.layer.k_row_bytes);
                decode_run(a.layer.k_format, load_run(a.layer.k_format, row, d, n), row, d, n, a.round_keys,
                           sk + w.row * ks + d, 1);
            }
            __syncthreads();
            float v[2 * kHeadBatch];
#pragma unroll
            for (int x = 0; x < 2 * kHeadBatch; ++x) v[x] = 0.0f;
            const float *ka = sk + hw * ks;
            const float *kb = ka + 16 * ks;
            for (int d = hl; d < hd; d += 16) {
                const float k0 = ka[d];
                const float k1 = kb[d];
                const float4 q03 = *reinterpret_cast<const float4 *>(sq + d * kQStride);
                const float4 q47 = *reinterpret_cast<const float4 *>(sq + d * kQStride + 4);
                const float q[kHeadBatch] = {q03.x, q03.y, q03.z, q03.w, q47.x, q47.y, q47.z, q47.w};
#pragma unroll
                for (int j = 0; j < kHeadBatch; ++j) {
                    v[j] = v[j] + q[j] * k0;
                    v[kHeadBatch + j] = v[kHeadBatch + j] + q[j] * k1;
                }
            }
            reduce_level<kHeadBatch, 1>(v, hl);
            reduce_level<kHeadBatch / 2, 2>(v, hl);
            reduce_level<kHeadBatch / 4, 4>(v, hl);
            reduce_level<kHeadBatch / 8, 8>(v, hl);
            if (sum_row < n_c && sum_head < nh) sp[sum_head * kScoreStride + ch + sum_row] = v[0] * a.scale;
            __syncthreads();  // sk is read before the next chunk is staged
        }

        // Block c's max per head: the fold bm = s > bm ? s : bm over increasing positions, each lane folding its
        // positions and the lanes combining on the larger value or, on equal values (+0 and -0), the earlier
        // position, which is the fold's result bit for bit. NaN scores are never taken.
        if (warp < nh) {
            const float *sj = sp + warp * kScoreStride;
            float bm = neg_inf;
            int bi = 0x7fffffff;
            for (int r = c_lo + lane; r <= c_hi; r += 32) {
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
            if (lane == 0) s_bm[warp] = bm;
        }
        cluster.sync();

        // The running max over the split's blocks, from the cluster's block maxima (every CTA the same).
        if (tid < nh) {
            const int j = tid;
            float m = neg_inf;
            for (int b = 0; b < kClusterCtas; ++b) {
                const bool has = blk_lo(b) <= blk_hi(b);
                const float bm = has ? *cluster.map_shared_rank(&s_bm[j], b) : neg_inf;
                const float m_new = bm > m ? bm : m;
                const bool live = has && m_new != neg_inf;
                s_live[b][j] = live ? 1 : 0;
                s_mb[b][j] = m_new;
                s_alpha[b][j] = live && m != neg_inf ? exp_f32(m - m_new) : 0.0f;
                if (live) m = m_new;
            }
            s_m[j] = m;
        }
        __syncthreads();

        // Block c: e_p and P_p, then lane j's b_sum in increasing p.
        for (int x = tid; x < nh * static_cast<int>(kBlockRows); x += kAttnThreads) {
            const int j = x / static_cast<int>(kBlockRows);
            const int r = c * static_cast<int>(kBlockRows) + x % static_cast<int>(kBlockRows);
            if (r >= c_lo && r <= c_hi && s_live[c][j]) {
                const float e = exp_f32(sp[j * kScoreStride + r] - s_mb[c][j]);
                se[j * kSumStride + x % static_cast<int>(kBlockRows)] = e;
                sp[j * kScoreStride + r] = round_bf16_inner(e);
            }
        }
        __syncthreads();
        if (tid < nh) {
            float b_sum = 0.0f;
            if (s_live[c][tid]) {
                const float *ej = se + tid * kSumStride - c * static_cast<int>(kBlockRows);
                for (int r = c_lo; r <= c_hi; ++r) b_sum = b_sum + ej[r];
            }
            s_bsum[tid] = b_sum;
        }
        cluster.sync();

        // The other blocks' P, and l over the live blocks.
        for (int b = 0; b < kClusterCtas; ++b) {
            if (b == c || blk_lo(b) > blk_hi(b)) continue;
            const float *remote = cluster.map_shared_rank(sp, b);
            for (int x = tid; x < nh * static_cast<int>(kBlockRows / 4); x += kAttnThreads) {
                const int off = (x / static_cast<int>(kBlockRows / 4)) * kScoreStride +
                                b * static_cast<int>(kBlockRows) + 4 * (x % static_cast<int>(kBlockRows / 4));
                *reinterpret_cast<float4 *>(sp + off) = *reinterpret_cast<const float4 *>(remote + off);
            }
        }
        if (tid < nh) {
            float l = 0.0f;
            for (int b = 0; b < kClusterCtas; ++b) {
                if (s_live[b][tid]) l = l * s_alpha[b][tid] + *cluster.map_shared_rank(&s_bsum[tid], b);
            }
            s_l[tid] = l;
        }
        // No CTA of the cluster reads another's shared memory after this until the next split's exchange.
        cluster.sync();

        // The values of the CTA's dims, block by block.
        for (int b = 0; b < kClusterCtas; ++b) {
            const int b_lo = blk_lo(b);
            const int b_hi = blk_hi(b);
            if (b_lo > b_hi) continue;
            const int b0 = b * static_cast<int>(kBlockRows);
            const int n_r = b_hi - b_lo + 1;
            // sv[dc][r - b0]: a thread decodes a run of dims of a row (split where the 16-dim runs of the head
            // split), runs fastest; the row stride spreads the transposed stores over the banks.
            const int first_run = d0 / kRun;
            const int runs = nd == 0 ? 0 : (d0 + nd - 1) / kRun - first_run + 1;
            for (GridWalk w(tid, max(runs, 1)); runs > 0 && w.row < n_r; w.next()) {
                const int da = max(d0, (first_run + w.unit) * kRun);
                const int db = min(d0 + nd, (first_run + w.unit + 1) * kRun);
                const std::byte *row = v_base + row_offset(b_lo + w.row, a.layer.v_row_bytes);
                decode_run(a.layer.v_format, load_run(a.layer.v_format, row, da, db - da), row, da, db - da, true,
                           sv + (da - d0) * kValueStride + b_lo - b0 + w.row, kValueStride);
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < kChains; ++k) {
                if (tid + k * kAttnThreads >= n_chains) continue;
                const int j = chain_j(k);
                if (!s_live[b][j]) continue;
                const float *pj = sp + j * kScoreStride;
                const float *vj = sv + chain_dc(k) * kValueStride - b0;
                float x = acc[k] * s_alpha[b][j];
                int r = b_lo;
                for (; r <= b_hi && (r & 3) != 0; ++r) x = x + pj[r] * vj[r];
                if (r + 3 <= b_hi) {  // 4 at a time, the next 4 loaded while these are added
                    float4 p4 = *reinterpret_cast<const float4 *>(pj + r);
                    float4 v4 = *reinterpret_cast<const float4 *>(vj + r);
                    for (; r + 7 <= b_hi; r += 4) {
                        const float4 p_next = *reinterpret_cast<const float4 *>(pj + r + 4);
                        const float4 v_next = *reinterpret_cast<const float4 *>(vj + r + 4);
                        x = x + p4.x * v4.x;
                        x = x + p4.y * v4.y;
                        x = x + p4.z * v4.z;
                        x = x + p4.w * v4.w;
                        p4 = p_next;
                        v4 = v_next;
                    }
                    x = x + p4.x * v4.x;
                    x = x + p4.y * v4.y;
                    x = x + p4.z * v4.z;
                    x = x + p4.w * v4.w;
                    r += 4;
                }
                for (; r <= b_hi; ++r) x = x + pj[r] * vj[r];
                acc[k] = x;
            }
            __syncthreads();  // sv is read before the next block is staged
        }
    };

    if constexpr (kMode == AttnMode::kSplit) {
        run_split(p_lo, p_hi);
        float *st = ws_item + split_k * split_state_floats(hd);
#pragma unroll
        for (int k = 0; k < kChains; ++k) {
            if (tid + k * kAttnThreads < n_chains) st[2 * kHeadBatch + chain_j(k) * hd + d0 + chain_dc(k)] = acc[k];
        }
        if (c == 0 && tid < nh) {
            st[tid] = s_m[tid];
            st[kHeadBatch + tid] = s_l[tid];
        }
    } else {
        for (int64_t s0 = lo; s0 <= hi;) {
            const int64_t s1 = imin(hi, (s0 / kSplitRows + 1) * kSplitRows - 1);  // split [s0, s1]
            run_split(s0, s1);
            const bool first = s0 == lo;
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
                    s_fa[j] = fa;
                    s_fb[j] = fb;
                }
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < kChains; ++k) {
                if (tid + k * kAttnThreads >= n_chains) continue;
                const int j = chain_j(k);
                run[k] = first ? acc[k] : run[k] * s_fa[j] + acc[k] * s_fb[j];
                acc[k] = 0.0f;
            }
            s0 = s1 + 1;
        }
        float *gout = a.out + (it.i * a.n_heads + it.h0) * hd;  // [nh, hd]
#pragma unroll
        for (int k = 0; k < kChains; ++k) {
            if (tid + k * kAttnThreads >= n_chains) continue;
            const int j = chain_j(k);
            float o = run[k] / s_run_l[j];
            if (a.gate != nullptr) o = o * sigmoid_f32(a.gate[it.i * a.gate_stride + it.h0 + j]);
            gout[j * hd + d0 + chain_dc(k)] = o;
        }
    }
#endif
}

// kSplit's second launch: thread e of item blockIdx.x merges the (head j, dim d) pair e = j * head_dim + d of the
// stored split states left to right, M' = max(M, m), L' = L * e^(M - M') + l * e^(m - M'), ACC likewise, and writes
// out = ACC / L times the sigmoid gate; NaN outputs (and the error flag) for a refused query.
__global__ void __launch_bounds__(kMergeThreads) attention_merge_kernel(const AttentionArgs a) {
    pdl_enter();
    const int64_t item = blockIdx.x;
    const Item it = item_of(a, item);
    const int hd = a.head_dim;
    const int e = static_cast<int>(blockIdx.y) * kMergeThreads + static_cast<int>(threadIdx.x);
    if (e >= it.nh * hd) return;
    const int j = e / hd;
    int64_t lo = 0, hi = 0;
    bool bad = !visible_range(a, it.i, lo, hi);
    float o = 0.0f;
    if (!bad) {
        const int64_t state = split_state_floats(hd);
        const float *st = a.split_ws + item * a.max_splits * state;
        const int64_t n_k = hi / kSplitRows - lo / kSplitRows + 1;
        float run_m = 0.0f, run_l = 0.0f, run_acc = 0.0f;
        for (int64_t k = 0; k < n_k && !bad; ++k, st += state) {
            const float m = st[j];
            const float l = st[kHeadBatch + j];
            const float acc = st[2 * kHeadBatch + e];
            if (m != m) {
                bad = true;  // a split whose pages were refused
            } else if (k == 0) {
                run_m = m;
                run_l = l;
                run_acc = acc;
            } else {
                const float m_next = m > run_m ? m : run_m;
                const float fa = exp_f32(run_m - m_next);
                const float fb = exp_f32(m - m_next);
                run_l = run_l * fa + l * fb;
                run_acc = run_acc * fa + acc * fb;
                run_m = m_next;
            }
        }
        o = run_acc / run_l;
        if (a.gate != nullptr) o = o * sigmoid_f32(a.gate[it.i * a.gate_stride + it.h0 + j]);
    }
    if (bad) {
        if (e == 0 && a.error_flag != nullptr) atomicExch(a.error_flag, 1);
        o = u32_as_f32(0x7fc00000u);
    }
    a.out[(it.i * a.n_heads + it.h0) * hd + e] = o;
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
    launch_kernel(kv_write_kernel, dim3(static_cast<unsigned>(n), 2), kRowThreads, 0, stream, layer, row_elems, k, v,
                  slots, error_flag);
    return cudaGetLastError();
}

cudaError_t round_rows(float *x, int64_t n_rows, int64_t d, RowRounding r, cudaStream_t stream) {
    if (n_rows < 0 || d <= 0 || (r == RowRounding::kQ8 && d % kQuantBlock != 0)) return cudaErrorInvalidValue;
    if (r == RowRounding::kNone || n_rows == 0) return cudaSuccess;
    if (x == nullptr) return cudaErrorInvalidValue;
    const int64_t n = n_rows * d;
    if (r == RowRounding::kBf16) {
        launch_kernel(round_bf16_kernel, static_cast<unsigned>(grid_for(n)), kElemThreads, 0, stream, x, n);
    } else {
        const int64_t n_blocks = n / kQuantBlock;
        launch_kernel(round_q8_kernel, static_cast<unsigned>(grid_for(n_blocks)), kElemThreads, 0, stream, x, n_blocks);
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

cudaError_t attention_supported(bool &ok) {
    static std::atomic<uint64_t> asked{0};  // bit d: device d was asked
    static std::atomic<uint64_t> yes{0};    // bit d: and it runs the cluster kernel
    int device = 0;
    if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
    const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
    if (bit != 0 && (asked.load() & bit) != 0) {
        ok = (yes.load() & bit) != 0;
        return cudaSuccess;
    }
    int major = 0, minor = 0;
    if (cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device); e != cudaSuccess) {
        return e;
    }
    if (cudaError_t e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device); e != cudaSuccess) {
        return e;
    }
    ok = major == 9 && minor == 0;
    if (ok) yes.fetch_or(bit);
    asked.fetch_or(bit);
    return cudaSuccess;
}

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
    if (n_q > kMaxGrid / (n_kv_heads * batches * kClusterCtas)) return cudaErrorInvalidValue;
    const int64_t n_items = n_q * n_kv_heads * batches;
    if (n_items == 0) return cudaSuccess;
    if (q == nullptr || q_pos == nullptr || q_seq == nullptr || layer.base == nullptr || block_tables == nullptr ||
        out == nullptr) {
        return cudaErrorInvalidValue;
    }

    bool supported = false;
    if (const cudaError_t e = attention_supported(supported); e != cudaSuccess) return e;
    if (!supported) return cudaErrorNotSupported;

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
    a.head_dim = static_cast<int>(head_dim);
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

    const int64_t smem_bytes = attention_smem_floats(a.head_dim) * static_cast<int64_t>(sizeof(float));
    const auto launch = [&](auto kernel, dim3 grid) {
        if (smem_bytes > kDefaultSmemBytes) {
            const cudaError_t err =
                cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
            if (err != cudaSuccess) return err;
        }
        launch_kernel(kernel, grid, kAttnThreads, static_cast<size_t>(smem_bytes), stream, a);
        return cudaGetLastError();
    };
    const auto clusters = static_cast<unsigned>(n_items * kClusterCtas);
    const bool one_chain = attention_chains(a.head_dim) == 1;
    if (!split) {
        return one_chain ? launch(paged_attention_kernel<AttnMode::kWhole, 1>, dim3(clusters))
                         : launch(paged_attention_kernel<AttnMode::kWhole, kMaxChains>, dim3(clusters));
    }
    const dim3 split_grid(clusters, static_cast<unsigned>(a.max_splits));
    const cudaError_t err = one_chain ? launch(paged_attention_kernel<AttnMode::kSplit, 1>, split_grid)
                                      : launch(paged_attention_kernel<AttnMode::kSplit, kMaxChains>, split_grid);
    if (err != cudaSuccess) return err;
    const int64_t pairs = std::min<int64_t>(kHeadBatch, group) * head_dim;
    launch_kernel(
        attention_merge_kernel,
        dim3(static_cast<unsigned>(n_items), static_cast<unsigned>((pairs + kMergeThreads - 1) / kMergeThreads)),
        kMergeThreads, 0, stream, a);
    return cudaGetLastError();
}

}  // namespace memra::cuda
