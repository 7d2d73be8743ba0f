// The Step-3.5 forward recipe over the Backend interface: the decoder layer (attention block over the paged
// KV pools, dense or MoE FFN), the MTP layers and the logits head, run over a step's tables. Which op runs in
// which order lives here and nowhere else; how an op computes lives in the backend; what rows a step holds
// is the engine's. On a tensor-parallel rank the same recipe runs over the rank's shard; the exchanges
// (row-parallel subtree sums, logit slices; the MoE state's expert rows) go through all_gather below and in
// the MoE state, nowhere else.
#include "model/step35_forward.h"

#include <algorithm>
#include <span>
#include <utility>

#include "core/check.h"

namespace memra::model {

namespace {

// Allocates a flat buffer of n elements.
Result<TensorView> alloc_flat(Backend &backend, DType dtype, int64_t n) {
    return backend.alloc(dtype, {std::max<int64_t>(n, 1)});
}

}  // namespace

int64_t max_blocks(const ForwardCapacity &cap) { return (cap.max_context + kKvPageRows - 1) / kKvPageRows; }

KvPoolLayout kv_pool_layout(const Step35Config &cfg, int n_mtp) {
    MEMRA_CHECK(n_mtp >= 0 && n_mtp <= cfg.n_mtp_layers, "kv_pool_layout: {} MTP layers of {}", n_mtp,
                cfg.n_mtp_layers);
    KvPoolLayout out;
    out.pool_layer.assign(cfg.layers.size(), -1);
    out.in_swa.assign(cfg.layers.size(), false);
    for (const LayerGeometry &g : cfg.layers) {
        if (g.is_mtp && g.index - cfg.n_layers >= n_mtp) continue;
        const auto i = static_cast<size_t>(g.index);
        if (g.attn == AttnKind::kSliding || g.is_mtp) {
            out.pool_layer[i] = static_cast<int>(out.swa_layers.size());
            out.in_swa[i] = true;
            out.swa_layers.push_back(g.index);
            out.window = std::max<int64_t>(out.window, g.window > 0 ? g.window : cfg.context_length);
        } else {
            out.pool_layer[i] = static_cast<int>(out.full_layers.size());
            out.full_layers.push_back(g.index);
        }
    }
    return out;
}

std::vector<KvPoolLayer> kv_pool_layers(const Step35Config &cfg, const std::vector<int> &layers,
                                        const parallel::RankPlan *rank) {
    std::vector<KvPoolLayer> out;
    for (const int l : layers) {
        const LayerGeometry &g = cfg.layers[static_cast<size_t>(l)];
        const int heads = rank != nullptr ? rank->layers[static_cast<size_t>(l)].kv_heads.size() : g.n_kv_heads;
        out.push_back(KvPoolLayer{heads, g.head_dim});
    }
    return out;
}

RowRounding query_rounding(KvFormat k_format, Numerics numerics) {
    switch (k_format) {
    case KvFormat::kF32: return numerics == Numerics::kDevice ? RowRounding::kBf16 : RowRounding::kNone;
    case KvFormat::kBf16: return RowRounding::kBf16;
    case KvFormat::kQ8_0:
    case KvFormat::kQ5_1: return RowRounding::kQ8;
    }
    MEMRA_CHECK(false, "query_rounding: unknown KV format {}", static_cast<int>(k_format));
    return RowRounding::kNone;
}

Result<Step35Forward> Step35Forward::create(Backend &backend, const Step35Model &model, const ForwardCapacity &cap,
                                            const ForwardKv &kv) {
    if (!model.shard.whole) {
        return make_error("forward: the model is the shard of TP rank {} of {}; create its forward with a RankContext",
                          model.shard.rank.tp_rank, model.shard.tp);
    }
    return create_impl(backend, model, cap, kv, nullptr);
}

Result<Step35Forward> Step35Forward::create(Backend &backend, const Step35Model &model, const ForwardCapacity &cap,
                                            const ForwardKv &kv, const RankContext &ctx) {
    if (ctx.plan == nullptr || ctx.comm == nullptr) {
        return make_error("forward: a rank context needs the plan and the rank's communicator");
    }
    const parallel::ParallelPlan &plan = *ctx.plan;
    if (model.shard.whole) {
        return make_error("forward: the model was bound whole; bind it for rank {} of the plan to run it on a rank",
                          ctx.rank);
    }
    if (plan.request.pipeline_stages != 1 || plan.request.tp != model.shard.tp || ctx.rank != model.shard.rank.rank) {
        return make_error("forward: rank {} of a plan with tp={} ({} stages), but the model is the shard of rank {} of "
                          "tp={}",
                          ctx.rank, plan.request.tp, plan.request.pipeline_stages, model.shard.rank.rank,
                          model.shard.tp);
    }
    if (ctx.comm->size() != plan.request.tp || ctx.comm->rank() != ctx.rank) {
        return make_error("forward: the communicator is rank {} of {}, the context rank {} of tp={}", ctx.comm->rank(),
                          ctx.comm->size(), ctx.rank, plan.request.tp);
    }
    return create_impl(backend, model, cap, kv, ctx.comm);
}

Result<Step35Forward> Step35Forward::create_impl(Backend &backend, const Step35Model &model,
                                                 const ForwardCapacity &cap, const ForwardKv &kv,
                                                 parallel::Communicator *comm) {
    const Step35Config &cfg = model.cfg;
    if (cap.max_rows < 1 || cap.max_seqs < 1 || cap.max_context < 1 || cap.max_logit_rows < 1) {
        return make_error("forward capacity: expected max_rows, max_seqs, max_context, max_logit_rows >= 1, found "
                          "{}, {}, {}, {}",
                          cap.max_rows, cap.max_seqs, cap.max_context, cap.max_logit_rows);
    }
    if (cap.max_context > (int64_t{1} << 24)) {
        return make_error("forward capacity: max_context {} exceeds 2^24 positions", cap.max_context);
    }
    if (cap.n_mtp < 0 || cap.n_mtp > cfg.n_mtp_layers || cap.n_mtp > kMaxMtp) {
        return make_error("forward capacity: {} MTP layers, the model has {}", cap.n_mtp, cfg.n_mtp_layers);
    }
    if (cap.carry_rows < 0) return make_error("forward capacity: {} carry rows", cap.carry_rows);
    if (model.layers.size() != cfg.layers.size() || kv.pool_layer.size() != cfg.layers.size()) {
        return make_error("forward: the model binds {} layers and the KV layout covers {}, the config has {}",
                          model.layers.size(), kv.pool_layer.size(), cfg.layers.size());
    }
    Step35Forward f;
    f.backend_ = &backend;
    f.model_ = &model;
    f.cap_ = cap;
    f.kv_ = kv;
    const KvPoolId any_pool = kv.full.valid() ? kv.full : kv.swa;
    if (!any_pool.valid()) return make_error("forward: no KV pool");
    f.eps_ = static_cast<float>(cfg.rms_norm_eps);
    f.comm_ = comm;
    f.tp_ = model.shard.tp;
    f.tp_rank_ = model.shard.rank.tp_rank;

    // What this forward computes of each layer: all of it, or what the rank's plan gives it.
    for (const LayerGeometry &g : cfg.layers) {
        LayerDims dims{g.n_heads, g.n_kv_heads, g.d_ff};
        if (!model.shard.whole) {
            const parallel::RankLayerPlan &rl = model.shard.rank.layers[static_cast<size_t>(g.index)];
            dims = LayerDims{rl.q_heads.size(), rl.kv_heads.size(), rl.ff.size()};
        }
        f.dims_.push_back(dims);
        const bool runs = !g.is_mtp || g.index - cfg.n_layers < cap.n_mtp;
        if (runs && kv.pool_layer[static_cast<size_t>(g.index)] < 0) {
            return make_error("forward: layer {} has no KV pool layer", g.index);
        }
    }

    const int64_t T = cap.max_rows;
    const int64_t L = cap.max_logit_rows;
    const int64_t d = cfg.d_model;
    int64_t q_w = 0, kv_w = 0, heads = 0, ff_w = 0;
    for (const LayerGeometry &g : cfg.layers) {
        const LayerDims &dims = f.dims_[static_cast<size_t>(g.index)];
        q_w = std::max<int64_t>(q_w, dims.n_heads * g.head_dim);
        kv_w = std::max<int64_t>(kv_w, dims.n_kv_heads * g.head_dim);
        heads = std::max<int64_t>(heads, dims.n_heads);
        ff_w = std::max<int64_t>(ff_w, dims.d_ff);
    }

    // RoPE tables, one per distinct (rot_dim, theta, scaled) variant.
    struct Variant {
        int rot_dim;
        double theta;
        bool scaled;
        RopeId id;
    };
    std::vector<Variant> variants;
    RopeScalingParams llama3;
    llama3.factor = cfg.rope_scaling.factor;
    llama3.low_freq_factor = cfg.rope_scaling.low_freq_factor;
    llama3.high_freq_factor = cfg.rope_scaling.high_freq_factor;
    llama3.original_max_position_embeddings = static_cast<double>(cfg.rope_scaling.original_max_position_embeddings);
    f.rope_.assign(cfg.layers.size(), RopeId{});
    for (const LayerGeometry &g : cfg.layers) {
        if (!g.uses_rope) continue;
        const bool scaled = g.rope_scaled && cfg.rope_scaling.present;
        auto it = std::find_if(variants.begin(), variants.end(), [&](const Variant &v) {
            return v.rot_dim == g.rot_dim && v.theta == g.rope_theta && v.scaled == scaled;
        });
        if (it == variants.end()) {
            auto id = backend.create_rope_table(g.rot_dim, g.rope_theta, scaled ? &llama3 : nullptr, cap.max_context);
            if (!id) return wrap_error(fmt::format("layer {} RoPE table", g.index), id.error());
            variants.push_back(Variant{g.rot_dim, g.rope_theta, scaled, *id});
            it = variants.end() - 1;
        }
        f.rope_[static_cast<size_t>(g.index)] = it->id;
    }

    // Workspace of the canonical (row-parallel) products: the largest any layer needs (the MoE states hold
    // their own for the shared expert's down_proj).
    int64_t ws = 0;
    for (size_t i = 0; i < cfg.layers.size(); ++i) {
        const LayerWeights &w = model.layers[i];
        ws = std::max(ws, backend.canonical_workspace_floats(T, w.attn.o));
        if (cfg.layers[i].ffn == FfnKind::kDense) ws = std::max(ws, backend.canonical_workspace_floats(T, w.mlp.down));
    }

    struct Request {
        TensorView *view;
        DType dtype;
        int64_t n;
    };
    // A stream another MTP layer reads keeps its carry rows after the step rows.
    const auto stream_rows = [&](int stream) {
        if (stream > cap.n_mtp) return int64_t{0};
        return T + (stream < cap.n_mtp ? cap.carry_rows : 0);
    };
    const Request requests[] = {
        {&f.x_, DType::kF32, stream_rows(0) * d},
        {&f.mtp_x_[0], DType::kF32, std::max<int64_t>(1, stream_rows(1) * d)},
        {&f.mtp_x_[1], DType::kF32, std::max<int64_t>(1, stream_rows(2) * d)},
        {&f.mtp_x_[2], DType::kF32, std::max<int64_t>(1, stream_rows(3) * d)},
        {&f.a_, DType::kF32, T * d},
        {&f.f_, DType::kF32, T * d},
        {&f.cat_, DType::kF32, cap.n_mtp > 0 ? T * 2 * d : 1},
        {&f.q_, DType::kF32, T * q_w},
        {&f.k_, DType::kF32, T * kv_w},
        {&f.v_, DType::kF32, T * kv_w},
        {&f.g_, DType::kF32, T * heads},
        {&f.att_, DType::kF32, T * q_w},
        {&f.ff_gate_, DType::kF32, T * ff_w},
        {&f.ff_up_, DType::kF32, T * ff_w},
        {&f.x_logit_, DType::kF32, L * d},
        {&f.logits_, DType::kF32, L * cfg.vocab_size},
        {&f.workspace_, DType::kF32, ws},
    };
    for (const Request &r : requests) {
        auto v = alloc_flat(backend, r.dtype, r.n);
        if (!v) return wrap_error("forward buffers", v.error());
        *r.view = *v;
    }
    if (comm != nullptr) {
        // One slot per rank: the row-parallel subtree sums ([n, d] per token row) and the logit slices
        // ([L, vocab / tp]). The routed experts' exchange is the MoE states'.
        const int64_t n = std::max(f.tp_ * T * d, L * cfg.vocab_size);
        auto v = alloc_flat(backend, DType::kF32, n);
        if (!v) return wrap_error("forward gather buffer", v.error());
        f.gather_ = *v;
    }
    // MoE layers of one shape share a state: they run one after the other, and its buffers are only scratch.
    f.moe_of_layer_.assign(cfg.layers.size(), -1);
    for (const LayerGeometry &g : cfg.layers) {
        if (g.ffn != FfnKind::kMoe) continue;
        auto it = std::find_if(f.moe_.begin(), f.moe_.end(), [&](const MoeState &m) { return m.serves(g.index); });
        if (it == f.moe_.end()) {
            auto state = MoeState::create(backend, model, g.index, T, comm);
            if (!state) return wrap_error(fmt::format("layer {}", g.index), state.error());
            f.moe_.push_back(std::move(*state));
            it = f.moe_.end() - 1;
        }
        f.moe_of_layer_[static_cast<size_t>(g.index)] = static_cast<int>(it - f.moe_.begin());
    }
    return f;
}

TensorView Step35Forward::mat(TensorView buf, int64_t rows, int64_t cols) const {
    MEMRA_CHECK(rows >= 0 && cols >= 0 && rows * cols <= buf.numel(), "forward buffer of {} elements viewed as [{}, {}]",
                buf.numel(), rows, cols);
    TensorView v = buf;
    v.rank = 2;
    v.shape = {rows, cols, 0, 0};
    return v;
}

TensorView Step35Forward::logits(int64_t rows) const {
    MEMRA_CHECK(rows >= 0 && rows <= cap_.max_logit_rows, "forward logits: {} rows of {}", rows, cap_.max_logit_rows);
    return mat(logits_, rows, model_->cfg.vocab_size);
}

TensorView Step35Forward::hidden(int stream, int64_t rows) const {
    MEMRA_CHECK(stream >= 0 && stream <= cap_.n_mtp && rows >= 0 && rows <= cap_.max_rows, "forward hidden: stream {} "
                "rows {}", stream, rows);
    return mat(stream == 0 ? x_ : mtp_x_[stream - 1], rows, model_->cfg.d_model);
}

Result<void> Step35Forward::run(const StepTables &t) {
    for (int s = 0; s <= cap_.n_mtp; ++s) {
        if (auto ok = run_stream(t, s); !ok) return ok;
    }
    return {};
}

Result<void> Step35Forward::run_stream(const StepTables &t, int stream) {
    MEMRA_CHECK(stream >= 0 && stream <= cap_.n_mtp, "forward: stream {} of {} MTP layers", stream, cap_.n_mtp);
    const StreamTables &s = t.streams[stream];
    if (s.n_rows == 0) return {};
    if (auto ok = stream == 0 ? run_trunk(t) : run_mtp(t, stream - 1); !ok) return ok;
    // The rows the next step's MTP rows read, saved past the step rows.
    if (cap_.carry_rows > 0 && stream < cap_.n_mtp) {
        const TensorView buf = stream == 0 ? x_ : mtp_x_[stream - 1];
        const int64_t d = model_->cfg.d_model;
        backend_->scatter_rows(hidden(stream, s.n_rows), s.carry_dst,
                               mat(buf, cap_.max_rows + cap_.carry_rows, d).row_slice(cap_.max_rows,
                                                                                      cap_.max_rows + cap_.carry_rows));
    }
    return {};
}

Result<void> Step35Forward::run_trunk(const StepTables &t) {
    const Step35Config &cfg = model_->cfg;
    const StreamTables &s = t.streams[0];
    const TensorView x = mat(x_, s.n_rows, cfg.d_model);  // [rows, d_model] residual stream, replicated on ranks
    if (auto ok = backend_->embedding(model_->embed, s.ids, x); !ok) return ok;
    for (int layer = 0; layer < cfg.n_layers; ++layer) {
        if (auto ok = run_layer(layer, t, 0, x); !ok) return ok;
    }
    if (s.n_logit_rows == 0) return {};
    return emit_logits(s, x, model_->final_norm, model_->lm_head);
}

// MTP layer `mtp` (config layer n_layers + mtp, STEP35.md 4.8): row p takes the token at p + 1 (ids) and the
// previous stream's hidden row (hidden_src: the trunk's h_p for the first MTP layer, MTP layer k - 1's row
// p - 1 after it): u = eh_proj([enorm(embed(token)) | hnorm(h)]), then a decoder block and the MTP head.
Result<void> Step35Forward::run_mtp(const StepTables &t, int mtp) {
    const Step35Config &cfg = model_->cfg;
    const int layer = cfg.n_layers + mtp;
    const LayerWeights &w = model_->layers[static_cast<size_t>(layer)];
    const StreamTables &s = t.streams[1 + mtp];
    Backend &be = *backend_;
    const int64_t n = s.n_rows;
    const int64_t d = cfg.d_model;
    const TensorView e = mat(a_, n, d);         // [n, d_model] RMSNorm(Embed(next token); enorm)
    const TensorView hh = mat(f_, n, d);        // [n, d_model] RMSNorm(h_prev; hnorm)
    const TensorView cat = mat(cat_, n, 2 * d);  // [n, 2 * d_model] [e | hh]
    const TensorView u = mat(mtp_x_[mtp], n, d);  // [n, d_model] the MTP layer's residual stream
    if (auto ok = be.embedding(model_->embed, s.ids, e); !ok) return ok;
    be.rms_norm(e, w.mtp.enorm, eps_, e);
    // The previous stream's rows of this step, then its carry rows.
    const int64_t src_rows = cap_.max_rows + cap_.carry_rows;
    be.gather_rows(mat(mtp == 0 ? x_ : mtp_x_[mtp - 1], src_rows, d), s.hidden_src, hh);
    be.rms_norm(hh, w.mtp.hnorm, eps_, hh);
    be.concat_cols(e, hh, cat);
    be.matmul(cat, w.mtp.eh_proj, u);
    if (auto ok = run_layer(layer, t, 1 + mtp, u); !ok) return ok;
    if (s.n_logit_rows == 0) return {};
    return emit_logits(s, u, w.mtp.head_norm, w.mtp.head);
}

const char *tap_name(Tap tap) {
    switch (tap) {
    case Tap::kLayerIn: return "layer_in";
    case Tap::kAttnNorm: return "attn_norm";
    case Tap::kQ: return "q";
    case Tap::kK: return "k";
    case Tap::kV: return "v";
    case Tap::kAttnGate: return "attn_gate";
    case Tap::kAttnOut: return "attn_out";
    case Tap::kOProj: return "o_proj";
    case Tap::kResidual: return "residual";
    case Tap::kFfnNorm: return "ffn_norm";
    case Tap::kRouterLogits: return "router_logits";
    case Tap::kExpertIds: return "expert_ids";
    case Tap::kExpertWeights: return "expert_weights";
    case Tap::kExpertGate: return "expert_gate";
    case Tap::kExpertUp: return "expert_up";
    case Tap::kExpertAct: return "expert_act";
    case Tap::kExpertDownOwn: return "expert_down_own";
    case Tap::kExpertDown: return "expert_down";
    case Tap::kSharedOut: return "shared_out";
    case Tap::kLayerOut: return "layer_out";
    }
    MEMRA_CHECK(false, "tap_name: unknown tap {}", static_cast<int>(tap));
    return "";
}

void Step35Forward::set_tap(int layer, TapFn fn) {
    tap_layer_ = fn ? layer : -1;
    tap_fn_ = std::move(fn);
}

Result<void> Step35Forward::attention_block(int layer, const StepTables &t, int stream, TensorView x) {
    const Step35Config &cfg = model_->cfg;
    const LayerGeometry &g = cfg.layers[static_cast<size_t>(layer)];
    const LayerWeights &w = model_->layers[static_cast<size_t>(layer)];
    const LayerDims &dims = dims_[static_cast<size_t>(layer)];
    const StreamTables &s = t.streams[stream];
    Backend &be = *backend_;
    const int64_t n = x.rows();
    const int64_t d = cfg.d_model;
    // On a TP rank: its query heads and the KV heads they read; the whole layer otherwise.
    const int64_t n_heads = dims.n_heads;
    const int64_t n_kv_heads = dims.n_kv_heads;
    const int64_t q_w = n_heads * g.head_dim;
    const int64_t kv_w = n_kv_heads * g.head_dim;

    const TensorView a = mat(a_, n, d);  // [n, d_model] RMSNorm_in(x)
    be.rms_norm(x, w.input_norm, eps_, a);
    tap(layer, Tap::kAttnNorm, a);
    const TensorView q = mat(q_, n, q_w);    // [n, n_heads * head_dim]
    const TensorView k = mat(k_, n, kv_w);   // [n, n_kv_heads * head_dim]
    const TensorView v = mat(v_, n, kv_w);   // [n, n_kv_heads * head_dim]
    const TensorView gate = w.attn.g.valid() ? mat(g_, n, n_heads) : TensorView{};  // [n, n_heads] logits
    // q, k, v and the head gate (when the layer has one) from the one normed x.
    const MatrixId proj_w[] = {w.attn.q, w.attn.k, w.attn.v, w.attn.g};
    const TensorView proj_y[] = {q, k, v, gate};
    const size_t n_proj = w.attn.g.valid() ? 4 : 3;
    be.matmul_multi(a, std::span(proj_w, n_proj), std::span(proj_y, n_proj));
    // q and k normalised and rotated, the step's new K/V rows into their slots, the query rounded for the keys:
    // attention then reads every key of every sequence back from the pool in its stored format, the new ones
    // included, so every chunking sees the same keys (rule 9).
    const auto li = static_cast<size_t>(layer);
    const bool swa = g.attn == AttnKind::kSliding || g.is_mtp;
    const KvPoolId pool = swa ? kv_.swa : kv_.full;
    const int pool_layer = kv_.pool_layer[li];
    be.attention_prologue(AttentionInputs{q, k, v, n_heads, n_kv_heads, g.head_dim, w.attn.q_norm, w.attn.k_norm, eps_,
                                          rope_[li], s.pos, pool, pool_layer, swa ? s.slot_swa : s.slot_full,
                                          query_rounding(kv_.k_format, be.numerics())});
    tap(layer, Tap::kQ, q);
    tap(layer, Tap::kK, k);
    tap(layer, Tap::kV, v);
    if (w.attn.g.valid()) tap(layer, Tap::kAttnGate, gate);
    const TensorView att = mat(att_, n, q_w);  // [n, n_heads * head_dim]
    const AttentionParams params{n_heads, n_kv_heads, g.head_dim,
                                 g.attn == AttnKind::kSliding ? int64_t{g.window} : 0};
    // MTP layer k has no rows below position k (its row p reads layer k - 1's row p - 1).
    const int64_t first_pos = stream == 0 ? 0 : stream - 1;
    be.paged_attention(params, q, s.pos, s.seq, pool, pool_layer, swa ? t.bt_swa : t.bt_full, first_pos, gate, att);

    tap(layer, Tap::kAttnOut, att);
    const TensorView o = mat(f_, n, d);  // [n, d_model] o_proj, canonical K blocks
    if (auto ok = row_parallel(att, w.attn.o, o, "o_proj"); !ok) {
        return wrap_error(fmt::format("layer {}", layer), ok.error());
    }
    tap(layer, Tap::kOProj, o);
    be.add_rms_norm(x, o, w.post_norm, eps_, x, a);  // x = h = x + attn; a = RMSNorm_post(h)
    tap(layer, Tap::kResidual, x);
    tap(layer, Tap::kFfnNorm, a);
    return {};
}

namespace {

// The forward's tap point for a MoE state's stage.
Tap moe_tap(MoeStage stage) {
    switch (stage) {
    case MoeStage::kRouterLogits: return Tap::kRouterLogits;
    case MoeStage::kExpertIds: return Tap::kExpertIds;
    case MoeStage::kExpertWeights: return Tap::kExpertWeights;
    case MoeStage::kExpertGate: return Tap::kExpertGate;
    case MoeStage::kExpertUp: return Tap::kExpertUp;
    case MoeStage::kExpertAct: return Tap::kExpertAct;
    case MoeStage::kExpertDownOwn: return Tap::kExpertDownOwn;
    case MoeStage::kExpertDown: return Tap::kExpertDown;
    case MoeStage::kSharedOut: return Tap::kSharedOut;
    }
    MEMRA_CHECK(false, "moe_tap: unknown stage {}", static_cast<int>(stage));
    return Tap::kLayerOut;
}

}  // namespace

Result<void> Step35Forward::ffn_block(int layer, TensorView x) {
    const Step35Config &cfg = model_->cfg;
    const LayerGeometry &g = cfg.layers[static_cast<size_t>(layer)];
    const LayerWeights &w = model_->layers[static_cast<size_t>(layer)];
    const LayerDims &dims = dims_[static_cast<size_t>(layer)];
    Backend &be = *backend_;
    const int64_t n = x.rows();
    const int64_t d = cfg.d_model;
    const TensorView a = mat(a_, n, d);  // [n, d_model] RMSNorm_post(h)
    const TensorView out = mat(f_, n, d);

    if (g.ffn == FfnKind::kDense) {
        const TensorView gate = mat(ff_gate_, n, dims.d_ff);  // [n, d_ff] (a TP rank: its d_ff slice)
        const TensorView up = mat(ff_up_, n, dims.d_ff);
        const MatrixId mlp_w[] = {w.mlp.gate, w.mlp.up};
        const TensorView mlp_y[] = {gate, up};
        be.matmul_multi(a, mlp_w, mlp_y);
        be.swiglu(gate, up, g.clamp_shared, gate);
        if (auto ok = row_parallel(gate, w.mlp.down, out, "down_proj"); !ok) {
            return wrap_error(fmt::format("layer {}", layer), ok.error());
        }
        be.residual_add(x, out, x);
        return {};
    }

    // The MoE layer (step35_moe.h): x = h + (routed + shared), routed experts combined in canonical slot order.
    // A tapped layer's MoE intermediates reach the tap through the state's observer.
    MoeState &moe = moe_[static_cast<size_t>(moe_of_layer_[static_cast<size_t>(layer)])];
    MoeObserver observe;
    if (layer == tap_layer_) observe = [this, layer](MoeStage st, TensorView v) { tap(layer, moe_tap(st), v); };
    auto ok = moe.refresh(layer, a, observe);
    if (ok) ok = moe.run(x, x, observe);
    if (!ok) return wrap_error(fmt::format("layer {}", layer), ok.error());
    return {};
}

Result<void> Step35Forward::run_layer(int layer, const StepTables &t, int stream, TensorView x) {
    tap(layer, Tap::kLayerIn, x);
    auto r = attention_block(layer, t, stream, x);
    if (!r) return r;
    r = ffn_block(layer, x);
    if (r) tap(layer, Tap::kLayerOut, x);
    return r;
}

// y = x . W^T for a row-parallel weight: TP = 1 forms all 8 canonical blocks here; a TP rank forms its
// aligned subtree sum into its slot, the ranks all-gather the slots and every rank finishes the same tree.
Result<void> Step35Forward::row_parallel(TensorView x, MatrixId w, TensorView y, const char *what) {
    Backend &be = *backend_;
    if (comm_ == nullptr) {
        be.matmul_canonical(x, w, y, workspace_);
        return {};
    }
    const TensorView all = gathered(y.numel());  // [tp, rows * cols]
    be.matmul_canonical(x, w, own_slot(all, y.rows(), y.row_elems()), workspace_);
    if (auto ok = all_gather(all, what); !ok) return ok;
    be.canonical_combine(all, y);
    return {};
}

TensorView Step35Forward::gathered(int64_t elems_per_rank) const { return mat(gather_, tp_, elems_per_rank); }

TensorView Step35Forward::own_slot(TensorView all, int64_t rows, int64_t cols) const {
    return all.row_slice(tp_rank_, tp_rank_ + 1).reshaped({rows, cols});
}

CommCounters Step35Forward::comm_counters() const {
    CommCounters c = comm_counters_;
    for (const MoeState &m : moe_) c += m.comm_counters();
    return c;
}

void Step35Forward::reset_comm_counters() {
    comm_counters_ = {};
    for (MoeState &m : moe_) m.reset_comm_counters();
}

Result<void> Step35Forward::all_gather(TensorView all, const char *what) {
    return gather_rank_slots(*comm_, tp_, tp_rank_, all, what, comm_counters_);
}

// The logits of a stream's logit rows into logits_ rows [logit_begin, + n_logit_rows).
Result<void> Step35Forward::emit_logits(const StreamTables &s, TensorView x, VectorId norm, MatrixId head) {
    Backend &be = *backend_;
    const int64_t d = model_->cfg.d_model;
    const int64_t vocab = model_->cfg.vocab_size;
    const int64_t rows = s.n_logit_rows;
    const TensorView xl = mat(x_logit_, rows, d);  // [rows, d_model]
    const TensorView lg = mat(logits_, s.logit_begin + rows, vocab).row_slice(s.logit_begin, s.logit_begin + rows);
    be.gather_rows(x, s.logit_rows, xl);
    be.rms_norm(xl, norm, eps_, xl);
    if (comm_ == nullptr) {
        be.matmul(xl, head, lg);
        return {};
    }
    // Each rank its vocabulary rows; the gathered [tp, rows, vocab / tp] slices joined into [rows, vocab].
    const int64_t slice = vocab / tp_;
    const TensorView all = gathered(rows * slice);
    be.matmul(xl, head, own_slot(all, rows, slice));
    if (auto ok = all_gather(all, "logits"); !ok) return ok;
    be.join_col_shards(all.reshaped({tp_, rows, slice}), lg);
    return {};
}

}  // namespace memra::model
