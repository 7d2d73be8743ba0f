// RoPE frequencies (HF float32 arithmetic), the host cos/sin table and the in-place rotation (ops_rope.h).
#include "backend/cpu/ops_rope.h"

#include <cmath>
#include <numbers>

#include "backend/cpu/ops_common.h"
#include "core/check.h"

namespace memra::cpu {
namespace {

constexpr int64_t kMaxExactPositions = int64_t{1} << 24;  // every integer up to 2^24 is exact in float32

float f32(double v) { return static_cast<float>(v); }

}  // namespace

Result<std::vector<float>> rope_inv_freq(int64_t rot_dim, double theta, const RopeLlama3 *llama3) {
    if (rot_dim <= 0 || rot_dim % 2 != 0) {
        return make_error("rope: rot_dim: expected a positive even number, found {}", rot_dim);
    }
    if (!std::isfinite(theta) || theta <= 0.0) {
        return make_error("rope: theta: expected a finite value > 0, found {}", theta);
    }
    const int64_t half = rot_dim / 2;
    std::vector<float> inv(static_cast<size_t>(half));
    const float theta_f = f32(theta);
    for (int64_t j = 0; j < half; ++j) {
        const float e = static_cast<float>(2 * j) / static_cast<float>(rot_dim);
        const float p = f32(std::pow(static_cast<double>(theta_f), static_cast<double>(e)));
        inv[static_cast<size_t>(j)] = 1.0f / p;
    }
    if (llama3 == nullptr) return inv;

    const RopeLlama3 &s = *llama3;
    const double l0 = s.original_max_position_embeddings;
    if (!std::isfinite(s.factor) || s.factor <= 0.0) {
        return make_error("rope_scaling.factor: expected a finite value > 0, found {}", s.factor);
    }
    if (!std::isfinite(l0) || l0 <= 0.0) {
        return make_error("rope_scaling.original_max_position_embeddings: expected > 0, found {}", l0);
    }
    if (!std::isfinite(s.low_freq_factor) || !std::isfinite(s.high_freq_factor) || s.low_freq_factor <= 0.0 ||
        s.high_freq_factor <= s.low_freq_factor) {
        return make_error("rope_scaling: expected 0 < low_freq_factor < high_freq_factor, found low {} high {}",
                          s.low_freq_factor, s.high_freq_factor);
    }
    const float factor = f32(s.factor);
    const float low_wavelen = f32(l0 / s.low_freq_factor);
    const float high_wavelen = f32(l0 / s.high_freq_factor);
    const float two_pi = f32(2.0 * std::numbers::pi);
    const float l0_f = f32(l0);
    const float low_f = f32(s.low_freq_factor);
    const float span = f32(s.high_freq_factor - s.low_freq_factor);
    for (float &f : inv) {
        const float wavelen = (1.0f / f) * two_pi;
        const float base = wavelen > low_wavelen ? f / factor : f;
        const float sf = ((1.0f / wavelen) * l0_f - low_f) / span;
        const float smooth = ((1.0f - sf) * base) / factor + sf * base;
        const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
        f = medium ? smooth : base;
    }
    return inv;
}

Result<RopeTable> rope_table_build(ThreadPool &pool, const std::vector<float> &inv_freq, int64_t n_positions) {
    if (inv_freq.empty()) return make_error("rope table: expected at least one inverse frequency, found none");
    if (n_positions < 1 || n_positions > kMaxExactPositions) {
        return make_error("rope table: n_positions: expected 1..{}, found {}", kMaxExactPositions, n_positions);
    }
    RopeTable table;
    table.n_positions = n_positions;
    table.half = static_cast<int64_t>(inv_freq.size());
    table.cos.resize(static_cast<size_t>(n_positions * table.half));
    table.sin.resize(static_cast<size_t>(n_positions * table.half));
    detail::parallel_rows(pool, n_positions, table.half * 64, [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) {
            for (int64_t j = 0; j < table.half; ++j) {
                const float angle = static_cast<float>(p) * inv_freq[static_cast<size_t>(j)];
                const size_t at = static_cast<size_t>(p * table.half + j);
                table.cos[at] = f32(std::cos(static_cast<double>(angle)));
                table.sin[at] = f32(std::sin(static_cast<double>(angle)));
            }
        }
    });
    return table;
}

Result<void> rope_apply(ThreadPool &pool, const RopeTable &table, float *x, int64_t n_tokens, int64_t token_stride,
                        int64_t n_heads, int64_t head_dim, const int64_t *positions) {
    const int64_t half = table.half;
    MEMRA_CHECK(n_tokens >= 0 && n_heads > 0 && half > 0 && 2 * half <= head_dim && token_stride >= n_heads * head_dim,
                "rope_apply: bad shape tokens {} heads {} head_dim {} rot_dim {} token_stride {}", n_tokens, n_heads,
                head_dim, 2 * half, token_stride);
    for (int64_t t = 0; t < n_tokens; ++t) {
        if (positions[t] < 0 || positions[t] >= table.n_positions) {
            return make_error("rope: position of token {}: expected 0 <= position < {} (table size), found {}", t,
                              table.n_positions, positions[t]);
        }
    }
    detail::parallel_rows(pool, n_tokens, n_heads * 2 * half, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            const float *c = table.cos.data() + positions[t] * half;
            const float *s = table.sin.data() + positions[t] * half;
            for (int64_t h = 0; h < n_heads; ++h) {
                float *row = x + t * token_stride + h * head_dim;
                for (int64_t j = 0; j < half; ++j) {
                    const float a = row[j];
                    const float b = row[j + half];
                    row[j] = a * c[j] - b * s[j];
                    row[j + half] = b * c[j] + a * s[j];
                }
            }
        }
    });
    return {};
}

}  // namespace memra::cpu
