// Embedding lookup, residual add, SwiGLU and the per-head sigmoid gate on the CPU (see ops_elementwise.h).
#include "backend/cpu/ops_elementwise.h"

#include <cstring>

#include "backend/cpu/matmul.h"
#include "backend/cpu/ops_common.h"
#include "backend/cpu/simd_avx2.h"
#include "core/check.h"
#include "core/float_formats.h"
#include "core/math.h"
#include "core/quant_blocks.h"

namespace memra::cpu {

Result<void> embedding_lookup(ThreadPool &pool, const void *table, DType dtype, int64_t vocab_size, int64_t d_model,
                              const int32_t *ids, int64_t n_tokens, float *out) {
    MEMRA_CHECK(table != nullptr && vocab_size > 0 && d_model > 0 && n_tokens >= 0,
                "embedding_lookup: bad shape [{}, {}] for {} tokens", vocab_size, d_model, n_tokens);
    if (dtype != DType::kF32 && dtype != DType::kBF16) {
        return make_error("embedding table: expected dtype F32 or BF16, found {}", dtype_name(dtype));
    }
    // Validate every id before writing anything, so a bad request leaves `out` untouched.
    for (int64_t t = 0; t < n_tokens; ++t) {
        if (ids[t] < 0 || ids[t] >= vocab_size) {
            return make_error("embedding lookup: token id at index {}: expected 0 <= id < {}, found {}", t,
                              vocab_size, ids[t]);
        }
    }
    detail::parallel_rows(pool, n_tokens, d_model, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            float *row = out + t * d_model;
            const int64_t id = ids[t];
            if (dtype == DType::kF32) {
                std::memcpy(row, static_cast<const float *>(table) + id * d_model, sizeof(float) * d_model);
            } else {
                const uint16_t *src = static_cast<const uint16_t *>(table) + id * d_model;
                for (int64_t i = 0; i < d_model; ++i) row[i] = bf16_to_f32(src[i]);
            }
        }
    });
    return {};
}

void residual_add(ThreadPool &pool, const float *a, const float *b, int64_t n_rows, int64_t d, float *out) {
    MEMRA_CHECK(n_rows >= 0 && d > 0, "residual_add: bad shape [{}, {}]", n_rows, d);
    detail::parallel_rows(pool, n_rows, d, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin * d; i < end * d; ++i) out[i] = a[i] + b[i];
    });
}

void round_rows(ThreadPool &pool, float *x, int64_t n_rows, int64_t d, RowRounding r) {
    MEMRA_CHECK(n_rows >= 0 && d > 0, "round_rows: bad shape [{}, {}]", n_rows, d);
    MEMRA_CHECK(r != RowRounding::kQ8 || d % kQuantBlock == 0, "round_rows: q8 rows need d % {} == 0, got {}",
                kQuantBlock, d);
    if (r == RowRounding::kNone) return;
    detail::parallel_rows(pool, n_rows, d, [&](int64_t begin, int64_t end) {
        float *p = x + begin * d;
        float *const stop = x + end * d;
        if (r == RowRounding::kBf16) {
            for (; p < stop; ++p) *p = bf16_to_f32(f32_to_bf16(*p));
            return;
        }
        for (; p < stop; p += kQuantBlock) {
            BlockQ8_0 block;
            quantize_row_q8_0(p, &block, kQuantBlock);
            q8_0_dequant_block(block, p);
        }
    });
}

namespace {

// One row of swiglu: out[j] = clamp(silu(g[j])) * clamp(u[j]) (the clamps only when limit > 0).
void swiglu_row(const float *g, const float *u, int64_t n, float limit, float *o) {
    for (int64_t j = 0; j < n; ++j) o[j] = swiglu_f32(g[j], u[j], limit);
}

#if MEMRA_X86
// swiglu_row in 8 lanes (simd_avx2.h): the same operations per value; each comparison keeps a NaN as the
// scalar ternaries do (an ordered comparison with a NaN is false).
[[gnu::target("avx2"), gnu::noinline]] void swiglu_row_avx2(const float *g, const float *u, int64_t n, float limit,
                                                          float *o) {
    const __m256 hi = _mm256_set1_ps(limit);
    const __m256 lo = _mm256_set1_ps(-limit);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j);
        __m256 act = _mm256_mul_ps(gv, simd::sigmoid_8(gv));
        __m256 uv = _mm256_loadu_ps(u + j);
        if (limit > 0.0f) {
            act = _mm256_blendv_ps(act, hi, _mm256_cmp_ps(act, hi, _CMP_GT_OQ));
            uv = _mm256_blendv_ps(_mm256_blendv_ps(uv, hi, _mm256_cmp_ps(uv, hi, _CMP_GT_OQ)), lo,
                                  _mm256_cmp_ps(uv, lo, _CMP_LT_OQ));
        }
        _mm256_storeu_ps(o + j, _mm256_mul_ps(act, uv));
    }
    swiglu_row(g + j, u + j, n - j, limit, o + j);
}
#endif

}  // namespace

void swiglu(ThreadPool &pool, const float *gate, const float *up, int64_t in_stride, int64_t n_rows, int64_t d_ff,
            float limit, float *out) {
    MEMRA_CHECK(n_rows >= 0 && d_ff > 0 && in_stride >= d_ff, "swiglu: bad shape rows {} d_ff {} in_stride {}",
                n_rows, d_ff, in_stride);
    MEMRA_CHECK(limit >= 0.0f, "swiglu: limit must be >= 0 (0 = off), got {}", limit);
    detail::parallel_rows(pool, n_rows, d_ff, [&](int64_t begin, int64_t end) {
#if MEMRA_X86
        const bool simd = product_isa() != ProductIsa::kPortable;
#endif
        for (int64_t t = begin; t < end; ++t) {
            const float *g_row = gate + t * in_stride;
            const float *u_row = up + t * in_stride;
            float *o_row = out + t * d_ff;
#if MEMRA_X86
            if (simd) {
                swiglu_row_avx2(g_row, u_row, d_ff, limit, o_row);
                continue;
            }
#endif
            swiglu_row(g_row, u_row, d_ff, limit, o_row);
        }
    });
}

void head_gate(ThreadPool &pool, float *x, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
               const float *gate_logits, int64_t gate_stride) {
    MEMRA_CHECK(n_tokens >= 0 && n_heads > 0 && head_dim > 0 && gate_stride >= n_heads,
                "head_gate: bad shape tokens {} heads {} head_dim {} gate_stride {}", n_tokens, n_heads, head_dim,
                gate_stride);
    detail::parallel_rows(pool, n_tokens, n_heads * head_dim, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            for (int64_t h = 0; h < n_heads; ++h) {
                const float g = sigmoid_f32(gate_logits[t * gate_stride + h]);
                float *row = x + (t * n_heads + h) * head_dim;
                for (int64_t i = 0; i < head_dim; ++i) row[i] = row[i] * g;
            }
        }
    });
}

}  // namespace memra::cpu
