// The Step-3.5 forward recipe over the Backend interface: validation of a step's chunks, the per-step KV
// transactions, the decoder layer (attention block, dense or MoE FFN), the MTP layer and the logits head.
// Which op runs in which order lives here and nowhere else; how an op computes lives in the backend. On a
// tensor-parallel rank the same recipe runs over the rank's shard; the three exchanges (row-parallel
// subtree sums, EP expert rows, logit slices) go through all_gather / broadcast below and nowhere else.
#include "model/step35_forward.h"

#include <algorithm>
#include <utility>

#include "core/check.h"

namespace memra::model {

namespace {

kv::KvLayerSpec kv_layer_spec(const LayerGeometry &g) {
    return kv::KvLayerSpec{g.n_kv_heads, g.head_dim, g.attn == AttnKind::kSliding ? g.window : 0};
}

kv::KvCacheSpec make_spec(const Step35Config &cfg, int first, int count, kv::KvFormat k_format,
                          kv::KvFormat v_format, int64_t capacity, int max_stage_rows) {
    kv::KvCacheSpec spec;
    for (int i = first; i < first + count; ++i) {
        spec.layers.push_back(kv_layer_spec(cfg.layers[static_cast<size_t>(i)]));
    }
    spec.k_format = k_format;
    spec.v_format = v_format;
    spec.capacity = capacity;
    spec.max_stage_rows = max_stage_rows;
    return spec;
}

// Allocates a flat buffer of n elements.
Result<TensorView> alloc_flat(Backend &backend, DType dtype, int64_t n) {
    return backend.alloc(dtype, {std::max<int64_t>(n, 1)});
}

}  // namespace

kv::KvCacheSpec trunk_kv_spec(const Step35Config &cfg, kv::KvFormat k_format, kv::KvFormat v_format,
                              int64_t capacity, int max_stage_rows) {
    return make_spec(cfg, 0, cfg.n_layers, k_format, v_format, capacity, max_stage_rows);
}

kv::KvCacheSpec mtp_kv_spec(const Step35Config &cfg, int mtp, kv::KvFormat k_format, kv::KvFormat v_format,
                            int64_t capacity, int max_stage_rows) {
    MEMRA_CHECK(mtp >= 0 && mtp < cfg.n_mtp_layers, "mtp_kv_spec: MTP layer {} of {}", mtp, cfg.n_mtp_layers);
    return make_spec(cfg, cfg.n_layers + mtp, 1, k_format, v_format, capacity, max_stage_rows);
}

namespace {

// Narrows the spec of layers [first, first + count) to the rank's KV heads.
kv::KvCacheSpec rank_spec(kv::KvCacheSpec spec, const parallel::RankPlan &rank, int first) {
    MEMRA_CHECK(first + static_cast<int>(spec.layers.size()) <= static_cast<int>(rank.layers.size()),
                "rank KV spec: layers [{}, {}) of a rank holding {}", first, first + spec.layers.size(),
                rank.layers.size());
    for (size_t i = 0; i < spec.layers.size(); ++i) {
        spec.layers[i].n_kv_heads = rank.layers[static_cast<size_t>(first) + i].kv_heads.size();
    }
    return spec;
}

}  // namespace

kv::KvCacheSpec trunk_kv_spec(const Step35Config &cfg, const parallel::RankPlan &rank, kv::KvFormat k_format,
                              kv::KvFormat v_format, int64_t capacity, int max_stage_rows) {
    return rank_spec(trunk_kv_spec(cfg, k_format, v_format, capacity, max_stage_rows), rank, 0);
}

kv::KvCacheSpec mtp_kv_spec(const Step35Config &cfg, const parallel::RankPlan &rank, int mtp, kv::KvFormat k_format,
                            kv::KvFormat v_format, int64_t capacity, int max_stage_rows) {
    return rank_spec(mtp_kv_spec(cfg, mtp, k_format, v_format, capacity, max_stage_rows), rank, cfg.n_layers + mtp);
}

Result<Step35Forward> Step35Forward::create(Backend &backend, const Step35Model &model, const ForwardCapacity &cap) {
    if (!model.shard.whole) {
        return make_error("forward: the model is the shard of TP rank {} of {}; create its forward with a RankContext",
                          model.shard.rank.tp_rank, model.shard.tp);
    }
    return create_impl(backend, model, cap, nullptr);
}

Result<Step35Forward> Step35Forward::create(Backend &backend, const Step35Model &model, const ForwardCapacity &cap,
                                            const RankContext &ctx) {
    if (ctx.plan == nullptr || ctx.comm == nullptr) {
        return make_error("forward: a rank context needs the plan and the rank's communicator");
    }
    const parallel::ParallelPlan &plan = *ctx.plan;
    if (model.shard.whole) {
        return make_error("forward: the model was bound whole; bind it for rank {} of the plan to run it on a rank",
                          ctx.rank);
    }
    if (plan.request.pipeline_stages != 1 || plan.request.tp != model.shard.tp || plan.request.ep != model.shard.ep ||
        ctx.rank != model.shard.rank.rank) {
        return make_error("forward: rank {} of a plan with tp={} ep={} ({} stages), but the model is the shard of rank "
                          "{} of tp={} ep={}",
                          ctx.rank, plan.request.tp, plan.request.ep, plan.request.pipeline_stages,
                          model.shard.rank.rank, model.shard.tp, model.shard.ep);
    }
    if (ctx.comm->size() != plan.request.tp || ctx.comm->rank() != ctx.rank) {
        return make_error("forward: the communicator is rank {} of {}, the context rank {} of tp={}", ctx.comm->rank(),
                          ctx.comm->size(), ctx.rank, plan.request.tp);
    }
    return create_impl(backend, model, cap, ctx.comm);
}

Result<Step35Forward> Step35Forward::create_impl(Backend &backend, const Step35Model &model,
                                                 const ForwardCapacity &cap, parallel::Communicator *comm) {
    const Step35Config &cfg = model.cfg;
    if (cap.max_tokens < 1 || cap.max_seqs < 1 || cap.max_context < 1 || cap.max_logit_rows < 0) {
        return make_error("forward capacity: expected max_tokens, max_seqs, max_context >= 1 and max_logit_rows >= 0, "
                          "found {}, {}, {}, {}",
                          cap.max_tokens, cap.max_seqs, cap.max_context, cap.max_logit_rows);
    }
    if (cap.max_context > (int64_t{1} << 24)) {
        return make_error("forward capacity: max_context {} exceeds 2^24 positions", cap.max_context);
    }
    if (model.layers.size() != cfg.layers.size()) {
        return make_error("forward: the model binds {} layers, the config has {}", model.layers.size(),
                          cfg.layers.size());
    }
    Step35Forward f;
    f.backend_ = &backend;
    f.model_ = &model;
    f.cap_ = cap;
    if (f.cap_.max_logit_rows == 0) f.cap_.max_logit_rows = cap.max_tokens;
    f.eps_ = static_cast<float>(cfg.rms_norm_eps);
    f.comm_ = comm;
    f.tp_ = model.shard.tp;
    f.tp_rank_ = model.shard.rank.tp_rank;
    f.ep_ = model.shard.ep;

    // What this forward computes of each layer: all of it, or what the rank's plan gives it.
    for (const LayerGeometry &g : cfg.layers) {
        LayerDims dims{g.n_heads, g.n_kv_heads, g.d_ff};
        if (!model.shard.whole) {
            const parallel::RankLayerPlan &rl = model.shard.rank.layers[static_cast<size_t>(g.index)];
            dims = LayerDims{rl.q_heads.size(), rl.kv_heads.size(), rl.ff.size()};
        }
        f.dims_.push_back(dims);
    }

    const int64_t T = cap.max_tokens;
    const int64_t L = f.cap_.max_logit_rows;
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
    // their own for the expert and shared-expert down_proj).
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
    const Request requests[] = {
        {&f.ids_, DType::kI32, T},
        {&f.pos_, DType::kI64, T},
        {&f.logit_rows_, DType::kI32, L},
        {&f.x_, DType::kF32, T * d},
        {&f.a_, DType::kF32, T * d},
        {&f.f_, DType::kF32, T * d},
        {&f.mtp_x_, DType::kF32, cfg.n_mtp_layers > 0 ? T * d : 1},
        {&f.cat_, DType::kF32, cfg.n_mtp_layers > 0 ? T * 2 * d : 1},
        {&f.q_, DType::kF32, T * q_w},
        {&f.k_, DType::kF32, T * kv_w},
        {&f.v_, DType::kF32, T * kv_w},
        {&f.g_, DType::kF32, T * heads},
        {&f.att_, DType::kF32, T * q_w},
        {&f.k_ctx_, DType::kF32, cap.max_context * kv_w},
        {&f.v_ctx_, DType::kF32, cap.max_context * kv_w},
        {&f.ff_gate_, DType::kF32, T * ff_w},
        {&f.ff_up_, DType::kF32, T * ff_w},
        {&f.x_logit_, DType::kF32, L * d},
        {&f.logits_dev_, DType::kF32, L * cfg.vocab_size},
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
    f.ids_host_.resize(static_cast<size_t>(T));
    f.pos_host_.resize(static_cast<size_t>(T));
    f.logit_rows_host_.resize(static_cast<size_t>(L));
    f.kv_host_k_.resize(static_cast<size_t>(std::max(cap.max_context, T) * kv_w));
    f.kv_host_v_.resize(f.kv_host_k_.size());
    f.logits_host_.resize(static_cast<size_t>(L * cfg.vocab_size));
    f.logit_row_begin_.reserve(static_cast<size_t>(cap.max_seqs + 1));
    f.slots_.reserve(static_cast<size_t>(cap.max_seqs));
    return f;
}

TensorView Step35Forward::mat(TensorView buf, int64_t rows, int64_t cols) const {
    MEMRA_CHECK(rows >= 0 && cols >= 0 && rows * cols <= buf.numel(),
                "forward buffer of {} elements viewed as [{}, {}]",
                buf.numel(), rows, cols);
    TensorView v = buf;
    v.rank = 2;
    v.shape = {rows, cols, 0, 0};
    return v;
}

std::span<const float> Step35Forward::logits() const {
    return {logits_host_.data(), static_cast<size_t>(n_logit_rows_ * model_->cfg.vocab_size)};
}

std::span<const int64_t> Step35Forward::logit_row_begin() const { return logit_row_begin_; }

TensorView Step35Forward::hidden() const { return mat(x_, n_rows_, model_->cfg.d_model); }

TensorView Step35Forward::mtp_hidden() const { return mat(mtp_x_, n_mtp_rows_, model_->cfg.d_model); }

// Checks the slots (filled by load_*_slots) against the capacity and their caches against the layers
// [first_cache_layer, + n_cache_layers) of the config (at this rank's KV width). Changes nothing visible.
Result<void> Step35Forward::check_slots(int first_cache_layer, int n_cache_layers, int64_t n_rows,
                                        std::span<const int32_t> ids) {
    const Step35Config &cfg = model_->cfg;
    if (n_rows > cap_.max_tokens) {
        return make_error("step: {} tokens, the forward was prepared for at most {}", n_rows, cap_.max_tokens);
    }
    int64_t n_logits = 0;
    for (size_t i = 0; i < slots_.size(); ++i) {
        const Slot &s = slots_[i];
        const kv::KvCache &c = *s.cache;
        for (size_t j = 0; j < i; ++j) {
            if (slots_[j].cache == s.cache) return make_error("chunk {}: same KV cache as chunk {}", i, j);
        }
        if (c.n_layers() != n_cache_layers) {
            return make_error("chunk {}: KV cache has {} layers, expected {}", i, c.n_layers(), n_cache_layers);
        }
        for (int l = 0; l < n_cache_layers; ++l) {
            const size_t layer = static_cast<size_t>(first_cache_layer + l);
            kv::KvLayerSpec want = kv_layer_spec(cfg.layers[layer]);
            want.n_kv_heads = static_cast<int>(dims_[layer].n_kv_heads);
            const kv::KvLayerSpec &have = c.spec().layers[static_cast<size_t>(l)];
            if (have.n_kv_heads != want.n_kv_heads || have.head_dim != want.head_dim || have.window != want.window) {
                return make_error("chunk {}: KV cache layer {} is {} heads x {} window {}, layer {} needs {} x {} "
                                  "window {}",
                                  i, l, have.n_kv_heads, have.head_dim, have.window, first_cache_layer + l,
                                  want.n_kv_heads, want.head_dim, want.window);
            }
        }
        if (c.in_txn()) return make_error("chunk {}: KV cache has an open transaction", i);
        if (s.n > c.spec().max_stage_rows) {
            return make_error("chunk {}: {} tokens, the KV cache stages at most {} per step", i, s.n,
                              c.spec().max_stage_rows);
        }
        const int64_t limit = std::min(c.capacity(), cap_.max_context);
        if (s.pos0 + s.n > limit) {
            return make_error("chunk {}: positions {} .. {} exceed the context limit {} (cache capacity {}, forward "
                              "max_context {})",
                              i, s.pos0, s.pos0 + s.n - 1, limit, c.capacity(), cap_.max_context);
        }
        if (s.commit < -1 || s.commit > s.n) {
            return make_error("chunk {}: commit {} outside [-1, {}]", i, s.commit, s.n);
        }
        n_logits += s.all_logits ? s.n : 1;
    }
    if (n_logits > cap_.max_logit_rows) {
        return make_error("step: {} logit rows, the forward was prepared for at most {}", n_logits,
                          cap_.max_logit_rows);
    }
    for (size_t i = 0; i < ids.size(); ++i) {
        if (ids[i] < 0 || ids[i] >= cfg.vocab_size) {
            return make_error("step: token id {} at row {} outside the vocabulary [0, {})", ids[i], i, cfg.vocab_size);
        }
    }
    return {};
}

// Stages the checked step's ids, positions and logit rows on the backend.
void Step35Forward::stage_inputs(int64_t n_rows) {
    logit_row_begin_.clear();
    int64_t lr = 0;
    for (const Slot &s : slots_) {
        logit_row_begin_.push_back(lr);
        for (int64_t r = 0; r < s.n; ++r) {
            pos_host_[static_cast<size_t>(s.row0 + r)] = s.pos0 + r;
            if (s.all_logits || r == s.n - 1) {
                logit_rows_host_[static_cast<size_t>(lr++)] = static_cast<int32_t>(s.row0 + r);
            }
        }
    }
    logit_row_begin_.push_back(lr);
    n_logit_rows_ = lr;
    backend_->copy_from_host(ids_host_.data(), ids_.row_slice(0, n_rows));
    backend_->copy_from_host(pos_host_.data(), pos_.row_slice(0, n_rows));
    backend_->copy_from_host(logit_rows_host_.data(), logit_rows_.row_slice(0, lr));
}

Result<void> Step35Forward::begin_all() {
    for (size_t i = 0; i < slots_.size(); ++i) {
        auto txn = slots_[i].cache->begin();
        if (!txn) {
            for (size_t j = 0; j < i; ++j) {
                (void)slots_[j].cache->rollback(slots_[j].txn);
            }
            return wrap_error(fmt::format("chunk {}", i), txn.error());
        }
        slots_[i].txn = *txn;
    }
    return {};
}

void Step35Forward::rollback_all() {
    for (Slot &s : slots_) {
        auto r = s.cache->rollback(s.txn);
        MEMRA_CHECK(r.has_value(), "forward: rollback failed: {}", r ? "" : r.error().message);
    }
}

Result<void> Step35Forward::commit_all() {
    for (size_t i = 0; i < slots_.size(); ++i) {
        Slot &s = slots_[i];
        auto r = s.cache->commit(s.txn, s.commit < 0 ? s.n : s.commit);
        if (!r) {
            for (size_t j = i; j < slots_.size(); ++j) {
                (void)slots_[j].cache->rollback(slots_[j].txn);
            }
            return wrap_error(fmt::format("chunk {} commit", i), r.error());
        }
    }
    return {};
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

RowRounding query_rounding(kv::KvFormat k_format) {
    switch (k_format) {
    case kv::KvFormat::kF32: return RowRounding::kNone;
    case kv::KvFormat::kBf16: return RowRounding::kBf16;
    case kv::KvFormat::kQ8_0:
    case kv::KvFormat::kQ5_1: return RowRounding::kQ8;
    }
    MEMRA_CHECK(false, "query_rounding: unknown KV format {}", static_cast<int>(k_format));
    return RowRounding::kNone;
}

Result<void> Step35Forward::attention_block(int layer, int cache_layer, TensorView x) {
    const Step35Config &cfg = model_->cfg;
    const LayerGeometry &g = cfg.layers[static_cast<size_t>(layer)];
    const LayerWeights &w = model_->layers[static_cast<size_t>(layer)];
    const LayerDims &dims = dims_[static_cast<size_t>(layer)];
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
    be.matmul(a, w.attn.q, q);
    be.matmul(a, w.attn.k, k);
    be.matmul(a, w.attn.v, v);
    if (w.attn.g.valid()) be.matmul(a, w.attn.g, gate);
    be.rms_norm_heads(q, n_heads, g.head_dim, w.attn.q_norm, eps_);
    be.rms_norm_heads(k, n_kv_heads, g.head_dim, w.attn.k_norm, eps_);
    const TensorView pos = pos_.row_slice(0, n);  // [n] i64
    const RopeId rope = rope_[static_cast<size_t>(layer)];
    if (rope.valid()) {
        be.rope(rope, q, n_heads, g.head_dim, pos);
        be.rope(rope, k, n_kv_heads, g.head_dim, pos);
    }
    tap(layer, Tap::kQ, q);
    tap(layer, Tap::kK, k);
    tap(layer, Tap::kV, v);
    if (w.attn.g.valid()) tap(layer, Tap::kAttnGate, gate);

    // Per sequence: stage the new K/V rows, then attend over the cache's rows read back in their stored
    // format (the new ones included), so every chunking sees the same keys (rule 9).
    const TensorView att = mat(att_, n, q_w);  // [n, n_heads * head_dim]
    const AttentionParams params{n_heads, n_kv_heads, g.head_dim,
                                 g.attn == AttnKind::kSliding ? int64_t{g.window} : 0};
    for (const Slot &s : slots_) {
        const int64_t r0 = s.row0;
        const int64_t r1 = s.row0 + s.n;
        const size_t staged = static_cast<size_t>(s.n * kv_w);
        be.copy_to_host(k.row_slice(r0, r1), kv_host_k_.data());
        be.copy_to_host(v.row_slice(r0, r1), kv_host_v_.data());
        auto st = s.cache->stage(s.txn, cache_layer, {kv_host_k_.data(), staged}, {kv_host_v_.data(), staged}, s.n);
        if (!st) return wrap_error(fmt::format("layer {} KV stage", layer), st.error());
        const int64_t lo = params.window > 0 ? std::max<int64_t>(0, s.pos0 - params.window + 1) : 0;
        const int64_t hi = s.pos0 + s.n;
        const size_t ctx = static_cast<size_t>((hi - lo) * kv_w);
        auto rd = s.cache->read(cache_layer, lo, hi, {kv_host_k_.data(), ctx}, {kv_host_v_.data(), ctx});
        if (!rd) return wrap_error(fmt::format("layer {} KV read", layer), rd.error());
        const TensorView k_ctx = mat(k_ctx_, hi - lo, kv_w);  // [hi - lo, n_kv_heads * head_dim]
        const TensorView v_ctx = mat(v_ctx_, hi - lo, kv_w);
        be.copy_from_host(kv_host_k_.data(), k_ctx);
        be.copy_from_host(kv_host_v_.data(), v_ctx);
        const RowRounding q_round = query_rounding(s.cache->spec().k_format);
        if (q_round != RowRounding::kNone) be.round_rows(q.row_slice(r0, r1), q_round);
        be.attention(params, q.row_slice(r0, r1), pos.row_slice(r0, r1), k_ctx, v_ctx, lo,
                     gate.data != nullptr ? gate.row_slice(r0, r1) : TensorView{}, att.row_slice(r0, r1));
    }

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
        be.matmul(a, w.mlp.gate, gate);
        be.matmul(a, w.mlp.up, up);
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
    if (layer == tap_layer_) observe = [this, layer](MoeStage s, TensorView v) { tap(layer, moe_tap(s), v); };
    auto ok = moe.refresh(layer, a, observe);
    if (ok) ok = moe.run(x, x, observe);
    if (!ok) return wrap_error(fmt::format("layer {}", layer), ok.error());
    return {};
}

Result<void> Step35Forward::run_layer(int layer, int cache_layer, TensorView x) {
    tap(layer, Tap::kLayerIn, x);
    auto r = attention_block(layer, cache_layer, x);
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

Result<void> Step35Forward::emit_logits(TensorView x, VectorId norm, MatrixId head) {
    Backend &be = *backend_;
    const int64_t d = model_->cfg.d_model;
    const int64_t vocab = model_->cfg.vocab_size;
    const TensorView xl = mat(x_logit_, n_logit_rows_, d);  // [n_logit_rows, d_model]
    const TensorView lg = mat(logits_dev_, n_logit_rows_, vocab);
    be.gather_rows(x, logit_rows_.row_slice(0, n_logit_rows_), xl);
    be.rms_norm(xl, norm, eps_, xl);
    if (comm_ == nullptr) {
        be.matmul(xl, head, lg);
    } else {
        // Each rank its vocabulary rows; the gathered [tp, rows, vocab / tp] slices joined into [rows, vocab].
        const int64_t slice = vocab / tp_;
        const TensorView all = gathered(n_logit_rows_ * slice);
        be.matmul(xl, head, own_slot(all, n_logit_rows_, slice));
        if (auto ok = all_gather(all, "logits"); !ok) return ok;
        be.join_col_shards(all.reshaped({tp_, n_logit_rows_, slice}), lg);
    }
    be.copy_to_host(lg, logits_host_.data());
    return {};
}

Result<void> Step35Forward::begin_slots(size_t n_chunks, const char *op) {
    if (n_chunks == 0 || static_cast<int64_t>(n_chunks) > cap_.max_seqs) {
        return make_error("{}: {} chunks, expected 1 .. {}", op, n_chunks, cap_.max_seqs);
    }
    slots_.clear();
    return {};
}

Result<void> Step35Forward::add_slot(size_t i, kv::KvCache *cache, std::span<const int32_t> tokens, bool all_logits,
                                     int64_t commit, int64_t &rows) {
    if (cache == nullptr) return make_error("chunk {}: no KV cache", i);
    if (tokens.empty()) return make_error("chunk {}: no tokens", i);
    const auto n = static_cast<int64_t>(tokens.size());
    if (rows + n <= cap_.max_tokens) std::copy(tokens.begin(), tokens.end(), ids_host_.begin() + rows);
    slots_.push_back(Slot{cache, {}, rows, n, cache->length(), all_logits, commit});
    rows += n;
    return {};
}

Result<void> Step35Forward::load_trunk_slots(std::span<const SeqChunk> chunks, int64_t &rows) {
    if (auto ok = begin_slots(chunks.size(), "step"); !ok) return ok;
    rows = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
        const SeqChunk &c = chunks[i];
        if (auto ok = add_slot(i, c.cache, c.tokens, c.all_logits, c.commit, rows); !ok) return ok;
    }
    const size_t n_ids = static_cast<size_t>(std::min(rows, cap_.max_tokens));
    return check_slots(0, model_->cfg.n_layers, rows, {ids_host_.data(), n_ids});
}

Result<void> Step35Forward::check_step(std::span<const SeqChunk> chunks) {
    int64_t rows = 0;
    return load_trunk_slots(chunks, rows);
}

Result<void> Step35Forward::step(std::span<const SeqChunk> chunks) {
    const Step35Config &cfg = model_->cfg;
    int64_t rows = 0;
    if (auto ok = load_trunk_slots(chunks, rows); !ok) return ok;
    stage_inputs(rows);
    auto begun = begin_all();
    if (!begun) return begun;

    n_rows_ = rows;
    const TensorView x = mat(x_, rows, cfg.d_model);  // [rows, d_model] residual stream, replicated on ranks
    auto emb = backend_->embedding(model_->embed, ids_.row_slice(0, rows), x);
    if (!emb) {
        rollback_all();
        return emb;
    }
    for (int layer = 0; layer < cfg.n_layers; ++layer) {
        auto r = run_layer(layer, layer, x);
        if (!r) {
            rollback_all();
            return r;
        }
    }
    if (auto ok = emit_logits(x, model_->final_norm, model_->lm_head); !ok) {
        rollback_all();
        return ok;
    }
    return commit_all();
}

Result<void> Step35Forward::load_mtp_slots(int mtp, std::span<const MtpChunk> chunks, TensorView h_prev,
                                           int64_t &rows) {
    const Step35Config &cfg = model_->cfg;
    if (mtp < 0 || mtp >= cfg.n_mtp_layers) {
        return make_error("mtp_step: MTP layer {} outside [0, {})", mtp, cfg.n_mtp_layers);
    }
    if (auto ok = begin_slots(chunks.size(), "mtp_step"); !ok) return ok;
    rows = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
        const MtpChunk &c = chunks[i];
        if (auto ok = add_slot(i, c.cache, c.next_tokens, c.all_logits, c.commit, rows); !ok) return ok;
    }
    if (h_prev.dtype != DType::kF32 || h_prev.rows() != rows || h_prev.row_elems() != cfg.d_model) {
        return make_error("mtp_step: h_prev is [{}, {}] {}, expected [{}, {}] F32", h_prev.rows(), h_prev.row_elems(),
                          dtype_name(h_prev.dtype), rows, cfg.d_model);
    }
    const size_t n_ids = static_cast<size_t>(std::min(rows, cap_.max_tokens));
    return check_slots(cfg.n_layers + mtp, 1, rows, {ids_host_.data(), n_ids});
}

Result<void> Step35Forward::check_mtp_step(int mtp, std::span<const MtpChunk> chunks, TensorView h_prev) {
    int64_t rows = 0;
    return load_mtp_slots(mtp, chunks, h_prev, rows);
}

Result<void> Step35Forward::mtp_step(int mtp, std::span<const MtpChunk> chunks, TensorView h_prev) {
    const Step35Config &cfg = model_->cfg;
    int64_t rows = 0;
    if (auto ok = load_mtp_slots(mtp, chunks, h_prev, rows); !ok) return ok;
    const int layer = cfg.n_layers + mtp;
    const LayerWeights &w = model_->layers[static_cast<size_t>(layer)];
    stage_inputs(rows);
    auto begun = begin_all();
    if (!begun) return begun;

    Backend &be = *backend_;
    const int64_t d = cfg.d_model;
    const TensorView e = mat(a_, rows, d);         // [rows, d_model] RMSNorm(Embed(next token); enorm)
    const TensorView hh = mat(f_, rows, d);        // [rows, d_model] RMSNorm(h_prev; hnorm)
    const TensorView cat = mat(cat_, rows, 2 * d);  // [rows, 2 * d_model] [e | hh]
    const TensorView u = mat(mtp_x_, rows, d);     // [rows, d_model] the MTP layer's residual stream
    auto emb = be.embedding(model_->embed, ids_.row_slice(0, rows), e);
    if (!emb) {
        rollback_all();
        return emb;
    }
    be.rms_norm(e, w.mtp.enorm, eps_, e);
    be.rms_norm(h_prev, w.mtp.hnorm, eps_, hh);  // h_prev is read before u (which it may alias) is written
    be.concat_cols(e, hh, cat);
    be.matmul(cat, w.mtp.eh_proj, u);
    n_mtp_rows_ = rows;
    auto r = run_layer(layer, 0, u);
    if (!r) {
        rollback_all();
        return r;
    }
    if (auto ok = emit_logits(u, w.mtp.head_norm, w.mtp.head); !ok) {
        rollback_all();
        return ok;
    }
    return commit_all();
}

}  // namespace memra::model
