// Step-3.5 parameter and byte accounting over the tensor catalogue. All sums fit int64_t: the config
// parser refuses configs describing more than kMaxConfigParams parameters.
#include "model/step35_stats.h"

#include <algorithm>
#include <cmath>
#include <string>

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

Result<DecodeTraffic> decode_traffic(const Step35Config &cfg, const io::TensorStore &store, int64_t batch,
                                     double context, KvFormat k_format, KvFormat v_format) {
    if (batch < 1 || !(context >= 1.0)) {
        return make_error("decode traffic: batch {} and context {}, expected both >= 1", batch, context);
    }
    DecodeTraffic t;
    for (const ExpectedTensor &e : expected_tensors(cfg)) {
        if (e.role == TensorRole::kFp8Scale) continue;  // counted with its weight
        if (e.layer >= 0 && cfg.layers[static_cast<size_t>(e.layer)].is_mtp) continue;
        const io::TensorInfo *info = store.find(e.name);
        if (info == nullptr) return make_error("decode traffic: the store has no tensor {}", e.name);
        double bytes = static_cast<double>(info->n_bytes());
        if (const io::TensorInfo *scale = store.find(e.name + std::string(kFp8ScaleSuffix)); scale != nullptr) {
            bytes += static_cast<double>(scale->n_bytes());
        }
        if (e.role == TensorRole::kEmbedding && !cfg.tie_word_embeddings) {
            bytes *= std::min(1.0, static_cast<double>(batch) / static_cast<double>(e.shape.front()));
        } else if (e.role == TensorRole::kRoutedExperts) {
            const auto n = static_cast<double>(e.shape.front());
            const LayerGeometry &g = cfg.layers[static_cast<size_t>(e.layer)];
            t.experts_per_layer = n * (1.0 - std::pow(1.0 - g.top_k / n, static_cast<double>(batch)));
            bytes *= t.experts_per_layer / n;
        }
        t.weight_bytes += bytes;
    }
    for (const LayerGeometry &g : cfg.layers) {
        if (g.is_mtp) continue;
        auto k = kv_row_bytes(k_format, g.n_kv_heads, g.head_dim);
        auto v = kv_row_bytes(v_format, g.n_kv_heads, g.head_dim);
        if (!k || !v) return wrap_error(fmt::format("decode traffic: layer {}", g.index), (k ? v : k).error());
        const double seen = g.window > 0 ? std::min(context, static_cast<double>(g.window)) : context;
        t.kv_bytes += static_cast<double>(batch) * seen * static_cast<double>(*k + *v);
    }
    return t;
}

}  // namespace memra::model
