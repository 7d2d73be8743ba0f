// CPU row and element-wise ops of the Step-3.5 forward pass: embedding lookup, residual add, SwiGLU with
// the Step clamp (STEP35.md 4.4, 4.5 item 5) and the per-head sigmoid output gate (4.3 item 6). Each
// output element depends only on its own row; the order of operations written here defines the op (D6).
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "core/dtype.h"
#include "core/result.h"
#include "core/thread_pool.h"

namespace memra::cpu {

// embedding_lookup: out[t, :] = table[ids[t], :] widened exactly to f32.
// table: [vocab_size, d_model] kF32 or kBF16; ids: [n_tokens]; out: [n_tokens, d_model] f32.
// Errors (nothing is written): a dtype other than F32/BF16, an id outside [0, vocab_size).
Result<void> embedding_lookup(ThreadPool &pool, const void *table, DType dtype, int64_t vocab_size, int64_t d_model,
                              const int32_t *ids, int64_t n_tokens, float *out);

// residual_add: out = a + b, one rounded fp32 add per element. a, b, out: [n_rows, d] f32; out may equal a or b.
void residual_add(ThreadPool &pool, const float *a, const float *b, int64_t n_rows, int64_t d, float *out);

// round_rows: x <- x rounded in place, row by row (RowRounding, backend/backend.h). kBf16: f32_to_bf16 then
// back (round to nearest even). kQ8: each block of 32 along a row through GGML's reference q8_0
// (quantize_row_q8_0: d = amax / 127, codes roundf(x / d), d kept as f16) and back (code * f16 d).
// x: [n_rows, d] f32; d % 32 == 0 for kQ8 (a checked invariant).
void round_rows(ThreadPool &pool, float *x, int64_t n_rows, int64_t d, RowRounding r);

// swiglu: for each row t and column j, with g = gate[t * in_stride + j], u = up[t * in_stride + j]:
//   act = silu_f32(g)                                   (= g * sigmoid_f32(g), core/math.h)
//   if limit > 0: act = (act > limit) ? limit : act     (upper clamp of silu's output only; NaN stays NaN)
//                 u = (u < -limit) ? -limit : ((u > limit) ? limit : u)
//   out[t * d_ff + j] = act * u
// gate and up may be two halves of one fused row (in_stride = 2 * d_ff) or separate arrays
// (in_stride = d_ff). out: [n_rows, d_ff] f32, must not overlap gate or up unless it equals gate exactly
// with in_stride == d_ff.
void swiglu(ThreadPool &pool, const float *gate, const float *up, int64_t in_stride, int64_t n_rows, int64_t d_ff,
            float limit, float *out);

// head_gate: x[t, h, :] = x[t, h, :] * sigmoid_f32(gate_logits[t * gate_stride + h]) (one scalar per head,
// one rounded multiply per element). x: [n_tokens, n_heads, head_dim] f32, in place; gate_logits holds the
// raw g = a . W_g^T values (the sigmoid is applied here).
void head_gate(ThreadPool &pool, float *x, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
               const float *gate_logits, int64_t gate_stride);

}  // namespace memra::cpu
