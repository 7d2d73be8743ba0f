// Binding a validated Step-3.5 checkpoint to backend handles: every tensor is looked up by its official
// name and described to the backend as a matrix, an expert bank or a vector (fp8 weights with their
// "_scale_inv" companions). Validation comes first, so the lookups here only fail on a broken invariant.
#include "model/step35_model.h"

#include <string>

#include <fmt/format.h>

#include "model/step35_weights.h"

namespace memra::model {

namespace {

class Binder {
public:
    Binder(Backend &backend, const io::Checkpoint &ckpt, const Step35Config &cfg)
        : backend_(backend), ckpt_(ckpt), cfg_(cfg) {}

    Result<MatrixId> matrix(const std::string &name) {
        auto ref = ckpt_.get(name);
        if (!ref) return tl::unexpected(ref.error());
        const io::TensorInfo &info = *ref->info;
        if (info.shape.size() != 2) {
            return make_error("tensor {}: expected a matrix, found rank {}", name, info.shape.size());
        }
        HostMatrix m;
        m.dtype = info.dtype;
        m.data = ref->bytes.data();
        m.rows = info.shape[0];
        m.cols = info.shape[1];
        auto scale = fp8_scale(name, info.dtype, m.block_rows, m.block_cols);
        if (!scale) return tl::unexpected(scale.error());
        m.scale_inv = *scale;
        return wrap(name, backend_.upload_matrix(m));
    }

    Result<BankId> bank(const std::string &name) {
        auto ref = ckpt_.get(name);
        if (!ref) return tl::unexpected(ref.error());
        const io::TensorInfo &info = *ref->info;
        if (info.shape.size() != 3) {
            return make_error("tensor {}: expected [n_experts, out, in], found rank {}", name, info.shape.size());
        }
        HostBank b;
        b.dtype = info.dtype;
        b.data = ref->bytes.data();
        b.n_experts = info.shape[0];
        b.rows = info.shape[1];
        b.cols = info.shape[2];
        auto scale = fp8_scale(name, info.dtype, b.block_rows, b.block_cols);
        if (!scale) return tl::unexpected(scale.error());
        b.scale_inv = *scale;
        return wrap(name, backend_.upload_bank(b));
    }

    Result<VectorId> vector(const std::string &name) {
        auto ref = ckpt_.get(name);
        if (!ref) return tl::unexpected(ref.error());
        const io::TensorInfo &info = *ref->info;
        if (info.shape.size() != 1) {
            return make_error("tensor {}: expected a vector, found rank {}", name, info.shape.size());
        }
        HostVector v;
        v.dtype = info.dtype;
        v.data = ref->bytes.data();
        v.n = info.shape[0];
        return wrap(name, backend_.upload_vector(v));
    }

private:
    // The f32 scale grid of an fp8 weight (nullptr for other dtypes); sets the block edges from the config.
    Result<const float *> fp8_scale(const std::string &name, DType dtype, int64_t &block_rows, int64_t &block_cols) {
        if (dtype != DType::kF8E4M3) return static_cast<const float *>(nullptr);
        const std::string scale_name = name + std::string(kFp8ScaleSuffix);
        auto ref = ckpt_.get(scale_name);
        if (!ref) return tl::unexpected(ref.error());
        auto floats = ref->as<float>();
        if (!floats) return tl::unexpected(floats.error());
        block_rows = cfg_.quantization.block_out;
        block_cols = cfg_.quantization.block_in;
        return floats->data();
    }

    template <class T>
    static Result<T> wrap(const std::string &name, Result<T> r) {
        if (!r) return wrap_error("tensor " + name, r.error());
        return r;
    }

    Backend &backend_;
    const io::Checkpoint &ckpt_;
    const Step35Config &cfg_;
};

// Assigns *out from a Result or returns its error from the enclosing function.
#define MEMRA_BIND(out, expr)                              \
    do {                                                   \
        auto bound_ = (expr);                              \
        if (!bound_) return tl::unexpected(bound_.error()); \
        (out) = *bound_;                                   \
    } while (0)

Result<LayerWeights> bind_layer(Binder &b, const Step35Config &cfg, const LayerGeometry &g) {
    const std::string p = fmt::format("model.layers.{}.", g.index);
    LayerWeights w;
    MEMRA_BIND(w.input_norm, b.vector(p + "input_layernorm.weight"));
    MEMRA_BIND(w.post_norm, b.vector(p + "post_attention_layernorm.weight"));
    MEMRA_BIND(w.attn.q, b.matrix(p + "self_attn.q_proj.weight"));
    MEMRA_BIND(w.attn.k, b.matrix(p + "self_attn.k_proj.weight"));
    MEMRA_BIND(w.attn.v, b.matrix(p + "self_attn.v_proj.weight"));
    MEMRA_BIND(w.attn.o, b.matrix(p + "self_attn.o_proj.weight"));
    if (cfg.use_head_wise_attn_gate) {
        MEMRA_BIND(w.attn.g, b.matrix(p + "self_attn.g_proj.weight"));
    }
    MEMRA_BIND(w.attn.q_norm, b.vector(p + "self_attn.q_norm.weight"));
    MEMRA_BIND(w.attn.k_norm, b.vector(p + "self_attn.k_norm.weight"));
    if (g.ffn == FfnKind::kDense) {
        MEMRA_BIND(w.mlp.gate, b.matrix(p + "mlp.gate_proj.weight"));
        MEMRA_BIND(w.mlp.up, b.matrix(p + "mlp.up_proj.weight"));
        MEMRA_BIND(w.mlp.down, b.matrix(p + "mlp.down_proj.weight"));
    } else {
        MEMRA_BIND(w.moe.router, b.matrix(p + "moe.gate.weight"));
        MEMRA_BIND(w.moe.router_bias, b.vector(p + "moe.router_bias"));
        MEMRA_BIND(w.moe.gate, b.bank(p + "moe.gate_proj.weight"));
        MEMRA_BIND(w.moe.up, b.bank(p + "moe.up_proj.weight"));
        MEMRA_BIND(w.moe.down, b.bank(p + "moe.down_proj.weight"));
        MEMRA_BIND(w.moe.shared.gate, b.matrix(p + "share_expert.gate_proj.weight"));
        MEMRA_BIND(w.moe.shared.up, b.matrix(p + "share_expert.up_proj.weight"));
        MEMRA_BIND(w.moe.shared.down, b.matrix(p + "share_expert.down_proj.weight"));
    }
    if (g.is_mtp) {
        MEMRA_BIND(w.mtp.enorm, b.vector(p + "enorm.weight"));
        MEMRA_BIND(w.mtp.hnorm, b.vector(p + "hnorm.weight"));
        MEMRA_BIND(w.mtp.eh_proj, b.matrix(p + "eh_proj.weight"));
        MEMRA_BIND(w.mtp.head_norm, b.vector(p + "transformer.shared_head.norm.weight"));
        MEMRA_BIND(w.mtp.head, b.matrix(p + "transformer.shared_head.output.weight"));
    }
    return w;
}

}  // namespace

Result<Step35Model> bind_step35_model(Backend &backend, const io::Checkpoint &ckpt, const Step35Config &cfg) {
    std::vector<io::TensorInfo> infos;
    infos.reserve(ckpt.n_tensors());
    for (const std::string &name : ckpt.names()) {
        infos.push_back(*ckpt.find(name));
    }
    auto valid = check_tensors(cfg, infos);
    if (!valid) return tl::unexpected(valid.error());

    Binder b(backend, ckpt, cfg);
    Step35Model model;
    model.cfg = cfg;
    MEMRA_BIND(model.embed, b.matrix("model.embed_tokens.weight"));
    MEMRA_BIND(model.final_norm, b.vector("model.norm.weight"));
    if (cfg.tie_word_embeddings) {
        model.lm_head = model.embed;
    } else {
        MEMRA_BIND(model.lm_head, b.matrix("lm_head.weight"));
    }
    model.layers.reserve(cfg.layers.size());
    for (const LayerGeometry &g : cfg.layers) {
        auto layer = bind_layer(b, cfg, g);
        if (!layer) return tl::unexpected(layer.error());
        model.layers.push_back(*layer);
    }
    return model;
}

#undef MEMRA_BIND

}  // namespace memra::model
