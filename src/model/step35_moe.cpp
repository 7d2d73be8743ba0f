// MoeState (step35_moe.h): the MoE layer's op sequence over the Backend interface, shared by the forward,
// `memra bench --experts` and the tests. refresh() = router, top-k, pair sort, the own pairs' rows, the shared
// expert on the side branch; run() = grouped whole-expert projections of the own pairs, the exchange of the
// owners' rows (fixed capacity or exact counts), the join of the side branch and the slot-order combine.
#include "model/step35_moe.h"

#include <algorithm>
#include <limits>
#include <span>
#include <utility>

#include <fmt/format.h>

#include "core/check.h"

namespace memra::model {

namespace {

// A flat buffer viewed as [rows, cols] (the view's extent checked against the buffer).
TensorView mat(TensorView buf, int64_t rows, int64_t cols) {
    MEMRA_CHECK(rows >= 0 && cols >= 0 && rows * cols <= buf.numel(), "MoE buffer of {} elements viewed as [{}, {}]",
                buf.numel(), rows, cols);
    TensorView v = buf;
    v.rank = 2;
    v.shape = {rows, cols, 0, 0};
    return v;
}

bool is_moe_layer(const Step35Model &model, int layer) {
    return layer >= 0 && static_cast<size_t>(layer) < model.cfg.layers.size() &&
           static_cast<size_t>(layer) < model.layers.size() &&
           model.cfg.layers[static_cast<size_t>(layer)].ffn == FfnKind::kMoe;
}

// Floats of workspace the shared expert's canonical down_proj of `layer` needs for `capacity` token rows.
int64_t workspace_floats(const Backend &backend, const Step35Model &model, int layer, int64_t capacity) {
    const LayerWeights &w = model.layers[static_cast<size_t>(layer)];
    return backend.canonical_workspace_floats(capacity, w.moe.shared.down);
}

}  // namespace

MoeShape moe_shape(const Step35Model &model, int layer) {
    MEMRA_CHECK(is_moe_layer(model, layer), "moe_shape: layer {} is not a MoE layer of the model", layer);
    const LayerGeometry &g = model.cfg.layers[static_cast<size_t>(layer)];
    MoeShape s{model.cfg.d_model, g.n_experts, g.top_k, g.d_expert, g.d_shared, parallel::Range{0, g.n_experts}};
    if (!model.shard.whole) s.experts = model.shard.rank.layers[static_cast<size_t>(layer)].experts;
    return s;
}

int64_t moe_owner_capacity(int64_t n_tokens, int64_t top_k, int64_t held) {
    return n_tokens * std::min(top_k, held);
}

Result<MoeState> MoeState::create(Backend &backend, const Step35Model &model, int layer, int64_t capacity,
                                  parallel::Communicator *comm) {
    if (model.layers.size() != model.cfg.layers.size()) {
        return make_error("moe state: the model binds {} layers, the config has {}", model.layers.size(),
                          model.cfg.layers.size());
    }
    if (layer < 0 || static_cast<size_t>(layer) >= model.cfg.layers.size()) {
        return make_error("moe state: layer {} outside the model's {} layers", layer, model.cfg.layers.size());
    }
    if (!is_moe_layer(model, layer)) return make_error("moe state: layer {} is a dense layer, not MoE", layer);
    const MoeShape shape = moe_shape(model, layer);
    const int64_t max_pairs = std::numeric_limits<int32_t>::max();
    if (capacity < 1 || capacity > max_pairs / shape.top_k) {
        return make_error("moe state: capacity {} rows, expected 1 .. {} ({} pairs of top-{} fit int32 offsets)",
                          capacity, max_pairs / shape.top_k, max_pairs, shape.top_k);
    }
    if (model.shard.whole && comm != nullptr) {
        return make_error("moe state: the model is bound whole; a whole model runs without a communicator");
    }
    if (!model.shard.whole) {
        if (comm == nullptr) {
            return make_error("moe state: the model is the shard of TP rank {} of {}; it needs the rank's communicator",
                              model.shard.rank.tp_rank, model.shard.tp);
        }
        if (comm->size() != model.shard.tp || comm->rank() != model.shard.rank.tp_rank) {
            return make_error("moe state: the communicator is rank {} of {}, the model the shard of rank {} of tp={}",
                              comm->rank(), comm->size(), model.shard.rank.tp_rank, model.shard.tp);
        }
    }

    MoeState s;
    s.backend_ = &backend;
    s.model_ = &model;
    s.shape_ = shape;
    s.capacity_ = capacity;
    s.comm_ = comm;
    s.tp_ = model.shard.tp;
    s.tp_rank_ = model.shard.rank.tp_rank;

    const int64_t T = capacity;
    const int64_t pairs = T * shape.top_k;
    const int64_t C = moe_owner_capacity(T, shape.top_k, shape.experts.size());
    const int64_t d = shape.d_model;
    struct Request {
        TensorView *view;
        DType dtype;
        int64_t n;
    };
    const Request requests[] = {
        {&s.router_, DType::kF32, T * shape.n_experts},
        {&s.ids_, DType::kI32, pairs},
        {&s.weights_, DType::kF32, pairs},
        {&s.offsets_, DType::kI32, shape.n_experts + 1},
        {&s.sorted_pair_, DType::kI32, pairs},
        {&s.row_of_pair_, DType::kI32, pairs},
        {&s.src_row_, DType::kI32, pairs},
        {&s.x_own_, DType::kF32, C * d},
        {&s.e_gate_, DType::kF32, C * shape.d_expert},
        {&s.e_up_, DType::kF32, C * shape.d_expert},
        {&s.e_out_, DType::kF32, s.tp_ * C * d},
        {&s.s_gate_, DType::kF32, T * shape.d_shared},
        {&s.s_up_, DType::kF32, T * shape.d_shared},
        {&s.shared_, DType::kF32, T * d},
        {&s.workspace_, DType::kF32, workspace_floats(backend, model, layer, T)},
    };
    for (const Request &r : requests) {
        auto v = backend.alloc(r.dtype, {std::max<int64_t>(r.n, 1)});
        if (!v) return wrap_error(fmt::format("moe state buffers (capacity {})", capacity), v.error());
        *r.view = *v;
    }
    s.host_offsets_.resize(static_cast<size_t>(shape.n_experts + 1));
    return s;
}

bool MoeState::serves(int layer) const {
    return is_moe_layer(*model_, layer) && moe_shape(*model_, layer) == shape_ &&
           workspace_floats(*backend_, *model_, layer, capacity_) <= workspace_.numel();
}

Result<void> MoeState::refresh(int layer, TensorView x, const MoeObserver &observe) {
    if (!serves(layer)) {
        if (!is_moe_layer(*model_, layer)) {
            return make_error("moe refresh: layer {} is not a MoE layer of the model", layer);
        }
        const MoeShape o = moe_shape(*model_, layer);
        return make_error("moe refresh: layer {} has {} experts (held {} .. {}) top-{} of width {} and a shared "
                          "expert of {}; the state was prepared for {} experts (held {} .. {}) top-{} of width {} "
                          "and {}",
                          layer, o.n_experts, o.experts.begin, o.experts.end, o.top_k, o.d_expert, o.d_shared,
                          shape_.n_experts, shape_.experts.begin, shape_.experts.end, shape_.top_k, shape_.d_expert,
                          shape_.d_shared);
    }
    const int64_t d = shape_.d_model;
    if (x.dtype != DType::kF32 || x.rank != 2 || x.row_elems() != d) {
        return make_error("moe refresh: x is [{}, {}] {}, expected [n, {}] F32", x.rows(), x.row_elems(),
                          dtype_name(x.dtype), d);
    }
    const int64_t n = x.rows();
    if (n < 1 || n > capacity_) {
        return make_error("moe refresh: {} rows, the state was prepared for 1 .. {} rows", n, capacity_);
    }

    // Routing is replicated: every rank computes the same router bits, selections and sorted pairs.
    const Step35Config &cfg = model_->cfg;
    const LayerGeometry &g = cfg.layers[static_cast<size_t>(layer)];
    const LayerWeights &w = model_->layers[static_cast<size_t>(layer)];
    Backend &be = *backend_;
    const int64_t k = shape_.top_k;
    const TensorView logits = mat(router_, n, shape_.n_experts);  // [n, n_experts] f32 router logits
    const TensorView ids = mat(ids_, n, k);                        // [n, top_k] i32
    const TensorView weights = mat(weights_, n, k);                // [n, top_k] f32
    const TensorView offsets = mat(offsets_, shape_.n_experts + 1, 1);
    const TensorView sorted_pair = mat(sorted_pair_, n * k, 1);  // [n * top_k] i32
    const TensorView row_of_pair = mat(row_of_pair_, n * k, 1);
    const int64_t own = moe_owner_capacity(n, k, shape_.experts.size());
    const TensorView x_own = mat(x_own_, own, d);  // [own capacity, d_model], the own pairs in expert order
    // The shared expert needs only x: it runs on the side branch (Backend::side_fork), alongside the routing and
    // the routed experts, whose latency-bound launches leave the memory idle; run() joins it before the combine.
    be.side_fork();
    // The source rows too: where each pair's expert row lies once the owners' rows are gathered (routed_experts).
    be.moe_route(
        x, w.moe.router,
        RouterConfig{g.n_experts, k, cfg.norm_expert_weight, static_cast<float>(cfg.moe_router_scaling_factor)},
        w.moe.router_bias,
        MoeRouteViews{logits, ids, weights, offsets, sorted_pair, row_of_pair, mat(src_row_, n * k, 1), tp_, own});
    if (observe) {
        observe(MoeStage::kRouterLogits, logits);
        observe(MoeStage::kExpertIds, ids);
        observe(MoeStage::kExpertWeights, weights);
    }
    be.moe_permute(x, sorted_pair, offsets, shape_.experts.begin, shape_.experts.end, k, x_own);

    // The shared expert is replicated: every rank computes it whole.
    const TensorView s_gate = mat(s_gate_, n, shape_.d_shared);  // [n, d_shared]
    const TensorView s_up = mat(s_up_, n, shape_.d_shared);
    const MatrixId shared_w[] = {w.moe.shared.gate, w.moe.shared.up};
    const TensorView shared_y[] = {s_gate, s_up};
    be.side_begin();
    be.matmul_multi(x, shared_w, shared_y);
    be.swiglu(s_gate, s_up, g.clamp_shared, s_gate);
    be.matmul_canonical(s_gate, w.moe.shared.down, mat(shared_, n, d), workspace_);
    be.side_end();
    layer_ = layer;
    n_ = n;
    ++generation_;
    return {};
}

Result<void> MoeState::run(TensorView residual, TensorView out, const MoeObserver &observe) {
    if (generation_ == 0) return make_error("moe run: nothing routed yet; refresh the state first");
    const int64_t d = shape_.d_model;
    for (const auto &[name, v] : {std::pair{"residual", residual}, std::pair{"out", out}}) {
        if (v.dtype != DType::kF32 || v.rank != 2 || v.rows() != n_ || v.row_elems() != d) {
            return make_error("moe run: {} is [{}, {}] {}, expected [{}, {}] F32 (the rows of the last refresh)",
                              name, v.rows(), v.row_elems(), dtype_name(v.dtype), n_, d);
        }
    }
    if (auto ok = routed_experts(observe); !ok) return ok;

    Backend &be = *backend_;
    be.side_join();                                 // the shared expert, issued by refresh
    const TensorView shared = mat(shared_, n_, d);  // [n, d_model]
    if (observe) observe(MoeStage::kSharedOut, shared);
    // out = residual + (routed + shared), each pair's row read through src_row, added in canonical slot order.
    const int64_t pairs = n_ * shape_.top_k;
    be.moe_combine(residual, mat(e_out_, tp_ * own_capacity(), d), mat(src_row_, pairs, 1),
                   mat(weights_, n_, shape_.top_k), shared, out);
    return {};
}

int64_t MoeState::own_capacity() const { return moe_owner_capacity(n_, shape_.top_k, shape_.experts.size()); }

// e_out[owner slot, j] = expert(x_own[j]) for the own pairs; after the exchange every owner's slot on every
// rank; src_row tells each pair where its row is.
Result<void> MoeState::routed_experts(const MoeObserver &observe) {
    const LayerGeometry &g = model_->cfg.layers[static_cast<size_t>(layer_)];
    const LayerWeights &w = model_->layers[static_cast<size_t>(layer_)];
    Backend &be = *backend_;
    const int64_t C = own_capacity();
    const int64_t d = shape_.d_model;
    const TensorView offsets = mat(offsets_, shape_.n_experts + 1, 1);
    const TensorView x_own = mat(x_own_, C, d);
    const TensorView e_gate = mat(e_gate_, C, shape_.d_expert);  // [C, d_expert]
    const TensorView e_up = mat(e_up_, C, shape_.d_expert);
    const TensorView all = mat(e_out_, tp_ * C, d);  // [tp * C, d_model]: slot r = rank r's own rows
    const TensorView own = all.row_slice(tp_rank_ * C, (tp_rank_ + 1) * C);
    const auto seen = [&observe](MoeStage stage, TensorView v) {
        if (observe) observe(stage, v);
    };
    be.matmul_grouped_pair(x_own, w.moe.gate, w.moe.up, offsets, e_gate, e_up);
    seen(MoeStage::kExpertGate, e_gate);
    seen(MoeStage::kExpertUp, e_up);
    // Over the whole capacity: the rows past the own pair count are stale and never read. The activation goes
    // into e_gate.
    be.matmul_grouped_swiglu(e_gate, e_up, g.clamp_routed, w.moe.down, offsets, own);
    seen(MoeStage::kExpertAct, e_gate);
    seen(MoeStage::kExpertDownOwn, own);
    if (comm_ != nullptr) {
        const bool exact = exchange_ == MoeExchange::kExact ||
                           (exchange_ == MoeExchange::kAuto &&
                            (be.device() == Device::kCpu || n_ > kFixedExchangeMaxRows));
        auto ok = exact ? exchange_exact(all)
                        : gather_rank_slots(*comm_, tp_, tp_rank_, all, "expert rows", comm_counters_);
        if (!ok) return ok;
    }
    seen(MoeStage::kExpertDown, all);
    return {};
}

Result<void> MoeState::exchange_exact(TensorView all) {
    // Owner o holds experts [o E / tp, (o + 1) E / tp) (moe_source_rows), so its row count is the difference of
    // two offsets, which every rank has: a host-memory backend's buffer is read in place, a device's is copied.
    const int32_t *offsets = host_offsets_.data();
    if (backend_->device() == Device::kCpu) {
        offsets = static_cast<const int32_t *>(offsets_.data);
    } else {
        backend_->copy_to_host(mat(offsets_, shape_.n_experts + 1, 1), host_offsets_.data());
    }
    const auto count = [&](int o) {
        const int64_t per = shape_.n_experts / tp_;
        return int64_t{offsets[(o + 1) * per]} - offsets[o * per];
    };
    const size_t row = static_cast<size_t>(shape_.d_model) * sizeof(float);
    const size_t slot = static_cast<size_t>(own_capacity()) * row;
    const std::span<std::byte> bytes(static_cast<std::byte *>(all.data), all.n_bytes());
    const std::span<std::byte> mine = bytes.subspan(static_cast<size_t>(tp_rank_) * slot, static_cast<size_t>(count(tp_rank_)) * row);
    ++comm_counters_.exchanges;
    if (auto ok = comm_->group_start(); !ok) return wrap_error("expert rows exchange", ok.error());
    Result<void> posted;
    for (int p = 0; p < tp_ && posted; ++p) {
        if (p == tp_rank_) continue;
        const size_t theirs = static_cast<size_t>(count(p)) * row;
        comm_counters_.bytes += static_cast<int64_t>(theirs);
        // Both sides know both counts, so an empty send and its empty recv are skipped alike.
        if (!mine.empty()) posted = comm_->send(mine, p);
        if (posted && theirs > 0) posted = comm_->recv(bytes.subspan(static_cast<size_t>(p) * slot, theirs), p);
    }
    // group_end runs even after a refused post, so no peer waits on this rank's half-posted group.
    auto ended = comm_->group_end();
    if (!posted) return wrap_error("expert rows exchange", posted.error());
    if (!ended) return wrap_error("expert rows exchange", ended.error());
    return {};
}

void MoeState::read_routing(MoeRouting &out) const {
    MEMRA_CHECK(generation_ > 0, "moe state: routing before the first refresh");
    const int64_t k = shape_.top_k;
    const auto pairs = static_cast<size_t>(n_ * k);
    out.n_tokens = n_;
    out.top_k = k;
    out.n_experts = shape_.n_experts;
    out.expert_ids.resize(pairs);
    out.weights.resize(pairs);
    out.offsets.resize(static_cast<size_t>(shape_.n_experts + 1));
    out.sorted_pair.resize(pairs);
    out.row_of_pair.resize(pairs);
    const MoeBuffers b = buffers();
    backend_->copy_to_host(b.expert_ids, out.expert_ids.data());
    backend_->copy_to_host(b.expert_weights, out.weights.data());
    backend_->copy_to_host(b.offsets, out.offsets.data());
    backend_->copy_to_host(b.sorted_pair, out.sorted_pair.data());
    backend_->copy_to_host(b.row_of_pair, out.row_of_pair.data());
}

MoeBuffers MoeState::buffers() const {
    const int64_t n = n_;
    const int64_t k = shape_.top_k;
    const int64_t d = shape_.d_model;
    const int64_t C = own_capacity();
    MoeBuffers b;
    b.capacity = C;
    b.router_logits = mat(router_, n, shape_.n_experts);
    b.expert_ids = mat(ids_, n, k);
    b.expert_weights = mat(weights_, n, k);
    b.offsets = mat(offsets_, shape_.n_experts + 1, 1);
    b.sorted_pair = mat(sorted_pair_, n * k, 1);
    b.row_of_pair = mat(row_of_pair_, n * k, 1);
    b.x_own = mat(x_own_, C, d);
    b.expert_act = mat(e_gate_, C, shape_.d_expert);
    b.expert_up = mat(e_up_, C, shape_.d_expert);
    b.expert_out = mat(e_out_, tp_ * C, d);
    b.src_row = mat(src_row_, n * k, 1);
    b.shared_out = mat(shared_, n, d);
    return b;
}

Result<void> gather_rank_slots(parallel::Communicator &comm, int tp, int rank, TensorView all, const char *what,
                               CommCounters &counters) {
    // all: [tp, m] with this rank's slot (row `rank`) filled; afterwards every slot is filled.
    const size_t bytes = all.n_bytes();
    const size_t slot = bytes / static_cast<size_t>(tp);
    const std::span<std::byte> recv(static_cast<std::byte *>(all.data), bytes);
    ++counters.all_gathers;
    counters.bytes += static_cast<int64_t>(bytes);
    auto ok = comm.all_gather(recv.subspan(static_cast<size_t>(rank) * slot, slot), recv);
    if (!ok) return wrap_error(fmt::format("{} all_gather", what), ok.error());
    return {};
}

}  // namespace memra::model
