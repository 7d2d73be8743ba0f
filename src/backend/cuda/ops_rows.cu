// Row, element-wise and copy kernels (ops_rows.h). Element-wise kernels run one thread per output element
// in a grid-stride loop and call the shared MEMRA_HD scalar code; the norms run one warp per row, whose 16
// canonical lane partials and butterfly tree are core/math.h's sum_squares_f32 exactly; the copies move
// whole aligned units (16/8/4/2/1 bytes), never converting a value, so every bit pattern survives.
#include "backend/cuda/ops_rows.h"

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include <cuda_runtime.h>

#include "backend/cuda/launch.cuh"
#include "backend/cuda/norm_rope.cuh"
#include "backend/cuda/ptx.cuh"
#include "core/float_formats.h"
#include "core/math.h"

namespace memra::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;  // grid-stride loops cover anything larger
constexpr int kWarp = 32;
constexpr int kRowsPerBlock = kThreads / kWarp;  // norm kernels: one warp per row

int64_t grid_for(int64_t n, int64_t per_block) {
    const int64_t blocks = (n + per_block - 1) / per_block;
    return blocks < kMaxBlocks ? blocks : kMaxBlocks;
}

unsigned grid_elems(int64_t n) { return static_cast<unsigned>(grid_for(n, kThreads)); }
unsigned grid_rows(int64_t n) { return static_cast<unsigned>(grid_for(n, kRowsPerBlock)); }

__device__ int64_t first_index() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }

__device__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// Sets the caller's sticky error flag (ops_rows.h); many threads may set it, all to 1.
__device__ void raise_flag(int32_t *flag) {
    if (flag != nullptr) atomicExch(flag, 1);
}

// ---- Embedding ----------------------------------------------------------------------------------------

// gtable: [vocab, d] f32 or bf16; gids: [n] i32; gout: [n, d] f32.
__global__ void embedding_kernel(const void *gtable, bool bf16, int64_t vocab, int64_t d, const int32_t *gids,
                                 int64_t n, float *gout, int32_t *flag) {
    pdl_enter();
    const int64_t total = n * d;
    for (int64_t i = first_index(); i < total; i += grid_stride()) {
        const int64_t t = i / d;
        const int64_t j = i - t * d;
        const int64_t id = gids[t];
        if (id < 0 || id >= vocab) {
            gout[i] = 0.0f;
            if (j == 0) raise_flag(flag);
            continue;
        }
        gout[i] = bf16 ? bf16_to_f32(static_cast<const uint16_t *>(gtable)[id * d + j])
                       : static_cast<const float *>(gtable)[id * d + j];
    }
}

// ---- RMSNorm family -------------------------------------------------------------------------------------

using norm_rope::HeadRows;
using norm_rope::load_weight;
using norm_rope::norm_inv;
using norm_rope::rope_pair;
using norm_rope::warp_norm_row;
using norm_rope::warp_sum_squares;

// Normalises n_items rows of d floats, item i at offset (i / per_token) * token_stride + (i % per_token) * d
// of gx and gy (rms_norm: per_token 1, token_stride d; rms_norm_heads: per_token n_heads, gy == gx).
// The row loop is warp-uniform, so the shuffles always see the full warp.
__global__ void rms_norm_kernel(const float *gx, float *gy, int64_t n_items, int64_t per_token, int64_t token_stride,
                                int64_t d, const void *gw, bool w_bf16, float eps) {
    pdl_enter();
    const int64_t warp = threadIdx.x / kWarp;
    for (int64_t item = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp; item < n_items;
         item += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
        const int64_t off = (item / per_token) * token_stride + (item % per_token) * d;
        warp_norm_row(gx + off, d, gw, w_bf16, eps, gy + off);
    }
}

// cpu::add_rms_norm row by row: the warp first writes h = x + r (h may be x or r: each element is read and
// written by one thread), __syncwarp publishes h to the whole warp, then h is normalised into y.
// gx, gr, gh, gy: [n_rows, d] f32.
__global__ void add_rms_norm_kernel(const float *gx, const float *gr, int64_t n_rows, int64_t d, const void *gw,
                                    bool w_bf16, float eps, float *gh, float *gy) {
    pdl_enter();
    const int64_t warp = threadIdx.x / kWarp;
    for (int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp; row < n_rows;
         row += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
        const int64_t off = row * d;
        for (int64_t i = threadIdx.x % kWarp; i < d; i += kWarp) gh[off + i] = gx[off + i] + gr[off + i];
        __syncwarp();
        warp_norm_row(gh + off, d, gw, w_bf16, eps, gy + off);
    }
}

// Rows of up to kBlockNormMax floats, one block each (rms_norm and add_rms_norm; a warp per row waits on its
// reduction's loads one after another): the block holds the row, or h = x + r (written to gh), in registers
// (kNormPer values a thread) and in shared memory, the first warp runs warp_sum_squares from there (the same
// lanes and tree), and the block writes y. Each pass issues all of its loads before its first store, so a row
// waits on three memory latencies (the weights' from the L2), not one per element (gh may be x or r and y may be x, so
// the compiler could not hoist a load above an earlier store on its own). Every element is read before it is written.
constexpr int64_t kBlockNormMax = 8192;  // 32 KiB of staged row (the static smem beside it stays under 48 KiB)
constexpr int kNormPer = static_cast<int>(kBlockNormMax / kThreads);

__global__ void __launch_bounds__(kThreads) block_norm_kernel(const float *gx, const float *gr, int64_t n_rows,
                                                              int64_t d, const void *gw, bool w_bf16, float eps,
                                                              float *gh, float *gy) {
    prefetch_l2_span(gw, d * (w_bf16 ? 2 : 4), threadIdx.x, kThreads);
    pdl_enter();
    extern __shared__ float s_row[];  // [d]
    __shared__ float s_inv;
    const auto elem = [&](int k) { return static_cast<int64_t>(threadIdx.x) + int64_t{k} * kThreads; };
    for (int64_t row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const int64_t off = row * d;
        float v[kNormPer];
#pragma unroll
        for (int k = 0; k < kNormPer; ++k) v[k] = elem(k) < d ? gx[off + elem(k)] : 0.0f;
        if (gr != nullptr) {
            float r[kNormPer];
#pragma unroll
            for (int k = 0; k < kNormPer; ++k) r[k] = elem(k) < d ? gr[off + elem(k)] : 0.0f;
#pragma unroll
            for (int k = 0; k < kNormPer; ++k) {
                v[k] = v[k] + r[k];
                if (elem(k) < d) gh[off + elem(k)] = v[k];
            }
        }
#pragma unroll
        for (int k = 0; k < kNormPer; ++k) {
            if (elem(k) < d) s_row[elem(k)] = v[k];
        }
        __syncthreads();
        if (threadIdx.x < kWarp) {
            const float inv = norm_inv(warp_sum_squares(s_row, d), d, eps);
            if (threadIdx.x == 0) s_inv = inv;
        }
        __syncthreads();
        const float inv = s_inv;
        float factor[kNormPer];
#pragma unroll
        for (int k = 0; k < kNormPer; ++k) factor[k] = elem(k) < d ? 1.0f + load_weight(gw, w_bf16, elem(k)) : 0.0f;
#pragma unroll
        for (int k = 0; k < kNormPer; ++k) {
            if (elem(k) < d) gy[off + elem(k)] = (v[k] * inv) * factor[k];
        }
        __syncthreads();  // s_row and s_inv are rewritten for the next row
    }
}

unsigned grid_blocks(int64_t n) { return static_cast<unsigned>(n < kMaxBlocks ? n : kMaxBlocks); }

size_t block_norm_smem(int64_t d) { return static_cast<size_t>(d) * sizeof(float); }

// ---- Element-wise -------------------------------------------------------------------------------------

__global__ void residual_add_kernel(const float *ga, const float *gb, int64_t n, float *gout) {
    pdl_enter();
    for (int64_t i = first_index(); i < n; i += grid_stride()) gout[i] = ga[i] + gb[i];
}

// gx: [n_tokens, token_stride]; gcos, gsin: [n_positions, half]; gpos: [n_tokens] i64. One thread per
// (token, head, j < half) rotates the pair (j, j + half); pairs are disjoint, so no two threads meet.
__global__ void rope_kernel(const float *gcos, const float *gsin, int64_t n_positions, int64_t half, float *gx,
                            int64_t n_tokens, int64_t token_stride, int64_t n_heads, int64_t head_dim,
                            const int64_t *gpos, int32_t *flag) {
    pdl_enter();
    const int64_t total = n_tokens * n_heads * half;
    for (int64_t i = first_index(); i < total; i += grid_stride()) {
        const int64_t j = i % half;
        const int64_t th = i / half;
        const int64_t h = th % n_heads;
        const int64_t t = th / n_heads;
        const int64_t p = gpos[t];
        if (p < 0 || p >= n_positions) {
            if (h == 0 && j == 0) raise_flag(flag);
            continue;
        }
        rope_pair(gx + t * token_stride + h * head_dim, j, half, gcos + p * half, gsin + p * half);
    }
}

// The heads of q and k of one step (qk_norm_rope): x rows of token_stride floats, n_heads heads each, norm
// weights w.

// rms_norm_heads of q's heads and k's, then (gcos != nullptr) rope_kernel's rotation of each, one warp per head
// (token t's q heads, then its k heads): warp_norm_row in place, __syncwarp to publish the normed head to the
// warp, then the head's pairs. Every branch is warp-uniform.
__global__ void qk_norm_rope_kernel(HeadRows q, HeadRows k, int64_t n_tokens, int64_t head_dim, float eps,
                                    const RopeRows rope, int32_t *flag) {
    pdl_enter();
    const int64_t per_token = q.n_heads + k.n_heads;
    const int64_t warp = threadIdx.x / kWarp;
    const int64_t lane = threadIdx.x % kWarp;
    for (int64_t item = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp; item < n_tokens * per_token;
         item += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
        const int64_t t = item / per_token;
        const int64_t h = item % per_token;
        const HeadRows &r = h < q.n_heads ? q : k;
        float *row = r.x + t * r.token_stride + (h < q.n_heads ? h : h - q.n_heads) * head_dim;
        const int64_t p = rope.cos != nullptr ? rope.positions[t] : 0;
        if (!norm_rope::warp_norm_rope(row, head_dim, r.w, r.w_bf16, eps, rope.cos, rope.sin, rope.n_positions,
                                       rope.half, p) &&
            h == 0 && lane == 0) {
            raise_flag(flag);
        }
    }
}

// ggate, gup: [n_rows, in_stride]; gout: [n_rows, d_ff]. swiglu_f32's selects survive: no fast-math here.
__global__ void swiglu_kernel(const float *ggate, const float *gup, int64_t in_stride, int64_t n_rows, int64_t d_ff,
                              float limit, float *gout) {
    pdl_enter();
    const int64_t total = n_rows * d_ff;
    for (int64_t i = first_index(); i < total; i += grid_stride()) {
        const int64_t t = i / d_ff;
        const int64_t j = i - t * d_ff;
        gout[i] = swiglu_f32(ggate[t * in_stride + j], gup[t * in_stride + j], limit);
    }
}

// gsums: [tp, n]; gout: [n]: cpu balanced_tree (matmul.cpp) per element.
__global__ void canonical_combine_kernel(const float *gsums, int tp, int64_t n, float *gout) {
    pdl_enter();
    for (int64_t i = first_index(); i < n; i += grid_stride()) {
        const float *p = gsums + i;
        float s;
        switch (tp) {
            case 1: s = p[0]; break;
            case 2: s = p[0] + p[n]; break;
            case 4: s = (p[0] + p[n]) + (p[2 * n] + p[3 * n]); break;
            default:
                s = ((p[0] + p[n]) + (p[2 * n] + p[3 * n])) + ((p[4 * n] + p[5 * n]) + (p[6 * n] + p[7 * n]));
                break;
        }
        gout[i] = s;
    }
}

// gh, gout: [n_tokens, d]; gexp: [expert_rows, d]; gsrc: [n_tokens * top_k]; gw: [n_tokens, top_k];
// gshared: [n_tokens, d] or nullptr. cpu::moe_combine's order per element. The slots go kCombineSlots at a time:
// their sources and weights, then their expert values, are loaded together before the adds (a slot's value
// load waits on its source row, so slot by slot every add would wait on two memory latencies).
constexpr int kCombineSlots = 8;

__global__ void moe_combine_kernel(const float *gh, const float *gexp, int64_t expert_rows, const int32_t *gsrc,
                                   const float *gw, const float *gshared, int64_t n_tokens, int64_t top_k, int64_t d,
                                   float *gout, int32_t *flag) {
    pdl_enter();
    const int64_t total = n_tokens * d;
    for (int64_t i = first_index(); i < total; i += grid_stride()) {
        const int64_t t = i / d;
        const int64_t j = i - t * d;
        const float h = gh[i];
        const float shared = gshared != nullptr ? gshared[i] : 0.0f;
        float routed = 0.0f;
        for (int64_t k0 = 0; k0 < top_k; k0 += kCombineSlots) {
            int64_t src[kCombineSlots];
            float w[kCombineSlots], e[kCombineSlots];
#pragma unroll
            for (int k = 0; k < kCombineSlots; ++k) {
                const bool slot = k0 + k < top_k;
                src[k] = slot ? gsrc[t * top_k + k0 + k] : -1;
                w[k] = slot ? gw[t * top_k + k0 + k] : 0.0f;
            }
#pragma unroll
            for (int k = 0; k < kCombineSlots; ++k) {
                e[k] = src[k] >= 0 && src[k] < expert_rows ? gexp[src[k] * d + j] : 0.0f;
            }
#pragma unroll
            for (int k = 0; k < kCombineSlots; ++k) {
                if (k0 + k >= top_k) break;
                if (src[k] < 0 || src[k] >= expert_rows) {
                    if (j == 0) raise_flag(flag);
                    continue;
                }
                routed = routed + w[k] * e[k];
            }
        }
        const float ffn = gshared != nullptr ? routed + shared : routed;
        gout[i] = h + ffn;
    }
}

// ---- Exact copies ---------------------------------------------------------------------------------------

// Row lengths below are in units of Unit (uint4, uint2, uint32_t, uint16_t or uint8_t).

// gdst[i, :] = gsrc[grows[i], :]; a bad row gives zero bytes.
template <class Unit>
__global__ void gather_rows_kernel(const Unit *gsrc, int64_t src_rows, const int32_t *grows, int64_t n_out,
                                   int64_t row_units, Unit *gdst, int32_t *flag) {
    pdl_enter();
    const int64_t total = n_out * row_units;
    for (int64_t i = first_index(); i < total; i += grid_stride()) {
        const int64_t r = i / row_units;
        const int64_t u = i - r * row_units;
        const int64_t s = grows[r];
        if (s < 0 || s >= src_rows) {
            gdst[i] = Unit{};
            if (u == 0) raise_flag(flag);
            continue;
        }
        gdst[i] = gsrc[s * row_units + u];
    }
}

// gdst[grows[i], :] = gsrc[i, :] for grows[i] >= 0.
template <class Unit>
__global__ void scatter_rows_kernel(const Unit *gsrc, const int32_t *grows, int64_t n, int64_t row_units, Unit *gdst,
                                    int64_t dst_rows, int32_t *flag) {
    pdl_enter();
    const int64_t total = n * row_units;
    for (int64_t i = first_index(); i < total; i += grid_stride()) {
        const int64_t r = i / row_units;
        const int64_t u = i - r * row_units;
        const int64_t d = grows[r];
        if (d < 0) continue;
        if (d >= dst_rows) {
            if (u == 0) raise_flag(flag);
            continue;
        }
        gdst[d * row_units + u] = gsrc[i];
    }
}

// gout[t] = [ga[t] | gb[t]]: a row of gout is ua + ub units.
template <class Unit>
__global__ void concat_cols_kernel(const Unit *ga, int64_t ua, const Unit *gb, int64_t ub, int64_t n_rows,
                                   Unit *gout) {
    pdl_enter();
    const int64_t row_units = ua + ub;
    const int64_t total = n_rows * row_units;
    for (int64_t i = first_index(); i < total; i += grid_stride()) {
        const int64_t t = i / row_units;
        const int64_t c = i - t * row_units;
        gout[i] = c < ua ? ga[t * ua + c] : gb[t * ub + (c - ua)];
    }
}

// gout[t, s * wu + j] = gshards[s, t, j]: a row of gout is n_shards * wu units.
template <class Unit>
__global__ void join_col_shards_kernel(const Unit *gshards, int64_t n_shards, int64_t n_rows, int64_t wu,
                                       Unit *gout) {
    pdl_enter();
    const int64_t row_units = n_shards * wu;
    const int64_t total = n_rows * row_units;
    for (int64_t i = first_index(); i < total; i += grid_stride()) {
        const int64_t t = i / row_units;
        const int64_t c = i - t * row_units;
        const int64_t s = c / wu;
        const int64_t j = c - s * wu;
        gout[i] = gshards[(s * n_rows + t) * wu + j];
    }
}

// Pair i writes unless a later valid pair names the same entry (the CPU's sequential loop: the last one
// wins). gtokens: n_tokens records of token_bytes, the i32 id first; gpairs: [n_pairs, 2]; gdst: [n_dst].
__global__ void scatter_ids_kernel(const unsigned char *gtokens, int64_t n_tokens, int64_t token_bytes,
                                   const int32_t *gpairs, int64_t n_pairs, int32_t *gdst, int64_t n_dst,
                                   int32_t *flag) {
    pdl_enter();
    for (int64_t i = first_index(); i < n_pairs; i += grid_stride()) {
        const int64_t src = gpairs[2 * i];
        const int64_t dst = gpairs[2 * i + 1];
        if (src < 0 || src >= n_tokens || dst < 0 || dst >= n_dst) {
            raise_flag(flag);
            continue;
        }
        bool overwritten = false;
        for (int64_t k = i + 1; k < n_pairs && !overwritten; ++k) {
            const int64_t src_k = gpairs[2 * k];
            overwritten = gpairs[2 * k + 1] == dst && src_k >= 0 && src_k < n_tokens;
        }
        if (!overwritten) gdst[dst] = *reinterpret_cast<const int32_t *>(gtokens + src * token_bytes);
    }
}

// ---- Launch helpers -------------------------------------------------------------------------------------

// A negative count, or a null pointer where there is work.
bool bad_ptrs(int64_t work, std::initializer_list<const void *> ptrs) {
    if (work < 0) return true;
    if (work == 0) return false;
    for (const void *p : ptrs) {
        if (p == nullptr) return true;
    }
    return false;
}

bool norm_dtype_ok(DType t) { return t == DType::kF32 || t == DType::kBF16; }

// The widest copy unit (16, 8, 4, 2 or 1 bytes) dividing every byte length and address given.
int64_t copy_unit(std::initializer_list<int64_t> lengths, std::initializer_list<const void *> ptrs) {
    int64_t unit = 16;
    const auto fits = [&](int64_t u) {
        for (int64_t len : lengths) {
            if (len % u != 0) return false;
        }
        for (const void *p : ptrs) {
            if (reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(u) != 0) return false;
        }
        return true;
    };
    while (unit > 1 && !fits(unit)) unit /= 2;
    return unit;
}

// Calls fn(Unit{}) with the unsigned type of `unit` bytes: the one runtime-to-template dispatch of the copies.
template <class Fn>
void with_unit(int64_t unit, const Fn &fn) {
    switch (unit) {
        case 16: fn(uint4{}); break;
        case 8: fn(uint2{}); break;
        case 4: fn(uint32_t{}); break;
        case 2: fn(uint16_t{}); break;
        default: fn(uint8_t{}); break;
    }
}

cudaError_t launch_status() { return cudaGetLastError(); }

}  // namespace

cudaError_t embedding(const void *table, DType dtype, int64_t vocab_size, int64_t d_model, const int32_t *ids,
                      int64_t n_tokens, float *out, int32_t *error_flag, cudaStream_t stream) {
    if (dtype != DType::kF32 && dtype != DType::kBF16) return cudaErrorInvalidValue;
    if (vocab_size <= 0 || d_model <= 0 || table == nullptr || bad_ptrs(n_tokens, {ids, out})) {
        return cudaErrorInvalidValue;
    }
    if (n_tokens == 0) return cudaSuccess;
    launch_kernel(embedding_kernel, grid_elems(n_tokens * d_model), kThreads, 0, stream, table, dtype == DType::kBF16,
                  vocab_size, d_model, ids, n_tokens, out, error_flag);
    return launch_status();
}

cudaError_t rms_norm(const float *x, int64_t n_rows, int64_t d, DType w_dtype, const void *w, float eps, float *y,
                     cudaStream_t stream) {
    if (d <= 0 || !norm_dtype_ok(w_dtype) || bad_ptrs(n_rows, {x, w, y})) return cudaErrorInvalidValue;
    if (n_rows == 0) return cudaSuccess;
    if (d <= kBlockNormMax) {
        launch_kernel(block_norm_kernel, grid_blocks(n_rows), kThreads, block_norm_smem(d), stream, x, nullptr, n_rows,
                      d, w, w_dtype == DType::kBF16, eps, nullptr, y);
    } else {
        launch_kernel(rms_norm_kernel, grid_rows(n_rows), kThreads, 0, stream, x, y, n_rows, 1, d, d, w,
                      w_dtype == DType::kBF16, eps);
    }
    return launch_status();
}

cudaError_t rms_norm_heads(float *x, int64_t n_tokens, int64_t token_stride, int64_t n_heads, int64_t head_dim,
                           DType w_dtype, const void *w, float eps, cudaStream_t stream) {
    if (n_heads <= 0 || head_dim <= 0 || token_stride < n_heads * head_dim || !norm_dtype_ok(w_dtype) ||
        bad_ptrs(n_tokens, {x, w})) {
        return cudaErrorInvalidValue;
    }
    if (n_tokens == 0) return cudaSuccess;
    const int64_t n_items = n_tokens * n_heads;
    launch_kernel(rms_norm_kernel, grid_rows(n_items), kThreads, 0, stream, x, x, n_items, n_heads, token_stride,
                  head_dim, w, w_dtype == DType::kBF16, eps);
    return launch_status();
}

bool qk_norm_rope_valid(const QkHeads &q, const QkHeads &k, int64_t n_tokens, int64_t head_dim, const RopeRows &rope) {
    for (const QkHeads *h : {&q, &k}) {
        if (h->n_heads < 1 || h->token_stride < h->n_heads * head_dim || !norm_dtype_ok(h->w_dtype) ||
            bad_ptrs(n_tokens, {h->x, h->w})) {
            return false;
        }
    }
    return n_tokens >= 0 && head_dim >= 1 &&
           (rope.cos == nullptr || (rope.n_positions >= 1 && rope.half >= 1 && 2 * rope.half <= head_dim &&
                                    rope.sin != nullptr && !bad_ptrs(n_tokens, {rope.positions})));
}

cudaError_t qk_norm_rope(const QkHeads &q, const QkHeads &k, int64_t n_tokens, int64_t head_dim, float eps,
                         const RopeRows &rope, int32_t *error_flag, cudaStream_t stream) {
    if (!qk_norm_rope_valid(q, k, n_tokens, head_dim, rope)) return cudaErrorInvalidValue;
    if (n_tokens == 0) return cudaSuccess;
    const HeadRows hq{q.x, q.token_stride, q.n_heads, q.w, q.w_dtype == DType::kBF16};
    const HeadRows hk{k.x, k.token_stride, k.n_heads, k.w, k.w_dtype == DType::kBF16};
    launch_kernel(qk_norm_rope_kernel, grid_rows(n_tokens * (q.n_heads + k.n_heads)), kThreads, 0, stream, hq, hk,
                  n_tokens, head_dim, eps, rope, error_flag);
    return launch_status();
}

cudaError_t add_rms_norm(const float *x, const float *r, int64_t n_rows, int64_t d, DType w_dtype, const void *w,
                         float eps, float *h, float *y, cudaStream_t stream) {
    if (d <= 0 || !norm_dtype_ok(w_dtype) || bad_ptrs(n_rows, {x, r, w, h, y})) return cudaErrorInvalidValue;
    if (n_rows > 0 && h == y) return cudaErrorInvalidValue;
    if (n_rows == 0) return cudaSuccess;
    if (d <= kBlockNormMax) {
        launch_kernel(block_norm_kernel, grid_blocks(n_rows), kThreads, block_norm_smem(d), stream, x, r, n_rows, d, w,
                      w_dtype == DType::kBF16, eps, h, y);
    } else {
        launch_kernel(add_rms_norm_kernel, grid_rows(n_rows), kThreads, 0, stream, x, r, n_rows, d, w,
                      w_dtype == DType::kBF16, eps, h, y);
    }
    return launch_status();
}

cudaError_t residual_add(const float *a, const float *b, int64_t n_rows, int64_t d, float *out, cudaStream_t stream) {
    if (d <= 0 || bad_ptrs(n_rows, {a, b, out})) return cudaErrorInvalidValue;
    if (n_rows == 0) return cudaSuccess;
    launch_kernel(residual_add_kernel, grid_elems(n_rows * d), kThreads, 0, stream, a, b, n_rows * d, out);
    return launch_status();
}

cudaError_t rope(const float *cos_table, const float *sin_table, int64_t n_positions, int64_t half, float *x,
                 int64_t n_tokens, int64_t token_stride, int64_t n_heads, int64_t head_dim, const int64_t *positions,
                 int32_t *error_flag, cudaStream_t stream) {
    if (n_positions < 1 || half < 1 || n_heads < 1 || 2 * half > head_dim || token_stride < n_heads * head_dim ||
        cos_table == nullptr || sin_table == nullptr || bad_ptrs(n_tokens, {x, positions})) {
        return cudaErrorInvalidValue;
    }
    if (n_tokens == 0) return cudaSuccess;
    launch_kernel(rope_kernel, grid_elems(n_tokens * n_heads * half), kThreads, 0, stream, cos_table, sin_table,
                  n_positions, half, x, n_tokens, token_stride, n_heads, head_dim, positions, error_flag);
    return launch_status();
}

cudaError_t swiglu(const float *gate, const float *up, int64_t in_stride, int64_t n_rows, int64_t d_ff, float limit,
                   float *out, cudaStream_t stream) {
    if (d_ff <= 0 || in_stride < d_ff || !(limit >= 0.0f) || bad_ptrs(n_rows, {gate, up, out})) {
        return cudaErrorInvalidValue;
    }
    if (n_rows == 0) return cudaSuccess;
    launch_kernel(swiglu_kernel, grid_elems(n_rows * d_ff), kThreads, 0, stream, gate, up, in_stride, n_rows, d_ff,
                  limit, out);
    return launch_status();
}

cudaError_t canonical_combine(const float *subtree_sums, int64_t tp, int64_t n, float *out, cudaStream_t stream) {
    if (!(tp == 1 || tp == 2 || tp == 4 || tp == 8) || bad_ptrs(n, {subtree_sums, out})) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    launch_kernel(canonical_combine_kernel, grid_elems(n), kThreads, 0, stream, subtree_sums, static_cast<int>(tp), n,
                  out);
    return launch_status();
}

cudaError_t moe_combine(const float *h, const float *expert_out, int64_t expert_rows, const int32_t *src_row,
                        const float *weights, const float *shared, int64_t n_tokens, int64_t top_k, int64_t d,
                        float *out, int32_t *error_flag, cudaStream_t stream) {
    if (top_k < 1 || d <= 0 || expert_rows < 0 || bad_ptrs(n_tokens, {h, src_row, weights, out})) {
        return cudaErrorInvalidValue;
    }
    if (n_tokens > 0 && expert_rows > 0 && expert_out == nullptr) return cudaErrorInvalidValue;
    if (n_tokens == 0) return cudaSuccess;
    launch_kernel(moe_combine_kernel, grid_elems(n_tokens * d), kThreads, 0, stream, h, expert_out, expert_rows,
                  src_row, weights, shared, n_tokens, top_k, d, out, error_flag);
    return launch_status();
}

cudaError_t gather_rows(const void *src, int64_t src_rows, const int32_t *rows, int64_t n_out, int64_t row_elems,
                        int64_t elem_bytes, void *dst, int32_t *error_flag, cudaStream_t stream) {
    if (elem_bytes < 1 || row_elems < 0 || src_rows < 0 || bad_ptrs(n_out, {rows, dst})) return cudaErrorInvalidValue;
    if (n_out > 0 && src_rows > 0 && src == nullptr) return cudaErrorInvalidValue;
    const int64_t row_bytes = row_elems * elem_bytes;
    if (n_out == 0 || row_bytes == 0) return cudaSuccess;
    const int64_t unit = copy_unit({row_bytes}, {src, dst});
    const int64_t row_units = row_bytes / unit;
    with_unit(unit, [&](auto tag) {
        using Unit = decltype(tag);
        launch_kernel(gather_rows_kernel<Unit>, grid_elems(n_out * row_units), kThreads, 0, stream,
                      static_cast<const Unit *>(src), src_rows, rows, n_out, row_units, static_cast<Unit *>(dst),
                      error_flag);
    });
    return launch_status();
}

cudaError_t scatter_rows(const void *src, const int32_t *rows, int64_t n, int64_t row_elems, int64_t elem_bytes,
                         void *dst, int64_t dst_rows, int32_t *error_flag, cudaStream_t stream) {
    if (elem_bytes < 1 || row_elems < 0 || dst_rows < 0 || bad_ptrs(n, {src, rows})) return cudaErrorInvalidValue;
    if (n > 0 && dst_rows > 0 && dst == nullptr) return cudaErrorInvalidValue;
    const int64_t row_bytes = row_elems * elem_bytes;
    if (n == 0 || row_bytes == 0) return cudaSuccess;
    const int64_t unit = copy_unit({row_bytes}, {src, dst});
    const int64_t row_units = row_bytes / unit;
    with_unit(unit, [&](auto tag) {
        using Unit = decltype(tag);
        launch_kernel(scatter_rows_kernel<Unit>, grid_elems(n * row_units), kThreads, 0, stream,
                      static_cast<const Unit *>(src), rows, n, row_units, static_cast<Unit *>(dst), dst_rows,
                      error_flag);
    });
    return launch_status();
}

cudaError_t scatter_ids(const void *tokens, int64_t n_tokens, int64_t token_bytes, const int32_t *pairs,
                        int64_t n_pairs, int32_t *dst, int64_t n_dst, int32_t *error_flag, cudaStream_t stream) {
    if (n_tokens < 0 || n_dst < 0 || token_bytes < 4 || token_bytes % 4 != 0 || bad_ptrs(n_pairs, {pairs})) {
        return cudaErrorInvalidValue;
    }
    if (reinterpret_cast<uintptr_t>(tokens) % 4 != 0) return cudaErrorInvalidValue;
    if (n_pairs > 0 && ((n_tokens > 0 && tokens == nullptr) || (n_dst > 0 && dst == nullptr))) {
        return cudaErrorInvalidValue;
    }
    if (n_pairs == 0) return cudaSuccess;
    launch_kernel(scatter_ids_kernel, grid_elems(n_pairs), kThreads, 0, stream,
                  static_cast<const unsigned char *>(tokens), n_tokens, token_bytes, pairs, n_pairs, dst, n_dst,
                  error_flag);
    return launch_status();
}

cudaError_t concat_cols(const void *a, int64_t da, const void *b, int64_t db, int64_t n_rows, int64_t elem_bytes,
                        void *out, cudaStream_t stream) {
    if (elem_bytes < 1 || da < 0 || db < 0 || bad_ptrs(n_rows, {out})) return cudaErrorInvalidValue;
    if (n_rows > 0 && ((da > 0 && a == nullptr) || (db > 0 && b == nullptr))) return cudaErrorInvalidValue;
    const int64_t a_bytes = da * elem_bytes;
    const int64_t b_bytes = db * elem_bytes;
    if (n_rows == 0 || a_bytes + b_bytes == 0) return cudaSuccess;
    const int64_t unit = copy_unit({a_bytes, b_bytes}, {a, b, out});
    const int64_t ua = a_bytes / unit;
    const int64_t ub = b_bytes / unit;
    with_unit(unit, [&](auto tag) {
        using Unit = decltype(tag);
        launch_kernel(concat_cols_kernel<Unit>, grid_elems(n_rows * (ua + ub)), kThreads, 0, stream,
                      static_cast<const Unit *>(a), ua, static_cast<const Unit *>(b), ub, n_rows,
                      static_cast<Unit *>(out));
    });
    return launch_status();
}

cudaError_t join_col_shards(const void *shards, int64_t n_shards, int64_t n_rows, int64_t width, int64_t elem_bytes,
                            void *out, cudaStream_t stream) {
    if (elem_bytes < 1 || n_shards < 0 || width < 0 || bad_ptrs(n_rows, {shards, out})) return cudaErrorInvalidValue;
    const int64_t piece = width * elem_bytes;
    if (n_rows == 0 || n_shards == 0 || piece == 0) return cudaSuccess;
    const int64_t unit = copy_unit({piece}, {shards, out});
    const int64_t wu = piece / unit;
    with_unit(unit, [&](auto tag) {
        using Unit = decltype(tag);
        launch_kernel(join_col_shards_kernel<Unit>, grid_elems(n_rows * n_shards * wu), kThreads, 0, stream,
                      static_cast<const Unit *>(shards), n_shards, n_rows, wu, static_cast<Unit *>(out));
    });
    return launch_status();
}

}  // namespace memra::cuda
