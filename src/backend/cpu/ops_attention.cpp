// Paged two-pass softmax attention and the KV write on the CPU (see ops_attention.h).
#include "backend/cpu/ops_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "backend/cpu/ops_common.h"
#include "core/check.h"
#include "core/math.h"

namespace memra::cpu {
namespace {

// Query heads one work item serves together, and the pass-1 scores each keeps for pass 2 (positions past
// it are scored again: the same bits). Stack: 8 * 2048 scores + 8 * 512 accumulators, ~80 KiB.
constexpr int64_t kHeadBatch = 8;
constexpr int64_t kScoreCache = 2048;
constexpr int64_t kMaxHeadDim = 512;

}  // namespace

float attention_scale(int64_t head_dim) {
    MEMRA_CHECK(head_dim > 0, "attention_scale: head_dim must be > 0, got {}", head_dim);
    return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

void kv_write(ThreadPool &pool, const PagedLayer &layer, int64_t row_elems, const float *k, const float *v,
              const int32_t *slots, int64_t n) {
    MEMRA_CHECK(row_elems > 0 && n >= 0, "kv_write: {} rows of {} values", n, row_elems);
    detail::parallel_rows(pool, n, row_elems * 4, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const int64_t slot = slots[i];
            MEMRA_CHECK(slot >= 0 && slot < layer.n_pages * kKvPageRows, "kv_write: row {} has slot {} of {}", i,
                        slot, layer.n_pages * kKvPageRows);
            std::byte *page = layer.base + (slot / kKvPageRows) * layer.page_bytes;
            const int64_t r = slot % kKvPageRows;
            kv_encode(layer.k_format, k + i * row_elems, row_elems, page + layer.k_offset + r * layer.k_row_bytes);
            kv_encode(layer.v_format, v + i * row_elems, row_elems, page + layer.v_offset + r * layer.v_row_bytes);
        }
    });
}

void paged_attention(ThreadPool &pool, const AttentionShape &shape, const float *q, int64_t q_stride,
                     const int64_t *q_pos, const int32_t *q_seq, int64_t n_q, const PagedLayer &layer,
                     const int32_t *block_tables, int64_t bt_stride, int64_t n_seqs, int64_t first_pos,
                     const float *gate, int64_t gate_stride, float *out) {
    const int64_t n_heads = shape.n_heads;
    const int64_t n_kv_heads = shape.n_kv_heads;
    const int64_t head_dim = shape.head_dim;
    MEMRA_CHECK(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0 && head_dim > 0 &&
                    head_dim <= kMaxHeadDim && shape.window >= 0 && first_pos >= 0,
                "paged_attention: bad shape heads {} kv_heads {} head_dim {} window {} first_pos {}", n_heads,
                n_kv_heads, head_dim, shape.window, first_pos);
    MEMRA_CHECK(q_stride >= n_heads * head_dim && n_q >= 0 && bt_stride >= 1 && n_seqs >= 1,
                "paged_attention: bad q_stride {} / n_q {} / block table [{}, {}]", q_stride, n_q, n_seqs, bt_stride);
    MEMRA_CHECK(gate == nullptr || gate_stride >= n_heads, "paged_attention: gate_stride {} < n_heads {}",
                gate_stride, n_heads);
    MEMRA_CHECK(layer.k_row_bytes % n_kv_heads == 0 && layer.v_row_bytes % n_kv_heads == 0,
                "paged_attention: rows of {} / {} bytes for {} kv heads", layer.k_row_bytes, layer.v_row_bytes,
                n_kv_heads);
    auto visible_lo = [&](int64_t pos) {
        return shape.window > 0 ? std::max(first_pos, pos - shape.window + 1) : first_pos;
    };
    // Every visible position of every query must have a page.
    for (int64_t i = 0; i < n_q; ++i) {
        MEMRA_CHECK(q_seq[i] >= 0 && q_seq[i] < n_seqs && q_pos[i] >= first_pos && (q_pos[i] / kKvPageRows) <
                                                                                          bt_stride,
                    "paged_attention: query {} at position {} of sequence {} (first position {}, {} sequences, {} "
                    "blocks)",
                    i, q_pos[i], q_seq[i], first_pos, n_seqs, bt_stride);
        const int32_t *bt = block_tables + q_seq[i] * bt_stride;
        for (int64_t b = visible_lo(q_pos[i]) / kKvPageRows; b <= q_pos[i] / kKvPageRows; ++b) {
            MEMRA_CHECK(bt[b] >= 0, "paged_attention: query {} at position {} sees block {} of sequence {}, which "
                                    "has no page",
                        i, q_pos[i], b, q_seq[i]);
            MEMRA_CHECK(bt[b] < layer.n_pages, "paged_attention: block {} of sequence {} names page {} of a pool of {}",
                        b, q_seq[i], bt[b], layer.n_pages);
        }
    }
    const int64_t group = n_heads / n_kv_heads;
    const int64_t k_head_bytes = layer.k_row_bytes / n_kv_heads;
    const int64_t v_head_bytes = layer.v_row_bytes / n_kv_heads;
    const float scale = shape.scale;

    const int64_t batches = (group + kHeadBatch - 1) / kHeadBatch;  // head batches per kv head
    const int64_t n_items = n_q * n_kv_heads * batches;
    const int64_t span = shape.window > 0 ? shape.window : 1024;
    detail::parallel_rows(pool, n_items, span * head_dim * 3, [&](int64_t begin, int64_t end) {
        float kbuf[kMaxHeadDim];
        float vbuf[kMaxHeadDim];
        float scores[kHeadBatch][kScoreCache];
        float m[kHeadBatch];
        float l[kHeadBatch];
        for (int64_t item = begin; item < end; ++item) {
            const int64_t i = item / (n_kv_heads * batches);
            const int64_t g = (item / batches) % n_kv_heads;
            const int64_t h0 = g * group + (item % batches) * kHeadBatch;
            const int64_t nh = std::min(kHeadBatch, (g + 1) * group - h0);
            const int64_t hi = q_pos[i];
            const int64_t lo = visible_lo(hi);
            const int32_t *bt = block_tables + q_seq[i] * bt_stride;
            auto row = [&](int64_t p) {
                return layer.base + static_cast<int64_t>(bt[p / kKvPageRows]) * layer.page_bytes;
            };
            auto decode_key = [&](int64_t p) {
                kv_decode(layer.k_format,
                          row(p) + layer.k_offset + (p % kKvPageRows) * layer.k_row_bytes + g * k_head_bytes,
                          head_dim, kbuf);
            };
            const float *qv[kHeadBatch];
            for (int64_t j = 0; j < nh; ++j) {
                qv[j] = q + i * q_stride + (h0 + j) * head_dim;
                m[j] = -std::numeric_limits<float>::infinity();
                l[j] = 0.0f;
            }
            // Pass 1: scores and their max, increasing p.
            for (int64_t p = lo; p <= hi; ++p) {
                decode_key(p);
                for (int64_t j = 0; j < nh; ++j) {
                    const float s = dot_f32(qv[j], kbuf, head_dim) * scale;
                    if (p - lo < kScoreCache) scores[j][p - lo] = s;
                    m[j] = s > m[j] ? s : m[j];
                }
            }
            // Pass 2: exp weights and the weighted values, increasing p.
            float *o = out + (i * n_heads + h0) * head_dim;  // heads h0 .. h0 + nh of query i, contiguous
            for (int64_t d = 0; d < nh * head_dim; ++d) o[d] = 0.0f;
            for (int64_t p = lo; p <= hi; ++p) {
                const bool cached = p - lo < kScoreCache;
                if (!cached) decode_key(p);
                kv_decode(layer.v_format,
                          row(p) + layer.v_offset + (p % kKvPageRows) * layer.v_row_bytes + g * v_head_bytes,
                          head_dim, vbuf);
                for (int64_t j = 0; j < nh; ++j) {
                    const float s = cached ? scores[j][p - lo] : dot_f32(qv[j], kbuf, head_dim) * scale;
                    const float e = exp_f32(s - m[j]);
                    l[j] = l[j] + e;
                    float *oj = o + j * head_dim;
                    for (int64_t d = 0; d < head_dim; ++d) oj[d] = oj[d] + e * vbuf[d];
                }
            }
            for (int64_t j = 0; j < nh; ++j) {
                float *oj = o + j * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) oj[d] = oj[d] / l[j];
                if (gate != nullptr) {
                    const float gv = sigmoid_f32(gate[i * gate_stride + h0 + j]);
                    for (int64_t d = 0; d < head_dim; ++d) oj[d] = oj[d] * gv;
                }
            }
        }
    });
}

}  // namespace memra::cpu
