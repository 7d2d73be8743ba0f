// Parameter and byte accounting for a Step-3.5 config: totals for the trunk and the MTP layers, the
// parameters one token activates, and the bytes a checkpoint holds per dtype. Derived from the tensor
// catalogue (step35_weights.h), so the counts and the validated layout cannot disagree.
#pragma once

#include <cstdint>
#include <map>
#include <span>

#include "core/dtype.h"
#include "io/safetensors.h"
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

}  // namespace memra::model
