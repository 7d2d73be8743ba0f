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
#include <type_traits>

#include "backend/cuda/launch.cuh"
#include "backend/cuda/norm_rope.cuh"
#include "backend/cuda/ptx.cuh"
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

// Elements [0, n) of a row by `lanes` threads (this one is `lane`), kRowBatch loads in flight per thread before
// their stores: store(e, load(e)) (the pool and the rows may alias as far as the compiler knows, so it would not
// move a load above an earlier store by itself).
constexpr int kRowBatch = 8;

template <class Load, class Store>
__device__ void for_row_batches(int64_t n, int lane, int lanes, Load load, Store store) {
    for (int64_t e0 = lane; e0 < n; e0 += int64_t{kRowBatch} * lanes) {
        decltype(load(e0)) v[kRowBatch];
#pragma unroll
        for (int u = 0; u < kRowBatch; ++u) {
            const int64_t e = e0 + int64_t{u} * lanes;
            v[u] = e < n ? load(e) : decltype(load(e0)){};
        }
#pragma unroll
        for (int u = 0; u < kRowBatch; ++u) {
            const int64_t e = e0 + int64_t{u} * lanes;
            if (e < n) store(e, v[u]);
        }
    }
}

// kv_encode of n values x into `out` by `lanes` threads (this one is `lane`): f32 copies the bits, bf16 rounds
// each value, the block formats quantize one block of 32 per thread (2-byte aligned: every row and block offset
// is even). n values of a row's head start a block too (head_dim a multiple of 32 for the block formats).
__device__ void encode_row(KvFormat f, const float *x, int64_t n, std::byte *out, int lane, int lanes) {
    switch (f) {
        case KvFormat::kF32: {
            const uint32_t *gx = reinterpret_cast<const uint32_t *>(x);
            uint32_t *gout = reinterpret_cast<uint32_t *>(out);
            for_row_batches(
                n, lane, lanes, [&](int64_t e) { return gx[e]; }, [&](int64_t e, uint32_t b) { gout[e] = b; });
            return;
        }
        case KvFormat::kBf16: {
            uint16_t *gout = reinterpret_cast<uint16_t *>(out);
            for_row_batches(
                n, lane, lanes, [&](int64_t e) { return x[e]; }, [&](int64_t e, float v) { gout[e] = f32_to_bf16(v); });
            return;
        }
        case KvFormat::kQ8_0: {
            BlockQ8_0 *gout = reinterpret_cast<BlockQ8_0 *>(out);
            for (int64_t b = lane; b < n / kQuantBlock; b += lanes) {
                BlockQ8_0 block;
                quantize_block_q8_0(x + b * kQuantBlock, block);
                gout[b] = block;
            }
            return;
        }
        case KvFormat::kQ5_1: {
            BlockQ5_1 *gout = reinterpret_cast<BlockQ5_1 *>(out);
            for (int64_t b = lane; b < n / kQuantBlock; b += lanes) {
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
// The K (v false) or V row of pool slot `slot` in the layer, or nullptr for a slot outside the pool (the CPU
// refuses it).
__device__ std::byte *slot_row(const cpu::PagedLayer &layer, int64_t slot, bool v) {
    if (slot < 0 || slot >= layer.n_pages * kKvPageRows) return nullptr;
    std::byte *page = layer.base + (slot / kKvPageRows) * layer.page_bytes;
    const int64_t r = slot % kKvPageRows;
    return v ? page + layer.v_offset + r * layer.v_row_bytes : page + layer.k_offset + r * layer.k_row_bytes;
}

__global__ void kv_write_kernel(const cpu::PagedLayer layer, int64_t row_elems, const float *gk, const float *gv,
                                const int32_t *gslots, int32_t *error_flag) {
    pdl_enter();
    const int64_t i = blockIdx.x;
    const bool v = blockIdx.y != 0;
    std::byte *row = slot_row(layer, gslots[i], v);
    if (row == nullptr) {
        if (!v && threadIdx.x == 0 && error_flag != nullptr) atomicExch(error_flag, 1);
        return;
    }
    encode_row(v ? layer.v_format : layer.k_format, (v ? gv : gk) + i * row_elems, row_elems, row,
               static_cast<int>(threadIdx.x), kRowThreads);
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

// A block of 32 values through q8_0 and back in place (cpu::round_rows).
__device__ void round_q8_block(float *x) {
    BlockQ8_0 block;
    quantize_block_q8_0(x, block);
    q8_0_dequant_block(block, x);
}

// gx: [n_blocks, 32] f32, each block rounded by round_q8_block.
__global__ void round_q8_kernel(float *gx, int64_t n_blocks) {
    pdl_enter();
    for (int64_t b = first_index(); b < n_blocks; b += grid_stride()) round_q8_block(gx + b * kQuantBlock);
}

int64_t grid_for(int64_t n) {
    const int64_t blocks = (n + kElemThreads - 1) / kElemThreads;
    return blocks < kMaxBlocks ? blocks : kMaxBlocks;
}

// ---------------------------------------------------------------------------------------------
// The attention prologue: qk_norm_rope, kv_write and round_rows(q) in one launch.

constexpr int kPrologueThreads = 256;
constexpr int kPrologueWarps = kPrologueThreads / 32;

struct PrologueArgs {
    norm_rope::HeadRows q, k;
    const float *v;
    int64_t v_stride;
    int64_t n_tokens;
    int64_t head_dim;
    float eps;
    RopeRows rope;  // cos nullptr: the norms alone
    RowRounding q_round;
    cpu::PagedLayer layer;
    int64_t k_head_bytes;  // one head's bytes in the K (V) format
    int64_t v_head_bytes;
    const int32_t *slots;
    int32_t *error_flag;
};

// Head h's bytes in token t's K (or V) row of the layer, or nullptr (and the flag raised) when t's slot is outside
// the pool (slot_row).
__device__ std::byte *prologue_row(const PrologueArgs &a, int64_t t, bool v, int64_t h) {
    std::byte *row = slot_row(a.layer, a.slots[t], v);
    if (row == nullptr) {
        if (threadIdx.x % 32 == 0 && a.error_flag != nullptr) atomicExch(a.error_flag, 1);
        return nullptr;
    }
    return row + h * (v ? a.v_head_bytes : a.k_head_bytes);
}

// A warp per head of a token, in the order q heads, k heads, v heads: a q head is normalised, rotated and rounded
// for the keys' format, a k head normalised, rotated and encoded into its slot's K row, a v head encoded into the
// V row; each step runs the separate launches' code on the same values (qk_norm_rope_kernel's warp_norm_row and
// rope_pair, kv_write_kernel's encode_row over the head's span of the row, round_bf16_kernel's and
// round_q8_kernel's rounding over the head's values or blocks), so the bits are theirs. Every branch is
// warp-uniform; __syncwarp publishes each step's writes to the lanes of the next.
__global__ void __launch_bounds__(kPrologueThreads) attention_prologue_kernel(const PrologueArgs a) {
    prefetch_l2_span(a.q.w, a.head_dim * (a.q.w_bf16 ? 2 : 4), threadIdx.x, kPrologueThreads);
    prefetch_l2_span(a.k.w, a.head_dim * (a.k.w_bf16 ? 2 : 4), threadIdx.x, kPrologueThreads);
    pdl_enter();
    const int lane = static_cast<int>(threadIdx.x % 32);
    const int64_t hd = a.head_dim;
    const int64_t qk_heads = a.q.n_heads + a.k.n_heads;
    const int64_t per_token = qk_heads + a.k.n_heads;
    for (int64_t item = static_cast<int64_t>(blockIdx.x) * kPrologueWarps + threadIdx.x / 32;
         item < a.n_tokens * per_token; item += static_cast<int64_t>(gridDim.x) * kPrologueWarps) {
        const int64_t t = item / per_token;
        const int64_t h = item % per_token;
        if (h >= qk_heads) {
            std::byte *out = prologue_row(a, t, true, h - qk_heads);
            if (out != nullptr) {
                encode_row(a.layer.v_format, a.v + t * a.v_stride + (h - qk_heads) * hd, hd, out, lane, 32);
            }
            continue;
        }
        const bool is_q = h < a.q.n_heads;
        const norm_rope::HeadRows &r = is_q ? a.q : a.k;
        const int64_t head = is_q ? h : h - a.q.n_heads;
        float *x = r.x + t * r.token_stride + head * hd;
        const RopeRows &rope = a.rope;
        const int64_t p = rope.cos != nullptr ? rope.positions[t] : 0;
        if (!norm_rope::warp_norm_rope(x, hd, r.w, r.w_bf16, a.eps, rope.cos, rope.sin, rope.n_positions, rope.half,
                                       p) &&
            lane == 0 && a.error_flag != nullptr) {
            atomicExch(a.error_flag, 1);
        }
        __syncwarp();
        if (!is_q) {
            std::byte *out = prologue_row(a, t, false, head);
            if (out != nullptr) encode_row(a.layer.k_format, x, hd, out, lane, 32);
        } else if (a.q_round == RowRounding::kBf16) {
            for (int64_t e = lane; e < hd; e += 32) x[e] = round_bf16(x[e]);
        } else if (a.q_round == RowRounding::kQ8) {
            for (int64_t b = lane; b < hd / kQuantBlock; b += 32) round_q8_block(x + b * kQuantBlock);
        }
    }
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
    float *split_ws;     // kSplit and the merge: [n_items, max_splits * split_units, split_state_floats(head_dim)]
    int64_t max_splits;  // splits of an item's range at most
    // kSplit's units per split: 1 (a CTA runs a split) or kSplitRows / kBlockRows (the tensor-core kernel: a CTA
    // runs one block of 128 positions); the grid's y is max_splits * split_units, the workspace holds as many states
    // per item.
    int64_t split_units;
    int64_t n_q;
    // attention_tc_kernel's tiles: tc_tokens queries by tc_heads query heads of one kv head, tc_head_tiles tiles
    // covering a kv head's group; tc_async: bf16 rows are 16-byte aligned, so they stage by cp.async.
    int tc_tokens, tc_heads, tc_head_tiles;
    bool tc_async;
};

// How a launch covers a work item's splits. kWhole: one cluster runs every split of its item, merging as it goes.
// kSplit: cluster (item, k) runs split k of its item alone and stores its state (m, l, acc) in the workspace, and
// attention_merge_kernel then merges the stored states left to right. Both give the same bits: each split's state
// is formed the same way, and the merge is the same left fold over the same states. The tensor-core kernel's
// kSplit can also run one block of 128 positions per CTA (split_units > 1), storing the block's state, which the
// merge folds into its split's as that kernel's split CTA would.
enum class AttnMode { kWhole, kSplit };

// A stored split (or block) state: m[kHeadBatch], l[kHeadBatch], acc[kHeadBatch][head_dim]. A split or block whose
// pages the CPU would refuse stores m = NaN (a real m never is: NaN scores are never taken as a maximum).
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
__device__ bool visible_range_at(const AttentionArgs &a, int64_t pos, int64_t seq, int64_t &lo, int64_t &hi) {
    hi = pos;
    if (seq < 0 || seq >= a.n_seqs || hi < a.first_pos || hi / kKvPageRows >= a.bt_stride) return false;
    lo = a.window > 0 ? imax(a.first_pos, hi - a.window + 1) : a.first_pos;
    return true;
}
__device__ bool visible_range(const AttentionArgs &a, int64_t i, int64_t &lo, int64_t &hi) {
    return visible_range_at(a, a.q_pos[i], a.q_seq[i], lo, hi);
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

// e^x for the weights inside the tensor-core kernel and for its folds of blocks: the hardware's 2^x
// (ex2.approx.ftz) of x * log2(e), exactly 1 at x = 0 (the block maximum's own weight). Deterministic on the device,
// not the CPU's exp_f32 (the merge of splits keeps exp_f32, in every launch shape).
__device__ __forceinline__ float tc_exp(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.44269504088896341f));
    return x == 0.0f ? 1.0f : y;
}

// The tensor-core kernel's fold of a block's state (bm, bl, bacc) into a split's running state (m, l, acc), both
// live: M' = max(M, bm), fa = tc_exp(M - M'), fb = tc_exp(bm - M'), L' = L * fa + bl * fb, ACC' = ACC * fa +
// bacc * fb. attention_tc_kernel takes the weights once per row and folds each accumulator with them.
__device__ __forceinline__ float tc_fold_weights(float m, float bm, float &fa, float &fb) {
    const float m_new = fmaxf(m, bm);
    fa = tc_exp(m - m_new);
    fb = tc_exp(bm - m_new);
    return m_new;
}
__device__ __forceinline__ float tc_fold_value(float x, float fa, float bx, float fb) { return x * fa + bx * fb; }
__device__ __forceinline__ void tc_fold(float &m, float &l, float &acc, float bm, float bl, float bacc) {
    float fa = 0.0f, fb = 0.0f;
    m = tc_fold_weights(m, bm, fa, fb);
    l = tc_fold_value(l, fa, bl, fb);
    acc = tc_fold_value(acc, fa, bacc, fb);
}

// kSplit's second launch: thread e of item blockIdx.x merges the (head j, dim d) pair e = j * head_dim + d of the
// stored split states left to right, M' = max(M, m), L' = L * e^(M - M') + l * e^(m - M'), ACC likewise, and writes
// out = ACC / L times the sigmoid gate; NaN outputs (and the error flag) for a refused query. With split_units > 1
// a split's state is first folded from its blocks' states, left to right by tc_fold, as the kernel that runs a
// whole split folds them.
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
        // The pieces of the range in order: splits (split_units 1) or blocks; their states are loaded kAhead at a
        // time before any is folded, so the loads overlap.
        const int64_t state = split_state_floats(hd);
        const int64_t per = a.split_units;  // 1 or kSplitRows / kBlockRows: powers of two
        const int shift = per == 1 ? 0 : 2;
        static_assert(kSplitRows / kBlockRows == 4, "a split is 4 blocks");
        const float *states = a.split_ws + item * a.max_splits * per * state;
        const int64_t s_first = lo / kSplitRows;
        const int64_t first = per == 1 ? s_first : lo / kBlockRows;
        const int64_t last = per == 1 ? hi / kSplitRows : hi / kBlockRows;
        const float kNegInf = -__int_as_float(0x7f800000);
        float run_m = 0.0f, run_l = 0.0f, run_acc = 0.0f;
        float m = kNegInf, l = 0.0f, acc = 0.0f;  // the split's state (folded from its blocks' with split_units > 1)
        constexpr int kAhead = 8;
        for (int64_t p0 = first; p0 <= last; p0 += kAhead) {
            float pm[kAhead], pl[kAhead], pacc[kAhead];
#pragma unroll
            for (int i = 0; i < kAhead; ++i) {
                const int64_t p = p0 + i;
                if (p > last) break;
                const float *st = states + (((p >> shift) - s_first) * per + (p & (per - 1))) * state;
                pm[i] = st[j];
                pl[i] = st[kHeadBatch + j];
                pacc[i] = st[2 * kHeadBatch + e];
            }
#pragma unroll
            for (int i = 0; i < kAhead; ++i) {
                const int64_t p = p0 + i;
                if (p > last) break;
                if (per == 1) {
                    m = pm[i];
                    l = pl[i];
                    acc = pacc[i];
                } else {
                    // From the empty state; a block without a live position (m = -inf) leaves it, the first live
                    // block is taken as it is, a refused one (NaN) marks the split (as attention_tc_kernel folds).
                    if (p == first || (p & (per - 1)) == 0) {
                        m = kNegInf;
                        l = 0.0f;
                        acc = 0.0f;
                    }
                    const float bm = pm[i];
                    if (m == m && bm != kNegInf) {
                        if (bm != bm || m == kNegInf) {
                            m = bm;
                            l = pl[i];
                            acc = pacc[i];
                        } else {
                            tc_fold(m, l, acc, bm, pl[i], pacc[i]);
                        }
                    }
                    if (p != last && ((p + 1) & (per - 1)) != 0) continue;  // the split goes on
                }
                if (m != m) {
                    bad = true;  // a split whose pages were refused
                } else if ((p >> shift) == s_first) {
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

// ---------------------------------------------------------------------------------------------
// Tensor-core paged attention (CUDA.md 3.2), for f32 and bf16 keys at head_dim 32, 64 and 128: the GPU's own
// order, a different engine version's bits from the CPU's blocked order (held to it by a measured tolerance).
// A row is (query, query head) of one kv head; a group of 16 rows is an m16 fragment. In prefill (kWhole) each warp
// of a CTA owns 16 rows of a tile of T queries by H heads; in decode (kSplit) one query's H heads and one split (or
// one block) are 16 rows that all the CTA's warps share: warp w scores the block's n8 tiles w * k .. w * k + k - 1 of
// each page of 64 positions (k = 8 / warps) and sums the values into dim tiles w * d .. w * d + d - 1 (d = HD / 8 /
// warps), and the warps exchange the block's maxima, the partial sums of p and p itself through shared memory. Rows are
// independent in every instruction, and the shared work is split along positions and dims in the same fixed
// trees, so a row's bits depend on nothing else in its CTA and every launch shape gives the same bits. Per row,
// each block of 128 positions has its own state, and a split of 512 positions folds its blocks' states left to
// right:
//   S      = q . k by mma.sync m16n8k16 (bf16 in, fp32 accumulate): head_dim / 16 chained k16 steps from zero,
//            then times scale; positions outside [lo, hi] are -inf.
//   bm     = the block's max (fmaxf: NaN skipped); a block with bm = -inf has no state (the fold skips it).
//   p      = tc_exp(s - bm); b_sum: each lane's x_n = p(n, 0) + p(n, 1) over its two columns of tile n,
//            y_j = x_j + x_{j+8}, the tree ((y0 + y1) + (y2 + y3)) + ((y4 + y5) + (y6 + y7)), then over the quad by
//            xor 1 and xor 2.
//   c      = bf16(p) . v by mma.sync: 8 chained k16 steps from zero over the block's positions ascending, values
//            decoded and rounded to bf16. The block's state is (bm, b_sum, c).
//   fold   = a split starts empty (m = -inf, l = +0, acc = +0); its first block with a state is taken as it is,
//            each later one folds in by tc_fold (weights by tc_exp).
// Splits merge left to right exactly as attention_merge_kernel does (in kWhole inside the CTA, in kSplit by that
// kernel). A kSplit CTA runs one split, or one block (split_units > 1: launches of few splits), whose state the
// merge folds as the CTA would. Keys and values stream through a ring of pages (64 positions of one kv head each;
// 4 slots in prefill, 8 in decode, where one CTA must keep the memory busy) by cp.async, a block's two K pages and
// then its two V pages entering together; every thread of the CTA loads. The positions a tile stages are those its
// rows' ranges span; a position inside that span but outside one row's range gets p = 0 for that row (its values must
// be finite, as written values are).
constexpr int kTcPage = static_cast<int>(kKvPageRows);  // positions per staged slot: one page
constexpr int kTcWholeWarps = 4;
constexpr int64_t kTcSplitMaxQueries = 128;  // larger steps take kWhole (the same bits)
constexpr int64_t kTcBlockCtasBelow = 66;    // a launch of fewer split CTAs runs a CTA per block instead
constexpr int kTcMaxTokens = 16 * kTcWholeWarps;

// Decode's warps per CTA: 8 at head_dim 128, 4 at 64, 2 at 32, so that each sums the values into one pair of dim
// tiles (one ldmatrix .trans x4) and scores 8 / warps tiles of each page.
__host__ __device__ constexpr int tc_split_warps(int head_dim) { return head_dim / 16; }
__host__ __device__ constexpr int tc_slots(bool whole) { return whole ? 4 : 8; }
__host__ __device__ constexpr int tc_rows(int warps, bool whole) { return whole ? 16 * warps : 16; }

// Dynamic shared memory of a tensor-core CTA: the slot ring, the rows' queries as bf16, in kWhole the running
// accumulators of the merge (f32, in fragment order), in kSplit the warps' exchange (block maxima [warps][16],
// partial sums [warps][2][32], p as bf16 fragments [16 tiles][2][32]), the slots' missing-page marks, then the
// tile's query ranges (positions as i32: the launcher refuses block tables of 2^31 positions or more), sequences and
// states. Two prefill CTAs fit an SM at head_dim 128.
struct TcSmem {
    int64_t ring, q, run, xchg, tokens, total;
};
__host__ __device__ constexpr TcSmem tc_smem(int head_dim, int warps, bool whole) {
    TcSmem s{};
    const int rows = tc_rows(warps, whole);
    s.ring = 0;
    s.q = int64_t{tc_slots(whole)} * kTcPage * head_dim * 2;
    s.run = s.q + int64_t{rows} * head_dim * 2;
    s.xchg = s.run + (whole ? int64_t{rows} * head_dim * 4 : 0);
    s.tokens = s.xchg + (whole ? 0 : int64_t{warps} * (16 + 2 * 32) * 4 + 16 * 2 * 32 * 4);
    s.total = s.tokens + tc_slots(whole) * 4 + int64_t{kTcMaxTokens} * (3 * 4 + 1);
    return s;
}
// An SM holds 228 KiB of shared memory, 1 KiB of it reserved per CTA.
static_assert(2 * (tc_smem(128, kTcWholeWarps, true).total + 1024) <= 228 * 1024,
              "two prefill CTAs per SM at head_dim 128");

#ifdef MEMRA_ATTENTION_CLUSTERS
// Byte offset of 16-byte chunk c of row r in a [rows][HD] bf16 tile, swizzled so that the 8 rows an ldmatrix
// reads at one chunk hit distinct banks.
template <int HD>
__device__ __forceinline__ uint32_t tc_offset(int r, int c) {
    constexpr int kChunks = HD / 8;
    constexpr int kSwz = kChunks < 8 ? kChunks : 8;
    constexpr int kRowsPerLine = 8 / kSwz;
    return static_cast<uint32_t>(r * (HD * 2) + ((c ^ ((r / kRowsPerLine) % kSwz)) * 16));
}

// 8 values of a row from `row` (the kv head's bytes) at dims [8 c, 8 c + 8), decoded and rounded to bf16.
__device__ __forceinline__ uint4 tc_decode8(KvFormat f, const std::byte *row, int c) {
    const unsigned d = static_cast<unsigned>(8 * c);
    float v[kRun];
    const RawRun raw = load_run(f, row, d, 8);
    decode_run(f, raw, row, d, 8, true, v, 1);
    uint4 u;
    u.x = pack_bf16(v[0], v[1]);
    u.y = pack_bf16(v[2], v[3]);
    u.z = pack_bf16(v[4], v[5]);
    u.w = pack_bf16(v[6], v[7]);
    return u;
}

// v[0] = the pairwise tree of v[0 .. n): ((v0 + v1) + (v2 + v3)) + ... (n a power of two).
template <int n>
__device__ __forceinline__ float tc_tree(float (&v)[n]) {
#pragma unroll
    for (int w = 1; w < n; w *= 2) {
#pragma unroll
        for (int i = 0; i + w < n; i += 2 * w) v[i] = v[i] + v[i + w];
    }
    return v[0];
}
#endif

template <AttnMode kMode, int HD, int kWarps>
__global__ void __launch_bounds__(32 * kWarps, kMode == AttnMode::kWhole ? 2 : 1)
    attention_tc_kernel(const AttentionArgs a) {
    pdl_enter();
#if defined(MEMRA_ATTENTION_CLUSTERS) && defined(__CUDA_ARCH__)
    constexpr bool kWholeMode = kMode == AttnMode::kWhole;
    constexpr int kThreadsTc = 32 * kWarps;
    constexpr int kShare = kWholeMode ? 1 : kWarps;  // warps sharing a group of 16 rows
    constexpr int kRows = tc_rows(kWarps, kWholeMode);
    constexpr int kSlots = tc_slots(kWholeMode);
    constexpr int kHeld = 2;                // pages a step enters together: a block's two K or two V pages
    constexpr int kAhead = kSlots - kHeld;  // pages in flight beyond those
    constexpr int kChunks = HD / 8;
    constexpr int kKSteps = HD / 16;
    constexpr int kDimTiles = HD / 8;
    constexpr int kTilesW = 8 / kShare;         // a warp's score tiles per page
    constexpr int kDimsW = kDimTiles / kShare;  // a warp's dim tiles
    static_assert(kTilesW >= 1 && kDimsW >= 2 && kDimsW % 2 == 0, "a warp takes whole tiles and dim tile pairs");
    constexpr int kSlotBytes = kTcPage * HD * 2;
    constexpr int kLoadRows = kThreadsTc / kChunks;  // rows of a page the CTA stages per pass of 16-byte chunks
    constexpr int kLoadPasses = kTcPage / kLoadRows;
    static_assert(kThreadsTc % kChunks == 0 && kTcPage % kLoadRows == 0, "whole rows per pass");
    static_assert(kAhead >= kHeld && kSlots % kHeld == 0, "a step's pages sit in consecutive slots");
    const float kNegInf = -__int_as_float(0x7f800000);
    extern __shared__ float4 smem4[];
    std::byte *smem = reinterpret_cast<std::byte *>(smem4);
    const TcSmem lay = tc_smem(HD, kWarps, kWholeMode);
    std::byte *s_ring = smem + lay.ring;
    std::byte *s_q = smem + lay.q;
    float *s_run = reinterpret_cast<float *>(smem + lay.run);
    float *s_max = reinterpret_cast<float *>(smem + lay.xchg);              // [kShare][16]
    float *s_sum = s_max + kShare * 16;                                     // [kShare][2][32]
    uint32_t *s_p = reinterpret_cast<uint32_t *>(s_sum + kShare * 2 * 32);  // [16][2][32]
    int32_t *s_bad = reinterpret_cast<int32_t *>(smem + lay.tokens);        // per slot: its page is missing
    int32_t *s_lo = s_bad + kSlots;
    int32_t *s_hi = s_lo + kTcMaxTokens;
    int32_t *s_seq = s_hi + kTcMaxTokens;
    int8_t *s_state = reinterpret_cast<int8_t *>(s_seq + kTcMaxTokens);  // per token: 0 refused, 1 to do, 2 done

    const int tid = static_cast<int>(threadIdx.x);
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int ld_c = tid % kChunks, ld_r0 = tid / kChunks;  // the thread's chunk and first row in a page's loads
    const int part = warp % kShare;  // the warp's share of its rows' tiles and dims
    const int rg = warp / kShare;    // the warp's group of 16 rows
    const int T = a.tc_tokens, H = a.tc_heads;
    int64_t tile = blockIdx.x;
    const int ht = static_cast<int>(tile % a.tc_head_tiles);
    tile /= a.tc_head_tiles;
    const int64_t g = tile % a.n_kv_heads;
    const int64_t i0 = tile / a.n_kv_heads * T;
    const int n_tok = static_cast<int>(imin(T, a.n_q - i0));

    // The token's position and sequence are loaded first and used after the queries' loads are out: the two
    // memory latencies overlap.
    int64_t my_pos = 0;
    int32_t my_seq = -1;
    if (tid < n_tok) {
        my_pos = a.q_pos[i0 + tid];
        my_seq = a.q_seq[i0 + tid];
    }
    // The rows' queries as bf16 (nearest even), zero for rows past the tile.
    for (int e = tid; e < kRows * kChunks; e += kThreadsTc) {
        const int r = e / kChunks, c = e % kChunks;
        const int t = r / H, j = ht * H + r % H;
        uint4 u = make_uint4(0u, 0u, 0u, 0u);
        if (r < T * H && t < n_tok && j < a.group) {
            const float *qr = a.q + (i0 + t) * a.q_stride + (g * a.group + j) * HD + 8 * c;
            u.x = pack_bf16(qr[0], qr[1]);
            u.y = pack_bf16(qr[2], qr[3]);
            u.z = pack_bf16(qr[4], qr[5]);
            u.w = pack_bf16(qr[6], qr[7]);
        }
        *reinterpret_cast<uint4 *>(s_q + tc_offset<HD>(r, c)) = u;
    }
    if (tid < n_tok) {
        int64_t lo = 0, hi = -1;
        const bool ok = visible_range_at(a, my_pos, my_seq, lo, hi);
        s_lo[tid] = static_cast<int32_t>(lo);  // < bt_stride * kKvPageRows <= INT32_MAX where ok
        s_hi[tid] = static_cast<int32_t>(hi);
        s_seq[tid] = my_seq;
        s_state[tid] = ok ? 1 : 0;
    }
    __syncthreads();

    // The thread's two rows (fragment rows lane / 4 and lane / 4 + 8 of its group).
    const int quad = lane % 4;
    int row_t[2], row_j[2];
    bool row_real[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = rg * 16 + lane / 4 + 8 * h;
        row_t[h] = r / H;
        row_j[h] = ht * H + r % H;
        row_real[h] = r < T * H && row_t[h] < n_tok && row_j[h] < a.group;
    }
    const uint32_t q_base = smem_address(s_q);
    const uint32_t ring_base = smem_address(s_ring);

    for (;;) {  // one pass per sequence among the tile's queries (kSplit: one query, one pass)
        int first = -1;
        for (int t = 0; t < n_tok; ++t) {
            if (s_state[t] == 1) {
                first = t;
                break;
            }
        }
        if (first < 0) break;
        const int32_t seq = s_seq[first];
        int64_t lo_min = s_lo[first], hi_max = s_hi[first];
        for (int t = first + 1; t < n_tok; ++t) {
            if (s_state[t] == 1 && s_seq[t] == seq) {
                lo_min = imin(lo_min, s_lo[t]);
                hi_max = imax(hi_max, s_hi[t]);
            }
        }
        int64_t split_lo = lo_min / kSplitRows, split_hi = hi_max / kSplitRows;
        if constexpr (!kWholeMode) {
            split_lo += blockIdx.y / a.split_units;
            if (split_lo > split_hi) return;
            split_hi = split_lo;
        }
        int64_t p_first = imax(lo_min, split_lo * kSplitRows);
        int64_t p_last = imin(hi_max, split_hi * kSplitRows + kSplitRows - 1);
        if (!kWholeMode && a.split_units > 1) {  // one block of the split
            const int64_t blk = split_lo * (kSplitRows / kBlockRows) + blockIdx.y % a.split_units;
            p_first = imax(p_first, blk * kBlockRows);
            p_last = imin(p_last, blk * kBlockRows + kBlockRows - 1);
            if (p_first > p_last) return;
        }
        const int64_t b_first = p_first / kBlockRows, b_last = p_last / kBlockRows;
        const int n_steps = static_cast<int>(4 * (b_last - b_first + 1));

        // Each row's range in this pass (empty for rows of other sequences, refused queries and padding).
        int64_t lo_r[2], hi_r[2];
        bool bad[2] = {false, false};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const bool in = row_real[h] && s_state[row_t[h]] == 1 && s_seq[row_t[h]] == seq;
            lo_r[h] = in ? s_lo[row_t[h]] : INT64_MAX;
            hi_r[h] = in ? s_hi[row_t[h]] : -1;
        }
        __syncthreads();  // every thread has read the pass's states before they change
        if (tid < n_tok && s_state[tid] == 1 && s_seq[tid] == seq) s_state[tid] = 2;

        // The block table's entries for a block's two pages (-1 where the pass sees none of the page): read a
        // block ahead of their use, so that no step waits on the table.
        const auto pages_of = [&](int64_t block, int32_t(&pg)[2]) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int64_t p0 = block * kBlockRows + half * kTcPage;
                const bool any = p0 <= p_last && p0 + kTcPage - 1 >= p_first;
                pg[half] = any ? a.block_tables[seq * a.bt_stride + p0 / kTcPage] : -1;
            }
        };
        int32_t pg_cur[2], pg_next[2];
        pages_of(b_first, pg_next);
        // Step s stages page (s % 4) of block b_first + s / 4: K pages 0, 1 then V pages 0, 1. Steps load in order.
        const auto load = [&](int s) {
            const int slot = s % kSlots;
            const int kind = s % 4;
            const bool is_v = kind >= 2;
            if (kind == 0) {
                pg_cur[0] = pg_next[0];
                pg_cur[1] = pg_next[1];
                pages_of(b_first + s / 4 + 1, pg_next);
            }
            const int64_t p0 = (b_first + s / 4) * kBlockRows + (kind & 1) * kTcPage;
            const bool any = p0 <= p_last && p0 + kTcPage - 1 >= p_first;
            const int64_t page = pg_cur[kind & 1];
            const bool have = any && page >= 0 && page < a.layer.n_pages;
            if (tid == 0) s_bad[slot] = any && !have ? 1 : 0;
            const KvFormat f = is_v ? a.layer.v_format : a.layer.k_format;
            const std::byte *base = a.layer.base + (have ? page : 0) * a.layer.page_bytes +
                                    (is_v ? a.layer.v_offset : a.layer.k_offset) +
                                    g * (is_v ? a.v_head_bytes : a.k_head_bytes);
            const int64_t row_bytes = is_v ? a.layer.v_row_bytes : a.layer.k_row_bytes;
            std::byte *dst = s_ring + slot * kSlotBytes;
            // The thread's chunk ld_c of rows ld_r0, ld_r0 + kLoadRows, ...: fixed per thread, so the addresses are
            // a few adds per copy.
            const std::byte *src = base + ld_r0 * row_bytes;
            if (f == KvFormat::kBf16 && a.tc_async) {
#pragma unroll
                for (int i = 0; i < kLoadPasses; ++i) {
                    const int r = ld_r0 + i * kLoadRows;
                    const bool live = have && p0 + r >= p_first && p0 + r <= p_last;
                    cp_async16_zfill(dst + tc_offset<HD>(r, ld_c), live ? src + 16 * ld_c : a.layer.base,
                                     live ? 16 : 0);
                    src += kLoadRows * row_bytes;
                }
            } else {
                for (int i = 0; i < kLoadPasses; ++i) {
                    const int r = ld_r0 + i * kLoadRows;
                    const bool live = have && p0 + r >= p_first && p0 + r <= p_last;
                    *reinterpret_cast<uint4 *>(dst + tc_offset<HD>(r, ld_c)) =
                        live ? tc_decode8(f, src, ld_c) : make_uint4(0u, 0u, 0u, 0u);
                    src += kLoadRows * row_bytes;
                }
            }
        };

        float m[2], l[2], acc[kDimsW][4];
        float run_m[2] = {0.0f, 0.0f}, run_l[2] = {0.0f, 0.0f};
        bool has_run[2] = {false, false};
        float sc[2 * kTilesW][4];            // the warp's tiles of the block's scores, then p: page 0's, then page 1's
        uint32_t pa[kShare > 1 ? 1 : 8][4];  // p as bf16 A fragments by k16 step of the block (kSplit: in s_p)
#pragma unroll
        for (int s = 0; s < kAhead; ++s) {
            if (s < n_steps) load(s);
            cp_async_commit();
        }
        // Steps `step` .. step + kHeld - 1 (pages from p0 on): waits for their pages, issues the pages kAhead steps
        // on, folds the slots' missing-page marks into the rows that see one of their positions and returns the
        // first slot's address (the others follow it: kSlots is a multiple of kHeld).
        const auto enter = [&](int step, int64_t p0) {
            cp_async_wait_pending<kAhead - kHeld>();
            __syncthreads();
#pragma unroll
            for (int i = 0; i < kHeld; ++i) {
                if (step + kAhead + i < n_steps) load(step + kAhead + i);
                cp_async_commit();
                if (s_bad[(step + i) % kSlots] != 0) {
                    const int64_t q0 = p0 + i * kTcPage;
#pragma unroll
                    for (int h = 0; h < 2; ++h) bad[h] = bad[h] || (lo_r[h] <= q0 + kTcPage - 1 && hi_r[h] >= q0);
                }
            }
            return ring_base + static_cast<uint32_t>(step % kSlots * kSlotBytes);
        };
        // The block's n8 tile of the warp's local score tile i.
        const auto tile_of = [&](int i) { return 8 * (i / kTilesW) + part * kTilesW + i % kTilesW; };
        // Scores of the warp's tiles in the block's two pages (the slots from slot_base on), their k16 steps
        // interleaved.
        const auto score = [&](uint32_t slot_base) {
#pragma unroll
            for (int i = 0; i < 2 * kTilesW; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.0f;
            const int mat = lane / 8;
            const int r0 = 8 * part * kTilesW;  // the warp's first position in a page
#pragma unroll
            for (int kk = 0; kk < kKSteps; ++kk) {
                uint32_t qa[4];
                ldmatrix_x4(qa, q_base + tc_offset<HD>(rg * 16 + lane % 8 + (mat & 1) * 8, 2 * kk + mat / 2));
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const uint32_t base = slot_base + hh * kSlotBytes;
                    float(*t)[4] = sc + kTilesW * hh;
                    if constexpr (kTilesW == 1) {
                        uint32_t kb[2];
                        ldmatrix_x2(kb, base + tc_offset<HD>(r0 + lane % 8, 2 * kk + (mat & 1)));
                        mma_bf16(t[0], qa[0], qa[1], qa[2], qa[3], kb[0], kb[1]);
                    } else {
#pragma unroll
                        for (int np = 0; np < kTilesW / 2; ++np) {
                            uint32_t kb[4];
                            ldmatrix_x4(
                                kb, base + tc_offset<HD>(r0 + 16 * np + lane % 8 + (mat / 2) * 8, 2 * kk + (mat & 1)));
                            mma_bf16(t[2 * np], qa[0], qa[1], qa[2], qa[3], kb[0], kb[1]);
                            mma_bf16(t[2 * np + 1], qa[0], qa[1], qa[2], qa[3], kb[2], kb[3]);
                        }
                    }
                }
            }
        };
        // The block's fold into the rows' states, per row h: fold_mode 0 leaves the state (the block has no position
        // of the row), 1 takes the block's (the state is empty), 2 merges them with weights fa (the state) and fb (the
        // block).
        int fold_mode[2] = {0, 0};
        float fa[2] = {1.0f, 1.0f}, fb[2] = {0.0f, 0.0f};
        // c = P . V over the block's 128 positions (its two pages from slot_base on; k16 steps in position order
        // from zero), a group of the warp's dim tile pairs at a time, each folded into acc as soon as it is complete:
        // kGroup pairs at a time (independent mma chains in flight).
        constexpr int kPairs = kDimsW / 2;
        constexpr int kGroup = kPairs < 4 ? kPairs : 4;
        const auto sum_values = [&](uint32_t slot_base) {
            const int mat = lane / 8;
#pragma unroll
            for (int g0 = 0; g0 < kPairs; g0 += kGroup) {
                float c[2 * kGroup][4];
#pragma unroll
                for (int t = 0; t < 2 * kGroup; ++t) c[t][0] = c[t][1] = c[t][2] = c[t][3] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < 8; ++kk) {
                    uint32_t p[4];
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        if constexpr (kShare > 1) {
                            p[r] = s_p[(4 * kk + r) * 32 + lane];
                        } else {
                            p[r] = pa[kk][r];
                        }
                    }
#pragma unroll
                    for (int gi = 0; gi < kGroup; ++gi) {
                        uint32_t vb[4];
                        ldmatrix_x4_trans(vb, slot_base + (kk / 4) * kSlotBytes +
                                                  tc_offset<HD>(16 * (kk % 4) + lane % 8 + (mat & 1) * 8,
                                                                part * kDimsW + 2 * (g0 + gi) + mat / 2));
                        mma_bf16(c[2 * gi], p[0], p[1], p[2], p[3], vb[0], vb[1]);
                        mma_bf16(c[2 * gi + 1], p[0], p[1], p[2], p[3], vb[2], vb[3]);
                    }
                }
#pragma unroll
                for (int t = 0; t < 2 * kGroup; ++t) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int h = e / 2;
                        float &x = acc[2 * g0 + t][e];
                        x = fold_mode[h] == 1 ? c[t][e]
                                              : (fold_mode[h] == 2 ? tc_fold_value(x, fa[h], c[t][e], fb[h]) : x);
                    }
                }
            }
        };
        for (int step = 0; step < n_steps; step += 4) {
            const int64_t block0 = (b_first + step / 4) * kBlockRows;
            if (block0 % kSplitRows == 0 || step == 0) {  // a split starts
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    m[h] = kNegInf;
                    l[h] = 0.0f;
                }
#pragma unroll
                for (int n = 0; n < kDimsW; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
            }
            score(enter(step, block0));
            // The block's softmax step: the maxima first (over the warps sharing the rows), then p and b_sum.
            float bm[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int lo_rel = static_cast<int>(imin(imax(lo_r[h] - block0, -1), kBlockRows));
                const int hi_rel = static_cast<int>(imin(imax(hi_r[h] - block0, -1), kBlockRows));
                bm[h] = kNegInf;
#pragma unroll
                for (int i = 0; i < 2 * kTilesW; ++i) {
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int off = 8 * tile_of(i) + 2 * quad + c;
                        const float s = sc[i][2 * h + c] * a.scale;
                        const float sv = off >= lo_rel && off <= hi_rel ? s : kNegInf;
                        sc[i][2 * h + c] = sv;
                        bm[h] = fmaxf(bm[h], sv);
                    }
                }
                bm[h] = fmaxf(bm[h], __shfl_xor_sync(kFullMask, bm[h], 1));
                bm[h] = fmaxf(bm[h], __shfl_xor_sync(kFullMask, bm[h], 2));
                if constexpr (kShare > 1) {
                    if (quad == 0) s_max[part * 16 + lane / 4 + 8 * h] = bm[h];
                }
            }
            if constexpr (kShare > 1) {
                __syncthreads();
#pragma unroll
                for (int h = 0; h < 2; ++h) {
#pragma unroll
                    for (int w = 0; w < kShare; ++w) bm[h] = fmaxf(bm[h], s_max[w * 16 + lane / 4 + 8 * h]);
                }
            }
            float b_sum[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const bool live = bm[h] != kNegInf;
                float y[kTilesW];
#pragma unroll
                for (int i = 0; i < 2 * kTilesW; ++i) {
                    float x = 0.0f;
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const float p = live ? tc_exp(sc[i][2 * h + c] - bm[h]) : 0.0f;
                        sc[i][2 * h + c] = p;
                        x = c == 0 ? p : x + p;
                    }
                    if (i < kTilesW) {
                        y[i] = x;
                    } else {
                        y[i - kTilesW] = y[i - kTilesW] + x;
                    }
                }
                b_sum[h] = tc_tree(y);
                if constexpr (kShare > 1) s_sum[(part * 2 + h) * 32 + lane] = b_sum[h];
            }
            if constexpr (kShare > 1) {
#pragma unroll
                for (int i = 0; i < 2 * kTilesW; ++i) {
                    const int n = tile_of(i);
                    s_p[(2 * n) * 32 + lane] = pack_bf16(sc[i][0], sc[i][1]);
                    s_p[(2 * n + 1) * 32 + lane] = pack_bf16(sc[i][2], sc[i][3]);
                }
                __syncthreads();
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float parts[kShare];
#pragma unroll
                    for (int w = 0; w < kShare; ++w) parts[w] = s_sum[(w * 2 + h) * 32 + lane];
                    b_sum[h] = tc_tree(parts);
                }
            } else {
#pragma unroll
                for (int kk = 0; kk < 8; ++kk) {
                    pa[kk][0] = pack_bf16(sc[2 * kk][0], sc[2 * kk][1]);
                    pa[kk][1] = pack_bf16(sc[2 * kk][2], sc[2 * kk][3]);
                    pa[kk][2] = pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
                    pa[kk][3] = pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                b_sum[h] = b_sum[h] + __shfl_xor_sync(kFullMask, b_sum[h], 1);
                b_sum[h] = b_sum[h] + __shfl_xor_sync(kFullMask, b_sum[h], 2);
                // The block's state (bm, b_sum, P . V) folds into the row's (tc_fold).
                if (bm[h] == kNegInf) {
                    fold_mode[h] = 0;
                } else if (m[h] == kNegInf) {
                    fold_mode[h] = 1;
                    m[h] = bm[h];
                    l[h] = b_sum[h];
                } else {
                    fold_mode[h] = 2;
                    m[h] = tc_fold_weights(m[h], bm[h], fa[h], fb[h]);
                    l[h] = tc_fold_value(l[h], fa[h], b_sum[h], fb[h]);
                }
            }
            sum_values(enter(step + 2, block0));
            // Unless the split goes on: kSplit stores each row's state; kWhole merges it into the row's run.
            if ((block0 + kBlockRows) % kSplitRows != 0 && step + 4 < n_steps) continue;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if constexpr (!kWholeMode) {
                    if (lo_r[h] > p_last || hi_r[h] < p_first) continue;  // none of the row's positions
                    const int64_t i = i0 + row_t[h];
                    const int64_t item = (i * a.n_kv_heads + g) * a.batches + row_j[h] / kHeadBatch;
                    const int jj = row_j[h] % kHeadBatch;
                    float *st =
                        a.split_ws + (item * a.max_splits * a.split_units + blockIdx.y) * split_state_floats(HD);
                    if (quad == 0 && part == 0) {
                        st[jj] = bad[h] ? u32_as_f32(0x7fc00000u) : m[h];
                        st[kHeadBatch + jj] = l[h];
                    }
                    float *sa = st + 2 * kHeadBatch + jj * HD + 8 * part * kDimsW + 2 * quad;
#pragma unroll
                    for (int n = 0; n < kDimsW; ++n) {
                        sa[8 * n] = acc[n][2 * h];
                        sa[8 * n + 1] = acc[n][2 * h + 1];
                    }
                } else {
                    const int64_t s0 = block0 / kSplitRows * kSplitRows;
                    if (lo_r[h] > s0 + kSplitRows - 1 || hi_r[h] < s0) continue;  // not one of the row's splits
                    float *sr = s_run + (warp * kDimTiles * 4) * 32 + lane;
                    if (!has_run[h]) {
                        run_m[h] = m[h];
                        run_l[h] = l[h];
#pragma unroll
                        for (int n = 0; n < kDimTiles; ++n) {
                            sr[(4 * n + 2 * h) * 32] = acc[n][2 * h];
                            sr[(4 * n + 2 * h + 1) * 32] = acc[n][2 * h + 1];
                        }
                        has_run[h] = true;
                    } else {
                        const float m_next = m[h] > run_m[h] ? m[h] : run_m[h];
                        const float fa = exp_f32(run_m[h] - m_next);
                        const float fb = exp_f32(m[h] - m_next);
                        run_l[h] = run_l[h] * fa + l[h] * fb;
                        run_m[h] = m_next;
#pragma unroll
                        for (int n = 0; n < kDimTiles; ++n) {
#pragma unroll
                            for (int c = 0; c < 2; ++c) {
                                float &x = sr[(4 * n + 2 * h + c) * 32];
                                x = x * fa + acc[n][2 * h + c] * fb;
                            }
                        }
                    }
                }
            }
        }
        cp_async_wait_pending<0>();
        __syncthreads();  // the ring is free for the next pass
        if constexpr (kWholeMode) {
            // out = ACC / L times the gate, for the rows of this pass.
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (hi_r[h] < 0) continue;
                const int64_t i = i0 + row_t[h];
                const int64_t head = g * a.group + row_j[h];
                float gate = 1.0f;
                const bool gated = a.gate != nullptr;
                if (gated) gate = sigmoid_f32(a.gate[i * a.gate_stride + head]);
                if (bad[h] && quad == 0 && a.error_flag != nullptr) atomicExch(a.error_flag, 1);
                float *o = a.out + (i * a.n_heads + head) * HD + 2 * quad;
                const float *sr = s_run + (warp * kDimTiles * 4) * 32 + lane;
#pragma unroll
                for (int n = 0; n < kDimTiles; ++n) {
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        float x = sr[(4 * n + 2 * h + c) * 32] / run_l[h];
                        if (gated) x = x * gate;
                        o[8 * n + c] = bad[h] ? u32_as_f32(0x7fc00000u) : x;
                    }
                }
            }
        }
    }
    if constexpr (kWholeMode) {
        // Refused queries: NaN and the flag.
        for (int e = tid; e < T * H; e += kThreadsTc) {
            const int t = e / H, j = ht * H + e % H;
            if (t >= n_tok || j >= a.group || s_state[t] != 0) continue;
            if (a.error_flag != nullptr) atomicExch(a.error_flag, 1);
            float *o = a.out + ((i0 + t) * a.n_heads + g * a.group + j) * HD;
            for (int d = 0; d < HD; ++d) o[d] = u32_as_f32(0x7fc00000u);
        }
    }
#endif
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

cudaError_t attention_prologue(const QkHeads &q, const QkHeads &k, const float *v, int64_t v_stride, int64_t n_tokens,
                               int64_t head_dim, float eps, const RopeRows &rope, RowRounding q_round,
                               const cpu::PagedLayer &layer, const int32_t *slots, int32_t *error_flag,
                               cudaStream_t stream) {
    if (!qk_norm_rope_valid(q, k, n_tokens, head_dim, rope) || v_stride < k.n_heads * head_dim) {
        return cudaErrorInvalidValue;
    }
    const int64_t k_head_bytes = format_bytes(layer.k_format, head_dim);
    const int64_t v_head_bytes = format_bytes(layer.v_format, head_dim);
    if (!valid_format(layer.k_format) || !valid_format(layer.v_format) || k_head_bytes < 0 || v_head_bytes < 0 ||
        layer.k_row_bytes != k.n_heads * k_head_bytes || layer.v_row_bytes != k.n_heads * v_head_bytes ||
        (q_round == RowRounding::kQ8 && head_dim % kQuantBlock != 0)) {
        return cudaErrorInvalidValue;
    }
    if (n_tokens == 0) return cudaSuccess;
    if (v == nullptr || slots == nullptr || layer.base == nullptr) return cudaErrorInvalidValue;
    const PrologueArgs a{{q.x, q.token_stride, q.n_heads, q.w, q.w_dtype == DType::kBF16},
                         {k.x, k.token_stride, k.n_heads, k.w, k.w_dtype == DType::kBF16},
                         v,
                         v_stride,
                         n_tokens,
                         head_dim,
                         eps,
                         rope,
                         q_round,
                         layer,
                         k_head_bytes,
                         v_head_bytes,
                         slots,
                         error_flag};
    const int64_t warps = n_tokens * (q.n_heads + 2 * k.n_heads);
    const int64_t blocks = std::min<int64_t>((warps + kPrologueWarps - 1) / kPrologueWarps, kMaxBlocks);
    launch_kernel(attention_prologue_kernel, static_cast<unsigned>(blocks), kPrologueThreads, 0, stream, a);
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

int64_t paged_attention_split_floats(const cpu::AttentionShape &shape, int64_t n_q, int64_t bt_stride, SplitCtas ctas) {
    if (shape.n_heads <= 0 || shape.n_kv_heads <= 0 || shape.n_heads % shape.n_kv_heads != 0 || shape.head_dim <= 0 ||
        shape.head_dim > kMaxHeadDim || n_q <= 0 || bt_stride < 1 || bt_stride > (int64_t{1} << 40)) {
        return 0;
    }
    const int64_t splits = attention_max_splits(shape, bt_stride);
    if (splits < 2 || splits > 65535) return 0;
    const int64_t batches = (shape.n_heads / shape.n_kv_heads + kHeadBatch - 1) / kHeadBatch;
    const int64_t units = ctas == SplitCtas::kBlocks ? kSplitRows / kBlockRows : 1;
    const int64_t per_row = shape.n_kv_heads * batches * splits * units * split_state_floats(shape.head_dim);
    return n_q > (int64_t{1} << 62) / per_row ? 0 : n_q * per_row;
}

cudaError_t paged_attention(const cpu::AttentionShape &shape, const float *q, int64_t q_stride, const int64_t *q_pos,
                            const int32_t *q_seq, int64_t n_q, const cpu::PagedLayer &layer,
                            const int32_t *block_tables, int64_t bt_stride, int64_t n_seqs, int64_t first_pos,
                            const float *gate, int64_t gate_stride, float *out, int32_t *error_flag,
                            cudaStream_t stream, float *split_ws, int64_t split_ws_floats, SplitCtas ctas) {
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
    // The tensor-core tiles hold positions as i32.
    if (tensor_core_attention(layer.k_format, head_dim) && bt_stride > INT32_MAX / kKvPageRows) {
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
    a.split_units = 1;

    a.n_q = n_q;
    const auto merge = [&]() {
        const int64_t pairs = std::min<int64_t>(kHeadBatch, group) * head_dim;
        launch_kernel(
            attention_merge_kernel,
            dim3(static_cast<unsigned>(n_items), static_cast<unsigned>((pairs + kMergeThreads - 1) / kMergeThreads)),
            kMergeThreads, 0, stream, a);
        return cudaGetLastError();
    };
    const auto set_smem = [](auto kernel, int64_t bytes) {
        return bytes > kDefaultSmemBytes
                   ? cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes))
                   : cudaSuccess;
    };

    if (tensor_core_attention(layer.k_format, head_dim)) {
        // Split-KV takes a split to a CTA, or a block to a CTA where splits alone would leave most SMs idle and the
        // workspace holds the blocks' states (the same bits and launches).
        constexpr int64_t kUnits = kSplitRows / kBlockRows;
        const bool few = n_q <= kTcSplitMaxQueries;
        const int64_t split_tiles = n_q * n_kv_heads * ((group + 15) / 16);  // kSplit: a query's 16 heads a tile
        const int64_t block_floats = paged_attention_split_floats(shape, n_q, bt_stride, SplitCtas::kBlocks);
        const bool by_block = few && split && block_floats > 0 && block_floats <= split_ws_floats &&
                              a.max_splits * kUnits <= 65535 &&
                              (ctas == SplitCtas::kBlocks ||
                               (ctas == SplitCtas::kAuto && split_tiles * a.max_splits < kTcBlockCtasBelow));
        const bool tc_split = few && split;
        if (by_block) a.split_units = kUnits;
        const int warps = tc_split ? tc_split_warps(a.head_dim) : kTcWholeWarps;
        a.tc_heads = static_cast<int>(std::min<int64_t>(group, tc_rows(warps, !tc_split)));
        a.tc_head_tiles = static_cast<int>((group + a.tc_heads - 1) / a.tc_heads);
        a.tc_tokens = tc_split ? 1 : tc_rows(warps, true) / a.tc_heads;
        const auto aligned = [](int64_t x) { return x % 16 == 0; };
        a.tc_async = reinterpret_cast<uintptr_t>(layer.base) % 16 == 0 && aligned(layer.page_bytes) &&
                     aligned(layer.k_offset) && aligned(layer.v_offset) && aligned(layer.k_row_bytes) &&
                     aligned(layer.v_row_bytes) && aligned(k_head_bytes) && aligned(v_head_bytes);
        const int64_t tiles = (n_q + a.tc_tokens - 1) / a.tc_tokens * n_kv_heads * a.tc_head_tiles;
        if (tiles > kMaxGrid) return cudaErrorInvalidValue;
        const int64_t bytes = tc_smem(a.head_dim, warps, !tc_split).total;
        const auto launch = [&](auto kernel) {
            if (const cudaError_t err = set_smem(kernel, bytes); err != cudaSuccess) return err;
            launch_kernel(
                kernel,
                dim3(static_cast<unsigned>(tiles), tc_split ? static_cast<unsigned>(a.max_splits * a.split_units) : 1u),
                32 * warps, static_cast<size_t>(bytes), stream, a);
            return cudaGetLastError();
        };
        cudaError_t err = cudaSuccess;
        switch (a.head_dim) {
            case 32:
                err = tc_split ? launch(attention_tc_kernel<AttnMode::kSplit, 32, tc_split_warps(32)>)
                               : launch(attention_tc_kernel<AttnMode::kWhole, 32, kTcWholeWarps>);
                break;
            case 64:
                err = tc_split ? launch(attention_tc_kernel<AttnMode::kSplit, 64, tc_split_warps(64)>)
                               : launch(attention_tc_kernel<AttnMode::kWhole, 64, kTcWholeWarps>);
                break;
            default:
                err = tc_split ? launch(attention_tc_kernel<AttnMode::kSplit, 128, tc_split_warps(128)>)
                               : launch(attention_tc_kernel<AttnMode::kWhole, 128, kTcWholeWarps>);
                break;
        }
        if (err != cudaSuccess || !tc_split) return err;
        return merge();
    }

    const int64_t smem_bytes = attention_smem_floats(a.head_dim) * static_cast<int64_t>(sizeof(float));
    const auto launch = [&](auto kernel, dim3 grid) {
        if (const cudaError_t err = set_smem(kernel, smem_bytes); err != cudaSuccess) return err;
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
    return merge();
}

bool tensor_core_attention(KvFormat k_format, int64_t head_dim) {
    return (k_format == KvFormat::kBf16 || k_format == KvFormat::kF32) &&
           (head_dim == 32 || head_dim == 64 || head_dim == 128);
}

}  // namespace memra::cuda
