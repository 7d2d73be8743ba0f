// CUDA row, element-wise and copy ops of the Step-3.5 forward pass in `device` numerics: embedding, the
// RMSNorm family, residual add, RoPE, SwiGLU, the canonical tree combine, the MoE combine and the exact row
// copies. Each launcher reproduces the CPU function named beside it bit for bit (D6): the kernels call the
// same MEMRA_HD scalar code (core/math.h, core/float_formats.h) in the same operation order, and reductions
// follow core/math.h's canonical 16-lane order. Launchers take raw device pointers, sizes and a stream; they
// return cudaErrorInvalidValue for bad arguments (nothing is launched), otherwise the launch status. No
// launcher allocates, synchronises or reads device memory on the host; each is one kernel launch (none when
// there is no work). An index outside its range is never dereferenced: it raises a device error flag.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "core/dtype.h"

namespace memra::cuda {

// Error flags: an `int32_t *error_flag` argument is a device i32 that the kernel sets to 1 when an index it
// reads (token id, position, row number) is out of range; it is never cleared here (the caller zeroes it
// and checks it later, ENGINE.md section 1: a sticky error reported at finish). nullptr: not reported.
// Every op still writes deterministic bits for the bad entries, as each launcher says.

// cpu::embedding_lookup: out[t, :] = table[ids[t], :] widened exactly to f32.
// table: [vocab_size, d_model] kF32 or kBF16 (the dtypes the CPU accepts; others: cudaErrorInvalidValue);
// ids: [n_tokens] i32; out: [n_tokens, d_model] f32. An id outside [0, vocab_size) writes a row of +0 and
// raises the flag (the CPU refuses the whole call instead; every valid row is identical).
cudaError_t embedding(const void *table, DType dtype, int64_t vocab_size, int64_t d_model, const int32_t *ids,
                      int64_t n_tokens, float *out, int32_t *error_flag, cudaStream_t stream);

// Norm weights arrive as the backend stores a VectorId: `w` [d] of w_dtype kF32 or kBF16 (other dtypes:
// cudaErrorInvalidValue), applied as (1 + w), the Step convention (cpu::NormWeight with add_one = true).

// cpu::rms_norm: per row of x [n_rows, d] f32: ss = sum_squares_f32 (16 lanes + fixed tree), mean = ss / d,
// inv = rsqrt_f32(mean + eps), y_i = (x_i * inv) * (1 + w_i). y: [n_rows, d] f32, may equal x (in place),
// otherwise must not overlap it. A block per row up to 8192 wide, a warp per row beyond.
cudaError_t rms_norm(const float *x, int64_t n_rows, int64_t d, DType w_dtype, const void *w, float eps, float *y,
                     cudaStream_t stream);

// cpu::rms_norm_heads: in place, head h of token t = the head_dim floats at x[t * token_stride + h * head_dim],
// each normalised as one rms_norm row of width head_dim with w [head_dim]. token_stride >= n_heads * head_dim.
cudaError_t rms_norm_heads(float *x, int64_t n_tokens, int64_t token_stride, int64_t n_heads, int64_t head_dim,
                           DType w_dtype, const void *w, float eps, cudaStream_t stream);

// One of the two head sets of qk_norm_rope: x [n_tokens, token_stride] f32 (token_stride >= n_heads *
// head_dim), head h of token t at x[t * token_stride + h * head_dim], and its norm weight w [head_dim].
struct QkHeads {
    float *x;
    int64_t token_stride;
    int64_t n_heads;
    DType w_dtype;
    const void *w;
};

// A RoPE table's rows for a step: cos, sin [n_positions, half] f32 device tables, positions [n_tokens] i64; a null
// cos: no rotation.
struct RopeRows {
    const float *cos = nullptr;
    const float *sin = nullptr;
    int64_t n_positions = 0;
    int64_t half = 0;
    const int64_t *positions = nullptr;
};

// rms_norm_heads(q), rms_norm_heads(k), then with a table (rope.cos != nullptr; nullptr: the norms alone)
// rope(q) and rope(k): those launches' bits in one (a warp per head). q and k must not overlap. The table
// and the flag are rope's: a position outside [0, n_positions) leaves that token's heads normalised but not rotated
// and raises the flag.
cudaError_t qk_norm_rope(const QkHeads &q, const QkHeads &k, int64_t n_tokens, int64_t head_dim, float eps,
                         const RopeRows &rope, int32_t *error_flag, cudaStream_t stream);
// Whether qk_norm_rope takes these arguments (also the attention prologue's check of its q, k and table).
bool qk_norm_rope_valid(const QkHeads &q, const QkHeads &k, int64_t n_tokens, int64_t head_dim, const RopeRows &rope);

// cpu::add_rms_norm: h = x + r (one rounded add per element), then y = rms_norm(h). x, r, h, y: [n_rows, d] f32;
// h may equal x or r; y must not overlap h (y == h: cudaErrorInvalidValue); y may equal x or r when h does not.
cudaError_t add_rms_norm(const float *x, const float *r, int64_t n_rows, int64_t d, DType w_dtype, const void *w,
                         float eps, float *h, float *y, cudaStream_t stream);

// cpu::residual_add: out = a + b element-wise. a, b, out: [n_rows, d] f32; out may equal a or b.
cudaError_t residual_add(const float *a, const float *b, int64_t n_rows, int64_t d, float *out, cudaStream_t stream);

// cpu::rope_apply: NeoX rotation in place of dims [0, 2 * half) of every head; dims [2 * half, head_dim) pass
// through. cos_table, sin_table: [n_positions, half] f32 each, exactly cpu::RopeTable's cos and sin (built by
// cpu::rope_table_build and uploaded as is). x: [n_tokens, token_stride] f32, head h of token t at
// x[t * token_stride + h * head_dim]; positions: [n_tokens] i64. With a = x[j], b = x[j + half],
// c = cos[p, j], s = sin[p, j]: x[j] = a * c - b * s, x[j + half] = b * c + a * s (each product rounded).
// A position outside [0, n_positions) leaves that token untouched and raises the flag (the CPU refuses the call).
// Requires 1 <= half, 2 * half <= head_dim, token_stride >= n_heads * head_dim.
cudaError_t rope(const float *cos_table, const float *sin_table, int64_t n_positions, int64_t half, float *x,
                 int64_t n_tokens, int64_t token_stride, int64_t n_heads, int64_t head_dim, const int64_t *positions,
                 int32_t *error_flag, cudaStream_t stream);

// cpu::swiglu: out[t, j] = act * u with g = gate[t * in_stride + j], u = up[t * in_stride + j], act = silu_f32(g);
// with limit > 0 the Step clamp first: act = (act > limit ? limit : act) (upper only; NaN stays NaN) and
// u = (u < -limit ? -limit : (u > limit ? limit : u)). limit 0 = off; < 0 or NaN: cudaErrorInvalidValue.
// out: [n_rows, d_ff] f32, must not overlap gate or up unless it equals gate exactly with in_stride == d_ff.
// in_stride >= d_ff (2 * d_ff: gate and up as the two halves of one fused row).
cudaError_t swiglu(const float *gate, const float *up, int64_t in_stride, int64_t n_rows, int64_t d_ff, float limit,
                   float *out, cudaStream_t stream);

// cpu::canonical_tree_combine: out[i] = the canonical balanced tree over subtree_sums[0..tp)[i]:
// tp 1: p0; 2: p0 + p1; 4: (p0 + p1) + (p2 + p3); 8: ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)).
// subtree_sums: [tp, n] f32 (rank order); out: [n] f32. tp other than 1, 2, 4, 8: cudaErrorInvalidValue.
cudaError_t canonical_combine(const float *subtree_sums, int64_t tp, int64_t n, float *out, cudaStream_t stream);

// cpu::moe_combine: for token t and column j, routed = +0, then for k = 0..top_k-1 (slot order)
// routed = routed + (weights[t, k] * expert_out[src_row[t * top_k + k], j]) (product rounded, then the add);
// out[t, j] = h[t, j] + (routed + shared[t, j]) (shared == nullptr: h[t, j] + routed).
// h, out: [n_tokens, d] f32, out may equal h; expert_out: [expert_rows, d] f32; src_row: [n_tokens * top_k] i32;
// weights: [n_tokens, top_k] f32; shared: [n_tokens, d] f32 or nullptr. A src_row outside [0, expert_rows)
// adds nothing for that slot and raises the flag (the CPU aborts).
cudaError_t moe_combine(const float *h, const float *expert_out, int64_t expert_rows, const int32_t *src_row,
                        const float *weights, const float *shared, int64_t n_tokens, int64_t top_k, int64_t d,
                        float *out, int32_t *error_flag, cudaStream_t stream);

// Exact row copies of any element size (elem_bytes >= 1: f32, i32, bf16, bytes ...); rows are row_elems
// elements, contiguous. The copy unit is the widest of 16, 8, 4, 2, 1 bytes that every row, offset and
// pointer is a multiple of, so the result is a byte-exact copy whatever the alignment.

// CpuBackend::gather_rows: dst[i, :] = src[rows[i], :] for i < n_out. src: [src_rows, row_elems];
// rows: [n_out] i32; dst: [n_out, row_elems] (must not overlap src). A row outside [0, src_rows) writes
// zero bytes and raises the flag (the CPU aborts).
cudaError_t gather_rows(const void *src, int64_t src_rows, const int32_t *rows, int64_t n_out, int64_t row_elems,
                        int64_t elem_bytes, void *dst, int32_t *error_flag, cudaStream_t stream);

// CpuBackend::scatter_rows: dst[rows[i], :] = src[i, :] for every i < n with rows[i] >= 0 (no two rows[i]
// equal: the caller's invariant). src: [n, row_elems]; rows: [n] i32; dst: [dst_rows, row_elems] (must not
// overlap src). rows[i] >= dst_rows is skipped and raises the flag (the CPU aborts).
cudaError_t scatter_rows(const void *src, const int32_t *rows, int64_t n, int64_t row_elems, int64_t elem_bytes,
                         void *dst, int64_t dst_rows, int32_t *error_flag, cudaStream_t stream);

// CpuBackend::scatter_ids: dst[pairs[i, 1]] = tokens[pairs[i, 0]].id for i = 0..n_pairs-1 in order (when two
// pairs name the same dst entry, the later one wins, as the CPU's loop). tokens: n_tokens records of
// token_bytes bytes each whose first member is the i32 id — the SampledToken array (core/sampling.h): pass
// token_bytes = sizeof(SampledToken); tokens must be 4-byte aligned and token_bytes a multiple of 4.
// pairs: [n_pairs, 2] i32; dst: [n_dst] i32. A pair outside the ranges is skipped and raises the flag.
// Each pair scans the later pairs for its entry (O(n_pairs^2) reads): sized for a step's draft ids.
cudaError_t scatter_ids(const void *tokens, int64_t n_tokens, int64_t token_bytes, const int32_t *pairs,
                        int64_t n_pairs, int32_t *dst, int64_t n_dst, int32_t *error_flag, cudaStream_t stream);

// CpuBackend::concat_cols: out[t] = [a[t] | b[t]]. a: [n_rows, da]; b: [n_rows, db]; out: [n_rows, da + db]
// (must not overlap a or b); da, db >= 0 elements of elem_bytes each.
cudaError_t concat_cols(const void *a, int64_t da, const void *b, int64_t db, int64_t n_rows, int64_t elem_bytes,
                        void *out, cudaStream_t stream);

// CpuBackend::join_col_shards: out[t, s * width + j] = shards[s, t, j]. shards: [n_shards, n_rows, width];
// out: [n_rows, n_shards * width] (must not overlap shards).
cudaError_t join_col_shards(const void *shards, int64_t n_shards, int64_t n_rows, int64_t width, int64_t elem_bytes,
                            void *out, cudaStream_t stream);

}  // namespace memra::cuda
