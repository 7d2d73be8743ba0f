// Router, pair sort, permute and combine on the CPU (see ops_moe.h for the exact orders).
#include "backend/cpu/ops_moe.h"

#include <algorithm>
#include <cstdint>

#include <cstring>
#include <limits>

#include "backend/cpu/ops_common.h"
#include "core/check.h"
#include "core/math.h"

namespace memra::cpu {

void router_topk(ThreadPool &pool, const RouterParams &params, const float *logits, const float *bias,
                 int64_t n_tokens, int32_t *expert_ids, float *weights) {
    const int64_t n_experts = params.n_experts;
    const int64_t top_k = params.top_k;
    MEMRA_CHECK(n_experts > 0 && n_experts <= std::numeric_limits<int32_t>::max() && top_k >= 1 &&
                    top_k <= n_experts && n_tokens >= 0,
                "router_topk: bad shape experts {} top_k {} tokens {}", n_experts, top_k, n_tokens);
    detail::parallel_rows(pool, n_tokens, n_experts * top_k, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            const float *z = logits + t * n_experts;
            int32_t *ids = expert_ids + t * top_k;
            float *w = weights + t * top_k;
            // Slot k: scan experts in increasing index, keep a strictly greater score, skip chosen ones.
            // O(top_k * n_experts) with no scratch memory: "already chosen" is a look-up in ids[0..k).
            for (int64_t k = 0; k < top_k; ++k) {
                int64_t best = -1;
                float best_s = 0.0f;
                for (int64_t e = 0; e < n_experts; ++e) {
                    bool taken = false;
                    for (int64_t c = 0; c < k; ++c) taken = taken || ids[c] == e;
                    if (taken) continue;
                    float s = sigmoid_f32(z[e]);
                    if (bias != nullptr) s = s + bias[e];
                    if (s != s) s = -std::numeric_limits<float>::infinity();
                    if (best < 0 || s > best_s) {
                        best = e;
                        best_s = s;
                    }
                }
                ids[k] = static_cast<int32_t>(best);
                w[k] = sigmoid_f32(z[best]);
            }
            if (params.renormalize) {
                float sum = 0.0f;
                for (int64_t k = 0; k < top_k; ++k) sum = sum + w[k];
                for (int64_t k = 0; k < top_k; ++k) w[k] = w[k] / sum;
            }
            for (int64_t k = 0; k < top_k; ++k) w[k] = w[k] * params.scaling_factor;
        }
    });
}

void moe_sort_pairs(const int32_t *expert_ids, int64_t n_tokens, int64_t top_k, int64_t n_experts, int32_t *offsets,
                    int32_t *sorted_pair, int32_t *row_of_pair) {
    const int64_t n_pairs = n_tokens * top_k;
    MEMRA_CHECK(n_tokens >= 0 && top_k >= 1 && n_experts > 0 && n_pairs <= std::numeric_limits<int32_t>::max(),
                "moe_sort_pairs: bad shape tokens {} top_k {} experts {}", n_tokens, top_k, n_experts);
    // Histogram into offsets[e + 1], prefix sums give each expert's first row in offsets[e].
    for (int64_t e = 0; e <= n_experts; ++e) offsets[e] = 0;
    for (int64_t q = 0; q < n_pairs; ++q) {
        const int32_t e = expert_ids[q];
        MEMRA_CHECK(e >= 0 && e < n_experts, "moe_sort_pairs: pair {} has expert {}, expected 0..{}", q, e,
                    n_experts - 1);
        ++offsets[e + 1];
    }
    for (int64_t e = 0; e < n_experts; ++e) offsets[e + 1] += offsets[e];
    // Place pairs in increasing q, using offsets[e] as expert e's cursor; afterwards offsets[e] is the start
    // of expert e + 1, so shifting by one restores the starts. No scratch memory.
    for (int64_t q = 0; q < n_pairs; ++q) {
        const int32_t row = offsets[expert_ids[q]]++;
        sorted_pair[row] = static_cast<int32_t>(q);
        row_of_pair[q] = row;
    }
    for (int64_t e = n_experts; e >= 1; --e) offsets[e] = offsets[e - 1];
    offsets[0] = 0;
}

void moe_permute(ThreadPool &pool, const float *x, int64_t d, const int32_t *sorted_pair, int64_t n_pairs,
                 int64_t top_k, float *x_sorted) {
    MEMRA_CHECK(d > 0 && n_pairs >= 0 && top_k >= 1, "moe_permute: bad shape d {} pairs {} top_k {}", d, n_pairs,
                top_k);
    detail::parallel_rows(pool, n_pairs, d, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const int64_t t = sorted_pair[r] / top_k;
            std::memcpy(x_sorted + r * d, x + t * d, sizeof(float) * d);
        }
    });
}

void moe_source_rows(const int32_t *expert_ids, const int32_t *row_of_pair, int64_t n_pairs, const int32_t *offsets,
                     int64_t n_experts, int64_t n_owners, int64_t capacity, int32_t *src_row) {
    MEMRA_CHECK(n_owners >= 1 && n_experts >= n_owners && n_experts % n_owners == 0 && capacity >= 0,
                "moe_source_rows: {} experts over {} owners, capacity {}", n_experts, n_owners, capacity);
    const int64_t per_owner = n_experts / n_owners;
    for (int64_t q = 0; q < n_pairs; ++q) {
        const int64_t e = expert_ids[q];
        MEMRA_CHECK(e >= 0 && e < n_experts, "moe_source_rows: pair {} routed to expert {} of {}", q, e, n_experts);
        const int64_t owner = e / per_owner;
        const int64_t local = row_of_pair[q] - offsets[owner * per_owner];
        MEMRA_CHECK(local >= 0 && local < capacity, "moe_source_rows: pair {} is row {} of owner {}, capacity {}", q,
                    local, owner, capacity);
        MEMRA_CHECK(owner * capacity + local <= INT32_MAX, "moe_source_rows: row {} of the gathered rows past 2^31",
                    owner * capacity + local);
        src_row[q] = static_cast<int32_t>(owner * capacity + local);
    }
}

void moe_combine(ThreadPool &pool, const float *h, const float *expert_out, const int32_t *src_row,
                 const float *weights, const float *shared, int64_t n_tokens, int64_t top_k, int64_t d, float *out) {
    MEMRA_CHECK(n_tokens >= 0 && top_k >= 1 && d > 0, "moe_combine: bad shape tokens {} top_k {} d {}", n_tokens,
                top_k, d);
    detail::parallel_rows(pool, n_tokens, d * (top_k + 2), [&](int64_t begin, int64_t end) {
        // Per element: routed = ((0 + w0 e0) + w1 e1) + ..., in slot order; the slots run outermost over a
        // piece of the row (out may be h, so the sums wait in `routed`), which the compiler runs in vector lanes.
        constexpr int64_t kPiece = 256;
        float routed[kPiece];
        for (int64_t t = begin; t < end; ++t) {
            const float *w = weights + t * top_k;
            const int32_t *rows = src_row + t * top_k;
            for (int64_t j0 = 0; j0 < d; j0 += kPiece) {
                const int64_t len = std::min(kPiece, d - j0);
                std::fill(routed, routed + len, 0.0f);
                for (int64_t k = 0; k < top_k; ++k) {
                    const float wk = w[k];
                    const float *e = expert_out + rows[k] * d + j0;
                    for (int64_t j = 0; j < len; ++j) routed[j] = routed[j] + wk * e[j];
                }
                const float *hj = h + t * d + j0;
                float *oj = out + t * d + j0;
                if (shared != nullptr) {
                    const float *sj = shared + t * d + j0;
                    for (int64_t j = 0; j < len; ++j) oj[j] = hj[j] + (routed[j] + sj[j]);
                } else {
                    for (int64_t j = 0; j < len; ++j) oj[j] = hj[j] + routed[j];
                }
            }
        }
    });
}

}  // namespace memra::cpu
