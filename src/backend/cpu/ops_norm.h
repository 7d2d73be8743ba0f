// CPU RMSNorm family (STEP35.md 4.1): the Step zero-centred norm y = x * rsqrt(mean(x^2) + eps) * (1 + w),
// per row, per attention head (q_norm / k_norm) and fused with the residual add. The exact operation
// order written here is the op's definition; the CUDA kernels must reproduce it bit for bit (D6).
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/thread_pool.h"

namespace memra::cpu {

// A norm weight vector as stored in the checkpoint.
struct NormWeight {
    const void *data = nullptr;  // [d] kF32 or kBF16 (MEMRA_CHECK)
    DType dtype = DType::kBF16;
    bool add_one = true;  // true: the Step (1 + w) convention (HF/safetensors checkpoints); false: the file
                          // already stores (1 + w) (GGUF converters add the 1), so the factor is w itself
};

// rms_norm: for each row x of [n_rows, d] f32, in this order of fp32 operations:
//   ss   = sum_squares_f32(x, d)          (core/math.h: 16 lanes by i % 16, then the fixed pairwise tree)
//   mean = ss / float(d)                  (a division, as torch's mean)
//   inv  = rsqrt_f32(mean + eps)          (1.0f / IEEE sqrt)
//   y_i  = (x_i * inv) * f_i,  f_i = 1.0f + w_i (add_one) or w_i, w_i the exact f32 value of the weight
// Every output depends only on its own row. y may equal x (in place); otherwise they must not overlap.
// x, y: [n_rows, d] f32.
void rms_norm(ThreadPool &pool, const float *x, int64_t n_rows, int64_t d, const NormWeight &w, float eps, float *y);

// rms_norm_heads: the per-head norm (q_norm / k_norm), in place. Head h of token t is the head_dim floats at
// x[t * token_stride + h * head_dim]; each is normalised exactly as one rms_norm row of width head_dim with
// the same weight [head_dim]. token_stride >= n_heads * head_dim, so the heads may sit inside a wider fused
// row (e.g. a QKV projection output).
void rms_norm_heads(ThreadPool &pool, float *x, int64_t n_tokens, int64_t token_stride, int64_t n_heads,
                    int64_t head_dim, const NormWeight &w, float eps);

// add_rms_norm: h = x + r (one rounded add per element), then y = rms_norm(h). Bit-identical to
// residual_add followed by rms_norm. x, r, h, y: [n_rows, d] f32; h may equal x or r; y must not overlap h.
void add_rms_norm(ThreadPool &pool, const float *x, const float *r, int64_t n_rows, int64_t d, const NormWeight &w,
                  float eps, float *h, float *y);

}  // namespace memra::cpu
