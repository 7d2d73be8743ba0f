// CPU MoE ops (STEP35.md 4.5, DETERMINISM.md rule 5): the sigmoid top-k router with a selection-only bias,
// the stable counting sort of (token, slot) pairs by expert, the permute into expert order, where each pair's
// expert row lies among the owners' gathered rows (moe_source_rows), and the slot-order weighted combine with
// the shared expert and residual. Slot order is part of the contract: the combine adds expert outputs in it.
#pragma once

#include <cstdint>

#include "core/thread_pool.h"

namespace memra::cpu {

struct RouterParams {
    int64_t n_experts = 0;        // routed experts (288)
    int64_t top_k = 0;            // experts per token (8), 1 <= top_k <= n_experts
    bool renormalize = true;      // norm_expert_weight: divide the top-k weights by their sum
    float scaling_factor = 1.0f;  // moe_router_scaling_factor (3.0), applied to every routed weight
};

// router_topk: for each token t (independently), in this order of fp32 operations:
//   p_e = sigmoid_f32(logits[t, e])                       (core/math.h)
//   s_e = p_e + bias[e]                                   (selection score; s_e = p_e when bias == nullptr)
//   slots k = 0..top_k-1: idx_k = the not yet selected expert with the largest s_e, ties to the lower
//       index (a NaN score counts as -Inf); so slots are in descending s order, equal scores by index.
//   w_k = p_{idx_k}                                       (the bias never enters the weights)
//   renormalize: sum = +0; sum = sum + w_k for k = 0..top_k-1 (slot order; plain sum, no epsilon, as
//       transformers' Step3p7 and vLLM); w_k = w_k / sum
//   w_k = w_k * scaling_factor
// logits: [n_tokens, n_experts] f32; bias: [n_experts] f32 or nullptr; expert_ids, weights: [n_tokens, top_k].
void router_topk(ThreadPool &pool, const RouterParams &params, const float *logits, const float *bias,
                 int64_t n_tokens, int32_t *expert_ids, float *weights);

// moe_sort_pairs: stable counting sort of the n_pairs = n_tokens * top_k (token, slot) pairs by expert.
// Pair index q = t * top_k + k. Outputs:
//   offsets[e] .. offsets[e + 1]: the sorted rows of expert e ([n_experts + 1], offsets[0] = 0,
//       offsets[n_experts] = n_pairs);
//   sorted_pair[r]: the pair index q of sorted row r ([n_pairs]); within an expert, rows keep increasing q
//       (token order, then slot order);
//   row_of_pair[q]: the sorted row of pair q ([n_pairs]), the inverse permutation.
// expert_ids: [n_tokens, top_k], each in [0, n_experts) (MEMRA_CHECK). Sequential (O(n_pairs + n_experts)).
void moe_sort_pairs(const int32_t *expert_ids, int64_t n_tokens, int64_t top_k, int64_t n_experts, int32_t *offsets,
                    int32_t *sorted_pair, int32_t *row_of_pair);

// moe_permute: x_sorted[r, :] = x[sorted_pair[r] / top_k, :] (exact copies), so that each expert's rows are
// contiguous. x: [n_tokens, d] f32; sorted_pair: [n_pairs] (all pairs, or the contiguous run of one owner's
// experts); x_sorted: [n_pairs, d] f32.
void moe_permute(ThreadPool &pool, const float *x, int64_t d, const int32_t *sorted_pair, int64_t n_pairs,
                 int64_t top_k, float *x_sorted);

// moe_source_rows: where pair q's expert output lies in the gathered owner buffers [n_owners, capacity, d]:
// experts are owned in equal contiguous runs of n_experts / n_owners (parallel::expert_owner), owner
// o = expert_ids[q] / (n_experts / n_owners) keeps its pairs compact in sorted order, so
//   src_row[q] = o * capacity + row_of_pair[q] - offsets[o * (n_experts / n_owners)].
// With one owner and capacity n_pairs this is row_of_pair itself. MEMRA_CHECKs each row fits the capacity.
void moe_source_rows(const int32_t *expert_ids, const int32_t *row_of_pair, int64_t n_pairs, const int32_t *offsets,
                     int64_t n_experts, int64_t n_owners, int64_t capacity, int32_t *src_row);

// moe_combine: for each token t and column j, with y_k = expert_out[src_row[t * top_k + k], j]:
//   routed = +0; for k = 0..top_k-1 (slot order): routed = routed + (weights[t, k] * y_k)
//       (the product rounded, then the add: no fused multiply-add)
//   out[t, j] = h[t, j] + (routed + shared[t, j])      (shared == nullptr: out[t, j] = h[t, j] + routed)
// h: [n_tokens, d] residual; expert_out: [rows, d], any rows, each pair's row placed by src_row (the owners'
// gathered rows through moe_source_rows; row_of_pair for rows in sorted order; the identity map for rows in
// (token, slot) order); weights: [n_tokens, top_k]; shared: [n_tokens, d] or nullptr; out: [n_tokens, d], may
// equal h.
void moe_combine(ThreadPool &pool, const float *h, const float *expert_out, const int32_t *src_row,
                 const float *weights, const float *shared, int64_t n_tokens, int64_t top_k, int64_t d, float *out);

}  // namespace memra::cpu
