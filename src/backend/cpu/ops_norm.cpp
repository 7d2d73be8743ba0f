// RMSNorm family on the CPU: one row kernel (norm_row) shared by the plain, per-head and fused variants, so
// all three produce the same bits for the same row.
#include "backend/cpu/ops_norm.h"

#include "backend/cpu/ops_common.h"
#include "core/check.h"
#include "core/math.h"

namespace memra::cpu {
namespace {

void check_weight(const NormWeight &w) {
    MEMRA_CHECK(w.data != nullptr, "norm weight has no data");
    MEMRA_CHECK(w.dtype == DType::kF32 || w.dtype == DType::kBF16, "norm weight dtype must be F32 or BF16, got {}",
                dtype_name(w.dtype));
}

// y[0..d) = rms_norm(x[0..d)) in the order documented in ops_norm.h. y may equal x.
void norm_row(const float *x, int64_t d, const NormWeight &w, float eps, float *y) {
    const float ss = sum_squares_f32(x, d);
    const float mean = ss / static_cast<float>(d);
    const float inv = rsqrt_f32(mean + eps);
    for (int64_t i = 0; i < d; ++i) {
        const float wi = detail::load_f32_or_bf16(w.data, w.dtype, i);
        const float factor = w.add_one ? 1.0f + wi : wi;
        y[i] = (x[i] * inv) * factor;
    }
}

}  // namespace

void rms_norm(ThreadPool &pool, const float *x, int64_t n_rows, int64_t d, const NormWeight &w, float eps, float *y) {
    MEMRA_CHECK(n_rows >= 0 && d > 0, "rms_norm: bad shape [{}, {}]", n_rows, d);
    check_weight(w);
    detail::parallel_rows(pool, n_rows, d, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) norm_row(x + t * d, d, w, eps, y + t * d);
    });
}

void rms_norm_heads(ThreadPool &pool, float *x, int64_t n_tokens, int64_t token_stride, int64_t n_heads,
                    int64_t head_dim, const NormWeight &w, float eps) {
    MEMRA_CHECK(n_tokens >= 0 && n_heads > 0 && head_dim > 0 && token_stride >= n_heads * head_dim,
                "rms_norm_heads: bad shape tokens {} heads {} head_dim {} token_stride {}", n_tokens, n_heads,
                head_dim, token_stride);
    check_weight(w);
    detail::parallel_rows(pool, n_tokens * n_heads, head_dim, [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
            float *row = x + (item / n_heads) * token_stride + (item % n_heads) * head_dim;
            norm_row(row, head_dim, w, eps, row);
        }
    });
}

void add_rms_norm(ThreadPool &pool, const float *x, const float *r, int64_t n_rows, int64_t d, const NormWeight &w,
                  float eps, float *h, float *y) {
    MEMRA_CHECK(n_rows >= 0 && d > 0, "add_rms_norm: bad shape [{}, {}]", n_rows, d);
    MEMRA_CHECK(y != h, "add_rms_norm: y must not alias h");
    check_weight(w);
    detail::parallel_rows(pool, n_rows, d, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            float *h_row = h + t * d;
            for (int64_t i = 0; i < d; ++i) h_row[i] = x[t * d + i] + r[t * d + i];
            norm_row(h_row, d, w, eps, y + t * d);
        }
    });
}

}  // namespace memra::cpu
