// Parameter and byte accounting for a Step-3.5 config: totals for the trunk and the MTP layers, the
// parameters one token activates, and the bytes a checkpoint holds per dtype. Derived from the tensor
// catalogue (step35_weights.h), so the counts and the validated layout cannot disagree.
#pragma once

#include <cstdint>
#include <map>
#include <span>

#include "core/dtype.h"
#include "core/kv_format.h"
#include "core/result.h"
#include "io/safetensors.h"
#include "io/tensor_store.h"
#include "model/step35_config.h"

namespace memra::model {

// Parameters are the elements of the catalogue's weight tensors (router bias included); FP8 block
// scales are metadata, not parameters.
//
// Active parameters: what one token's trunk forward pass reads. Every attention, norm, router, router
// bias, dense-MLP and shared-expert weight, top_k / n_experts of each routed-expert bank, the final norm,
// the LM head, and one embedding row (d_model: a lookup, not a matmul; with tied embeddings the whole
// matrix counts once, as the LM head). MTP layers are excluded (they
// run per draft token, not per token). active_params_non_embedding also leaves out the embedding row and
// the LM head, the "non-embedding" convention of model cards.
struct ModelStats {
    int64_t embedding_params = 0;      // model.embed_tokens.weight: vocab_size * d_model
    int64_t lm_head_params = 0;        // lm_head.weight; 0 with tie_word_embeddings
    int64_t trunk_layer_params = 0;    // the trunk decoder layers alone
    int64_t trunk_params = 0;          // embedding + trunk layers + final norm + lm_head (the model without MTP)
    int64_t routed_expert_params = 0;  // routed-expert banks of the trunk (what the FP8 release quantizes)
    int64_t mtp_params = 0;            // every MTP layer, its shared_head.output included
    int64_t mtp_head_params = 0;       // the MTP shared_head.output matrices alone
    int64_t total_params = 0;          // trunk_params + mtp_params: everything the checkpoint stores
    int64_t active_params = 0;         // per token, as defined above
    int64_t active_params_non_embedding = 0;  // active_params without the embedding row and the LM head

    uint64_t expected_bytes = 0;  // the catalogue at released dtypes (first accepted dtype), FP8 scales included
    std::map<DType, uint64_t> bytes_by_dtype;  // data bytes per dtype of the given tensor list (empty without one)
    uint64_t checkpoint_bytes = 0;             // sum of bytes_by_dtype
};

// Counts from the config; bytes_by_dtype and checkpoint_bytes from `tensors` (only dtype, data_begin and
// data_end are read).
ModelStats compute_model_stats(const Step35Config &cfg, std::span<const io::TensorInfo> tensors = {});

// What one decode step of `batch` sequences, each attending over `context` positions, reads from memory: the
// floor of the step's time where memory bandwidth bounds it (PERFORMANCE.md section 7). Every trunk weight once —
// attention, norms, routers, dense and shared MLPs, the final norm, the LM head — except the routed experts, of
// which each MoE layer reads its expected distinct experts under uniform routing, n_experts (1 - (1 - top_k /
// n_experts)^batch), and the embedding, of which each sequence reads one row (the whole matrix once when tied, as
// the LM head). Bytes as the store holds them (FP8 block scales with their weights); MTP layers, which a plain step
// does not run, are not counted. KV: each sequence's K and V rows in the cache formats, `context` of each
// full-attention layer and min(context, window) of each sliding one.
struct DecodeTraffic {
    double weight_bytes = 0.0;
    double kv_bytes = 0.0;
    double experts_per_layer = 0.0;  // expected distinct routed experts read per MoE layer (0 without any)

    double total_bytes() const { return weight_bytes + kv_bytes; }
};

// Refused: batch or context < 1, a catalogue tensor the store lacks, KV formats the layers cannot hold.
Result<DecodeTraffic> decode_traffic(const Step35Config &cfg, const io::TensorStore &store, int64_t batch,
                                     double context, KvFormat k_format, KvFormat v_format);

}  // namespace memra::model
