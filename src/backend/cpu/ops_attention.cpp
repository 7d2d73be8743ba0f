// Two-pass softmax attention on the CPU, one (query, head) pair per work item (see ops_attention.h).
#include "backend/cpu/ops_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "backend/cpu/ops_common.h"
#include "core/check.h"
#include "core/math.h"

namespace memra::cpu {
namespace {

// Scores one work item keeps on its stack between the passes (16 KiB); keys past it are scored twice.
constexpr int64_t kScoreCache = 4096;

}  // namespace

float attention_scale(int64_t head_dim) {
    MEMRA_CHECK(head_dim > 0, "attention_scale: head_dim must be > 0, got {}", head_dim);
    return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

void attention(ThreadPool &pool, const AttentionShape &shape, const float *q, int64_t q_stride, const int64_t *q_pos,
               int64_t n_q, const float *k, const float *v, int64_t kv_begin, int64_t kv_end, const float *gate,
               int64_t gate_stride, float *out) {
    const int64_t n_heads = shape.n_heads;
    const int64_t n_kv_heads = shape.n_kv_heads;
    const int64_t head_dim = shape.head_dim;
    MEMRA_CHECK(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0 && head_dim > 0 && shape.window >= 0,
                "attention: bad shape heads {} kv_heads {} head_dim {} window {}", n_heads, n_kv_heads, head_dim,
                shape.window);
    MEMRA_CHECK(q_stride >= n_heads * head_dim && n_q >= 0 && 0 <= kv_begin && kv_begin <= kv_end,
                "attention: bad q_stride {} / n_q {} / key range [{}, {})", q_stride, n_q, kv_begin, kv_end);
    MEMRA_CHECK(gate == nullptr || gate_stride >= n_heads, "attention: gate_stride {} < n_heads {}", gate_stride,
                n_heads);
    // The visible range of each query must be fully present: [lo, P] inside [kv_begin, kv_end).
    auto visible_lo = [&](int64_t pos) { return shape.window > 0 ? std::max<int64_t>(0, pos - shape.window + 1) : 0; };
    for (int64_t i = 0; i < n_q; ++i) {
        MEMRA_CHECK(q_pos[i] >= 0 && visible_lo(q_pos[i]) >= kv_begin && q_pos[i] < kv_end,
                    "attention: query {} at position {} sees [{}, {}], keys given for [{}, {})", i, q_pos[i],
                    visible_lo(q_pos[i]), q_pos[i], kv_begin, kv_end);
    }
    const int64_t group = n_heads / n_kv_heads;
    const int64_t kv_row = n_kv_heads * head_dim;
    const float scale = shape.scale;

    detail::parallel_rows(pool, n_q * n_heads, (kv_end - kv_begin) * head_dim * 3, [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
            const int64_t i = item / n_heads;
            const int64_t h = item % n_heads;
            const float *qv = q + i * q_stride + h * head_dim;
            const int64_t kv_off = (h / group) * head_dim;
            const int64_t hi = q_pos[i];
            const int64_t lo = visible_lo(hi);
            auto key = [&](int64_t p) { return k + (p - kv_begin) * kv_row + kv_off; };
            auto value = [&](int64_t p) { return v + (p - kv_begin) * kv_row + kv_off; };

            // Pass 1's scores of the first kScoreCache keys are kept for pass 2 (the same bits as recomputing).
            float scores[kScoreCache];
            auto score = [&](int64_t p) { return dot_f32(qv, key(p), head_dim) * scale; };
            float m = -std::numeric_limits<float>::infinity();
            for (int64_t p = lo; p <= hi; ++p) {
                const float s = score(p);
                if (p - lo < kScoreCache) scores[p - lo] = s;
                m = s > m ? s : m;
            }
            float *o = out + (i * n_heads + h) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) o[d] = 0.0f;
            float l = 0.0f;
            for (int64_t p = lo; p <= hi; ++p) {
                const float e = exp_f32((p - lo < kScoreCache ? scores[p - lo] : score(p)) - m);
                l = l + e;
                const float *vv = value(p);
                for (int64_t d = 0; d < head_dim; ++d) o[d] = o[d] + e * vv[d];
            }
            for (int64_t d = 0; d < head_dim; ++d) o[d] = o[d] / l;
            if (gate != nullptr) {
                const float g = sigmoid_f32(gate[i * gate_stride + h]);
                for (int64_t d = 0; d < head_dim; ++d) o[d] = o[d] * g;
            }
        }
    });
}

}  // namespace memra::cpu
