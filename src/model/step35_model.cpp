// Binding a validated Step-3.5 checkpoint (any io::TensorStore) to backend handles: every tensor is looked up
// by its official name and described to the backend as a matrix, an expert bank or a vector (fp8 weights with
// their "_scale_inv" companions). Validation comes first, so the lookups here only fail on a broken invariant.
// A TP rank binds windows of the same tensors, as its RankLayerPlan says. Each tensor read for an upload is given
// back to the store afterwards when the backend copied it (the store's lifetime rule, io/tensor_store.h).
#include "model/step35_model.h"

#include <string>
#include <vector>

#include <fmt/format.h>

#include "model/step35_plan.h"
#include "model/step35_weights.h"

namespace memra::model {

namespace {

// The part of a matrix (or of each expert of a bank) a rank binds: all of it, output rows [begin, end), or
// K columns [begin, end).
struct Cut {
    enum class Axis { kWhole, kRows, kCols };
    Axis axis = Axis::kWhole;
    int64_t begin = 0;
    int64_t end = 0;

    static Cut whole() { return Cut{}; }
    static Cut rows(int64_t b, int64_t e) { return Cut{Axis::kRows, b, e}; }
    static Cut cols(int64_t b, int64_t e) { return Cut{Axis::kCols, b, e}; }
    // The cut scaled from heads (or other units) to rows / columns.
    static Cut rows(parallel::Range r, int64_t unit) { return rows(r.begin * unit, r.end * unit); }
    static Cut cols(parallel::Range r, int64_t unit) { return cols(r.begin * unit, r.end * unit); }
};

// The tensors one upload reads from the store: given back when the upload is over (successful or not) if the
// backend made its own copy, kept otherwise (the backend's views point into them).
class Lease {
public:
    Lease(const io::TensorStore &store, bool give_back) : store_(store), give_back_(give_back) {}
    Lease(const Lease &) = delete;
    Lease &operator=(const Lease &) = delete;
    ~Lease() {
        if (!give_back_) return;
        for (const std::string &name : names_) store_.release(name);
    }

    Result<io::TensorRef> get(const std::string &name) {
        auto ref = store_.get(name);
        if (ref) names_.push_back(name);
        return ref;
    }

private:
    const io::TensorStore &store_;
    bool give_back_;
    std::vector<std::string> names_;
};

class Binder {
public:
    Binder(Backend &backend, const io::TensorStore &store, const Step35Config &cfg)
        : backend_(backend), store_(store), cfg_(cfg) {}

    // f32_activations: the product keeps f32 activations in every numerics mode (the router).
    Result<MatrixId> matrix(const std::string &name, Cut cut = Cut::whole(), bool f32_activations = false) {
        Lease lease = open_lease();
        auto ref = lease.get(name);
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
        auto scale = fp8_scale(lease, name, info.dtype, m.block_rows, m.block_cols);
        if (!scale) return tl::unexpected(scale.error());
        m.scale_inv = *scale;
        m.f32_activations = f32_activations;
        if (cut.axis == Cut::Axis::kWhole) return wrap(name, backend_.upload_matrix(m));
        MatrixWindow w = MatrixWindow::whole(m);
        if (cut.axis == Cut::Axis::kRows) {
            w.row_begin = cut.begin;
            w.row_end = cut.end;
        } else {
            w.col_begin = cut.begin;
            w.col_end = cut.end;
        }
        return wrap(name, backend_.upload_matrix_window(m, w));
    }

    // experts: the experts held whole (a TP rank's own), or empty for all of them.
    Result<BankId> bank(const std::string &name, parallel::Range experts = {}) {
        Lease lease = open_lease();
        auto ref = lease.get(name);
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
        auto scale = fp8_scale(lease, name, info.dtype, b.block_rows, b.block_cols);
        if (!scale) return tl::unexpected(scale.error());
        b.scale_inv = *scale;
        if (experts.empty()) return wrap(name, backend_.upload_bank(b));
        return wrap(name, backend_.upload_bank_window(b, BankWindow{experts.begin, experts.end}));
    }

    Result<VectorId> vector(const std::string &name) {
        Lease lease = open_lease();
        auto ref = lease.get(name);
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
    Result<const float *> fp8_scale(Lease &lease, const std::string &name, DType dtype, int64_t &block_rows,
                                    int64_t &block_cols) {
        if (dtype != DType::kF8E4M3) return static_cast<const float *>(nullptr);
        const std::string scale_name = name + std::string(kFp8ScaleSuffix);
        auto ref = lease.get(scale_name);
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

    Lease open_lease() const { return Lease(store_, !backend_.keeps_host_views()); }

    Backend &backend_;
    const io::TensorStore &store_;
    const Step35Config &cfg_;
};

// Assigns *out from a Result or returns its error from the enclosing function.
#define MEMRA_BIND(out, expr)                              \
    do {                                                   \
        auto bound_ = (expr);                              \
        if (!bound_) return tl::unexpected(bound_.error()); \
        (out) = *bound_;                                   \
    } while (0)

// rl: the rank's part of the layer, or nullptr for the whole layer.
Result<LayerWeights> bind_layer(Binder &b, const Step35Config &cfg, const LayerGeometry &g,
                                const parallel::RankLayerPlan *rl, parallel::Range vocab) {
    const std::string p = fmt::format("model.layers.{}.", g.index);
    const int64_t hd = g.head_dim;
    // Column-parallel (rows) and row-parallel (K columns) cuts of this rank; whole without a plan.
    const Cut q_rows = rl ? Cut::rows(rl->q_heads, hd) : Cut::whole();
    const Cut kv_rows = rl ? Cut::rows(rl->kv_heads, hd) : Cut::whole();
    const Cut g_rows = rl ? Cut::rows(rl->q_heads, 1) : Cut::whole();
    const Cut o_cols = rl ? Cut::cols(rl->o_cols, 1) : Cut::whole();
    LayerWeights w;
    MEMRA_BIND(w.input_norm, b.vector(p + "input_layernorm.weight"));
    MEMRA_BIND(w.post_norm, b.vector(p + "post_attention_layernorm.weight"));
    MEMRA_BIND(w.attn.q, b.matrix(p + "self_attn.q_proj.weight", q_rows));
    MEMRA_BIND(w.attn.k, b.matrix(p + "self_attn.k_proj.weight", kv_rows));
    MEMRA_BIND(w.attn.v, b.matrix(p + "self_attn.v_proj.weight", kv_rows));
    MEMRA_BIND(w.attn.o, b.matrix(p + "self_attn.o_proj.weight", o_cols));
    if (cfg.use_head_wise_attn_gate) {
        MEMRA_BIND(w.attn.g, b.matrix(p + "self_attn.g_proj.weight", g_rows));
    }
    MEMRA_BIND(w.attn.q_norm, b.vector(p + "self_attn.q_norm.weight"));
    MEMRA_BIND(w.attn.k_norm, b.vector(p + "self_attn.k_norm.weight"));
    if (g.ffn == FfnKind::kDense) {
        const Cut ff_rows = rl ? Cut::rows(rl->ff, 1) : Cut::whole();
        const Cut ff_cols = rl ? Cut::cols(rl->ff, 1) : Cut::whole();
        MEMRA_BIND(w.mlp.gate, b.matrix(p + "mlp.gate_proj.weight", ff_rows));
        MEMRA_BIND(w.mlp.up, b.matrix(p + "mlp.up_proj.weight", ff_rows));
        MEMRA_BIND(w.mlp.down, b.matrix(p + "mlp.down_proj.weight", ff_cols));
    } else {
        // Routed experts whole: a rank binds its own, the whole model all of them.
        const parallel::Range experts = rl ? rl->experts : parallel::Range{};
        MEMRA_BIND(w.moe.router, b.matrix(p + "moe.gate.weight", Cut::whole(), /*f32_activations=*/true));
        MEMRA_BIND(w.moe.router_bias, b.vector(p + "moe.router_bias"));
        MEMRA_BIND(w.moe.gate, b.bank(p + "moe.gate_proj.weight", experts));
        MEMRA_BIND(w.moe.up, b.bank(p + "moe.up_proj.weight", experts));
        MEMRA_BIND(w.moe.down, b.bank(p + "moe.down_proj.weight", experts));
        MEMRA_BIND(w.moe.shared.gate, b.matrix(p + "share_expert.gate_proj.weight"));
        MEMRA_BIND(w.moe.shared.up, b.matrix(p + "share_expert.up_proj.weight"));
        MEMRA_BIND(w.moe.shared.down, b.matrix(p + "share_expert.down_proj.weight"));
    }
    if (g.is_mtp) {
        MEMRA_BIND(w.mtp.enorm, b.vector(p + "enorm.weight"));
        MEMRA_BIND(w.mtp.hnorm, b.vector(p + "hnorm.weight"));
        MEMRA_BIND(w.mtp.eh_proj, b.matrix(p + "eh_proj.weight"));
        MEMRA_BIND(w.mtp.head_norm, b.vector(p + "transformer.shared_head.norm.weight"));
        const Cut head_rows = rl ? Cut::rows(vocab, 1) : Cut::whole();
        MEMRA_BIND(w.mtp.head, b.matrix(p + "transformer.shared_head.output.weight", head_rows));
    }
    return w;
}

Result<void> check_store(const io::TensorStore &store, const Step35Config &cfg) {
    std::vector<io::TensorInfo> infos;
    infos.reserve(store.n_tensors());
    for (const std::string &name : store.names()) {
        infos.push_back(*store.find(name));
    }
    return check_tensors(cfg, infos);
}

// rank: the TP rank's plan, or nullptr for the whole model.
Result<Step35Model> bind(Backend &backend, const io::TensorStore &store, const Step35Config &cfg,
                         const parallel::RankPlan *rank) {
    Binder b(backend, store, cfg);
    Step35Model model;
    model.cfg = cfg;
    const parallel::Range vocab = rank ? rank->vocab : parallel::Range{0, cfg.vocab_size};
    MEMRA_BIND(model.embed, b.matrix("model.embed_tokens.weight"));
    MEMRA_BIND(model.final_norm, b.vector("model.norm.weight"));
    if (rank == nullptr && cfg.tie_word_embeddings) {
        model.lm_head = model.embed;
    } else {
        const char *head = cfg.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
        MEMRA_BIND(model.lm_head, b.matrix(head, rank ? Cut::rows(vocab, 1) : Cut::whole()));
    }
    model.layers.reserve(cfg.layers.size());
    for (const LayerGeometry &g : cfg.layers) {
        const parallel::RankLayerPlan *rl = rank ? &rank->layers[static_cast<size_t>(g.index)] : nullptr;
        auto layer = bind_layer(b, cfg, g, rl, vocab);
        if (!layer) return tl::unexpected(layer.error());
        model.layers.push_back(*layer);
    }
    return model;
}

bool same_layer_plan(const parallel::RankLayerPlan &a, const parallel::RankLayerPlan &b) {
    return a.layer == b.layer && a.q_heads == b.q_heads && a.kv_heads == b.kv_heads && a.o_cols == b.o_cols &&
           a.o_blocks == b.o_blocks && a.ff == b.ff && a.ff_blocks == b.ff_blocks && a.experts == b.experts;
}

}  // namespace

Result<Step35Model> bind_step35_model(Backend &backend, const io::TensorStore &store, const Step35Config &cfg) {
    // One rank still cuts every row-parallel product into the canonical K blocks: the TP=1 plan says whether
    // the config's widths allow them.
    if (auto one = parallel::make_plan(plan_shape(cfg), parallel::PlanRequest{}); !one) {
        return wrap_error("bind: the config cannot run even on one rank", one.error());
    }
    if (auto valid = check_store(store, cfg); !valid) return tl::unexpected(valid.error());
    return bind(backend, store, cfg, nullptr);
}

Result<Step35Model> bind_step35_model(Backend &backend, const io::TensorStore &store, const Step35Config &cfg,
                                      const parallel::ParallelPlan &plan, int rank) {
    const parallel::PlanRequest &req = plan.request;
    if (req.pipeline_stages != 1) {
        return make_error("bind: the plan has {} pipeline stages; the Step-3.5 forward runs one stage of tp ranks",
                          req.pipeline_stages);
    }
    if (rank < 0 || rank >= plan.n_ranks || static_cast<size_t>(rank) >= plan.ranks.size()) {
        return make_error("bind: rank {} outside the plan's {} ranks", rank, plan.n_ranks);
    }
    // The plan must be the one the config gives: rebuilt here and compared, so a plan made for another
    // model (or edited) cannot bind wrong slices.
    auto expected = parallel::make_plan(plan_shape(cfg), req);
    if (!expected) return wrap_error("bind: the plan does not fit the config", expected.error());
    const parallel::RankPlan &have = plan.ranks[static_cast<size_t>(rank)];
    const parallel::RankPlan &want = expected->ranks[static_cast<size_t>(rank)];
    if (have.layers.size() != cfg.layers.size() || have.vocab != want.vocab || have.tp_rank != want.tp_rank) {
        return make_error("bind: rank {} of the plan holds {} layers and vocabulary [{}, {}); the config gives {} "
                          "layers and [{}, {})",
                          rank, have.layers.size(), have.vocab.begin, have.vocab.end, cfg.layers.size(),
                          want.vocab.begin, want.vocab.end);
    }
    for (size_t i = 0; i < have.layers.size(); ++i) {
        if (!same_layer_plan(have.layers[i], want.layers[i])) {
            return make_error("bind: rank {} layer {} of the plan differs from the plan the config gives", rank, i);
        }
    }
    if (auto valid = check_store(store, cfg); !valid) return tl::unexpected(valid.error());
    auto model = bind(backend, store, cfg, &have);
    if (!model) return model;
    model->shard.whole = false;
    model->shard.tp = req.tp;
    model->shard.rank = have;
    return model;
}

#undef MEMRA_BIND

}  // namespace memra::model
