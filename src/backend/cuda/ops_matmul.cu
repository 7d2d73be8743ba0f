// CUDA products (ops_matmul.h). Products with bf16 activations (BF16 weights) run on the tensor cores in the
// GPU's canonical order (stream_bf16_kernel for decode, mma_bf16_kernel to 32 tokens, gemm_bf16_kernel beyond),
// held to a measured tolerance against the CPU; so do grouped products with e4m3 activations (F8_E4M3 banks with
// 128-wide scale tiles) whose shapes suit wgmma_e4m3_kernel (swap-AB FP8 wgmma, chunk sums promoted in K order).
// Every other product runs the CPU's K loop (backend/cpu/matmul.h) on CUDA cores, one 16-thread group per output
// element with thread j as lane j, so every element is formed by exactly the CPU's sequence of fp32 operations:
// the exact loop with IEEE operations and gradual underflow (the host's default mode), the e4m3 device loop with
// the FTZ/DAZ operations written out below, which reproduce core/device_numerics.cpp bit for bit (this file is not
// built with -ftz=true, and every operation is an explicit _rn intrinsic, so nothing is contracted or flushed
// behind our back): product_kernel / e4m3_product_kernel. The uploads are host code, in the header.
#include "backend/cuda/ops_matmul.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdint>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "backend/cuda/exact_loop.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/ops_rows.h"
#include "backend/cuda/ptx.cuh"
#include "core/float_formats.h"

namespace memra::cuda {

namespace {

// ---------------------------------------------------------------------------------------------
// Launch geometry. A block is 16 groups of 16 threads; a work item is one token and 16 consecutive output
// rows (group g takes row 16 * tile + g). Neither number enters an element's K loop.

constexpr int kLanes = kExactLanes;  // lanes of the K loop = threads of a group
constexpr int kThreads = 256;
constexpr int kRowsPerItem = kThreads / kLanes;   // 16 output rows per work item
constexpr int64_t kMaxBlocks = int64_t{1} << 20;  // the item loop covers anything larger
constexpr int kE4m3Chunk = 128;                   // e4m3 activation group = chunk = weight scale tile width
static_assert(kE4m3Chunk == cpu::kE4m3Group && kE4m3Chunk % 32 == 0);

// ---------------------------------------------------------------------------------------------
// FTZ/DAZ arithmetic of core/device_numerics.cpp: a denormal input counts as a zero of its sign; a result that
// is tiny after rounding at unbounded exponent range becomes a zero of its sign; round to nearest even.
//
// The hardware operation (gradual underflow, correctly rounded) gives those bits whenever its result r is 0,
// NaN or above FLT_MIN in magnitude: rounding is monotone, so |r| > FLT_MIN means the exact value is above
// FLT_MIN, where both roundings agree, and r = 0 means the exact value is at most 2^-150 (a zero of its sign
// either way, with IEEE's signs of exact zeros). Otherwise (0 < |r| <= FLT_MIN) the result is recomputed as the
// CPU does: the exact product in double, the sum rounded once to double, then ftz_round. (Not the hardware's
// .ftz instructions: PTX does not say whether they detect tininess before or after rounding; x86 does after.)

__device__ __forceinline__ float daz(float v) { return fabsf(v) < FLT_MIN ? copysignf(0.0f, v) : v; }

// core/device_numerics.cpp ftz_round, line for line.
__device__ float ftz_round(double d) {
    if (fabs(d) >= static_cast<double>(FLT_MIN) || d != d) return __double2float_rn(d);
    const float scaled = __double2float_rn(d * 0x1p64);  // the same rounding, in the normal range
    return fabsf(scaled) >= 0x1p-62f ? copysignf(FLT_MIN, scaled) : copysignf(0.0f, scaled);
}

__device__ __forceinline__ bool needs_ftz_path(float r) { return fabsf(r) <= FLT_MIN && r != 0.0f; }

// memra::fz_fma: c + a * b.
__device__ __forceinline__ float ftz_fma(float a, float b, float c) {
    a = daz(a);
    b = daz(b);
    c = daz(c);
    const float r = __fmaf_rn(a, b, c);
    if (!needs_ftz_path(r)) return r;
    return ftz_round(__fma_rn(static_cast<double>(a), static_cast<double>(b), static_cast<double>(c)));
}

// memra::fz_add.
__device__ __forceinline__ float ftz_add(float a, float b) {
    a = daz(a);
    b = daz(b);
    const float r = __fadd_rn(a, b);
    if (!needs_ftz_path(r)) return r;
    return ftz_round(__dadd_rn(static_cast<double>(a), static_cast<double>(b)));
}

// memra::fz_mul.
__device__ __forceinline__ float ftz_mul(float a, float b) {
    a = daz(a);
    b = daz(b);
    const float r = __fmul_rn(a, b);
    if (!needs_ftz_path(r)) return r;
    return ftz_round(__dmul_rn(static_cast<double>(a), static_cast<double>(b)));
}

// ---------------------------------------------------------------------------------------------
// The lane tree of exact_loop.cuh (lane_tree_exact) in the FTZ/DAZ arithmetic.

__device__ __forceinline__ float lane_tree_ftz(float v, unsigned mask) {
    for (int d = 1; d < kLanes; d <<= 1) v = ftz_add(v, __shfl_xor_sync(mask, v, d, kLanes));
    return v;
}

__device__ __forceinline__ int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

// ---------------------------------------------------------------------------------------------
// What a kernel reads.

enum class Op : uint8_t {
    kMatmul,     // whole K, one output per (token, row)
    kCanonical,  // the canonical blocks held, reduced by their subtree
    kGrouped,    // whole K, the row's expert found in the offsets
};

// One matrix of a stream_bf16_kernel product: a product of one x by up to kMaxMultiParts matrices of the same K
// (the parts) runs as one launch, whose tile groups are those of the parts one after the other (a group never
// spans two parts); a single matrix is one part.
struct ProductPart {
    const uint8_t *data;  // [rows, ld] bf16
    float *y;             // [n_tokens, y_ld] f32
    int64_t rows;
    int64_t y_ld;
    int64_t groups_end;   // tile groups of this part and those before it
};

struct ProductParams {
    // Weight: held row n starts at data + n * ld elements; held column c is absolute K k_begin + c.
    const uint8_t *data;     // [rows, ld] (grouped: expert e at data + e * expert_elems elements)
    int64_t ld;
    int64_t rows;
    int64_t k_begin;
    int64_t row_begin;       // absolute row of held row 0 (the scale tile row)
    int64_t block_rows;
    int64_t block_cols;      // the exact loop's chunk edge
    const float *scale;      // fp8: [.., scale_ld] tiles (grouped: expert e at scale + e * expert_scales)
    int64_t scale_ld;
    int64_t scale_row0;      // whole-matrix tile of scale row 0 / column 0
    int64_t scale_col0;
    // Activations and output.
    const float *x;          // [n_tokens, x_ld] f32; column 0 is absolute K k_begin
    int64_t x_ld;
    float *y;                // [n_tokens, y_ld] f32
    int64_t y_ld;
    int64_t n_tokens;
    // K range: [k0, k1) (kMatmul, kGrouped); kCanonical: n_blocks canonical blocks of block_size from k0.
    int64_t k0;
    int64_t k1;
    int64_t block_size;
    int64_t n_blocks;
    // kGrouped.
    const int32_t *offsets;  // offsets[first_expert .. first_expert + n_experts] are read
    int64_t first_expert;
    int64_t n_experts;
    int64_t expert_elems;    // rows * cols
    int64_t expert_scales;   // scale floats per expert
    // The tensor-core e4m3 products: rows [t_begin, n_tokens) of x, quantized (codes [.., q_ld], scales [..,
    // ceil(K / 128)], row 0 = token t_begin).
    int64_t t_begin;
    uint8_t *qcodes;
    float *qscales;
    int64_t q_ld;
    // The quantization of a down product's SwiGLU (cuda_matmul_grouped_swiglu): x is the gate, swiglu_up the up
    // (both [n_tokens, x_ld]), and the activation swiglu_f32(gate, up, swiglu_limit) is what is quantized, also
    // written to swiglu_act ([n_tokens, x_ld]); nullptr: x itself.
    const float *swiglu_up;
    float *swiglu_act;
    float swiglu_limit;
    // A pair of banks of one shape on one x (cuda_matmul_grouped_pair): row tiles from pair_tiles on are the second
    // bank's; 0 for one bank.
    int64_t pair_tiles;
    const uint8_t *pair_data;
    const float *pair_scale;
    float *pair_y;
    // Work items: n_tokens x row_tiles, of rows_per_item rows each (product_kernel narrows them, launch_narrow).
    int64_t row_tiles;
    int64_t items;
    int64_t rows_per_item = 16;
    // The bf16 products: whether every 8-element group of a segment may be read as one 16-byte weight load and two
    // 16-byte x loads (aligned rows and segment starts, whole groups).
    bool vec = false;
    // stream_bf16_kernel: tokens per block (B columns) and chunks per fold; its parts (data, rows, y and y_ld
    // above are part 0's).
    int64_t tile_tokens = 8;
    int64_t phase_chunks = 8;
    int n_parts = 1;
    ProductPart parts[kMaxMultiParts] = {};
};

// The item's token row of a grouped product and its held expert: the largest e with offsets[first + e] <=
// base + t (empty experts share their offset with the next, so the largest is the one that owns the row).
// False for a row past the held experts' rows. Reads only offsets[first .. first + n_experts].
__device__ bool grouped_expert(const ProductParams &p, int64_t t, int64_t *expert) {
    const int32_t *off = p.offsets + p.first_expert;
    const int64_t v = static_cast<int64_t>(off[0]) + t;
    if (v >= static_cast<int64_t>(off[p.n_experts])) return false;
    int64_t lo = 0;  // off[lo] <= v holds from the start (t >= 0)
    int64_t hi = p.n_experts - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (static_cast<int64_t>(off[mid]) <= v) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    *expert = lo;
    return true;
}

// ---------------------------------------------------------------------------------------------
// The exact K loop (ActRounding::kNone) of one element over absolute K [k0, k1), by this thread as lane
// `lane`: chunks cut at multiples of block_cols; lane j adds x[k] * w[k] (separately rounded) for the k of
// the chunk with (k - c0) % 16 == j in increasing k; the lane tree; fp8: times the chunk's scale; the chunk
// sums added in K order from +0. gx: the x row (column 0 = k_begin); gw: the held weight row; gs: its scale
// tile row (fp8).
template <DType kDt>
__device__ float exact_chunk(const ProductParams &p, const float *gx, const uint8_t *gw, const float *gs, int64_t c0,
                             int64_t c1, int64_t ci, int lane, unsigned mask) {
    float chunk = exact_chunk_sum<kDt>(gx, gw, p.k_begin, c0, c1, lane, mask);
    if constexpr (kDt == DType::kF8E4M3) chunk = __fmul_rn(chunk, gs[ci - p.scale_col0]);
    return chunk;
}

template <DType kDt>
__device__ float dot_exact(const ProductParams &p, const float *gx, const uint8_t *gw, const float *gs,
                           int64_t k0, int64_t k1, int lane, unsigned mask) {
    const int64_t edge = p.block_cols;
    float total = 0.0f;
    int64_t ci = k0 / edge;
    for (int64_t c0 = k0; c0 < k1; ++ci) {
        const int64_t c1 = min_i64(k1, (ci + 1) * edge);
        total = __fadd_rn(total, exact_chunk<kDt>(p, gx, gw, gs, c0, c1, ci, lane, mask));
        c0 = c1;
    }
    return total;
}

// The exact loop with one (token, row) per block (few outputs, long K: the f32 router): the row's chunks are
// independent until their sums are added in K order, so group g computes chunks g, g + 16, ... (each as
// dot_exact computes it) into shared memory and thread 0 adds them in chunk order: dot_exact's bits, with the
// chunks' memory latencies overlapped instead of paid one after another. Dynamic shared memory: n_chunks floats.
template <DType kDt>
__global__ void __launch_bounds__(kThreads) exact_chunks_kernel(const ProductParams p, int64_t n_chunks) {
    pdl_enter();
    extern __shared__ float s_chunk[];
    const int group = static_cast<int>(threadIdx.x) / kLanes;
    const int lane = static_cast<int>(threadIdx.x) % kLanes;
    const unsigned mask = 0xffffu << (threadIdx.x & 16u);
    const int64_t edge = p.block_cols;
    const int64_t c_first = p.k0 / edge;
    for (int64_t item = blockIdx.x; item < p.items; item += gridDim.x) {
        const int64_t t = item / p.rows;
        const int64_t n = item % p.rows;
        const uint8_t *gw = p.data + n * p.ld * kElemBytes<kDt>;
        const float *gs = nullptr;
        if constexpr (kDt == DType::kF8E4M3) gs = p.scale + ((p.row_begin + n) / p.block_rows - p.scale_row0) * p.scale_ld;
        const float *gx = p.x + t * p.x_ld;
        for (int64_t c = group; c < n_chunks; c += kThreads / kLanes) {
            const int64_t ci = c_first + c;
            const int64_t c0 = c == 0 ? p.k0 : ci * edge;
            const int64_t c1 = min_i64(p.k1, (ci + 1) * edge);
            const float v = exact_chunk<kDt>(p, gx, gw, gs, c0, c1, ci, lane, mask);
            if (lane == 0) s_chunk[c] = v;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            p.y[t * p.y_ld + n] = chain_sum(static_cast<int>(n_chunks), [&](int c) { return s_chunk[c]; });
        }
        __syncthreads();  // s_chunk is reused by the block's next item
    }
}

// cpu::canonical_tree_reduce over n_blocks (1, 2, 4 or 8) block partials: ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)).
__device__ __forceinline__ float canonical_tree(const float *part, int64_t n_blocks) {
    switch (n_blocks) {
        case 1: return part[0];
        case 2: return __fadd_rn(part[0], part[1]);
        case 4: return __fadd_rn(__fadd_rn(part[0], part[1]), __fadd_rn(part[2], part[3]));
        default:
            return __fadd_rn(__fadd_rn(__fadd_rn(part[0], part[1]), __fadd_rn(part[2], part[3])),
                             __fadd_rn(__fadd_rn(part[4], part[5]), __fadd_rn(part[6], part[7])));
    }
}

// The products of the exact loop. No block-level synchronisation: a group that has no row (past the weight's
// rows, or a grouped row past the experts' rows) simply moves on. A block is p.rows_per_item groups of 16
// threads (launch_narrow).
template <DType kDt, Op kOp>
__global__ void __launch_bounds__(kThreads) product_kernel(const ProductParams p) {
    pdl_enter();
    const int group = static_cast<int>(threadIdx.x) / kLanes;
    const int lane = static_cast<int>(threadIdx.x) % kLanes;
    const unsigned mask = 0xffffu << (threadIdx.x & 16u);
    for (int64_t item = blockIdx.x; item < p.items; item += gridDim.x) {
        const int64_t t = item / p.row_tiles;
        const int64_t n = (item % p.row_tiles) * p.rows_per_item + group;
        if (n >= p.rows) continue;
        const uint8_t *gdata = p.data;
        const float *gscale = p.scale;
        if constexpr (kOp == Op::kGrouped) {
            int64_t e = 0;
            if (!grouped_expert(p, t, &e)) continue;
            gdata += e * p.expert_elems * kElemBytes<kDt>;
            if constexpr (kDt == DType::kF8E4M3) gscale += e * p.expert_scales;
        }
        const uint8_t *gw = gdata + n * p.ld * kElemBytes<kDt>;  // [ld] dtype
        const float *gs = nullptr;                                  // [scale_ld] f32
        if constexpr (kDt == DType::kF8E4M3) {
            gs = gscale + ((p.row_begin + n) / p.block_rows - p.scale_row0) * p.scale_ld;
        }
        const float *gx = p.x + t * p.x_ld;  // [x_ld] f32
        float out;
        if constexpr (kOp == Op::kCanonical) {
            // Block partials in block order, then the canonical tree over them.
            float part[8];
            for (int64_t b = 0; b < p.n_blocks; ++b) {
                const int64_t b0 = p.k0 + b * p.block_size;
                part[b] = dot_exact<kDt>(p, gx, gw, gs, b0, b0 + p.block_size, lane, mask);
            }
            out = canonical_tree(part, p.n_blocks);
        } else {
            out = dot_exact<kDt>(p, gx, gw, gs, p.k0, p.k1, lane, mask);
        }
        if (lane == 0) p.y[t * p.y_ld + n] = out;
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core bf16 products: the device loop with bf16 activations (ActRounding::kBf16, BF16 weights) in the
// GPU's own canonical order, on mma.sync.m16n8k16 (bf16 in, fp32 accumulate) with the weights as the 16-row A
// operand and up to 8 tokens as the B operand (swap-AB). Tensor cores do not round like the CPU's lane chains,
// so these products agree with the CPU to a measured tolerance (DETERMINISM.md), and every GPU kernel computing
// a bf16 product takes this order, which depends on K alone:
//  - a K segment (the whole K, or one canonical block) is cut into chunks of kMmaChunk from its start, the last
//    one shorter; a chunk is walked in 32-wide spans (the last zero-padded), each span two m16n8k16 steps
//    chained on one fp32 accumulator from zero: in span [s, s + 32), thread group q's 8 consecutive elements
//    s + 8q .. s + 8q + 7 fill its two k slots of the first step with elements 8q .. 8q + 3 and of the second
//    with 8q + 4 .. 8q + 7 (one 16-byte load per row, the same permutation of k on both operands);
//  - the chunk partials of a segment are added in K order from +0 (IEEE add);
//  - canonical blocks: the block sums by the canonical tree ((b0+b1)+(b2+b3))+((b4+b5)+(b6+b7)).
// An output's bits depend on its W row, its x row and K only (an MMA's rows and columns are independent, and
// CUDA.md 7 measured that the column a token sits in does not change its bits), so tile shapes may follow the
// token count. Products of up to 8 tokens take stream_bf16_kernel (below), of more than 32 gemm_bf16_kernel
// (below), the rest mma_bf16_kernel: a block is kMmaWarps warps, kRT 16-row tiles by kKW warps splitting each
// tile's chunks (chunk c to warp c % kKW); per round every warp computes one chunk into shared memory and the
// block folds the round's partials in K order. Weights load straight into the A fragments a round ahead; x rows
// are read as f32 at the start of the round and rounded to bf16 (RNE) on the way in.

constexpr int kMmaChunk = 128;              // K per chunk partial
constexpr int kMmaSpan = 32;                // K per pair of k16 steps
constexpr int kMmaSpans = kMmaChunk / kMmaSpan;
constexpr int kMmaWarps = kThreads / 32;

// 16-byte loads of read-only data as volatile asm: issued where written, so a load meant to run a round ahead is
// never sunk towards its use (the compiler may move __ldg loads across barriers).
__device__ __forceinline__ uint4 ld_nc_u4(const void *ptr) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(ptr));
    return r;
}
__device__ __forceinline__ float4 ld_nc_f4(const void *ptr) {
    float4 r;
    asm volatile("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(ptr));
    return r;
}

// Held elements [i, i + 8) of a bf16 weight row, those at or past `end` as +0; kVec: one 16-byte load (ProductParams
// vec: the 8 are whole and aligned).
template <bool kVec>
__device__ __forceinline__ uint4 load_w8(const uint8_t *row, int64_t i, int64_t end) {
    if constexpr (kVec) return ld_nc_u4(row + i * 2);
    const auto *h = reinterpret_cast<const uint16_t *>(row);
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint32_t lo = i + 2 * j < end ? h[i + 2 * j] : 0u;
        const uint32_t hi = i + 2 * j + 1 < end ? h[i + 2 * j + 1] : 0u;
        w[j] = lo | (hi << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Elements [i, i + 8) of an f32 x row, those at or past `end` as +0; kVec: two 16-byte loads (as load_w8).
template <bool kVec>
__device__ __forceinline__ void load_x8(const float *row, int64_t i, int64_t end, float (&v)[8]) {
    if constexpr (kVec) {
        const float4 a = ld_nc_f4(row + i);
        const float4 b = ld_nc_f4(row + i + 4);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = i + j < end ? row[i + j] : 0.0f;
    }
}

// Eight x values rounded to bf16 pairs (element 2i in the low half).
__device__ __forceinline__ uint4 pack_x8(const float (&v)[8]) {
    return make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]), pack_bf16(v[4], v[5]), pack_bf16(v[6], v[7]));
}

// The absolute K range of chunk c: segment c / per_seg, chunk c % per_seg within it.
struct MmaChunk {
    int64_t begin;
    int64_t end;
    int seg;
    int j;
};
__device__ __forceinline__ MmaChunk mma_chunk(const ProductParams &p, int64_t seg_len, int per_seg, int c) {
    MmaChunk ch;
    ch.seg = c / per_seg;
    ch.j = c - ch.seg * per_seg;
    const int64_t s0 = p.k0 + ch.seg * seg_len;
    ch.begin = s0 + static_cast<int64_t>(ch.j) * kMmaChunk;
    ch.end = min_i64(ch.begin + kMmaChunk, s0 + seg_len);
    return ch;
}

// The block's tokens of a grouped product: the blockIdx.z-th run of one expert among the rows [t0, t0 + cols)
// (rows are sorted by expert, so a run is contiguous). False when the tile has no such run. Every thread
// computes it alike (lane l looks at row t0 + l; cols <= 32).
__device__ bool grouped_run(const ProductParams &p, int64_t t0, int cols, int64_t *expert, int64_t *t_lo,
                            int64_t *t_hi) {
    const int l = static_cast<int>(threadIdx.x % 32);
    int64_t e = -1;
    const bool has = l < cols && t0 + l < p.n_tokens && grouped_expert(p, t0 + l, &e);
    const int64_t e_prev = __shfl_up_sync(0xffffffffu, e, 1);
    const unsigned starts = __ballot_sync(0xffffffffu, has && (l == 0 || e_prev != e));
    const int z = static_cast<int>(blockIdx.z);
    if (__popc(starts) <= z) return false;
    unsigned rest = starts;
    for (int i = 0; i < z; ++i) rest &= rest - 1;  // drop the z lowest runs
    const int first = __ffs(static_cast<int>(rest)) - 1;
    *expert = __shfl_sync(0xffffffffu, e, first);
    const unsigned mine = __ballot_sync(0xffffffffu, has && e == *expert);
    *t_lo = t0 + first;
    *t_hi = t0 + (32 - __clz(static_cast<int>(mine)));
    return true;
}

// A bf16 product block's tokens [t_lo, t_hi) of token tile `tile` (cols wide) and their weight rows (grouped: the
// tile's blockIdx.z-th run and its expert); false where the block has no tokens (every thread alike).
template <Op kOp>
__device__ __forceinline__ bool block_tokens(const ProductParams &p, int64_t tile, int cols, int64_t *t_lo,
                                             int64_t *t_hi, const uint8_t **wdata) {
    const int64_t t0 = tile * cols;
    *t_lo = t0;
    *t_hi = min_i64(t0 + cols, p.n_tokens);
    *wdata = p.data;
    if constexpr (kOp == Op::kGrouped) {
        int64_t e = 0;
        if (!grouped_run(p, t0, cols, &e, t_lo, t_hi)) return false;
        *wdata += e * p.expert_elems * 2;
    }
    return true;
}

// Row group `group` of a bf16 product (`tiles` row tiles of 16; the kernels' blocks or tile groups): its part's
// weights (`offset` bytes in: a grouped product's expert), output and rows, and the part row of the group's first
// row. Only kMatmul products have several parts (part_groups numbers their groups one part after the other).
struct StreamGroup {
    const uint8_t *data;
    float *y;
    int64_t rows;
    int64_t y_ld;
    int64_t row0;
};
template <Op kOp>
__device__ __forceinline__ StreamGroup stream_group(const ProductParams &p, int64_t group, int tiles,
                                                    int64_t offset) {
    StreamGroup sg{p.parts[0].data, p.parts[0].y, p.parts[0].rows, p.parts[0].y_ld, 0};
    int64_t first = 0;  // the part's first group
    if constexpr (kOp == Op::kMatmul) {
#pragma unroll
        for (int i = 1; i < kMaxMultiParts; ++i) {  // (unrolled: the parameters are never indexed at run time)
            if (i < p.n_parts && group >= p.parts[i - 1].groups_end) {
                sg = {p.parts[i].data, p.parts[i].y, p.parts[i].rows, p.parts[i].y_ld, 0};
                first = p.parts[i - 1].groups_end;
            }
        }
    }
    sg.data += offset;
    sg.row0 = (group - first) * tiles * 16;
    return sg;
}

// The fold of a finished segment's sum `run` (segment seg of n_segs) into the output so far, `out`: canonical
// blocks meet the pending sums of their left siblings (the canonical tree as a binary counter over the finished
// blocks, level by level), the last one giving the output; a whole-K product's output is its one segment.
// kLevels pending sums fold up to 2^kLevels blocks; with `top`, one more level kept at *top.
template <Op kOp, int kLevels>
__device__ __forceinline__ float fold_segment(float run, int seg, int n_segs, float (&level)[kLevels], float out,
                                              float *top = nullptr) {
    if constexpr (kOp == Op::kCanonical) {
        float carry = run;
        bool pending = true;
#pragma unroll
        for (int l = 0; l < kLevels; ++l) {
            if (pending) {
                if ((seg >> l) & 1) {
                    carry = __fadd_rn(level[l], carry);
                } else {
                    level[l] = carry;
                    pending = false;
                }
            }
        }
        if (pending && top != nullptr) {
            if ((seg >> kLevels) & 1) {
                carry = __fadd_rn(*top, carry);
            } else {
                *top = carry;
            }
        }
        return seg == n_segs - 1 ? carry : out;
    } else {
        return run;
    }
}

template <int kNT, int kKW, Op kOp>
__global__ void __launch_bounds__(kThreads) mma_bf16_kernel(const ProductParams p) {
    pdl_enter();
    constexpr int kRT = kMmaWarps / kKW;         // 16-row tiles per block
    constexpr int kCols = 8 * kNT;               // tokens per block
    constexpr int kTileOut = 16 * kCols;         // outputs of one row tile: [col][row]
    constexpr int kOuts = kRT * kTileOut;
    constexpr int kPerThread = (kOuts + kThreads - 1) / kThreads;
    static_assert(kRT * kKW == kMmaWarps && kCols <= 32);
    __shared__ float s_part[2][kMmaWarps][kTileOut];

    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int g = lane / 4;
    const int q = lane % 4;
    const int rt = warp / kKW;
    const int kw = warp % kKW;
    const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kCols;
    int64_t t_lo = 0;
    int64_t t_hi = 0;
    const uint8_t *wdata = nullptr;  // [rows, ld] bf16: the matrix, or the run's expert
    if (!block_tokens<kOp>(p, blockIdx.y, kCols, &t_lo, &t_hi, &wdata)) return;  // the whole block alike
    const int64_t seg_len = kOp == Op::kCanonical ? p.block_size : p.k1 - p.k0;
    const int n_segs = kOp == Op::kCanonical ? static_cast<int>(p.n_blocks) : 1;
    const int per_seg = static_cast<int>((seg_len + kMmaChunk - 1) / kMmaChunk);
    const int n_chunks = n_segs * per_seg;
    const int rounds = (n_chunks + kKW - 1) / kKW;

    // The block's row group (of its part, a multi-part product's) and this thread's A rows (g, g + 8 of the
    // warp's tile) and B tokens (t0 + 8 j + g).
    const StreamGroup sg = stream_group<kOp>(p, blockIdx.x, kRT, wdata - p.data);
    const int64_t row0 = sg.row0 + rt * 16;
    const bool has_a = row0 + g < sg.rows;
    const bool has_b = row0 + g + 8 < sg.rows;
    const uint8_t *wa = sg.data + (has_a ? row0 + g : 0) * p.ld * 2;
    const uint8_t *wb = sg.data + (has_b ? row0 + g + 8 : 0) * p.ld * 2;
    const auto load_a = [&](int c, uint4 (&a)[kMmaSpans][2]) {
        const MmaChunk ch = mma_chunk(p, seg_len, per_seg, c < n_chunks ? c : 0);
        const int64_t end = ch.end - p.k_begin;
#pragma unroll
        for (int s = 0; s < kMmaSpans; ++s) {
            const int64_t i = ch.begin - p.k_begin + s * kMmaSpan + 8 * q;
            const bool in = has_a && c < n_chunks && i < end;
            const bool in_b = has_b && c < n_chunks && i < end;
            a[s][0] = in ? (p.vec ? load_w8<true>(wa, i, end) : load_w8<false>(wa, i, end)) : make_uint4(0, 0, 0, 0);
            a[s][1] = in_b ? (p.vec ? load_w8<true>(wb, i, end) : load_w8<false>(wb, i, end)) : make_uint4(0, 0, 0, 0);
        }
    };

    // This thread's outputs o = threadIdx.x + kThreads * i: f(i, row tile, index within the tile's [col][row]).
    const auto for_outputs = [&](auto &&f) {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
            const int o = static_cast<int>(threadIdx.x) + kThreads * i;
            if (o >= kOuts) break;
            const int o_rt = o / kTileOut;
            f(i, o_rt, o - o_rt * kTileOut);
        }
    };
    // Fold state of those outputs: the segment's running sum and the canonical tree's pending levels.
    float run[kPerThread];
    float level[kPerThread][4];
    float out[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
        run[i] = out[i] = 0.0f;
        level[i][0] = level[i][1] = level[i][2] = level[i][3] = 0.0f;
    }

    // x of chunk c for this thread's tokens, as f32 (zero for absent tokens and past the chunk).
    const auto load_x = [&](int c, float (&xr)[kNT][kMmaSpans][8]) {
        const MmaChunk ch = mma_chunk(p, seg_len, per_seg, c < n_chunks ? c : 0);
        const int64_t end = ch.end - p.k_begin;
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
            const int64_t t = t0 + 8 * j + g;
            const bool live = c < n_chunks && t >= t_lo && t < t_hi;
            const float *row = p.x + (live ? t : 0) * p.x_ld;
#pragma unroll
            for (int s = 0; s < kMmaSpans; ++s) {
                const int64_t i = ch.begin - p.k_begin + s * kMmaSpan + 8 * q;
                if (live && i < end) {
                    if (p.vec) {
                        load_x8<true>(row, i, end, xr[j][s]);
                    } else {
                        load_x8<false>(row, i, end, xr[j][s]);
                    }
                } else {
#pragma unroll
                    for (int e = 0; e < 8; ++e) xr[j][s][e] = 0.0f;
                }
            }
        }
    };
    // The weights are fetched a round ahead; x at the start of the round.
    uint4 a_cur[kMmaSpans][2];
    uint4 a_next[kMmaSpans][2];
    float x_now[kNT][kMmaSpans][8];
    load_a(kw, a_cur);
    for (int r = 0; r < rounds; ++r) {
        const int c = r * kKW + kw;
        const int buf = r & 1;
        uint4 xb[kNT][kMmaSpans];
        if (r + 1 < rounds) load_a(c + kKW, a_next);
        if (c < n_chunks) {
            const MmaChunk ch = mma_chunk(p, seg_len, per_seg, c);
            const int spans = static_cast<int>((ch.end - ch.begin + kMmaSpan - 1) / kMmaSpan);
            load_x(c, x_now);
#pragma unroll
            for (int j = 0; j < kNT; ++j) {
#pragma unroll
                for (int s = 0; s < kMmaSpans; ++s) xb[j][s] = pack_x8(x_now[j][s]);
            }
            float acc[kNT][4];
#pragma unroll
            for (int j = 0; j < kNT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
#pragma unroll
            for (int s = 0; s < kMmaSpans; ++s) {
                if (s < spans) {
#pragma unroll
                    for (int j = 0; j < kNT; ++j) {
                        mma_bf16(acc[j], a_cur[s][0].x, a_cur[s][1].x, a_cur[s][0].y, a_cur[s][1].y, xb[j][s].x,
                                 xb[j][s].y);
                        mma_bf16(acc[j], a_cur[s][0].z, a_cur[s][1].z, a_cur[s][0].w, a_cur[s][1].w, xb[j][s].z,
                                 xb[j][s].w);
                    }
                }
            }
            float *part = s_part[buf][warp];
#pragma unroll
            for (int j = 0; j < kNT; ++j) {
                const int col = 8 * j + 2 * q;
                part[col * 16 + g] = acc[j][0];
                part[(col + 1) * 16 + g] = acc[j][1];
                part[col * 16 + g + 8] = acc[j][2];
                part[(col + 1) * 16 + g + 8] = acc[j][3];
            }
        }
        __syncthreads();  // the round's partials are visible; buffer buf ^ 1 was folded by every thread
        for_outputs([&](int i, int o_rt, int within) {
            for (int w = 0; w < kKW; ++w) {
                const int cc = r * kKW + w;
                if (cc >= n_chunks) break;
                const int seg = cc / per_seg;
                const int j = cc - seg * per_seg;
                const float v = s_part[buf][o_rt * kKW + w][within];
                run[i] = __fadd_rn(j == 0 ? 0.0f : run[i], v);
                if (j == per_seg - 1) out[i] = fold_segment<kOp>(run[i], seg, n_segs, level[i], out[i]);
            }
        });
#pragma unroll
        for (int s = 0; s < kMmaSpans; ++s) {
            a_cur[s][0] = a_next[s][0];
            a_cur[s][1] = a_next[s][1];
        }
    }
    for_outputs([&](int i, int o_rt, int within) {
        const int64_t t = t0 + within / 16;
        const int64_t n = sg.row0 + o_rt * 16 + within % 16;
        if (t >= t_lo && t < t_hi && n < sg.rows) sg.y[t * sg.y_ld + n] = out[i];
    });
}

// ---------------------------------------------------------------------------------------------
// Products of up to 8 tokens (decode) stream the weights at the HBM limit in the same canonical order: a
// persistent block stages its tokens' x once, as bf16, in shared memory (padded per segment to whole chunks, the
// padding +0), then walks 16-row tiles. kw warps split a tile's chunks (chunk c to warp c % kw), each warp
// keeping kDepth chunks of weights in flight in registers, across tiles, and writing each chunk partial to shared
// memory; the block folds them in K order (and the canonical tree) exactly as mma_bf16_kernel does, a phase of
// chunks at a time (all of a tile's chunks where their partials fit). The B operand's column of a token is its
// place among the block's tokens (bits do not depend on it, CUDA.md 7).

constexpr int kStreamDepth = 2;      // chunks of weights a warp has in flight
constexpr int kStreamPadElems = 32;  // bf16 pad per staged x row: 64 bytes, conflict-free B fragment loads
constexpr int kStreamStage = 2;      // 8-element x groups a thread loads at once while staging
constexpr int kStreamFoldLoads = 4;  // chunk partials a thread of the fold loads at once (registers are short)

// Warps per row tile for a product of n_chunks chunks per tile: the largest power of two up to 8 that has a
// chunk for every warp.
__host__ __device__ constexpr int stream_tile_warps(int n_chunks) {
    return n_chunks >= 8 ? 8 : n_chunks >= 4 ? 4 : n_chunks >= 2 ? 2 : 1;
}

// The staged layout of a product: its chunks and the bf16 elements per staged token row (segments padded to
// whole chunks, then kStreamPadElems).
struct StreamShape {
    int64_t seg_len;
    int n_segs;
    int per_seg;
    int n_chunks;
    int tile_warps;
    int tiles;  // row tiles a block works on at once
    int64_t x_stride;
};
__host__ __device__ inline StreamShape stream_shape(const ProductParams &p, bool canonical) {
    StreamShape s;
    s.seg_len = canonical ? p.block_size : p.k1 - p.k0;
    s.n_segs = canonical ? static_cast<int>(p.n_blocks) : 1;
    s.per_seg = static_cast<int>((s.seg_len + kMmaChunk - 1) / kMmaChunk);
    s.n_chunks = s.n_segs * s.per_seg;
    s.tile_warps = stream_tile_warps(s.n_chunks);
    s.tiles = kMmaWarps / s.tile_warps;
    s.x_stride = static_cast<int64_t>(s.n_chunks) * kMmaChunk + kStreamPadElems;
    return s;
}

// Dynamic shared memory of stream_bf16_kernel: `tokens` staged x rows and a phase's chunk partials
// ([phase][tiles][tokens][16] f32).
__host__ __device__ inline int64_t stream_smem_bytes(const StreamShape &s, int64_t tokens, int64_t phase) {
    return tokens * s.x_stride * 2 + phase * s.tiles * tokens * 16 * 4;
}

// mma_chunk for a stream_bf16_kernel product: a whole-K product has one segment.
template <Op kOp>
__device__ __forceinline__ MmaChunk stream_chunk(const ProductParams &p, const StreamShape &sh, int c) {
    if constexpr (kOp == Op::kCanonical) return mma_chunk(p, sh.seg_len, sh.per_seg, c);
    MmaChunk ch;
    ch.seg = 0;
    ch.j = c;
    ch.begin = p.k0 + static_cast<int64_t>(c) * kMmaChunk;
    ch.end = min_i64(ch.begin + kMmaChunk, p.k1);
    return ch;
}

template <Op kOp, bool kVec>
__global__ void __launch_bounds__(kThreads, 2) stream_bf16_kernel(const ProductParams p) {
    if constexpr (kOp == Op::kGrouped) pdl_enter();  // the block's tokens come from the offsets
    constexpr int kDepth = kStreamDepth;
    extern __shared__ __align__(16) uint8_t stream_smem[];
    const StreamShape sh = stream_shape(p, kOp == Op::kCanonical);
    const int tokens = static_cast<int>(p.tile_tokens);  // B columns of a block
    const int phase = static_cast<int>(p.phase_chunks);  // chunks per fold, a multiple of tile_warps
    auto *s_x = reinterpret_cast<uint16_t *>(stream_smem);                             // [tokens][x_stride]
    auto *s_part = reinterpret_cast<float *>(stream_smem + tokens * sh.x_stride * 2);  // [phase][tile][token][16]

    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int g = lane / 4;
    const int q = lane % 4;
    const int rt = warp / sh.tile_warps;
    const int kw = warp % sh.tile_warps;

    int64_t t_lo = 0;
    int64_t t_hi = 0;
    const uint8_t *wdata = nullptr;  // [rows, ld] bf16: the matrix, or the run's expert
    if (!block_tokens<kOp>(p, blockIdx.y, tokens, &t_lo, &t_hi, &wdata)) return;  // the whole block alike
    const int live = static_cast<int>(t_hi - t_lo);

    // The block's tile group i is group blockIdx.x + i gridDim.x of the parts' groups (each covers `tiles` row
    // tiles of one part); per group this warp takes its m chunks kw + tile_warps j, j < m, in order.
    int64_t n_groups = p.parts[0].groups_end;
    if constexpr (kOp == Op::kMatmul) {
#pragma unroll
        for (int i = 1; i < kMaxMultiParts; ++i) n_groups = i < p.n_parts ? p.parts[i].groups_end : n_groups;
    }
    const int64_t my_groups = blockIdx.x < n_groups ? (n_groups - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const int m = (sh.n_chunks - kw + sh.tile_warps - 1) / sh.tile_warps;
    const int64_t expert_offset = wdata - p.data;  // bytes: a grouped product's expert (one part)
    const auto group_of = [&](int64_t i) {
        return stream_group<kOp>(p, static_cast<int64_t>(blockIdx.x) + i * gridDim.x, sh.tiles, expert_offset);
    };

    // The weight loads run kDepth steps ahead: step (li, lj) is chunk kw + tile_warps lj of group li (held in
    // lg across its steps where the group may be in any of several parts; else found at each step, for fewer
    // registers).
    int64_t li = 0;
    int lj = 0;
    StreamGroup lg = group_of(0);
    const auto load_next = [&](uint4 (&a)[kMmaSpans][2]) {
        const bool any = li < my_groups;
        const MmaChunk ch = stream_chunk<kOp>(p, sh, any ? kw + sh.tile_warps * lj : 0);
        if constexpr (kOp != Op::kMatmul) lg = group_of(li);
        const int64_t row0 = lg.row0 + rt * 16;
        const bool has_a = any && row0 + g < lg.rows;
        const bool has_b = any && row0 + g + 8 < lg.rows;
        const uint8_t *wa = lg.data + (has_a ? row0 + g : 0) * p.ld * 2;
        const uint8_t *wb = lg.data + (has_b ? row0 + g + 8 : 0) * p.ld * 2;
        const int64_t end = ch.end - p.k_begin;
#pragma unroll
        for (int s = 0; s < kMmaSpans; ++s) {
            // (vec: an 8-element group is in the chunk or past it)
            const int64_t i = ch.begin - p.k_begin + s * kMmaSpan + 8 * q;
            a[s][0] = has_a && i < end ? load_w8<kVec>(wa, i, end) : make_uint4(0, 0, 0, 0);
            a[s][1] = has_b && i < end ? load_w8<kVec>(wb, i, end) : make_uint4(0, 0, 0, 0);
        }
        if (++lj == m) {
            lj = 0;
            ++li;
            if (kOp == Op::kMatmul && li < my_groups) lg = group_of(li);
        }
    };
    // Every buffer's weights go out before the wait on the kernel before and before the staging (whose loads
    // therefore have fewer registers: kStreamStage).
    uint4 a[kDepth][kMmaSpans][2];
#pragma unroll
    for (int d = 0; d < kDepth; ++d) load_next(a[d]);
    if constexpr (kOp != Op::kGrouped) pdl_enter();  // the first weights stream in while the kernel before ends

    // Stage x: token row t_lo + r as bf16 (RNE), segment by segment, each padded to whole chunks with +0;
    // kStreamStage groups of 8 per thread in flight.
    {
        const int64_t seg_groups = static_cast<int64_t>(sh.per_seg) * (kMmaChunk / 8);
        const int64_t row_groups = sh.n_segs * seg_groups;
        const int64_t groups = live * row_groups;
        for (int64_t v0 = threadIdx.x; v0 < groups; v0 += kThreads * kStreamStage) {
            float xv[kStreamStage][8];
#pragma unroll
            for (int st = 0; st < kStreamStage; ++st) {
                const int64_t v = v0 + st * kThreads;
                const int64_t r = v / row_groups;
                const int64_t seg = (v - r * row_groups) / seg_groups;
                const int64_t off = (v - r * row_groups - seg * seg_groups) * 8;  // within the padded segment
                const int64_t s0 = p.k0 + seg * sh.seg_len - p.k_begin;
                if (v < groups && off < sh.seg_len) {
                    load_x8<kVec>(p.x + (t_lo + r) * p.x_ld, s0 + off, s0 + min_i64(off + 8, sh.seg_len), xv[st]);
                } else {
#pragma unroll
                    for (int e = 0; e < 8; ++e) xv[st][e] = 0.0f;
                }
            }
#pragma unroll
            for (int st = 0; st < kStreamStage; ++st) {
                const int64_t v = v0 + st * kThreads;
                if (v >= groups) break;
                const int64_t r = v / row_groups;
                *reinterpret_cast<uint4 *>(s_x + r * sh.x_stride + (v - r * row_groups) * 8) = pack_x8(xv[st]);
            }
        }
    }
    __syncthreads();

    // This thread's fold state across the phases of a tile (several phases only when the tile's partials do
    // not fit: then a block has one row tile and at most 8 x 16 outputs, one per thread).
    float run = 0.0f;
    float level[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float out = 0.0f;
    const int outs = sh.tiles * tokens * 16;
    const int n_phases = (sh.n_chunks + phase - 1) / phase;
    const int per_phase = phase / sh.tile_warps;  // a warp's steps per full phase
    // A tile whose partials all fit folds with a thread per (output, segment): a power of two of segments at
    // most a warp wide, as every canonical product has (8 / TP).
    const bool tree_fold = n_phases == 1 && (sh.n_segs & (sh.n_segs - 1)) == 0 && sh.n_segs <= 32;

    const uint16_t *xg = s_x + g * sh.x_stride + 8 * q;  // this thread's B column (token t_lo + g)
    const auto step = [&](int c, int c0, uint4 (&ac)[kMmaSpans][2]) {
        const MmaChunk ch = stream_chunk<kOp>(p, sh, c);
        const int spans = static_cast<int>((ch.end - ch.begin + kMmaSpan - 1) / kMmaSpan);
        const uint16_t *xc = xg + static_cast<int64_t>(c) * kMmaChunk;  // chunks are staged in order
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int s = 0; s < kMmaSpans; ++s) {
            if (s < spans) {
                const uint4 xb =
                    g < live ? *reinterpret_cast<const uint4 *>(xc + s * kMmaSpan) : make_uint4(0, 0, 0, 0);
                mma_bf16(acc, ac[s][0].x, ac[s][1].x, ac[s][0].y, ac[s][1].y, xb.x, xb.y);
                mma_bf16(acc, ac[s][0].z, ac[s][1].z, ac[s][0].w, ac[s][1].w, xb.z, xb.w);
            }
        }
        float *part = s_part + ((c - c0) * sh.tiles + rt) * tokens * 16;
        const int col = 2 * q;
        if (col < live) {
            part[col * 16 + g] = acc[0];
            part[col * 16 + g + 8] = acc[2];
        }
        if (col + 1 < live) {
            part[(col + 1) * 16 + g] = acc[1];
            part[(col + 1) * 16 + g + 8] = acc[3];
        }
        load_next(ac);  // (issued before the steps, the loads would wait on the registers they read)
    };

    int u = 0;  // steps taken, mod kDepth: the buffer of the next one
    for (int64_t i = 0; i < my_groups; ++i) {
        const StreamGroup og = group_of(i);  // the group whose outputs this pass folds
        for (int ph = 0; ph < n_phases; ++ph) {
            const int c0 = ph * phase;
            const int j_end = min(m, (ph + 1) * per_phase);
            for (int j = ph * per_phase; j < j_end; ++j) {
#pragma unroll
                for (int d = 0; d < kDepth; ++d) {
                    if (u == d) step(kw + sh.tile_warps * j, c0, a[d]);
                }
                u = u + 1 == kDepth ? 0 : u + 1;
            }
            __syncthreads();  // the phase's partials are whole
            if (tree_fold) {
                // The segment is the fastest index, so an output's n_segs threads are adjacent lanes: each adds
                // its segment's chunks in K order (chain_sum, the loop below's chain), then the canonical tree
                // over the segments is a butterfly across those lanes, whose level d pairs exactly the tree's
                // neighbours (the adds commute). items is a multiple of 32 wherever there is a shuffle, so every
                // lane of a warp that shuffles is in the loop.
                const int items = outs * sh.n_segs;
                const int chunk_stride = sh.tiles * tokens * 16;  // floats between a slot's chunk partials
                for (int it = static_cast<int>(threadIdx.x); it < items; it += kThreads) {
                    const int seg = it & (sh.n_segs - 1);
                    const int o = it / sh.n_segs;
                    const int o_rt = o / (tokens * 16);
                    const int col = (o / 16) % tokens;
                    const int r = o % 16;
                    const float *src = s_part + seg * sh.per_seg * chunk_stride + (o_rt * tokens + col) * 16 + r;
                    float v = chain_sum<kStreamFoldLoads>(sh.per_seg, [&](int j) { return src[j * chunk_stride]; });
                    for (int d = 1; d < sh.n_segs; d <<= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, d));
                    const int64_t n = og.row0 + o_rt * 16 + r;
                    if (seg == 0 && col < live && n < og.rows) og.y[(t_lo + col) * og.y_ld + n] = v;
                }
                __syncthreads();  // the partials were read before the next group writes them
                continue;
            }
            const int c1 = min(sh.n_chunks, c0 + phase);
            for (int o = static_cast<int>(threadIdx.x); o < outs; o += kThreads) {
                const int o_rt = o / (tokens * 16);
                const int col = (o / 16) % tokens;
                const int r = o % 16;
                const int64_t n = og.row0 + o_rt * 16 + r;
                if (col >= live || n >= og.rows) continue;
                if (c0 == 0) {
                    run = out = 0.0f;
                    level[0] = level[1] = level[2] = level[3] = 0.0f;
                }
                for (int c = c0; c < c1; ++c) {
                    const int seg = c / sh.per_seg;
                    const int j = c - seg * sh.per_seg;
                    const float v = s_part[(((c - c0) * sh.tiles + o_rt) * tokens + col) * 16 + r];
                    run = __fadd_rn(j == 0 ? 0.0f : run, v);
                    if (j == sh.per_seg - 1) out = fold_segment<kOp>(run, seg, sh.n_segs, level, out);
                }
                if (c1 == sh.n_chunks) og.y[(t_lo + col) * og.y_ld + n] = out;
            }
            __syncthreads();  // the partials were read before the next phase writes them
        }
    }
}

// ---------------------------------------------------------------------------------------------
// memra::f32_to_fp8_e4m3(q, kSaturate) for two values (a in the low byte). On sm_89 and later by the hardware's
// saturating RNE conversion, which agrees with the scalar code on every non-NaN value (a value past 464, or an Inf,
// saturates to +-448 either way; ties go to even); NaN takes the scalar code, which keeps its sign. Before sm_89
// (the compute_80 PTX), the scalar code.
__device__ __forceinline__ uint16_t e4m3_codes2(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint16_t codes;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(codes) : "f"(b), "f"(a));
    if (a != a) codes = static_cast<uint16_t>((codes & 0xff00u) | f32_to_fp8_e4m3(a, Fp8Saturation::kSaturate));
    if (b != b) codes = static_cast<uint16_t>((codes & 0x00ffu) | (f32_to_fp8_e4m3(b, Fp8Saturation::kSaturate) << 8));
    return codes;
#else
    return static_cast<uint16_t>(f32_to_fp8_e4m3(a, Fp8Saturation::kSaturate) |
                                 (f32_to_fp8_e4m3(b, Fp8Saturation::kSaturate) << 8));
#endif
}

// The scale of memra::e4m3_quantize_group by one warp over a group's values, lane l holding v[i] = x[c0 + l + 32 i]
// (0 past the group's end): amax ignoring NaN, IEEE division, scale 1 for amax 0 and 2^-149 on underflow. Every
// lane returns it.
__device__ float warp_values_scale(const float (&v)[kE4m3Chunk / 32]) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kE4m3Chunk / 32; ++i) {
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;  // a NaN never wins
    }
    // The maximum of non-NaN values does not depend on the order it is taken in.
    for (int d = 16; d > 0; d >>= 1) {
        const float o = __shfl_xor_sync(0xffffffffu, amax, d);
        amax = o > amax ? o : amax;
    }
    float scale = amax == 0.0f ? 1.0f : __fdiv_rn(amax, 448.0f);
    if (scale == 0.0f) scale = 0x1p-149f;  // amax / 448 underflowed
    return scale;
}

// warp_values_scale of x[c0, c1) (at most 128 values of the row gx, column 0 = K 0), loaded into v.
__device__ float warp_group_scale(const float *gx, int64_t c0, int64_t c1, float (&v)[kE4m3Chunk / 32]) {
    const int l = static_cast<int>(threadIdx.x % 32);
#pragma unroll
    for (int i = 0; i < kE4m3Chunk / 32; ++i) {
        const int64_t k = c0 + l + 32 * i;
        v[i] = k < c1 ? gx[k] : 0.0f;
    }
    return warp_values_scale(v);
}

// memra::e4m3_quantize_group by one warp: x[c0, c1) as e4m3 values (saturating RNE) widened to f32 into
// q[0, c1 - c0). Every lane returns the scale.
__device__ float warp_quantize_group(const float *gx, int64_t c0, int64_t c1, float *q) {
    const int l = static_cast<int>(threadIdx.x % 32);
    float v[kE4m3Chunk / 32];
    const float scale = warp_group_scale(gx, c0, c1, v);
#pragma unroll
    for (int i = 0; i < kE4m3Chunk / 32; i += 2) {
        const uint16_t codes = e4m3_codes2(__fdiv_rn(v[i], scale), __fdiv_rn(v[i + 1], scale));
        if (c0 + l + 32 * i < c1) q[l + 32 * i] = fp8_e4m3_to_f32(static_cast<uint8_t>(codes & 0xffu));
        if (c0 + l + 32 * (i + 1) < c1) q[l + 32 * (i + 1)] = fp8_e4m3_to_f32(static_cast<uint8_t>(codes >> 8));
    }
    return scale;
}

// One lane's chain of an e4m3 chunk [c0, c1): from +0 over groups of 32 (element g + 2j + 1, then g + 2j, by an
// FTZ fma; the last group zero-padded). q: the chunk's quantized x (q[0] = K c0); gw: the weight row (K 0).
__device__ float lane_chain_e4m3(const float *q, const uint8_t *gw, int64_t c0, int64_t c1, int lane) {
    float acc = 0.0f;
    for (int64_t g = c0; g < c1; g += 32) {
        const int64_t k_odd = g + 2 * lane + 1;
        const int64_t k_even = g + 2 * lane;
        const float x_odd = k_odd < c1 ? q[k_odd - c0] : 0.0f;
        const float w_odd = k_odd < c1 ? fp8_e4m3_to_f32(gw[k_odd]) : 0.0f;
        acc = ftz_fma(x_odd, w_odd, acc);
        const float x_even = k_even < c1 ? q[k_even - c0] : 0.0f;
        const float w_even = k_even < c1 ? fp8_e4m3_to_f32(gw[k_even]) : 0.0f;
        acc = ftz_fma(x_even, w_even, acc);
    }
    return acc;
}

// The device K loop with e4m3 activations (ActRounding::kE4m3x128, F8_E4M3 weights with 128-wide scale tiles,
// whole K from 0). Per 128-wide chunk, warp 0 quantizes the item's x group into shared memory exactly as
// memra::e4m3_quantize_group (amax ignoring NaN, IEEE division, scale 1 for amax 0 and 2^-149 on underflow,
// saturating RNE e4m3); then each group runs the chunk: lanes from +0 over groups of 32 (odd then even element,
// FTZ fma, last group zero-padded), the lane tree, times (x scale * weight scale), added to the running sum.
template <Op kOp>
__global__ void __launch_bounds__(kThreads) e4m3_product_kernel(const ProductParams p) {
    pdl_enter();
    __shared__ float s_x[kE4m3Chunk];  // [128] the chunk's e4m3 values as f32
    __shared__ float s_scale;          // the chunk's activation scale
    const int group = static_cast<int>(threadIdx.x) / kLanes;
    const int lane = static_cast<int>(threadIdx.x) % kLanes;
    const unsigned mask = 0xffffu << (threadIdx.x & 16u);
    for (int64_t item = blockIdx.x; item < p.items; item += gridDim.x) {
        const int64_t t = item / p.row_tiles;
        const int64_t n = (item % p.row_tiles) * kRowsPerItem + group;
        const uint8_t *gdata = p.data;
        const float *gscale = p.scale;
        if constexpr (kOp == Op::kGrouped) {
            int64_t e = 0;
            if (!grouped_expert(p, t, &e)) continue;  // the same for the whole block: t is the item's
            gdata += e * p.expert_elems;
            gscale += e * p.expert_scales;
        }
        const bool active = n < p.rows;
        const uint8_t *gw = gdata + (active ? n : 0) * p.ld;  // [ld] e4m3
        const float *gs = gscale + ((p.row_begin + (active ? n : 0)) / p.block_rows - p.scale_row0) * p.scale_ld;
        const float *gx = p.x + t * p.x_ld;  // [x_ld] f32, column 0 = K 0
        float total = 0.0f;
        for (int64_t c0 = p.k0; c0 < p.k1; c0 += kE4m3Chunk) {
            const int64_t c1 = min_i64(p.k1, c0 + kE4m3Chunk);
            if (threadIdx.x < 32) {
                const float scale = warp_quantize_group(gx, c0, c1, s_x);
                if (threadIdx.x == 0) s_scale = scale;
            }
            __syncthreads();
            if (active) {
                const float acc = lane_chain_e4m3(s_x, gw, c0, c1, lane);
                const float chunk = lane_tree_ftz(acc, mask);
                total = ftz_add(total, ftz_mul(chunk, ftz_mul(s_scale, gs[c0 / kE4m3Chunk - p.scale_col0])));
            }
            __syncthreads();  // s_x and s_scale are rewritten for the next chunk
        }
        if (active && lane == 0) p.y[t * p.y_ld + n] = total;
    }
}

// ---------------------------------------------------------------------------------------------
// E4m3 products on the tensor cores (kE4m3x128 banks; CUDA.md 7: FP8 products use wgmma in every phase). Two
// launches: e4m3_quantize_kernel writes each activation row's e4m3 codes and group scales once (the groups of
// memra::e4m3_quantize_group, bit for bit) into the caller's E4m3Scratch; wgmma_e4m3_kernel then runs swap-AB
// wgmma: a block is one warpgroup computing 64 weight rows (the instruction's M) by up to kN tokens of one expert
// (its N), over K in 128-wide chunks. Each chunk is four m64nNk32 instructions accumulating from zero (the first
// with scale-d 0), then promoted as the CPU's device loop promotes a chunk sum: total + sum * (x scale * weight
// scale), FTZ, in chunk order. A token's bits depend on its row, the weights and K only: the instruction sequence
// is the same for every token tile width kN and every position in the tile (measured, CUDA.md 7), zero codes pad a
// partial tile and a partial chunk, and the tile width is picked from the token count alone. Both operands are
// staged K-major in the 128-byte swizzle (a chunk of a row is one 128-byte swizzle row) in a ring of stages: the
// weights by TMA (one 64-row box a chunk, its stage's mbarrier counting the bytes), the tokens' codes by cp.async;
// a pass takes kWgGroup chunks, whose wgmma chains run together before one wait.

constexpr int kWgRows = 64;        // weight rows of a block: the wgmma M
constexpr int kWgThreads = 128;    // one warpgroup
constexpr int64_t kWgMaxK = 8192;  // the block's token scales stay in shared memory
constexpr int kSwizzleRow = 128;   // bytes: a chunk of one row, one row of the 128-byte swizzle
static_assert(kE4m3Chunk == kSwizzleRow, "a K chunk of e4m3 codes is one swizzle row");

// Chunks in flight per block by token tile width: about 40 KB of weights per block at 8 tokens, fewer stages
// where the token tiles grow so that two blocks still share an SM.
template <int kN>
constexpr int kWgStages = kN <= 8 ? 6 : (kN <= 32 ? 5 : 3);
// Chunks a pass (their wgmma chains in flight together, one wait): two at 8 tokens, where the block's time is its
// chain of passes (H100, 2026-12-07: [2560, 4096] x 8 pairs 42.1 us at one chunk a pass, 39.8 at two, 39.5 at
// three; 256 pairs over 128 experts 269 / 259 / 262 us), one for the wider tiles, whose products are longer.
template <int kN>
constexpr int kWgGroup = kN <= 8 ? 2 : 1;
static_assert(kWgStages<8> >= 2 * kWgGroup<8>, "a pass's stages are never those its refills write");
template <int kN>
constexpr int kWgStageBytes = (kWgRows + kN) * kSwizzleRow;  // the weights' 64 rows, then the tokens' kN

// Dynamic shared memory of wgmma_e4m3_kernel<.., kN> for n_chunks chunks: 1024 bytes to align the stages to the
// swizzle's 1024-byte atoms, the stages, the tokens' scales [kN][n_chunks], the weight scales [n_chunks], then the
// stages' mbarriers (8 bytes each, 8 more to align them).
template <int kN>
size_t wgmma_smem_bytes(int64_t n_chunks) {
    return 1024u + static_cast<size_t>(kWgStages<kN>) * kWgStageBytes<kN> +
           static_cast<size_t>((kN + 1) * n_chunks) * 4u + 8u + static_cast<size_t>(kWgStages<kN>) * 8u;
}

// The wgmma kernel's device code exists in the sm_90a build only (the backend refuses other devices).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MEMRA_WGMMA 1
// Offset of 16-byte unit u (0 .. 7) of staged row r: the 128-byte swizzle (unit u ^ (r mod 8)).
__device__ __forceinline__ int swizzled(int r, int u) { return r * kSwizzleRow + ((u ^ (r & 7)) << 4); }

// A wgmma shared-memory descriptor of a K-major operand in the 128-byte swizzle: start address, leading byte
// offset 1 (unused by swizzled K-major layouts), stride 1024 bytes (8 rows of 128), layout type 1 (128-byte).
__device__ __forceinline__ uint64_t wgmma_desc(const void *smem) {
    const auto a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    return static_cast<uint64_t>((a & 0x3ffffu) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
           (uint64_t{1} << 62);
}

// cp.async's writes (the generic proxy) made visible to wgmma's reads (the async proxy).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// The weights' stages arrive by TMA (cp.async.bulk.tensor, a 64-row x 128-byte box in the 128-byte swizzle: the
// layout `swizzled` names), each completing its stage's mbarrier by its bytes.
__device__ __forceinline__ void mbar_init(uint64_t *bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_address(bar)) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(smem_address(bar)),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void tma_load_2d(void *dst, const CUtensorMap *map, uint64_t *bar, int32_t x, int32_t y) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
        "[%4];\n" ::"r"(smem_address(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_address(bar))
        : "memory");
}
// Keeps the compiler from moving accesses to the accumulators across the asynchronous instructions.
template <int kRegs>
__device__ __forceinline__ void fence_operands(float (&d)[kRegs]) {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// One m64nNk32 e4m3 x e4m3 -> f32 instruction: d (+)= A[64 x 32] B[N x 32]^T, both from shared memory; scale_d 0
// starts from zero.
template <int kN>
struct Wgmma;
template <>
struct Wgmma<8> {
    static __device__ __forceinline__ void mma(float (&d)[4], uint64_t a, uint64_t b, int scale_d) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {"
            "%0, %1, %2, %3"
            "}, %4, %5, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "l"(a), "l"(b), "r"(scale_d));
    }
};
template <>
struct Wgmma<32> {
    static __device__ __forceinline__ void mma(float (&d)[16], uint64_t a, uint64_t b, int scale_d) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {"
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
            "}, %16, %17, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
            : "l"(a), "l"(b), "r"(scale_d));
    }
};
template <>
struct Wgmma<128> {
    static __device__ __forceinline__ void mma(float (&d)[64], uint64_t a, uint64_t b, int scale_d) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
            "}, %64, %65, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
              "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
              "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
              "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
              "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
              "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "l"(a), "l"(b), "r"(scale_d));
    }
};

// ftz_mul on the hardware's FTZ multiplication, redone exactly when the result is at or below FLT_MIN; ftz_add
// likewise.
__device__ __forceinline__ float mul_ftz_fast(float a, float b) {
    float r;
    asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return fabsf(r) <= FLT_MIN ? ftz_mul(a, b) : r;
}
__device__ __forceinline__ float add_ftz_fast(float a, float b) {
    float r;
    asm("add.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return fabsf(r) <= FLT_MIN ? ftz_add(a, b) : r;
}
#endif

// Rows [t_begin, n_tokens) of x (or of its SwiGLU with up, ProductParams::swiglu_up) quantized by
// memra::e4m3_quantize_group: group c of row t (K [128 c, 128 c + 128)) by one warp into codes[(t - t_begin) * q_ld
// + 128 c ..] (zero codes past K) and scales[(t - t_begin) * n_chunks + c].
__global__ void __launch_bounds__(256) e4m3_quantize_kernel(const ProductParams p) {
    pdl_enter();
    const int n_chunks = static_cast<int>((p.k1 + kE4m3Chunk - 1) / kE4m3Chunk);
    const int64_t g = static_cast<int64_t>(blockIdx.x) * 8 + threadIdx.x / 32;
    if (g >= (p.n_tokens - p.t_begin) * n_chunks) return;  // the warp
    const int64_t t = g / n_chunks;
    const int c = static_cast<int>(g - t * n_chunks);
    const int64_t c0 = static_cast<int64_t>(c) * kE4m3Chunk;
    const int64_t c1 = min_i64(p.k1, c0 + kE4m3Chunk);
    float v[kE4m3Chunk / 32];
    const int l = static_cast<int>(threadIdx.x % 32);
    const int64_t row = (p.t_begin + t) * p.x_ld;
    float scale;
    if (p.swiglu_up != nullptr) {
#pragma unroll
        for (int i = 0; i < kE4m3Chunk / 32; ++i) {
            const int64_t k = c0 + l + 32 * i;
            v[i] = k < c1 ? swiglu_f32(p.x[row + k], p.swiglu_up[row + k], p.swiglu_limit) : 0.0f;
            if (k < c1) p.swiglu_act[row + k] = v[i];
        }
        scale = warp_values_scale(v);
    } else {
        scale = warp_group_scale(p.x + row, c0, c1, v);
    }
    uint8_t *out = p.qcodes + t * p.q_ld + c0;
#pragma unroll
    for (int i = 0; i < kE4m3Chunk / 32; i += 2) {
        const uint16_t codes = e4m3_codes2(__fdiv_rn(v[i], scale), __fdiv_rn(v[i + 1], scale));
        out[l + 32 * i] = c0 + l + 32 * i < c1 ? static_cast<uint8_t>(codes & 0xffu) : uint8_t{0};
        out[l + 32 * (i + 1)] = c0 + l + 32 * (i + 1) < c1 ? static_cast<uint8_t>(codes >> 8) : uint8_t{0};
    }
    if (l == 0) p.qscales[t * n_chunks + c] = scale;
}

// The tokens of block `unit` of a grouped wgmma product: the held experts' rows within [t_begin, n_tokens), cut
// per expert into tiles of kN from the expert's first row; units number them expert by expert. Warp 0 finds them
// (each lane scans a run of experts, then an exclusive scan over the lanes); false when unit is past the last
// tile (the same for the whole block).
template <int kN>
__device__ bool wgmma_unit(const ProductParams &p, int64_t unit, int64_t *expert, int64_t *t_lo, int64_t *t_hi) {
    __shared__ int64_t s_found[3];
    if (threadIdx.x < 32) {
        const int l = static_cast<int>(threadIdx.x);
        const int32_t *off = p.offsets + p.first_expert;
        const int64_t base = off[0];
        const auto rows_of = [&](int64_t j, int64_t *lo) {  // expert j's rows in the range
            *lo = off[j] - base > p.t_begin ? off[j] - base : p.t_begin;
            const int64_t hi = min_i64(off[j + 1] - base, p.n_tokens);
            return hi > *lo ? hi - *lo : 0;
        };
        const int64_t per = (p.n_experts + 31) / 32;
        const int64_t j0 = min_i64(p.n_experts, l * per);
        const int64_t j1 = min_i64(p.n_experts, j0 + per);
        int64_t mine = 0;
        for (int64_t j = j0; j < j1; ++j) {
            int64_t lo = 0;
            mine += (rows_of(j, &lo) + kN - 1) / kN;
        }
        int64_t incl = mine;
        for (int d = 1; d < 32; d <<= 1) {
            const int64_t o = __shfl_up_sync(0xffffffffu, incl, d);
            if (l >= d) incl += o;
        }
        if (l == 0) s_found[0] = -1;
        __syncwarp();
        if (unit >= incl - mine && unit < incl) {
            int64_t u = unit - (incl - mine);
            for (int64_t j = j0; j < j1; ++j) {
                int64_t lo = 0;
                const int64_t n = rows_of(j, &lo);
                const int64_t tiles = (n + kN - 1) / kN;
                if (u < tiles) {
                    s_found[0] = j;
                    s_found[1] = lo + u * kN;
                    s_found[2] = lo + min_i64(n, (u + 1) * kN);
                    break;
                }
                u -= tiles;
            }
        }
    }
    __syncthreads();
    *expert = s_found[0];
    *t_lo = s_found[1];
    *t_hi = s_found[2];
    return *expert >= 0;
}

template <int kN, int kG>
__global__ void __launch_bounds__(kWgThreads)
    wgmma_e4m3_kernel(const ProductParams p, const __grid_constant__ CUtensorMap map_a,
                      const __grid_constant__ CUtensorMap map_b) {
#ifndef MEMRA_WGMMA
    pdl_enter();
#else
    extern __shared__ uint8_t s_raw[];
    const auto raw = static_cast<uint32_t>(__cvta_generic_to_shared(s_raw));
    uint8_t *s_stages = s_raw + ((1024u - raw % 1024u) % 1024u);  // [kWgStages][64 weight rows + kN tokens][128]
    constexpr int kStagesN = kWgStages<kN>;
    const int n_chunks = static_cast<int>((p.k1 + kE4m3Chunk - 1) / kE4m3Chunk);
    auto *s_xs = reinterpret_cast<float *>(s_stages + kStagesN * kWgStageBytes<kN>);  // [kN][n_chunks]
    float *s_ws = s_xs + kN * n_chunks;                                               // [n_chunks]
    auto *s_bar = reinterpret_cast<uint64_t *>((reinterpret_cast<uintptr_t>(s_ws + n_chunks) + 7u) & ~uintptr_t{7});
    const int tid = static_cast<int>(threadIdx.x);
    // Row tiles past pair_tiles belong to the second bank of a pair (same shape, same x, its own output).
    const bool second = p.pair_tiles > 0 && blockIdx.y >= p.pair_tiles;
    const int64_t m0 = (static_cast<int64_t>(blockIdx.y) - (second ? p.pair_tiles : 0)) * kWgRows;
    int64_t t_lo = 0;
    int64_t t_hi = 0;
    const CUtensorMap *wmap = second ? &map_b : &map_a;
    const float *wscale = second ? p.pair_scale : p.scale;
    float *const y = second ? p.pair_y : p.y;
    int64_t e = 0;
    // Before the wait on the kernel before (pdl_enter), the block reads only the weights and the offsets: the
    // launch before this one is always the product's quantization (cuda_matmul_grouped), which waited for the
    // kernel that wrote them before it let this one launch. So the first stages' weights stream in while the
    // quantization ends.
    if (!wgmma_unit<kN>(p, blockIdx.x, &e, &t_lo, &t_hi)) return;
    const auto w_row = static_cast<int32_t>(e * p.rows + m0);  // the tile's first row in the map's [experts x rows]
    wscale += e * p.expert_scales;
    const int cnt = static_cast<int>(t_hi - t_lo);
    const uint8_t *codes = p.qcodes + (t_lo - p.t_begin) * p.q_ld;
    // A stage's weights: one TMA box by thread 0 (zeros past K and past the bank's last row; rows past an expert's
    // own belong to the next expert and are never stored).
    const auto issue_weights = [&](int c) {
        if (tid != 0) return;
        uint64_t *bar = s_bar + c % kStagesN;
        mbar_expect(bar, kWgRows * kSwizzleRow);
        tma_load_2d(s_stages + (c % kStagesN) * kWgStageBytes<kN>, wmap, bar, c * kE4m3Chunk, w_row);
    };
    const auto issue_codes = [&](int c) {  // the tokens' codes (rows past cnt stay zero)
        uint8_t *st = s_stages + (c % kStagesN) * kWgStageBytes<kN>;
        for (int i = tid; i < cnt * 8; i += kWgThreads) {
            cp_async16_zfill(st + kWgRows * kSwizzleRow + swizzled(i / 8, i % 8),
                             codes + (i / 8) * p.q_ld + static_cast<int64_t>(c) * kE4m3Chunk + (i % 8) * 16, 16);
        }
    };
    // Stage c's copies are commit group c: the first group also holds the weights of the stages after it that
    // went out before the wait.
    const auto issue = [&](int c) {
        if (c < n_chunks) {
            issue_weights(c);
            issue_codes(c);
        }
        cp_async_commit();
    };
    if (tid == 0) {
        for (int s = 0; s < kStagesN; ++s) mbar_init(s_bar + s);
        mbar_init_fence();
    }
    for (int s = 0; s < kStagesN - kG && s < n_chunks; ++s) issue_weights(s);
    pdl_enter();
    for (int s = 0; s < kStagesN - kG; ++s) {
        if (s < n_chunks) issue_codes(s);
        cp_async_commit();
    }
    // The token rows past cnt: zero codes in every stage. The scales: the weight tile row's, the tokens'.
    for (int i = tid; i < kStagesN * (kN - cnt) * 8; i += kWgThreads) {
        const int s = i / ((kN - cnt) * 8);
        const int j = i % ((kN - cnt) * 8);
        *reinterpret_cast<uint4 *>(s_stages + s * kWgStageBytes<kN> + kWgRows * kSwizzleRow +
                                   swizzled(cnt + j / 8, j % 8)) = make_uint4(0, 0, 0, 0);
    }
    const float *ws_row = wscale + ((p.row_begin + m0) / p.block_rows - p.scale_row0) * p.scale_ld;
    for (int i = tid; i < n_chunks; i += kWgThreads) s_ws[i] = ws_row[i];
    for (int i = tid; i < kN * n_chunks; i += kWgThreads) {
        const int j = i / n_chunks;
        s_xs[i] = j < cnt ? p.qscales[(t_lo - p.t_begin + j) * n_chunks + (i - j * n_chunks)] : 0.0f;
    }

    constexpr int kRegs = kN / 2;
    float acc[kG][kRegs];
    float total[kRegs];
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
#pragma unroll
        for (int g = 0; g < kG; ++g) acc[g][i] = 0.0f;
        total[i] = 0.0f;
    }
    const int lane = tid % 32;
    // kG chunks a pass: their wgmma chains (each from zero) in flight together, one wait, then their scaled sums
    // added to the totals in chunk order.
    for (int c = 0; c < n_chunks; c += kG) {
        cp_async_wait_pending<kStagesN - 2 * kG>();
        fence_async_shared();
        __syncthreads();  // chunks c .. c + kG - 1's codes (and the zeros and scales) visible; the pass before's
                          // stages were read by wgmma
#pragma unroll
        for (int g = 0; g < kG; ++g) issue(c + kStagesN - kG + g);
#pragma unroll
        for (int g = 0; g < kG; ++g) {
            if (c + g < n_chunks) mbar_wait(s_bar + (c + g) % kStagesN, static_cast<uint32_t>((c + g) / kStagesN) & 1u);
        }
#pragma unroll
        for (int g = 0; g < kG; ++g) fence_operands(acc[g]);
        wgmma_fence();
#pragma unroll
        for (int g = 0; g < kG; ++g) {  // past the last chunk: a stale stage's product, never added (no branch
                                        // between the wgmma instructions)
            const uint8_t *st = s_stages + ((c + g) % kStagesN) * kWgStageBytes<kN>;
            const uint64_t da = wgmma_desc(st);
            const uint64_t db = wgmma_desc(st + kWgRows * kSwizzleRow);
#pragma unroll
            for (int kk = 0; kk < kE4m3Chunk / 32; ++kk) {
                Wgmma<kN>::mma(acc[g], da + 2 * kk, db + 2 * kk, kk);  // +32 bytes
            }
        }
        wgmma_commit();
        wgmma_wait_all();
#pragma unroll
        for (int g = 0; g < kG; ++g) fence_operands(acc[g]);
#pragma unroll
        for (int g = 0; g < kG; ++g) {
            if (c + g >= n_chunks) break;
            const float ws = s_ws[c + g];
#pragma unroll
            for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float s = mul_ftz_fast(s_xs[(8 * j + 2 * (lane % 4) + h) * n_chunks + c + g], ws);
                    total[4 * j + h] = add_ftz_fast(total[4 * j + h], mul_ftz_fast(acc[g][4 * j + h], s));
                    total[4 * j + 2 + h] = add_ftz_fast(total[4 * j + 2 + h], mul_ftz_fast(acc[g][4 * j + 2 + h], s));
                }
            }
        }
    }
    cp_async_wait_pending<0>();
    // Accumulator i of thread (warp w, lane l): weight row 16 w + l / 4 (+ 8 for i % 4 >= 2), token
    // 8 (i / 4) + 2 (l % 4) + i % 2.
    const int64_t row = m0 + 16 * (tid / 32) + lane / 4;
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
        const int col = 8 * (i / 4) + 2 * (lane % 4) + i % 2;
        const int64_t n = row + 8 * ((i % 4) / 2);
        if (col < cnt && n < p.rows) y[(t_lo + col) * p.y_ld + n] = total[i];
    }
#endif
}

// ---------------------------------------------------------------------------------------------
// Products of more than 32 tokens (prefill, wide decode batches): a tiled GEMM in the same canonical order. A
// block of kWR x (8 / kWR) warps takes tile_rows(kMF, kWR) weight rows by tile_tokens(kNF, kWR) tokens; warp
// (wr, wt) computes kMF 16-row fragments by kNF 8-token fragments, each output's chunk chain on its own
// accumulators, then adds it to the output's running sum in K order (and the canonical tree) in registers. K
// goes a chunk at a time through kTileStages shared-memory stages: the weights by cp.async kTileStages - 1 chunks
// ahead, x one chunk ahead, read as f32 into registers and stored rounded to bf16: with kXChunk the whole next
// chunk's x is read as the chunk starts and stored as it ends (small tiles: their few spans per chunk would not
// hide the reads' latency), else a span (32 K) at a time while the span before computes (large tiles, whose
// registers would not hold a chunk). Either staged row layout (tile_offset) has a warp's fragment loads (rows g and
// g + 1 in a phase) touch every bank once.

// The tile layout: small tiles (kXChunk) in two stages of rows padded to 320 bytes (conflict-free by the pad),
// large ones in three stages of unpadded, swizzled rows (the pad would not fit). Measured on the H200 at 40-64
// tokens: the small tiles 5-8 % slower in three swizzled stages.
template <bool kXChunk> constexpr int kTileStages = kXChunk ? 2 : 3;
template <bool kXChunk> constexpr int kTileStride = kXChunk ? kMmaChunk + 32 : kMmaChunk;

// A block's weight rows and tokens: kWR x (8 / kWR) warps of kMF 16-row by kNF 8-token fragments.
__host__ __device__ constexpr int tile_rows(int mf, int wr) { return 16 * mf * wr; }
__host__ __device__ constexpr int tile_tokens(int nf, int wr) { return 8 * nf * (kMmaWarps / wr); }
// Shared memory of gemm_bf16_kernel: `stages` stages of its weight rows and x rows, and for a canonical product
// the top pending sum of each output (f32).
constexpr int64_t tile_smem_bytes(int rows, int tokens, int stages, int stride, bool canonical) {
    return int64_t{stages} * (rows + tokens) * stride * 2 + (canonical ? int64_t{rows} * tokens * 4 : 0);
}

// The staged offset (bf16 elements) of 16-byte piece `piece` (0 .. 15) of staged row `row`: padded rows as they
// are, unpadded ones (128 bf16, 256 bytes) with their pieces swizzled by the row's parity.
template <int kStride>
__device__ __forceinline__ int tile_offset(int row, int piece) {
    if constexpr (kStride != kMmaChunk) return row * kStride + 8 * piece;
    return row * kMmaChunk + 8 * (piece ^ ((row & 1) << 2));
}

template <Op kOp, int kMF, int kNF, int kWR, bool kXChunk>
__global__ void __launch_bounds__(kThreads, kMF == 1 ? 2 : 1) gemm_bf16_kernel(const ProductParams p) {
    pdl_enter();
    constexpr int kRows = tile_rows(kMF, kWR);
    constexpr int kTok = tile_tokens(kNF, kWR);
    constexpr int kXQ = kTok * (kMmaSpan / 4) / kThreads;  // float4 groups of a span's x per thread
    constexpr int kXSpans = kXChunk ? kMmaSpans : 1;        // spans of x held in registers
    // canonical: at most 8 blocks, two pending sums in registers and the third in shared memory (s_top)
    constexpr int kLevels = kOp == Op::kCanonical ? 2 : 1;
    static_assert(kMmaWarps % kWR == 0 && kXQ >= 1 && kTok * (kMmaSpan / 4) % kThreads == 0 && kTok <= 32 * 4);
    static_assert(kOp != Op::kGrouped || kTok <= 32);
    extern __shared__ __align__(16) uint8_t tile_smem[];
    constexpr int kStages = kTileStages<kXChunk>;
    constexpr int kStride = kTileStride<kXChunk>;
    auto *s_w = reinterpret_cast<uint16_t *>(tile_smem);  // [kStages][kRows][kStride]
    uint16_t *s_x = s_w + kStages * kRows * kStride;  // [kStages][kTok][kStride]
    // canonical: [kMF][kNF][4][kThreads], each thread's outputs' top pending sums
    auto *s_top = reinterpret_cast<float *>(s_x + kStages * kTok * kStride);

    const int tid = static_cast<int>(threadIdx.x);
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int q = lane % 4;
    const int wr = warp % kWR;
    const int wt = warp / kWR;
    int64_t t_lo = 0;
    int64_t t_hi = 0;
    const uint8_t *wdata = nullptr;  // [rows, ld] bf16: the matrix, or the run's expert
    if (!block_tokens<kOp>(p, blockIdx.x, kTok, &t_lo, &t_hi, &wdata)) return;  // the whole block alike
    const StreamGroup sg = stream_group<kOp>(p, blockIdx.y, kRows / 16, wdata - p.data);  // the block's rows
    const int64_t row0 = sg.row0;
    const int64_t seg_len = kOp == Op::kCanonical ? p.block_size : p.k1 - p.k0;
    const int n_segs = kOp == Op::kCanonical ? static_cast<int>(p.n_blocks) : 1;
    const int per_seg = static_cast<int>((seg_len + kMmaChunk - 1) / kMmaChunk);
    const int n_chunks = n_segs * per_seg;

    // Chunk c's weights into stage b (one commit group): 16 pieces of 8 elements per row, +0 past the rows and
    // the chunk.
    const auto stage_w = [&](int c, int b) {
        const MmaChunk ch = mma_chunk(p, seg_len, per_seg, c);
        const int64_t end = ch.end - p.k_begin;
        uint16_t *sw = s_w + b * kRows * kStride;
#pragma unroll
        for (int u = 0; u < kRows * (kMmaChunk / 8) / kThreads; ++u) {
            const int v = tid + u * kThreads;
            const int r = v / (kMmaChunk / 8);
            const int piece = v % (kMmaChunk / 8);
            const int64_t n = row0 + r;
            const int64_t i = ch.begin - p.k_begin + piece * 8;
            const bool in = n < sg.rows && i < end;
            uint16_t *dst = sw + tile_offset<kStride>(r, piece);
            const uint8_t *row = sg.data + (in ? n : 0) * p.ld * 2;
            if (p.vec) {
                cp_async16_zfill(dst, row + (in ? i : 0) * 2, in ? 16 : 0);
            } else {
                *reinterpret_cast<uint4 *>(dst) = in ? load_w8<false>(row, i, end) : make_uint4(0, 0, 0, 0);
            }
        }
        cp_async_commit();
    };
    // Span s of chunk c's x for this thread: group v = tid + u kThreads is token v / 8, elements 4 (v % 8) ..
    // 4 (v % 8) + 3 of the span; +0 past the tokens and the chunk.
    const auto load_x = [&](int c, int s, float4 *xr) {
        const MmaChunk ch = mma_chunk(p, seg_len, per_seg, c);
        const int64_t end = ch.end - p.k_begin;
#pragma unroll
        for (int u = 0; u < kXQ; ++u) {
            const int v = tid + u * kThreads;
            const int64_t t = t_lo + v / 8;
            const int64_t i = ch.begin - p.k_begin + s * kMmaSpan + (v % 8) * 4;
            const float *row = p.x + (t < t_hi ? t : 0) * p.x_ld;
            if (t < t_hi && i < end && p.vec) {
                xr[u] = ld_nc_f4(row + i);
            } else {
                float e[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) e[j] = t < t_hi && i + j < end ? row[i + j] : 0.0f;
                xr[u] = make_float4(e[0], e[1], e[2], e[3]);
            }
        }
    };
    const auto store_x = [&](int b, int s, const float4 *xr) {
#pragma unroll
        for (int u = 0; u < kXQ; ++u) {
            const int v = tid + u * kThreads;
            const int r = v / 8;
            uint16_t *dst = s_x + b * kTok * kStride + tile_offset<kStride>(r, 4 * s + (v % 8) / 2) + 4 * (v % 2);
            *reinterpret_cast<uint2 *>(dst) = make_uint2(pack_bf16(xr[u].x, xr[u].y), pack_bf16(xr[u].z, xr[u].w));
        }
    };

    float run[kMF][kNF][4];
    float level[kMF][kNF][4][kLevels];
    float4 xr[kXSpans][kXQ];
#pragma unroll
    for (int c = 0; c < kStages - 1; ++c) {
        if (c < n_chunks) stage_w(c, c);
        else cp_async_commit();
    }
#pragma unroll
    for (int s = 0; s < kMmaSpans; ++s) {
        load_x(0, s, xr[0]);
        store_x(0, s, xr[0]);
    }
    for (int c = 0; c < n_chunks; ++c) {
        const int b = c % kStages;
        const int nb = (c + 1) % kStages;
        const bool next = c + 1 < n_chunks;
        cp_async_wait_pending<kStages - 2>();  // chunk c's weights (later ones may still be in flight)
        __syncthreads();  // stage b is whole; stage (c + kStages - 1) % kStages was read by every warp
        if (c + kStages - 1 < n_chunks) stage_w(c + kStages - 1, (c + kStages - 1) % kStages);
        else cp_async_commit();  // an empty group keeps the count
        const MmaChunk ch = mma_chunk(p, seg_len, per_seg, c);
        const int spans = static_cast<int>((ch.end - ch.begin + kMmaSpan - 1) / kMmaSpan);
        const uint16_t *sw = s_w + b * kRows * kStride;
        const uint16_t *sx = s_x + b * kTok * kStride;
        if constexpr (kXChunk) {
#pragma unroll
            for (int s = 0; s < kMmaSpans; ++s) {
                if (next) load_x(c + 1, s, xr[s]);
            }
        }
        float acc[kMF][kNF][4];
#pragma unroll
        for (int m = 0; m < kMF; ++m) {
#pragma unroll
            for (int j = 0; j < kNF; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.0f;
        }
#pragma unroll(kXChunk ? kMmaSpans : 1)  // (a span at a time: unrolled, the 128 x 128 tile spills)
        for (int s = 0; s < kMmaSpans; ++s) {
            if (!kXChunk && next) load_x(c + 1, s, xr[0]);
            if (s < spans) {
                uint4 xb[kNF];
#pragma unroll
                for (int j = 0; j < kNF; ++j) {
                    const int r = wt * 8 * kNF + 8 * j + g;
                    xb[j] = *reinterpret_cast<const uint4 *>(sx + tile_offset<kStride>(r, 4 * s + q));
                }
#pragma unroll
                for (int m = 0; m < kMF; ++m) {
                    const int r = wr * 16 * kMF + 16 * m + g;  // and r + 8, of the same parity
                    const uint4 a0 = *reinterpret_cast<const uint4 *>(sw + tile_offset<kStride>(r, 4 * s + q));
                    const uint4 a1 = *reinterpret_cast<const uint4 *>(sw + tile_offset<kStride>(r + 8, 4 * s + q));
#pragma unroll
                    for (int j = 0; j < kNF; ++j) {
                        mma_bf16(acc[m][j], a0.x, a1.x, a0.y, a1.y, xb[j].x, xb[j].y);
                        mma_bf16(acc[m][j], a0.z, a1.z, a0.w, a1.w, xb[j].z, xb[j].w);
                    }
                }
            }
            if (!kXChunk && next) store_x(nb, s, xr[0]);
        }
        if constexpr (kXChunk) {
#pragma unroll
            for (int s = 0; s < kMmaSpans; ++s) {
                if (next) store_x(nb, s, xr[s]);
            }
        }
#pragma unroll
        for (int m = 0; m < kMF; ++m) {
#pragma unroll
            for (int j = 0; j < kNF; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    run[m][j][e] = __fadd_rn(ch.j == 0 ? 0.0f : run[m][j][e], acc[m][j][e]);
                    if (ch.j == per_seg - 1) {  // the output once the last segment ends
                        float *top = s_top + ((m * kNF + j) * 4 + e) * kThreads + tid;
                        run[m][j][e] =
                            fold_segment<kOp>(run[m][j][e], ch.seg, n_segs, level[m][j][e], run[m][j][e], top);
                    }
                }
            }
        }
    }
    // acc element e: row g + 8 (e / 2), token 2q + e % 2 of the fragment.
#pragma unroll
    for (int m = 0; m < kMF; ++m) {
#pragma unroll
        for (int j = 0; j < kNF; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int64_t n = row0 + wr * 16 * kMF + 16 * m + g + 8 * (e / 2);
                const int64_t t = t_lo + wt * 8 * kNF + 8 * j + 2 * q + e % 2;
                if (n < sg.rows && t < t_hi) sg.y[t * sg.y_ld + n] = run[m][j][e];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Launch and dispatch.

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

cudaError_t launch(void (*kernel)(ProductParams), const ProductParams &p, cudaStream_t stream) {
    const int64_t blocks = p.items < kMaxBlocks ? p.items : kMaxBlocks;
    launch_kernel(kernel, static_cast<unsigned>(blocks), kThreads, 0, stream, p);
    return cudaGetLastError();
}

// product_kernel with items of fewer rows when 16-row items would leave most SMs idle (the f32 router: [experts,
// d_model] for a few tokens is a handful of blocks): rows per item halve, down to 2 (a warp), until the items
// give kFillBlocks blocks. Which block computes a row never enters its K loop.
constexpr int64_t kFillBlocks = 264;
cudaError_t launch_narrow(void (*kernel)(ProductParams), ProductParams p, cudaStream_t stream) {
    int64_t rows = kRowsPerItem;
    while (rows > 2 && p.n_tokens * ceil_div(p.rows, rows) < kFillBlocks) rows /= 2;
    p.rows_per_item = rows;
    p.row_tiles = ceil_div(p.rows, rows);
    p.items = p.n_tokens * p.row_tiles;
    const int64_t blocks = p.items < kMaxBlocks ? p.items : kMaxBlocks;
    launch_kernel(kernel, static_cast<unsigned>(blocks), static_cast<unsigned>(rows * kLanes), 0, stream, p);
    return cudaGetLastError();
}

// Whether exact_chunks_kernel takes an exact product: few outputs (at most kFillBlocks x 16: per-row blocks still
// fill the GPU) over several chunks, whose sums fit the block's shared memory.
constexpr int64_t kMaxExactChunks = 4096;
int64_t exact_chunk_count(const ProductParams &p) {
    return ceil_div(p.k1, p.block_cols) - p.k0 / p.block_cols;
}
bool exact_chunks(const ProductParams &p) {
    const int64_t chunks = exact_chunk_count(p);
    return p.n_tokens * p.rows <= kFillBlocks * 16 && chunks >= 2 && chunks <= kMaxExactChunks;
}
cudaError_t launch_exact_chunks(DType dtype, ProductParams p, cudaStream_t stream) {
    const int64_t chunks = exact_chunk_count(p);
    p.items = p.n_tokens * p.rows;
    const auto blocks = static_cast<unsigned>(p.items < kMaxBlocks ? p.items : kMaxBlocks);
    const size_t smem = static_cast<size_t>(chunks) * sizeof(float);
    switch (dtype) {
        case DType::kF32:
            launch_kernel(exact_chunks_kernel<DType::kF32>, blocks, kThreads, smem, stream, p, chunks);
            break;
        case DType::kBF16:
            launch_kernel(exact_chunks_kernel<DType::kBF16>, blocks, kThreads, smem, stream, p, chunks);
            break;
        case DType::kF16:
            launch_kernel(exact_chunks_kernel<DType::kF16>, blocks, kThreads, smem, stream, p, chunks);
            break;
        case DType::kF8E4M3:
            launch_kernel(exact_chunks_kernel<DType::kF8E4M3>, blocks, kThreads, smem, stream, p, chunks);
            break;
        default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

// Raises kernel's dynamic shared memory limit to `bytes` on the current device, once per device (bit d of
// `raised`): the first launch on a device is never inside a graph capture, whose steps run as issued first.
template <class... Params>
cudaError_t raise_smem_limit(void (*kernel)(Params...), size_t bytes, std::atomic<uint64_t> &raised) {
    int device = 0;
    if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
    const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
    if (bit != 0 && (raised.load() & bit) != 0) return cudaSuccess;
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (e == cudaSuccess) raised.fetch_or(bit);
    return e;
}

// Numbers the row groups of group_rows rows of every part one part after the other (parts[i].groups_end; a
// single matrix becomes part 0) and returns their count: the row blocks of a bf16 product's launch.
int64_t part_groups(ProductParams &p, int64_t group_rows) {
    if (p.n_parts == 1) p.parts[0] = {p.data, p.y, p.rows, p.y_ld, 0};
    int64_t groups = 0;
    for (int i = 0; i < p.n_parts; ++i) {
        groups += ceil_div(p.parts[i].rows, group_rows);
        p.parts[i].groups_end = groups;
    }
    return groups;
}

// Launches mma_bf16_kernel<kNT, kKW, kOp>: row tiles (of every part) by token tiles of 8 kNT (grouped: by the
// runs of one expert within a token tile, one block each).
template <int kNT, int kKW, Op kOp>
cudaError_t launch_mma_tokens(ProductParams p, cudaStream_t stream) {
    constexpr int64_t kRows = 16 * (kMmaWarps / kKW);
    constexpr int64_t kCols = 8 * kNT;
    const int64_t row_blocks = part_groups(p, kRows);
    if (row_blocks > INT32_MAX) return cudaErrorInvalidValue;
    const dim3 grid(static_cast<unsigned>(row_blocks), static_cast<unsigned>(ceil_div(p.n_tokens, kCols)),
                    kOp == Op::kGrouped ? static_cast<unsigned>(kCols) : 1u);
    launch_kernel(mma_bf16_kernel<kNT, kKW, kOp>, grid, kThreads, 0, stream, p);
    return cudaGetLastError();
}

// What stream_bf16_kernel may use on the current device (read once per device): its SMs and the shared memory
// a block may opt in to.
struct StreamDevice {
    int64_t sms = 0;
    int64_t block_smem = 0;
    int64_t sm_smem = 0;
};
constexpr int64_t kSmemReserve = 1024;  // shared memory the runtime keeps per block
cudaError_t stream_device(StreamDevice *d) {
    constexpr int kFields = 3;
    static std::atomic<int64_t> cache[64][kFields];  // per device, as StreamDevice (0: not read yet)
    int device = 0;
    if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
    if (device < 64 && cache[device][0].load() != 0) {
        *d = {cache[device][0].load(), cache[device][1].load(), cache[device][2].load()};
        return cudaSuccess;
    }
    const cudaDeviceAttr attrs[kFields] = {cudaDevAttrMultiProcessorCount, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                           cudaDevAttrMaxSharedMemoryPerMultiprocessor};
    int v[kFields] = {};
    for (int i = 0; i < kFields; ++i) {
        if (cudaError_t e = cudaDeviceGetAttribute(&v[i], attrs[i], device); e != cudaSuccess) return e;
    }
    *d = {v[0], v[1], v[2]};
    if (device < 64) {
        for (int i = kFields - 1; i >= 0; --i) cache[device][i].store(v[i]);  // field 0 last: the "read" mark
    }
    return cudaSuccess;
}

// Launches stream_bf16_kernel (up to 8 tokens) with as many tokens per block as its shared memory holds beside a
// phase of tile_warps chunks, then phases as long as fit (a tile's chunks at most), in a grid of persistent
// blocks that fills the SMs once; cudaErrorNotSupported where not even one token's x fits.
template <Op kOp>
cudaError_t launch_stream(ProductParams p, cudaStream_t stream) {
    const auto kernel = p.vec ? stream_bf16_kernel<kOp, true> : stream_bf16_kernel<kOp, false>;
    StreamDevice dev;
    if (cudaError_t e = stream_device(&dev); e != cudaSuccess) return e;
    const StreamShape sh = stream_shape(p, kOp == Op::kCanonical);
    int64_t tokens = p.n_tokens;
    while (tokens > 0 && stream_smem_bytes(sh, tokens, sh.tile_warps) > dev.block_smem) --tokens;
    if (tokens == 0) return cudaErrorNotSupported;
    const int64_t all = ceil_div(sh.n_chunks, sh.tile_warps) * sh.tile_warps;
    int64_t phase = sh.tile_warps;
    while (phase < all && stream_smem_bytes(sh, tokens, phase + sh.tile_warps) <= dev.block_smem) {
        phase += sh.tile_warps;
    }
    const int64_t smem = stream_smem_bytes(sh, tokens, phase);
    static std::atomic<uint64_t> raised[2] = {0, 0};
    if (cudaError_t e = raise_smem_limit(kernel, static_cast<size_t>(dev.block_smem), raised[p.vec]);
        e != cudaSuccess) {
        return e;
    }
    // Blocks per SM: two (__launch_bounds__) where the shared memory allows.
    const int64_t per_sm = 2 * (smem + kSmemReserve) <= dev.sm_smem ? 2 : 1;
    p.tile_tokens = tokens;
    p.phase_chunks = phase;
    const int64_t token_tiles = ceil_div(p.n_tokens, tokens);
    const int64_t runs = kOp == Op::kGrouped ? tokens : 1;
    const int64_t groups = part_groups(p, 16 * int64_t{sh.tiles});
    const int64_t gx = std::clamp<int64_t>(ceil_div(dev.sms * per_sm, token_tiles * runs), 1, groups);
    const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(token_tiles), static_cast<unsigned>(runs));
    launch_kernel(kernel, grid, kThreads, static_cast<size_t>(smem), stream, p);
    return cudaGetLastError();
}

// Launches gemm_bf16_kernel<kOp, kMF, kNF, kWR>: token tiles (x, so the token tiles of a row tile run side by side
// and its weights come from HBM once) by row tiles (y); grouped: by the runs of one expert within a token tile (z).
template <Op kOp, int kMF, int kNF, int kWR, bool kXChunk>
cudaError_t launch_gemm(ProductParams p, cudaStream_t stream) {
    constexpr int kRows = tile_rows(kMF, kWR);
    constexpr int kTok = tile_tokens(kNF, kWR);
    constexpr auto kernel = gemm_bf16_kernel<kOp, kMF, kNF, kWR, kXChunk>;
    constexpr auto smem = static_cast<size_t>(
        tile_smem_bytes(kRows, kTok, kTileStages<kXChunk>, kTileStride<kXChunk>, kOp == Op::kCanonical));
    static std::atomic<uint64_t> raised{0};
    if (cudaError_t e = raise_smem_limit(kernel, smem, raised); e != cudaSuccess) return e;
    const int64_t row_blocks = part_groups(p, kRows);
    if (row_blocks > 65535) return cudaErrorInvalidValue;
    const dim3 grid(static_cast<unsigned>(ceil_div(p.n_tokens, kTok)), static_cast<unsigned>(row_blocks),
                    kOp == Op::kGrouped ? static_cast<unsigned>(kTok) : 1u);
    launch_kernel(kernel, grid, kThreads, smem, stream, p);
    return cudaGetLastError();
}

// Whether a bf16 product may read its weights and x in 16-byte groups (ProductParams::vec), every part's
// weights included.
template <Op kOp>
bool mma_vec(const ProductParams &p) {
    const int64_t seg_len = kOp == Op::kCanonical ? p.block_size : p.k1 - p.k0;
    const int64_t seg0 = p.k0 - p.k_begin;
    bool vec = reinterpret_cast<uintptr_t>(p.data) % 16 == 0 && p.ld % 8 == 0 && seg0 % 8 == 0 &&
               seg_len % 8 == 0 && p.expert_elems % 8 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
               p.x_ld % 4 == 0;
    for (int i = 1; i < p.n_parts; ++i) vec = vec && reinterpret_cast<uintptr_t>(p.parts[i].data) % 16 == 0;
    return vec;
}

// A bf16 product on the tensor cores. Kernels and tile shapes follow the token count (never an output's bits): up
// to 8 tokens, stream_bf16_kernel (where one token's x fits a block's shared memory); up to 16, mma_bf16_kernel's
// two tiles of 4 warps; up to 32, its 32-token tiles; more, gemm_bf16_kernel (measured on the H200: the tiled
// GEMM is 2-3x faster from 40 tokens on, the split-K rounds faster below 32).
template <Op kOp>
cudaError_t launch_mma(ProductParams p, cudaStream_t stream) {
    p.vec = mma_vec<kOp>(p);
    if (ceil_div(p.n_tokens, 8) > 65535 || ceil_div(p.rows, 16) > INT32_MAX) return cudaErrorInvalidValue;
    if (p.n_tokens <= 8) {
        if (const cudaError_t e = launch_stream<kOp>(p, stream); e != cudaErrorNotSupported) return e;
    }
    if (p.n_tokens <= 16) return launch_mma_tokens<2, 4, kOp>(p, stream);
    if (p.n_tokens <= 32) return launch_mma_tokens<4, 4, kOp>(p, stream);
    if constexpr (kOp != Op::kMatmul) {
        // 64 x 32 at every size. Grouped: a token tile's runs, up to 32 blocks. Canonical: measured on the H200,
        // 128 x 32 and 128 x 64 tiles (a span of x at a time) are 4-60 % slower from 40 to 512 tokens.
        return launch_gemm<kOp, 1, 2, 4, true>(p, stream);
    } else {
        // 64 x 64 (two blocks per SM) or 128 x 128 (one), whichever leaves the busiest SM less work: measured on the
        // H200, a 128 x 128 block takes 2.5 times as long as a 64 x 64 one where two share each SM, and a lone
        // 64 x 64 block 1.4 times that share.
        StreamDevice dev;
        if (cudaError_t e = stream_device(&dev); e != cudaSuccess) return e;
        const auto per_sm = [&](int rows, int tokens) {
            ProductParams q = p;
            return ceil_div(part_groups(q, rows) * ceil_div(p.n_tokens, tokens), dev.sms);
        };
        const int64_t small = per_sm(tile_rows(1, 4), tile_tokens(4, 4));
        const int64_t large = per_sm(tile_rows(4, 2), tile_tokens(4, 2));
        if (25 * large < std::max<int64_t>(10 * small, 14)) return launch_gemm<kOp, 4, 4, 2, false>(p, stream);
        return launch_gemm<kOp, 1, 4, 4, true>(p, stream);
    }
}

// Whether wgmma_e4m3_kernel takes an e4m3 product: K from 0, a multiple of 16 up to kWgMaxK, 16-byte aligned
// weight rows (and experts), 64-row tiles inside one weight scale row, rows within CUDA's y limit and the bank's
// rows within the TMA map's i32 coordinates. Shapes only:
// a product takes one kernel family at every token count.
bool wgmma_e4m3(const ProductParams &p) {
    return p.k0 == 0 && p.k_begin == 0 && p.k1 > 0 && p.k1 % 16 == 0 && p.k1 <= kWgMaxK && p.ld % 16 == 0 &&
           reinterpret_cast<uintptr_t>(p.data) % 16 == 0 && p.expert_elems % 16 == 0 && p.block_rows % kWgRows == 0 &&
           p.row_begin % kWgRows == 0 && p.block_cols == kE4m3Chunk && ceil_div(p.rows, kWgRows) <= 32767 &&
           p.n_experts * p.rows <= INT32_MAX;  // the weight map's row coordinates
}

// The TMA map of an e4m3 bank's weights as one [n_rows, cols] byte matrix (rows ld bytes apart) read in boxes of
// 64 rows by 128 bytes in the 128-byte swizzle, zeros past either end.
cudaError_t weight_map(const uint8_t *data, int64_t n_rows, int64_t cols, int64_t ld, CUtensorMap *map) {
    static const auto encode = [] {
        void *fn = nullptr;
        cudaDriverEntryPointQueryResult found{};
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
                cudaSuccess ||
            found != cudaDriverEntryPointSuccess) {
            fn = nullptr;
        }
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }();
    if (encode == nullptr) return cudaErrorNotSupported;
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(n_rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld)};
    const cuuint32_t box[2] = {kSwizzleRow, kWgRows};
    const cuuint32_t steps[2] = {1, 1};
    const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t *>(data), dims, strides, box,
                              steps, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <int kN, int kG>
cudaError_t launch_wgmma_group(const ProductParams &p, cudaStream_t stream) {
    static std::atomic<uint64_t> raised{0};  // bit d: done on device d
    const int64_t n_chunks = ceil_div(p.k1, kE4m3Chunk);
    const cudaError_t raise =
        raise_smem_limit(wgmma_e4m3_kernel<kN, kG>, wgmma_smem_bytes<kN>(ceil_div(kWgMaxK, kE4m3Chunk)), raised);
    if (raise != cudaSuccess) return raise;
    const int64_t n = p.n_tokens - p.t_begin;
    const int64_t units = ceil_div(n, kN) + std::min(p.n_experts, n);
    const int64_t tiles = ceil_div(p.rows, kWgRows) * (p.pair_tiles > 0 ? 2 : 1);
    const dim3 grid(static_cast<unsigned>(units), static_cast<unsigned>(tiles));
    CUtensorMap map_a{};
    CUtensorMap map_b{};
    if (const cudaError_t e = weight_map(p.data, p.n_experts * p.rows, p.k1, p.ld, &map_a); e != cudaSuccess) return e;
    if (p.pair_tiles > 0) {
        if (const cudaError_t e = weight_map(p.pair_data, p.n_experts * p.rows, p.k1, p.ld, &map_b); e != cudaSuccess) {
            return e;
        }
    } else {
        map_b = map_a;
    }
    launch_kernel(wgmma_e4m3_kernel<kN, kG>, grid, kWgThreads, wgmma_smem_bytes<kN>(n_chunks), stream, p, map_a, map_b);
    return cudaGetLastError();
}

template <int kN>
cudaError_t launch_wgmma_tile(const ProductParams &p, cudaStream_t stream) {
    return launch_wgmma_group<kN, kWgGroup<kN>>(p, stream);
}

// The product on the tensor cores, in slices of the rows the scratch holds: each slice quantized
// (e4m3_quantize_kernel), then multiplied with token tiles of 8, 32 or 128 by the tokens per expert (every width
// gives the same bits).
cudaError_t launch_wgmma(ProductParams p, const E4m3Scratch &scratch, cudaStream_t stream) {
    const int64_t n_chunks = ceil_div(p.k1, kE4m3Chunk);
    p.q_ld = n_chunks * kE4m3Chunk;
    const int64_t slice = std::min(scratch.code_bytes / p.q_ld, scratch.scale_floats / n_chunks);
    if (scratch.codes == nullptr || scratch.scales == nullptr || slice < 1) return cudaErrorInvalidValue;
    p.qcodes = scratch.codes;
    p.qscales = scratch.scales;
    const int64_t n_tokens = p.n_tokens;
    for (int64_t t0 = 0; t0 < n_tokens; t0 += slice) {
        p.t_begin = t0;
        p.n_tokens = std::min(n_tokens, t0 + slice);
        const int64_t rows = p.n_tokens - t0;
        launch_kernel(e4m3_quantize_kernel, dim3(static_cast<unsigned>(ceil_div(rows * n_chunks, 8))), 256, 0, stream,
                      p);
        if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
        const int64_t per_expert = rows / p.n_experts;
        const cudaError_t e = per_expert <= 8    ? launch_wgmma_tile<8>(p, stream)
                              : per_expert <= 32 ? launch_wgmma_tile<32>(p, stream)
                                                 : launch_wgmma_tile<128>(p, stream);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

template <Op kOp>
cudaError_t dispatch(DType dtype, ActRounding act, const ProductParams &p, cudaStream_t stream,
                     const E4m3Scratch &scratch = {}) {
    if (act == ActRounding::kBf16) return launch_mma<kOp>(p, stream);  // valid_weight: BF16 weights
    if (act == ActRounding::kE4m3x128) {
        if constexpr (kOp == Op::kCanonical) {
            return cudaErrorInvalidValue;  // e4m3 groups span canonical blocks (the CPU refuses it too)
        } else {
            if constexpr (kOp == Op::kGrouped) {
                if (wgmma_e4m3(p)) return launch_wgmma(p, scratch, stream);
            }
            return launch(e4m3_product_kernel<kOp>, p, stream);
        }
    }
    if constexpr (kOp == Op::kMatmul) {
        if (exact_chunks(p)) return launch_exact_chunks(dtype, p, stream);
    }
    switch (dtype) {
        case DType::kF32: return launch_narrow(product_kernel<DType::kF32, kOp>, p, stream);
        case DType::kBF16: return launch_narrow(product_kernel<DType::kBF16, kOp>, p, stream);
        case DType::kF16: return launch_narrow(product_kernel<DType::kF16, kOp>, p, stream);
        case DType::kF8E4M3: return launch_narrow(product_kernel<DType::kF8E4M3, kOp>, p, stream);
        default: return cudaErrorInvalidValue;
    }
}

bool linear_dtype(DType t) {
    return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16 || t == DType::kF8E4M3;
}

// The pairing of weight dtype, activation rounding and scales that cpu::matmul's check_weight accepts.
bool valid_weight(DType dtype, ActRounding act, const void *data, const float *scale, int64_t block_rows,
                  int64_t block_cols) {
    if (!linear_dtype(dtype) || data == nullptr || block_rows < 1 || block_cols < 1) return false;
    if (dtype == DType::kF8E4M3 && scale == nullptr) return false;
    if (act == ActRounding::kBf16 && dtype != DType::kBF16) return false;
    if (act == ActRounding::kE4m3x128 && (dtype != DType::kF8E4M3 || block_cols != kE4m3Chunk)) return false;
    return true;
}

// The fields every product over a CudaMatrix shares.
ProductParams matrix_params(const CudaMatrix &w, const float *x, int64_t n_tokens, float *y) {
    ProductParams p{};
    p.data = static_cast<const uint8_t *>(w.data);
    p.ld = w.cols;
    p.rows = w.rows;
    p.k_begin = w.k_begin;
    p.row_begin = w.row_begin;
    p.block_rows = w.block_rows;
    p.block_cols = w.block_cols;
    p.scale = w.scale_inv;
    p.scale_ld = w.scale_tile_cols;
    p.scale_row0 = w.scale_row0;
    p.scale_col0 = w.scale_col0;
    p.x = x;
    p.x_ld = w.cols;
    p.y = y;
    p.y_ld = w.rows;
    p.n_tokens = n_tokens;
    p.row_tiles = ceil_div(w.rows, kRowsPerItem);
    p.items = n_tokens * p.row_tiles;
    return p;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Products.

cudaError_t cuda_matmul(const CudaMatrix &w, const float *x, int64_t n_tokens, float *y, cudaStream_t stream) {
    if (n_tokens < 0 || w.rows <= 0 || w.cols <= 0 ||
        !valid_weight(w.dtype, w.act, w.data, w.scale_inv, w.block_rows, w.block_cols)) {
        return cudaErrorInvalidValue;
    }
    if (w.k_begin != 0 || w.cols != w.k_full) return cudaErrorInvalidValue;  // column-parallel: every K column
    if (n_tokens == 0) return cudaSuccess;
    if (x == nullptr || y == nullptr) return cudaErrorInvalidValue;
    ProductParams p = matrix_params(w, x, n_tokens, y);
    p.k0 = 0;
    p.k1 = w.cols;
    return dispatch<Op::kMatmul>(w.dtype, w.act, p, stream);
}

cudaError_t cuda_matmul_multi(const CudaMatrix *const *w, float *const *y, int n, const float *x, int64_t n_tokens,
                              cudaStream_t stream) {
    if (n < 1 || n > kMaxMultiParts || n_tokens < 1 || x == nullptr) return cudaErrorNotSupported;
    for (int i = 0; i < n; ++i) {
        const CudaMatrix &m = *w[i];
        if (m.dtype != DType::kBF16 || m.act != ActRounding::kBf16 || m.rows <= 0 || m.cols != w[0]->cols ||
            m.k_begin != 0 || m.cols != m.k_full || m.data == nullptr || y[i] == nullptr) {
            return cudaErrorNotSupported;
        }
    }
    ProductParams p = matrix_params(*w[0], x, n_tokens, y[0]);
    p.k0 = 0;
    p.k1 = w[0]->cols;
    p.n_parts = n;
    for (int i = 0; i < n; ++i) {
        p.parts[i] = {static_cast<const uint8_t *>(w[i]->data), y[i], w[i]->rows, w[i]->rows, 0};
    }
    return launch_mma<Op::kMatmul>(p, stream);
}

bool cuda_canonical_blocks(const CudaMatrix &w, int64_t *block_begin, int64_t *block_end) {
    if (w.k_full <= 0 || w.k_full % cpu::kCanonicalBlocks != 0) return false;
    const int64_t bs = w.k_full / cpu::kCanonicalBlocks;
    if (w.k_begin % bs != 0 || w.cols % bs != 0 || w.cols <= 0) return false;
    const int64_t b0 = w.k_begin / bs;
    const int64_t m = w.cols / bs;
    if (!(m == 1 || m == 2 || m == 4 || m == 8) || b0 % m != 0) return false;
    *block_begin = b0;
    *block_end = b0 + m;
    return true;
}

cudaError_t cuda_matmul_canonical(const CudaMatrix &w, const float *x, int64_t n_tokens, float *y,
                                  cudaStream_t stream) {
    int64_t b0 = 0;
    int64_t b1 = 0;
    if (n_tokens < 0 || w.rows <= 0 || !cuda_canonical_blocks(w, &b0, &b1) ||
        !valid_weight(w.dtype, w.act, w.data, w.scale_inv, w.block_rows, w.block_cols) ||
        w.act == ActRounding::kE4m3x128) {
        return cudaErrorInvalidValue;
    }
    if (n_tokens == 0) return cudaSuccess;
    if (x == nullptr || y == nullptr) return cudaErrorInvalidValue;
    ProductParams p = matrix_params(w, x, n_tokens, y);
    p.block_size = w.k_full / cpu::kCanonicalBlocks;
    p.k0 = b0 * p.block_size;
    p.k1 = b1 * p.block_size;
    p.n_blocks = b1 - b0;
    return dispatch<Op::kCanonical>(w.dtype, w.act, p, stream);
}

namespace {

// The fields of a grouped product over b (rows x: [n_rows, b.cols], y: [n_rows, b.rows]).
ProductParams grouped_params(const CudaBank &b, const float *x, int64_t n_rows, const int32_t *offsets, float *y) {
    ProductParams p{};
    p.data = static_cast<const uint8_t *>(b.data);
    p.ld = b.cols;
    p.rows = b.rows;
    p.block_rows = b.block_rows;
    p.block_cols = b.block_cols;
    p.scale = b.scale_inv;
    p.scale_ld = ceil_div(b.cols, b.block_cols);
    p.x = x;
    p.x_ld = b.cols;
    p.y = y;
    p.y_ld = b.rows;
    p.n_tokens = n_rows;
    p.k0 = 0;
    p.k1 = b.cols;
    p.offsets = offsets;
    p.first_expert = b.first_expert;
    p.n_experts = b.n_experts;
    p.expert_elems = b.rows * b.cols;
    p.expert_scales = ceil_div(b.rows, b.block_rows) * p.scale_ld;
    p.row_tiles = ceil_div(b.rows, kRowsPerItem);
    p.items = n_rows * p.row_tiles;
    return p;
}

}  // namespace

namespace {

// The checks of a grouped product's row count, bank and expert offsets.
bool valid_grouped(const CudaBank &b, int64_t n_rows, const int32_t *offsets, int64_t n_offsets) {
    return n_rows >= 0 && b.n_experts > 0 && b.rows > 0 && b.cols > 0 && b.first_expert >= 0 &&
           n_offsets >= b.first_expert + b.n_experts + 1 && offsets != nullptr &&
           valid_weight(b.dtype, b.act, b.data, b.scale_inv, b.block_rows, b.block_cols);
}

}  // namespace

cudaError_t cuda_matmul_grouped(const CudaBank &b, const float *x, int64_t n_rows, const int32_t *offsets,
                                int64_t n_offsets, float *y, const E4m3Scratch &scratch, cudaStream_t stream) {
    if (!valid_grouped(b, n_rows, offsets, n_offsets)) return cudaErrorInvalidValue;
    if (n_rows == 0) return cudaSuccess;
    if (x == nullptr || y == nullptr) return cudaErrorInvalidValue;
    return dispatch<Op::kGrouped>(b.dtype, b.act, grouped_params(b, x, n_rows, offsets, y), stream, scratch);
}

namespace {

// Whether a and b can run as one pair: tensor-core e4m3 banks of one shape over the same experts.
bool pairable(const CudaBank &a, const CudaBank &b, int64_t n_rows) {
    const ProductParams p = grouped_params(a, nullptr, n_rows, nullptr, nullptr);
    return a.act == ActRounding::kE4m3x128 && b.act == a.act && b.dtype == a.dtype && b.rows == a.rows &&
           b.cols == a.cols && b.block_rows == a.block_rows && b.block_cols == a.block_cols &&
           b.first_expert == a.first_expert && b.n_experts == a.n_experts &&
           reinterpret_cast<uintptr_t>(b.data) % 16 == 0 && wgmma_e4m3(p);
}

}  // namespace

cudaError_t cuda_matmul_grouped_pair(const CudaBank &a, const CudaBank &b, const float *x, int64_t n_rows,
                                     const int32_t *offsets, int64_t n_offsets, float *y_a, float *y_b,
                                     const E4m3Scratch &scratch, cudaStream_t stream) {
    if (!pairable(a, b, n_rows) || n_rows <= 0) {
        const cudaError_t e = cuda_matmul_grouped(a, x, n_rows, offsets, n_offsets, y_a, scratch, stream);
        return e != cudaSuccess ? e : cuda_matmul_grouped(b, x, n_rows, offsets, n_offsets, y_b, scratch, stream);
    }
    if (n_offsets < a.first_expert + a.n_experts + 1 || offsets == nullptr || x == nullptr || y_a == nullptr ||
        y_b == nullptr || !valid_weight(a.dtype, a.act, a.data, a.scale_inv, a.block_rows, a.block_cols) ||
        !valid_weight(b.dtype, b.act, b.data, b.scale_inv, b.block_rows, b.block_cols)) {
        return cudaErrorInvalidValue;
    }
    ProductParams p = grouped_params(a, x, n_rows, offsets, y_a);
    p.pair_tiles = ceil_div(a.rows, kWgRows);
    p.pair_data = static_cast<const uint8_t *>(b.data);
    p.pair_scale = b.scale_inv;
    p.pair_y = y_b;
    return launch_wgmma(p, scratch, stream);
}

int64_t cuda_matmul_grouped_pair_launches(const CudaBank &a, const CudaBank &b, int64_t n_rows,
                                          const E4m3Scratch &scratch) {
    if (!pairable(a, b, n_rows) || n_rows <= 0) {
        return cuda_matmul_grouped_launches(a, n_rows, scratch) + cuda_matmul_grouped_launches(b, n_rows, scratch);
    }
    return cuda_matmul_grouped_launches(a, n_rows, scratch);
}

namespace {

// The rows of one slice of launch_wgmma for b (0 where b's products do not run there).
int64_t wgmma_slice(const CudaBank &b, int64_t n_rows, const E4m3Scratch &scratch) {
    const ProductParams p = grouped_params(b, nullptr, n_rows, nullptr, nullptr);
    if (b.act != ActRounding::kE4m3x128 || !wgmma_e4m3(p)) return 0;
    const int64_t n_chunks = ceil_div(p.k1, kE4m3Chunk);
    return std::max<int64_t>(0,
                             std::min(scratch.code_bytes / (n_chunks * kE4m3Chunk), scratch.scale_floats / n_chunks));
}

}  // namespace

int64_t cuda_matmul_grouped_launches(const CudaBank &b, int64_t n_rows, const E4m3Scratch &scratch) {
    if (n_rows <= 0) return 0;
    const int64_t slice = wgmma_slice(b, n_rows, scratch);
    return slice < 1 ? 1 : 2 * ceil_div(n_rows, slice);
}

cudaError_t cuda_matmul_grouped_swiglu(const CudaBank &b, float *gate, const float *up, float limit, int64_t n_rows,
                                       const int32_t *offsets, int64_t n_offsets, float *y, const E4m3Scratch &scratch,
                                       cudaStream_t stream) {
    if (!valid_grouped(b, n_rows, offsets, n_offsets) || !(limit >= 0.0f)) return cudaErrorInvalidValue;
    if (n_rows == 0) return cudaSuccess;
    if (gate == nullptr || up == nullptr || y == nullptr) return cudaErrorInvalidValue;
    if (wgmma_slice(b, n_rows, scratch) >= 1) {
        ProductParams p = grouped_params(b, gate, n_rows, offsets, y);
        p.swiglu_up = up;
        p.swiglu_act = gate;
        p.swiglu_limit = limit;
        return launch_wgmma(p, scratch, stream);
    }
    if (const cudaError_t e = swiglu(gate, up, b.cols, n_rows, b.cols, limit, gate, stream); e != cudaSuccess) return e;
    return cuda_matmul_grouped(b, gate, n_rows, offsets, n_offsets, y, scratch, stream);
}

int64_t cuda_matmul_grouped_swiglu_launches(const CudaBank &b, int64_t n_rows, const E4m3Scratch &scratch) {
    if (n_rows <= 0) return 0;
    return wgmma_slice(b, n_rows, scratch) >= 1 ? cuda_matmul_grouped_launches(b, n_rows, scratch)
                                                : 1 + cuda_matmul_grouped_launches(b, n_rows, scratch);
}

}  // namespace memra::cuda
