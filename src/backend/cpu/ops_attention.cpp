// Paged attention on the CPU, in the two-pass exact order and the blocked device order, and the KV write
// (see ops_attention.h).
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

// The blocked (device) order: blocks of 128 positions and splits of 512, both aligned to position 0. A work
// item keeps the scores of one split and its accumulators: 8 * 512 + 8 * 512 floats, 32 KiB of stack.
constexpr int64_t kBlockRows = 128;
constexpr int64_t kSplitRows = 512;

float round_to_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

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
    // One work item of either order: query i, kv head g, query heads [h0, h0 + nh), visible positions [lo, hi].
    struct WorkItem {
        int64_t i, g, h0, nh, hi, lo;
        const int32_t *bt;
        const PagedLayer *layer;
        std::byte *page(int64_t p) const {
            return layer->base + static_cast<int64_t>(bt[p / kKvPageRows]) * layer->page_bytes;
        }
    };
    auto work_item = [&](int64_t item) {
        WorkItem w{};
        w.i = item / (n_kv_heads * batches);
        w.g = (item / batches) % n_kv_heads;
        w.h0 = w.g * group + (item % batches) * kHeadBatch;
        w.nh = std::min(kHeadBatch, (w.g + 1) * group - w.h0);
        w.hi = q_pos[w.i];
        w.lo = visible_lo(w.hi);
        w.bt = block_tables + q_seq[w.i] * bt_stride;
        w.layer = &layer;
        return w;
    };
    const int64_t n_items = n_q * n_kv_heads * batches;
    const int64_t span = shape.window > 0 ? shape.window : 1024;
    if (shape.blocked) {
        const bool round_keys = layer.k_format == KvFormat::kF32 || layer.k_format == KvFormat::kBf16;
        constexpr float kNegInf = -std::numeric_limits<float>::infinity();
        detail::parallel_rows(pool, n_items, span * head_dim * 3, [&](int64_t begin, int64_t end) {
            float kbuf[kMaxHeadDim];
            float vbuf[kMaxHeadDim];
            float scores[kHeadBatch][kSplitRows];  // s_p of the split, then e_p once its block's max is known
            float acc[kHeadBatch][kMaxHeadDim];    // the split's acc; the running ACC lives in out
            float m[kHeadBatch];
            float l[kHeadBatch];
            float run_m[kHeadBatch];
            float run_l[kHeadBatch];
            for (int64_t item = begin; item < end; ++item) {
                const WorkItem w = work_item(item);
                const int64_t i = w.i, g = w.g, h0 = w.h0, nh = w.nh, hi = w.hi, lo = w.lo;
                auto row = [&](int64_t p) { return w.page(p); };
                const float *qv[kHeadBatch];
                for (int64_t j = 0; j < nh; ++j) qv[j] = q + i * q_stride + (h0 + j) * head_dim;
                float *o = out + (i * n_heads + h0) * head_dim;  // heads h0 .. h0 + nh of query i: ACC, then out
                for (int64_t s0 = lo; s0 <= hi;) {
                    const int64_t s1 = std::min(hi, (s0 / kSplitRows + 1) * kSplitRows - 1);  // split [s0, s1]
                    // The split's scores, each key decoded once.
                    for (int64_t p = s0; p <= s1; ++p) {
                        kv_decode(layer.k_format,
                                  row(p) + layer.k_offset + (p % kKvPageRows) * layer.k_row_bytes + g * k_head_bytes,
                                  head_dim, kbuf);
                        if (round_keys) {
                            for (int64_t d = 0; d < head_dim; ++d) kbuf[d] = round_to_bf16(kbuf[d]);
                        }
                        for (int64_t j = 0; j < nh; ++j) scores[j][p - s0] = dot_f32(qv[j], kbuf, head_dim) * scale;
                    }
                    for (int64_t j = 0; j < nh; ++j) {
                        m[j] = kNegInf;
                        l[j] = 0.0f;
                        for (int64_t d = 0; d < head_dim; ++d) acc[j][d] = 0.0f;
                    }
                    for (int64_t b0 = s0; b0 <= s1;) {
                        const int64_t b1 = std::min(s1, (b0 / kBlockRows + 1) * kBlockRows - 1);  // block [b0, b1]
                        bool live[kHeadBatch];
                        bool any_live = false;
                        for (int64_t j = 0; j < nh; ++j) {
                            float *sj = scores[j];  // sj[p - s0] for p in [s0, s1]
                            float bm = kNegInf;
                            for (int64_t p = b0 - s0; p <= b1 - s0; ++p) bm = sj[p] > bm ? sj[p] : bm;
                            const float m_new = bm > m[j] ? bm : m[j];
                            live[j] = m_new != kNegInf;
                            if (!live[j]) continue;
                            any_live = true;
                            const float alpha = m[j] == kNegInf ? 0.0f : exp_f32(m[j] - m_new);
                            float b_sum = 0.0f;
                            for (int64_t p = b0 - s0; p <= b1 - s0; ++p) {
                                sj[p] = exp_f32(sj[p] - m_new);
                                b_sum = b_sum + sj[p];
                            }
                            l[j] = l[j] * alpha + b_sum;
                            for (int64_t d = 0; d < head_dim; ++d) acc[j][d] = acc[j][d] * alpha;
                            m[j] = m_new;
                        }
                        for (int64_t p = b0; any_live && p <= b1; ++p) {
                            kv_decode(
                                layer.v_format,
                                row(p) + layer.v_offset + (p % kKvPageRows) * layer.v_row_bytes + g * v_head_bytes,
                                head_dim, vbuf);
                            for (int64_t d = 0; d < head_dim; ++d) vbuf[d] = round_to_bf16(vbuf[d]);
                            for (int64_t j = 0; j < nh; ++j) {
                                if (!live[j]) continue;
                                const float pw = round_to_bf16(scores[j][p - s0]);
                                float *aj = acc[j];
                                for (int64_t d = 0; d < head_dim; ++d) aj[d] = aj[d] + pw * vbuf[d];
                            }
                        }
                        b0 = b1 + 1;
                    }
                    // Merge the split into the running state, left to right.
                    for (int64_t j = 0; j < nh; ++j) {
                        float *oj = o + j * head_dim;
                        if (s0 == lo) {
                            run_m[j] = m[j];
                            run_l[j] = l[j];
                            for (int64_t d = 0; d < head_dim; ++d) oj[d] = acc[j][d];
                            continue;
                        }
                        const float m_next = m[j] > run_m[j] ? m[j] : run_m[j];
                        const float a = exp_f32(run_m[j] - m_next);
                        const float b = exp_f32(m[j] - m_next);
                        run_l[j] = run_l[j] * a + l[j] * b;
                        for (int64_t d = 0; d < head_dim; ++d) oj[d] = oj[d] * a + acc[j][d] * b;
                        run_m[j] = m_next;
                    }
                    s0 = s1 + 1;
                }
                for (int64_t j = 0; j < nh; ++j) {
                    float *oj = o + j * head_dim;
                    for (int64_t d = 0; d < head_dim; ++d) oj[d] = oj[d] / run_l[j];
                    if (gate != nullptr) {
                        const float gv = sigmoid_f32(gate[i * gate_stride + h0 + j]);
                        for (int64_t d = 0; d < head_dim; ++d) oj[d] = oj[d] * gv;
                    }
                }
            }
        });
        return;
    }
    detail::parallel_rows(pool, n_items, span * head_dim * 3, [&](int64_t begin, int64_t end) {
        float kbuf[kMaxHeadDim];
        float vbuf[kMaxHeadDim];
        float scores[kHeadBatch][kScoreCache];
        float m[kHeadBatch];
        float l[kHeadBatch];
        for (int64_t item = begin; item < end; ++item) {
            const WorkItem w = work_item(item);
            const int64_t i = w.i, g = w.g, h0 = w.h0, nh = w.nh, hi = w.hi, lo = w.lo;
            auto row = [&](int64_t p) { return w.page(p); };
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

PagedLayer pool_layer(const KvPoolSpec &spec, const KvPageLayout &layout, std::byte *base, int layer) {
    MEMRA_CHECK(layer >= 0 && static_cast<size_t>(layer) < spec.layers.size(), "KV pool layer {} of {}", layer,
                spec.layers.size());
    const auto l = static_cast<size_t>(layer);
    PagedLayer p;
    p.base = base;
    p.n_pages = spec.n_pages;
    p.page_bytes = layout.page_bytes;
    p.k_offset = layout.k_offset[l];
    p.v_offset = layout.v_offset[l];
    p.k_row_bytes = layout.k_row_bytes[l];
    p.v_row_bytes = layout.v_row_bytes[l];
    p.k_format = spec.k_format;
    p.v_format = spec.v_format;
    return p;
}

}  // namespace memra::cpu
