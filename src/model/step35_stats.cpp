// Step-3.5 parameter and byte accounting over the tensor catalogue. All sums fit int64_t: the config
// parser refuses configs describing more than kMaxConfigParams parameters.
#include "model/step35_stats.h"

#include "model/step35_weights.h"

namespace memra::model {

ModelStats compute_model_stats(const Step35Config &cfg, std::span<const io::TensorInfo> tensors) {
    ModelStats s;
    for (const ExpectedTensor &t : expected_tensors(cfg)) {
        int64_t n = 1;
        for (int64_t dim : t.shape) {
            n *= dim;
        }
        s.expected_bytes += static_cast<uint64_t>(n) * dtype_size(t.dtypes.front());
        if (t.role == TensorRole::kFp8Scale) {
            continue;
        }
        const bool mtp = t.layer >= 0 && cfg.layers[static_cast<size_t>(t.layer)].is_mtp;
        if (mtp) {
            s.mtp_params += n;
            if (t.role == TensorRole::kMtpHead) {
                s.mtp_head_params += n;
            }
            continue;
        }
        s.trunk_params += n;
        switch (t.role) {
        case TensorRole::kEmbedding:
            s.embedding_params += n;
            // One row per token; with tied embeddings the whole matrix is also the LM head.
            s.active_params += cfg.tie_word_embeddings ? n : cfg.d_model;
            break;
        case TensorRole::kLmHead:
            s.lm_head_params += n;
            s.active_params += n;
            break;
        case TensorRole::kRoutedExperts: {
            // [n_experts, out, in]: a token reads top_k of the n_experts banks.
            const LayerGeometry &g = cfg.layers[static_cast<size_t>(t.layer)];
            const int64_t active = n / t.shape[0] * g.top_k;
            s.routed_expert_params += n;
            s.active_params += active;
            s.active_params_non_embedding += active;
            break;
        }
        case TensorRole::kNorm:
        case TensorRole::kAttention:
        case TensorRole::kDenseMlp:
        case TensorRole::kRouter:
        case TensorRole::kRouterBias:
        case TensorRole::kSharedExpert:
        case TensorRole::kMtpProj:
        case TensorRole::kMtpHead:
        case TensorRole::kFp8Scale:
            s.active_params += n;
            s.active_params_non_embedding += n;
            break;
        }
        if (t.layer >= 0) {
            s.trunk_layer_params += n;
        }
    }
    s.total_params = s.trunk_params + s.mtp_params;

    for (const io::TensorInfo &t : tensors) {
        const uint64_t bytes = t.data_end >= t.data_begin ? t.data_end - t.data_begin : 0;
        s.bytes_by_dtype[t.dtype] += bytes;
        s.checkpoint_bytes += bytes;
    }
    return s;
}

}  // namespace memra::model
