// The engine (engine.h): ranks, pools, sequences, and the plan -> run -> finish step.
#include "runtime/engine.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <utility>

#include <fmt/format.h>

#include "core/check.h"
#include "model/step35_plan.h"

namespace memra::runtime {

namespace {

constexpr int64_t kAlign = 8;

int64_t align_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// A [rows] view (or [rows, cols] when cols > 0) of dtype at byte `offset` of a rank's table buffer.
TensorView table_view(const TensorView &buf, int64_t offset, DType dtype, int64_t rows, int64_t cols = 0) {
    TensorView v = buf;
    v.data = static_cast<std::byte *>(buf.data) + offset;
    v.dtype = dtype;
    v.rank = cols > 0 ? 2 : 1;
    v.shape = {rows, cols > 0 ? cols : 0, 0, 0};
    return v;
}

}  // namespace

// ---- Sequence ----

Sequence::Sequence(Engine *engine, const kv::SeqKvShape &shape, const SequenceOptions &options)
    : engine_(engine), kv_(shape), sampling_(options.sampling), choice_(options.choice),
      logit_bias_(options.logit_bias) {}

Sequence::~Sequence() { engine_->release(*this); }

Result<void> Sequence::set_sampling(const SamplingParams &params) {
    if (auto ok = validate_sampling_params(params); !ok) return ok;
    sampling_ = params;
    return {};
}

Result<void> Sequence::set_logit_bias(std::span<const LogitBias> bias) {
    if (auto ok = validate_logit_bias(bias, engine_->options_.sample_vocab); !ok) return ok;
    logit_bias_.assign(bias.begin(), bias.end());
    return {};
}

// ---- Engine: creation ----

struct Engine::Rank {
    std::unique_ptr<Backend> backend;
    // EngineOptions::make_comms's communicator of this rank (null: the in-process group's): destroyed after the
    // forward that uses it and before the backend whose stream it enqueues on.
    std::unique_ptr<parallel::Communicator> comm;
    std::unique_ptr<model::Step35Model> model;  // the forward points into it
    std::optional<model::Step35Forward> forward;
    model::ForwardKv kv;
    KvPageLayout full_layout, swa_layout;
    TensorView tables;      // [table capacity] kU8: the packed step tables
    TensorView sample_out;  // [max sample rows * sizeof(SampledToken)] kU8
    model::StepTables step;  // this step's views into tables
    TensorView sample_rows, history, bias;
    int64_t d2h_at_run_end = 0;  // the backend's d2h count when run() returned (counters' d2h_before_finish)
    int64_t d2h_at_plan = 0;     // ... and when plan() began
    // fill_context's seeded rows: K and V of [fill chunk, heads * head_dim] f32 per distinct KV head range of the
    // rank's trunk layers, and the chunk's slots (the full pool's, then the sliding pool's); made by the first fill.
    struct FillRows {
        parallel::Range heads;
        int head_dim = 0;
        TensorView k, v;
    };
    std::vector<FillRows> fill;
    std::vector<int> fill_of_layer;     // [config layer] its entry of fill, -1: none (no rows stored, an MTP layer)
    TensorView fill_slots;              // [2 * fill chunk] i32
    std::optional<uint64_t> fill_seed;  // the seed fill's values are drawn with
};

Engine::~Engine() = default;

namespace {

// Values a step key holds at most (build_step_key: about 45 per stream and 30 more).
constexpr size_t kStepKeyCapacity = 512;

// Bytes the packed tables of a step need at most (the layout pack_tables uses, at the capacity).
int64_t table_capacity(const model::ForwardCapacity &cap, int64_t max_blocks, int64_t max_sample_rows,
                       int64_t max_positions, int spec_draft) {
    int64_t n = 0;
    for (int s = 0; s < model::kMaxStreamsPerStep; ++s) {
        n += 7 * align_up(cap.max_rows * 4) + align_up(cap.max_rows * 8) + align_up(cap.max_logit_rows * 4);
    }
    n += 2 * align_up(cap.max_seqs * max_blocks * 4);
    n += align_up(max_sample_rows * static_cast<int64_t>(sizeof(SampleRow)));
    // Penalty windows: one run of context tokens per sequence (a drafting one's with its draft slots after).
    n += align_up(cap.max_seqs * (max_positions + spec_draft) * 4);
    // Logit biases: one list per sampling sequence.
    n += align_up(cap.max_seqs * kMaxLogitBias * static_cast<int64_t>(sizeof(LogitBias)));
    // Draft pairs: per drafting layer and sequence, the trunk row, the later layers' draft rows, the window.
    n += spec_draft * align_up(cap.max_seqs * (2 + spec_draft) * 8);
    return n;
}

// A drafted token is sampled from the MTP logits with the sequence's noise and filters; the penalties act on
// the target's logits only (SERVING.md 2.5).
SamplingParams draft_params(SamplingParams p) {
    p.repetition_penalty = 1.0f;
    p.presence_penalty = 0.0f;
    p.frequency_penalty = 0.0f;
    return p;
}

// Pages of each pool: the full pool holds ctx_size positions plus one partial page per sequence; the sliding pool
// per sequence its window, a step's rows and an MTP lag of up to a step behind the trunk, plus two pages of slack
// at the edges (SERVING.md 1.6). blocks: the blocks one sequence may reach.
std::array<int64_t, 2> pool_pages(const model::KvPoolLayout &pools, const EngineOptions &o, int64_t blocks) {
    std::array<int64_t, 2> pages = {0, 0};
    if (!pools.full_layers.empty()) pages[0] = (o.ctx_size + kKvPageRows - 1) / kKvPageRows + o.max_seqs;
    if (!pools.swa_layers.empty()) {
        const int64_t live = (pools.window - 1 + 2 * o.step_rows + kKvPageRows - 1) / kKvPageRows + 2;
        pages[1] = int64_t{o.max_seqs} * std::min(live, blocks);
    }
    return pages;
}

}  // namespace

Result<int64_t> kv_budget_tokens(const model::Step35Config &cfg, const EngineOptions &options, int64_t bytes) {
    parallel::PlanRequest request;
    request.tp = options.tp;
    request.devices_available = options.tp;
    auto plan = parallel::make_plan(model::plan_shape(cfg), request);
    if (!plan) return wrap_error(fmt::format("KV budget: tp={}", options.tp), plan.error());
    const model::KvPoolLayout pools = model::kv_pool_layout(cfg, options.mtp_layers);
    // Bytes of one page of each pool, every rank together.
    int64_t page_bytes[2] = {0, 0};
    for (int r = 0; r < options.tp; ++r) {
        const parallel::RankPlan *rank_plan = options.tp > 1 ? &plan->ranks[static_cast<size_t>(r)] : nullptr;
        for (size_t k = 0; k < 2; ++k) {
            const std::vector<int> &layers = k == 0 ? pools.full_layers : pools.swa_layers;
            if (layers.empty()) continue;
            auto layout = kv_page_layout(KvPoolSpec{options.k_format, options.v_format, 1,
                                                    model::kv_pool_layers(cfg, layers, rank_plan)});
            if (!layout) return wrap_error("KV budget", layout.error());
            page_bytes[k] += layout->page_bytes;
        }
    }
    // The sliding pool as the longest context would size it; the full pool gets the rest.
    const auto blocks = (int64_t{cfg.context_length} + kKvPageRows - 1) / kKvPageRows;
    const int64_t swa_bytes = pool_pages(pools, options, blocks)[1] * page_bytes[1];
    const int64_t full_pages = page_bytes[0] > 0 ? (bytes - swa_bytes) / page_bytes[0] : 0;
    if (page_bytes[0] == 0 || full_pages < options.max_seqs + 1) {
        return make_error("KV budget of {} bytes: the sliding pool takes {} ({} sequences), a full-pool page {}: at "
                          "least {} bytes are needed",
                          bytes, swa_bytes, options.max_seqs, page_bytes[0],
                          swa_bytes + (options.max_seqs + 1) * page_bytes[0]);
    }
    return (full_pages - options.max_seqs) * kKvPageRows;
}

Result<std::unique_ptr<Engine>> Engine::create(const io::TensorStore &store, const model::Step35Config &cfg,
                                               const EngineOptions &options) {
    const EngineOptions &o = options;
    if (!o.make_backend) return make_error("engine: no backend factory");
    if (o.max_seqs < 1 || o.step_rows < 1 || o.ctx_size < 1 || o.max_logit_rows < 0) {
        return make_error("engine: expected max_seqs, step_rows, ctx_size >= 1 and max_logit_rows >= 0, found {}, {}, "
                          "{}, {}",
                          o.max_seqs, o.step_rows, o.ctx_size, o.max_logit_rows);
    }
    if (o.mtp_layers < 0 || o.mtp_layers > cfg.n_mtp_layers) {
        return make_error("engine: {} MTP layers requested, the model has {}", o.mtp_layers, cfg.n_mtp_layers);
    }
    if (o.spec_draft < 0 || o.spec_draft > o.mtp_layers) {
        return make_error("engine: {} drafts per step, expected 0 .. the {} MTP layers it runs", o.spec_draft,
                          o.mtp_layers);
    }
    // MTP layer k of a drafting step runs up to 1 + k catch-up rows and k draft rows.
    if (o.spec_draft > 0 && o.step_rows < 2 * int64_t{o.spec_draft}) {
        return make_error("engine: {} drafts per step need a step budget of at least {} rows, found {}", o.spec_draft,
                          2 * o.spec_draft, o.step_rows);
    }
    if (o.max_mtp_seqs < 0) return make_error("engine: max_mtp_seqs {}, expected >= 0", o.max_mtp_seqs);
    if (o.sample_vocab < 0 || o.sample_vocab > cfg.vocab_size) {
        return make_error("engine: sample_vocab {} outside [0, {}]", o.sample_vocab, cfg.vocab_size);
    }
    const bool one_rank_here = o.process_rank >= 0;
    if (o.process_rank < -1 || o.process_rank >= o.tp || (one_rank_here && (o.tp < 2 || !o.make_comms))) {
        return make_error("engine: process rank {} of tp={}, expected -1 (every rank here) or 0 .. {} with tp > 1 and "
                          "a communicator factory that reaches the other processes",
                          o.process_rank, o.tp, o.tp - 1);
    }
    const int rank_begin = one_rank_here ? o.process_rank : 0;
    const int rank_end = one_rank_here ? o.process_rank + 1 : o.tp;
    const auto n_local = static_cast<size_t>(rank_end - rank_begin);
    parallel::PlanRequest request;
    request.tp = o.tp;
    request.devices_available = o.tp;  // in-process ranks: one per requested rank
    auto plan = parallel::make_plan(model::plan_shape(cfg), request);
    if (!plan) return wrap_error(fmt::format("engine: tp={}", o.tp), plan.error());

    std::unique_ptr<Engine> e(new Engine());
    e->cfg_ = cfg;
    e->options_ = o;
    if (e->options_.sample_vocab == 0) e->options_.sample_vocab = cfg.vocab_size;
    e->plan_ = std::move(*plan);
    e->pools_ = model::kv_pool_layout(cfg, o.mtp_layers);
    const int64_t max_positions = std::min<int64_t>(o.ctx_size, cfg.context_length);
    e->seq_shape_.n_streams = 1;
    e->seq_shape_.trunk_full = !e->pools_.full_layers.empty();
    e->seq_shape_.trunk_sliding = std::any_of(e->pools_.swa_layers.begin(), e->pools_.swa_layers.end(),
                                              [&](int l) { return !cfg.layers[static_cast<size_t>(l)].is_mtp; });
    e->seq_shape_.window = e->pools_.window;
    e->seq_shape_.max_positions = max_positions;
    e->cap_.max_rows = o.step_rows;
    e->cap_.max_seqs = o.max_seqs;
    e->cap_.max_context = max_positions;
    const int64_t rows_per_seq = 1 + 2 * int64_t{o.spec_draft};  // a drafting item: 1 + k trunk rows, k drafts
    e->cap_.max_logit_rows = o.max_logit_rows > 0 ? o.max_logit_rows : o.max_seqs * rows_per_seq;
    e->cap_.n_mtp = o.mtp_layers;
    // One carry slot per live sequence with MTP streams, each two halves of kCarryRows rows.
    const int carry_slots = o.max_mtp_seqs > 0 ? o.max_mtp_seqs : o.max_seqs;
    e->cap_.carry_rows = o.mtp_layers > 0 ? int64_t{carry_slots} * 2 * kCarryRows : 0;
    if (o.mtp_layers > 0) {
        for (int slot = carry_slots - 1; slot >= 0; --slot) e->free_carry_.push_back(slot);
    }
    const int64_t blocks = model::max_blocks(e->cap_);

    const auto [full_pages, swa_pages] = pool_pages(e->pools_, o, blocks);
    if (full_pages > INT32_MAX / kKvPageRows || swa_pages > INT32_MAX / kKvPageRows) {
        return make_error("engine: {} full and {} sliding pages of {} rows exceed 2^31 slots", full_pages, swa_pages,
                          kKvPageRows);
    }
    e->full_ = kv::PagePool(static_cast<int32_t>(full_pages));
    e->swa_ = kv::PagePool(static_cast<int32_t>(swa_pages));
    if (o.prefix_cache) {
        e->prefix_ = kv::PrefixCache(e->seq_shape_, static_cast<int32_t>(full_pages), static_cast<int32_t>(swa_pages));
    }

    if (o.tp > 1 && !one_rank_here) {
        auto group = parallel::InProcessGroup::create(o.tp, o.rank_copy);
        if (!group) return wrap_error("engine", group.error());
        e->group_.emplace(std::move(*group));
    }
    const int64_t max_sample_rows = o.max_seqs * rows_per_seq;
    if (int64_t{o.max_seqs} * (max_positions + o.spec_draft) > INT32_MAX / 4) {
        return make_error("engine: the sampling history of {} sequences of {} positions exceeds 2^29 tokens; lower "
                          "the context (-c) or the sequences",
                          o.max_seqs, max_positions);
    }
    if (int64_t{o.max_seqs} * kMaxLogitBias > INT32_MAX / 8) {
        return make_error("engine: the logit biases of {} sequences of up to {} entries exceed 2^28 entries; lower "
                          "the sequences",
                          o.max_seqs, kMaxLogitBias);
    }
    const int64_t capacity = table_capacity(e->cap_, blocks, max_sample_rows, max_positions, o.spec_draft);
    std::vector<std::unique_ptr<Backend>> backends;
    std::vector<Backend *> backend_ptrs;
    std::vector<std::unique_ptr<parallel::Communicator>> comms_made;
    for (int r = rank_begin; r < rank_end; ++r) {
        auto backend = o.make_backend(r);
        if (!backend) return wrap_error(fmt::format("rank {} backend", r), backend.error());
        if (!*backend) return make_error("rank {} backend: the factory returned none", r);
        backend_ptrs.push_back(backend->get());
        backends.push_back(std::move(*backend));
    }
    if (o.tp > 1 && o.make_comms) {
        auto comms = o.make_comms(backend_ptrs);
        if (!comms) return wrap_error("engine: the ranks' communicators", comms.error());
        if ((!comms->empty() || one_rank_here) && comms->size() != n_local) {
            return make_error("engine: the communicator factory made {} communicators for {} ranks", comms->size(),
                              n_local);
        }
        for (int r = rank_begin; r < rank_begin + static_cast<int>(comms->size()); ++r) {
            const parallel::Communicator *c = (*comms)[static_cast<size_t>(r - rank_begin)].get();
            if (c == nullptr || c->rank() != r || c->size() != o.tp) {
                return make_error("engine: communicator {} is {}, expected rank {} of {}", r,
                                  c == nullptr ? std::string("missing")
                                               : fmt::format("rank {} of {}", c->rank(), c->size()),
                                  r, o.tp);
            }
        }
        comms_made = std::move(*comms);
    }
    e->first_rank_ = rank_begin;
    for (int r = rank_begin; r < rank_end; ++r) {
        auto rk = std::make_unique<Rank>();
        rk->backend = std::move(backends[static_cast<size_t>(r - rank_begin)]);
        if (!comms_made.empty()) rk->comm = std::move(comms_made[static_cast<size_t>(r - rank_begin)]);
        Backend &be = *rk->backend;
        const parallel::RankPlan *rank_plan = o.tp > 1 ? &e->plan_.ranks[static_cast<size_t>(r)] : nullptr;
        auto bound = o.tp > 1 ? model::bind_step35_model(be, store, cfg, e->plan_, r)
                              : model::bind_step35_model(be, store, cfg);
        if (!bound) return wrap_error(fmt::format("rank {} bind", r), bound.error());
        rk->model = std::make_unique<model::Step35Model>(std::move(*bound));
        rk->kv.pool_layer = e->pools_.pool_layer;
        rk->kv.k_format = o.k_format;
        for (const kv::PoolKind kind : {kv::PoolKind::kFull, kv::PoolKind::kSwa}) {
            const bool full = kind == kv::PoolKind::kFull;
            const std::vector<int> &layers = full ? e->pools_.full_layers : e->pools_.swa_layers;
            const int64_t pages = full ? full_pages : swa_pages;
            if (layers.empty()) continue;
            const KvPoolSpec spec{o.k_format, o.v_format, pages, model::kv_pool_layers(cfg, layers, rank_plan)};
            auto layout = kv_page_layout(spec);
            if (!layout) return wrap_error(fmt::format("rank {} {} KV pool", r, kv::pool_kind_name(kind)),
                                           layout.error());
            auto pool = be.create_kv_pool(spec);
            if (!pool) return wrap_error(fmt::format("rank {} {} KV pool ({} pages)", r, kv::pool_kind_name(kind), pages),
                                         pool.error());
            (full ? rk->kv.full : rk->kv.swa) = *pool;
            (full ? rk->full_layout : rk->swa_layout) = std::move(*layout);
        }
        auto fwd = o.tp > 1 ? model::Step35Forward::create(be, *rk->model, e->cap_, rk->kv,
                                                           model::RankContext{&e->plan_, r,
                                                                              rk->comm ? rk->comm.get()
                                                                                       : &e->group_->communicator(r)})
                            : model::Step35Forward::create(be, *rk->model, e->cap_, rk->kv);
        if (!fwd) return wrap_error(fmt::format("rank {} forward", r), fwd.error());
        rk->forward.emplace(std::move(*fwd));
        auto tables = be.alloc(DType::kU8, {capacity});
        auto out = be.alloc(DType::kU8, {max_sample_rows * static_cast<int64_t>(sizeof(SampledToken))});
        if (!tables || !out) return make_error("rank {}: step table buffers could not be allocated", r);
        rk->tables = *tables;
        rk->sample_out = *out;
        if (auto ok = be.prepare_sampling(cfg.vocab_size); !ok) return wrap_error(fmt::format("rank {}", r), ok.error());
        e->ranks_.push_back(std::move(rk));
    }
    e->host_tables_.assign(static_cast<size_t>(capacity), std::byte{0});
    e->sampled_.resize(static_cast<size_t>(max_sample_rows));
    e->step_seqs_.reserve(static_cast<size_t>(o.max_seqs));
    e->step_items_.reserve(static_cast<size_t>(o.max_seqs));
    e->sample_row_of_item_.reserve(static_cast<size_t>(o.max_seqs));
    e->spec_.reserve(static_cast<size_t>(o.max_seqs));
    for (int s = 0; s < kv::kMaxStreams; ++s) {
        e->logit_begin_[s].reserve(static_cast<size_t>(o.max_seqs));
        e->logit_count_[s].reserve(static_cast<size_t>(o.max_seqs));
    }
    e->run_error_.reserve(256);
    e->step_key_.reserve(kStepKeyCapacity);
    return e;
}

Result<std::unique_ptr<Sequence>> Engine::create_sequence(const SequenceOptions &options) {
    if (options.mtp_streams < 0 || options.mtp_streams > options_.mtp_layers) {
        return make_error("sequence: {} MTP streams, the engine runs {} MTP layers", options.mtp_streams,
                          options_.mtp_layers);
    }
    if (auto ok = validate_sampling_params(options.sampling); !ok) return tl::unexpected(ok.error());
    if (auto ok = validate_logit_bias(options.logit_bias, options_.sample_vocab); !ok) {
        return tl::unexpected(ok.error());
    }
    if (options.mtp_streams > 0 && free_carry_.empty()) {
        return make_error("sequence: the engine carries MTP hidden rows for {} sequences (max_mtp_seqs), all held",
                          options_.max_mtp_seqs > 0 ? options_.max_mtp_seqs : options_.max_seqs);
    }
    kv::SeqKvShape shape = seq_shape_;
    shape.n_streams = 1 + options.mtp_streams;
    std::unique_ptr<Sequence> seq(new Sequence(this, shape, options));
    if (options.mtp_streams > 0) {
        seq->carry_slot_ = free_carry_.back();
        free_carry_.pop_back();
    }
    live_.push_back(seq.get());
    return seq;
}

Result<int64_t> Engine::reuse_prefix(Sequence &seq) {
    if (seq.kv_.length(0) != 0 || seq.kv_.in_txn()) {
        return make_error("prefix cache: the sequence already has {} rows", seq.kv_.length(0));
    }
    if (phase_ != Phase::kIdle && std::find(step_seqs_.begin(), step_seqs_.end(), &seq) != step_seqs_.end()) {
        return make_error("prefix cache: the sequence is in a planned step");
    }
    if (!options_.prefix_cache || seq.n_streams() != 1) return 0;
    const kv::PrefixCache::Match m = prefix_.match(seq.tokens);
    if (m.blocks == 0) return 0;
    seq.kv_.adopt(m.full, m.swa_first, m.swa, full_, swa_);
    seq.published_ = m.blocks;
    seq.chain_ = m.chain;
    return m.blocks * kKvPageRows;
}

void Engine::clear_prefix_cache() { prefix_.clear(full_, swa_); }

namespace {

// fill_context's rows per chunk at most (fewer when a step's row budget is smaller: the sliding pool holds a
// window plus two steps' rows per sequence).
constexpr int64_t kFillRows = 512;
// Marks fill_context's Philox stream ("fill"); K's values use it, V's the next.
constexpr uint32_t kFillStream = 0x66696c6cu;

// Rows [0, rows) of fill_context's values of KV heads `heads` (whole-model indices), head_dim each: row-major
// [rows, heads * head_dim]; which = 0 for K, 1 for V. Value (r, h, d) is word d % 4 of Philox4x32-10 at counter
// (r, h, d / 4, kFillStream + which) under key (seed low, seed high): its top 24 bits scaled to [-1, 1).
std::vector<float> fill_values(uint64_t seed, uint32_t which, int64_t rows, parallel::Range heads, int head_dim) {
    std::vector<float> out;
    out.reserve(static_cast<size_t>(rows * heads.size() * head_dim));
    for (int64_t r = 0; r < rows; ++r) {
        for (int h = heads.begin; h < heads.end; ++h) {
            for (int d = 0; d < head_dim; d += 4) {
                const std::array<uint32_t, 4> w =
                    philox4x32_10({static_cast<uint32_t>(r), static_cast<uint32_t>(h), static_cast<uint32_t>(d / 4),
                                   kFillStream + which},
                                  {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
                for (int j = 0; j < 4 && d + j < head_dim; ++j) {
                    out.push_back(static_cast<float>(w[static_cast<size_t>(j)] >> 8) * (1.0f / 8388608.0f) - 1.0f);
                }
            }
        }
    }
    return out;
}

}  // namespace

Result<void> Engine::prepare_fill(Rank &rk, int rank, int64_t chunk, uint64_t seed) {
    Backend &be = *rk.backend;
    be.bind_thread();
    if (rk.fill_slots.data == nullptr) {
        auto slots = be.alloc(DType::kI32, {2 * chunk});
        if (!slots) return wrap_error(fmt::format("fill: rank {}", rank), slots.error());
        rk.fill_of_layer.assign(cfg_.layers.size(), -1);
        for (size_t l = 0; l < cfg_.layers.size(); ++l) {
            const model::LayerGeometry &g = cfg_.layers[l];
            if (pools_.pool_layer[l] < 0 || g.is_mtp) continue;
            const parallel::Range heads = options_.tp > 1 ? plan_.ranks[static_cast<size_t>(rank)].layers[l].kv_heads
                                                          : parallel::Range{0, g.n_kv_heads};
            auto same = std::find_if(rk.fill.begin(), rk.fill.end(), [&](const Rank::FillRows &f) {
                return f.heads == heads && f.head_dim == g.head_dim;
            });
            if (same == rk.fill.end()) {
                const int64_t width = int64_t{heads.size()} * g.head_dim;
                auto k = be.alloc(DType::kF32, {chunk, width});
                auto v = be.alloc(DType::kF32, {chunk, width});
                if (!k || !v) return wrap_error(fmt::format("fill: rank {}", rank), (k ? v : k).error());
                same = rk.fill.insert(rk.fill.end(), Rank::FillRows{heads, g.head_dim, *k, *v});
            }
            rk.fill_of_layer[l] = static_cast<int>(same - rk.fill.begin());
        }
        rk.fill_slots = *slots;
    }
    if (rk.fill_seed != seed) {
        for (const Rank::FillRows &f : rk.fill) {
            be.copy_from_host(fill_values(seed, 0, chunk, f.heads, f.head_dim).data(), f.k);
            be.copy_from_host(fill_values(seed, 1, chunk, f.heads, f.head_dim).data(), f.v);
        }
        rk.fill_seed = seed;
    }
    return {};
}

Result<void> Engine::fill_context(Sequence &seq, int64_t rows, uint64_t seed) {
    if (seq.engine_ != this) return make_error("fill: the sequence belongs to another engine");
    if (phase_ != Phase::kIdle) return make_error("fill: a step is planned; finish or abandon it first");
    if (seq.kv_.length(0) != 0 || seq.kv_.in_txn()) {
        return make_error("fill: the sequence already holds {} rows, expected a fresh one", seq.kv_.length(0));
    }
    if (seq.n_streams() != 1) {
        return make_error(
            "fill: the sequence has {} MTP streams, whose layers read hidden rows of the context that a "
            "fill does not make; prefill it instead",
            seq.n_streams() - 1);
    }
    const auto n_tokens = static_cast<int64_t>(seq.tokens.size());
    if (rows < 1 || rows > n_tokens) {
        return make_error("fill: {} rows, expected 1 .. the sequence's {} tokens", rows, n_tokens);
    }
    if (rows > seq_shape_.max_positions) {
        return make_error("fill: {} rows, past the {} positions a sequence reaches", rows, seq_shape_.max_positions);
    }
    const int64_t chunk = std::min(options_.step_rows, kFillRows);
    for (size_t i = 0; i < ranks_.size(); ++i) {
        if (auto ok = prepare_fill(*ranks_[i], first_rank_ + static_cast<int>(i), chunk, seed); !ok) return ok;
    }
    seq.published_ = -1;  // not the tokens' rows: never in the prefix cache
    std::vector<int32_t> slots(static_cast<size_t>(2 * chunk), 0);
    for (int64_t p = 0; p < rows; p += chunk) {
        const int64_t n = std::min(chunk, rows - p);
        const std::array<int64_t, 1> staged = {n};
        auto txn = seq.kv_.begin(staged, full_, swa_);
        if (!txn) return wrap_error(fmt::format("fill: positions {} .. {}", p, p + n - 1), txn.error());
        for (int64_t i = 0; i < n; ++i) {
            const auto at = static_cast<size_t>(i);
            if (seq_shape_.trunk_full) slots[at] = seq.kv_.slot(kv::PoolKind::kFull, p + i);
            if (seq_shape_.trunk_sliding)
                slots[static_cast<size_t>(chunk) + at] = seq.kv_.slot(kv::PoolKind::kSwa, p + i);
        }
        for (const std::unique_ptr<Rank> &rk : ranks_) {
            Backend &be = *rk->backend;
            be.bind_thread();
            be.copy_from_host(slots.data(), rk->fill_slots);
            for (size_t l = 0; l < cfg_.layers.size(); ++l) {
                const int f = rk->fill_of_layer[l];
                if (f < 0) continue;
                const Rank::FillRows &rows_of = rk->fill[static_cast<size_t>(f)];
                const bool swa = pools_.in_swa[l];
                const int64_t s0 = swa ? chunk : 0;
                be.kv_write(swa ? rk->kv.swa : rk->kv.full, pools_.pool_layer[l], rows_of.k.row_slice(0, n),
                            rows_of.v.row_slice(0, n), rk->fill_slots.row_slice(s0, s0 + n));
            }
        }
        if (auto ok = seq.kv_.commit(*txn, staged, full_, swa_); !ok) return wrap_error("fill", ok.error());
    }
    return {};
}

void Engine::publish(Sequence &seq) {
    const int64_t whole = seq.kv_.length(0) / kKvPageRows;
    const std::span<const int32_t> full = seq.kv_.block_table(kv::PoolKind::kFull);
    const std::span<const int32_t> swa = seq.kv_.block_table(kv::PoolKind::kSwa);
    for (; seq.published_ >= 0 && seq.published_ < whole; ++seq.published_) {
        const auto b = static_cast<size_t>(seq.published_);
        const std::span<const int32_t> tokens(seq.tokens.data() + b * kKvPageRows, kKvPageRows);
        const uint64_t chain = prefix_.publish(seq.chain_, tokens, full[b], swa[b], full_, swa_);
        if (chain == 0) {
            seq.published_ = -1;
            return;
        }
        seq.chain_ = chain;
    }
}

void Engine::release(Sequence &seq) {
    // The step cannot finish without it (a client unwinding between plan and finish): nothing of it commits.
    if (phase_ != Phase::kIdle && std::find(step_seqs_.begin(), step_seqs_.end(), &seq) != step_seqs_.end()) {
        abandon();
    }
    seq.kv_.release_all(full_, swa_);
    if (seq.carry_slot_ >= 0) free_carry_.push_back(seq.carry_slot_);
    live_.erase(std::remove(live_.begin(), live_.end(), &seq), live_.end());
}

// ---- The step ----

namespace {

// Logit rows a (resolved) item computes on a stream: the trunk's by `logits`; an MTP layer's every row with
// mtp_logits, or its last row when it drafts.
int64_t logit_rows_of(const StepItem &it, int stream) {
    if (stream == 0) {
        if (it.logits == LogitRows::kAll) return it.rows;
        return it.logits == LogitRows::kLast && it.rows > 0 ? 1 : 0;
    }
    if (it.draft > stream - 1) return 1;
    return it.mtp_logits ? it.mtp_rows[stream - 1] : 0;
}

int64_t stream_rows_of(const StepItem &it, int stream) { return stream == 0 ? it.rows : it.mtp_rows[stream - 1]; }

}  // namespace

bool Engine::source_ready(const Sequence &s, const StepItem &it, int stream, int64_t p) const {
    const int src = stream - 1;  // the trunk (0) or MTP layer stream - 2 (its stream index)
    const int64_t q = src == 0 ? p : p - 1;
    if (q < s.kv_.first(src)) return false;
    const int64_t in0 = s.length(src);
    const int64_t in1 = in0 + ((src == 0 && mtp_first_) ? 0 : stream_rows_of(it, src));
    if (q >= in0 && q < in1) return true;
    return s.carry_slot_ >= 0 && q >= s.carry_[src].lo && q < s.carry_[src].hi;
}

Result<void> Engine::resolve_items(std::span<const StepItem> items) {
    step_items_.clear();
    spec_.clear();
    mtp_first_ = std::any_of(items.begin(), items.end(), [](const StepItem &it) { return it.draft != 0; });
    int64_t used[kv::kMaxStreams] = {};
    for (size_t i = 0; i < items.size() && i < static_cast<size_t>(options_.max_seqs); ++i) {
        StepItem r = items[i];
        Spec sp;
        const Sequence *s = r.seq;
        if (s != nullptr && s->engine_ == this) {
            const int64_t len0 = s->length(0);
            const auto n_tokens = static_cast<int64_t>(s->tokens.size());
            if (r.draft != 0) {
                const int k = r.draft;
                if (k < 0 || k > options_.spec_draft || k >= s->n_streams()) {
                    return make_error("step item {}: {} drafts, expected 1 .. {} (the engine's spec_draft {}, the "
                                      "sequence's {} MTP layers)",
                                      i, k, std::min(options_.spec_draft, s->n_streams() - 1), options_.spec_draft,
                                      s->n_streams() - 1);
                }
                if (r.rows != 1 || n_tokens - len0 != 1 || !r.sample) {
                    return make_error("step item {}: drafting needs one pending token, rows = 1 and sample; found "
                                      "{} pending, rows {}, sample {}",
                                      i, n_tokens - len0, r.rows, r.sample);
                }
                if (r.mtp_logits) return make_error("step item {}: a drafting item computes no MTP logit rows", i);
                if (len0 < std::max(1, k - 1)) {
                    return make_error("step item {}: {} drafts need the sequence at position {} at least (MTP layer j "
                                      "drafts from its row at position {} + j), found {}",
                                      i, k, std::max(1, k - 1), len0 - 1, len0);
                }
                if (len0 + k >= max_positions()) {
                    return make_error("step item {}: {} drafts after position {} pass the sequence's {} positions",
                                      i, k, len0, max_positions());
                }
                r.rows = 1 + k;
                r.logits = LogitRows::kAll;
                r.mtp_follow = true;
            }
            if (r.mtp_follow) {
                for (int k = 0; k < model::kMaxMtp; ++k) {
                    if (r.mtp_rows[k] != 0) {
                        return make_error("step item {}: mtp_follow sets the MTP rows itself, found {} rows of MTP "
                                          "layer {}",
                                          i, r.mtp_rows[k], k);
                    }
                }
                for (int k = 0; k + 1 < s->n_streams(); ++k) {
                    const int drafts = r.draft > k ? k : 0;
                    const int64_t start = s->length(1 + k);
                    const int64_t budget = cap_.max_rows - used[1 + k] - drafts;
                    int64_t end = start;
                    // Row p takes token p + 1 and its source row.
                    while (end < n_tokens - 1 && end - start < budget && source_ready(*s, r, 1 + k, end)) ++end;
                    r.mtp_rows[k] = end - start;
                    sp.catch_up[k] = end - start;
                    if (r.draft > k) {
                        if (k == 0 && end == start) {
                            return make_error("step item {}: MTP layer 0 cannot draft: its row at position {} was "
                                              "computed in an earlier step (decode one token without drafts first)",
                                              i, len0 - 1);
                        }
                        if (end != len0) {
                            const auto [lo, hi] = s->carried(k);
                            return make_error("step item {}: MTP layer {} cannot draft: its rows reach position {}, "
                                              "the sequence is at {} (stream {} carries positions [{}, {}))",
                                              i, k, end - 1, len0 - 1, k, lo, hi);
                        }
                        r.mtp_rows[k] += drafts;
                    }
                }
            } else {
                std::copy(r.mtp_rows, r.mtp_rows + model::kMaxMtp, sp.catch_up);
            }
            for (int st = 0; st < kv::kMaxStreams; ++st) used[st] += std::max<int64_t>(0, stream_rows_of(r, st));
        }
        step_items_.push_back(r);
        spec_.push_back(sp);
    }
    return {};
}

Result<void> Engine::check_reach(const Sequence &s, const StepItem &it, std::span<const int64_t> kept) const {
    if (s.carry_slot_ < 0) return {};
    int64_t len[kv::kMaxStreams] = {}, lo[kv::kMaxStreams] = {}, hi[kv::kMaxStreams] = {};
    for (int st = 0; st < s.n_streams(); ++st) {
        const int64_t p0 = s.length(st);
        const int64_t n = stream_rows_of(it, st);
        const int64_t keep = kept[static_cast<size_t>(st)];
        len[st] = p0 + keep;
        lo[st] = s.carry_[st].lo;
        hi[st] = s.carry_[st].hi;
        if (n > 0 && keep > 0) {  // as update_carry will set it
            lo[st] = std::max(p0, p0 + n - kCarryRows);
            hi[st] = p0 + keep;
        }
    }
    for (int k = 0; k + 1 < s.n_streams(); ++k) {
        const int64_t next = len[1 + k];
        const int64_t q = k == 0 ? next : next - 1;  // the source row the next row reads
        if (q < len[k] && q >= s.kv_.first(k) && (q < lo[k] || q >= hi[k])) {
            return make_error("MTP layer {} would be left behind for good: its next row (position {}) reads {} row {}, "
                              "which would be committed but no longer carried (carried: [{}, {})); run the MTP rows "
                              "in the step of their source rows (not a prefill chunk in a drafting step, not a "
                              "budget too small for both) and keep them with it",
                              k, next, k == 0 ? std::string("trunk") : fmt::format("MTP layer {}", k - 1), q, lo[k],
                              hi[k]);
        }
    }
    return {};
}

Result<void> Engine::check_items(std::span<const StepItem> items) const {
    if (items.empty() || static_cast<int64_t>(items.size()) > options_.max_seqs) {
        return make_error("step: {} sequences, expected 1 .. {}", items.size(), options_.max_seqs);
    }
    int64_t rows[kv::kMaxStreams] = {};
    int64_t logit_rows = 0;
    for (size_t i = 0; i < items.size(); ++i) {
        const StepItem &it = items[i];
        const Sequence *s = it.seq;
        if (s == nullptr) return make_error("step item {}: no sequence", i);
        if (s->engine_ != this) return make_error("step item {}: a sequence of another engine", i);
        for (size_t j = 0; j < i; ++j) {
            if (items[j].seq == s) return make_error("step item {}: the same sequence as item {}", i, j);
        }
        if (s->kv_.in_txn()) return make_error("step item {}: the sequence has an open transaction", i);
        const int64_t len0 = s->length(0);
        const auto n_tokens = static_cast<int64_t>(s->tokens.size());
        const int64_t known = it.rows - it.draft;  // a drafting item's draft rows take their tokens in the run
        if (it.rows < 0 || known > n_tokens - len0) {
            return make_error("step item {}: {} trunk rows, the sequence has {} tokens past its {} cached ones", i,
                              it.rows, n_tokens - len0, len0);
        }
        for (int64_t p = len0; p < len0 + known; ++p) {
            const int32_t id = s->tokens[static_cast<size_t>(p)];
            if (id < 0 || id >= cfg_.vocab_size) {
                return make_error("step item {}: token id {} at position {} outside the vocabulary [0, {})", i, id, p,
                                  cfg_.vocab_size);
            }
        }
        rows[0] += it.rows;
        int64_t item_rows = it.rows;
        for (int k = 0; k < model::kMaxMtp; ++k) {
            const int64_t n = it.mtp_rows[k];
            if (n == 0) continue;
            if (n < 0 || k + 1 >= s->n_streams()) {
                return make_error("step item {}: {} rows of MTP layer {}, the sequence stages {} MTP layers", i, n, k,
                                  s->n_streams() - 1);
            }
            item_rows += n;
            const int64_t p0 = s->length(1 + k);
            const int64_t catch_up = spec_[i].catch_up[k];  // rows whose token is in the sequence
            if (p0 + catch_up + 1 > n_tokens) {
                return make_error("step item {}: MTP layer {} row {} needs the token at position {}, the sequence has {} "
                                  "tokens",
                                  i, k, p0 + catch_up - 1, p0 + catch_up, n_tokens);
            }
            for (int64_t p = p0 + 1; p <= p0 + catch_up; ++p) {
                const int32_t id = s->tokens[static_cast<size_t>(p)];
                if (id < 0 || id >= cfg_.vocab_size) {
                    return make_error("step item {}: token id {} at position {} outside the vocabulary [0, {})", i, id,
                                      p, cfg_.vocab_size);
                }
            }
            // Row p reads the hidden row of the trunk at p (k = 0) or of MTP layer k - 1 at p - 1: a row of this
            // step or one the sequence carries.
            for (int64_t p = p0; p < p0 + n; ++p) {
                if (!source_ready(*s, it, 1 + k, p)) {
                    const auto [lo, hi] = s->carried(k);
                    return make_error("step item {}: MTP layer {} row at position {} reads {} row {}, which this step "
                                      "does not compute{} and the sequence does not carry (it carries [{}, {}))",
                                      i, k, p, k == 0 ? std::string("trunk") : fmt::format("MTP layer {}", k - 1),
                                      k == 0 ? p : p - 1, k == 0 && mtp_first_ ? " before the MTP layers" : "", lo,
                                      hi);
                }
            }
            rows[1 + k] += n;
        }
        if (item_rows == 0) return make_error("step item {}: no rows to run", i);
        for (int st = 0; st < kv::kMaxStreams; ++st) logit_rows += logit_rows_of(it, st);
        if (it.sample && (it.rows == 0 || it.logits == LogitRows::kNone)) {
            return make_error("step item {}: sampling needs the last trunk row's logits", i);
        }
        if (it.top_logprobs < -1 || it.top_logprobs > kMaxTopLogprobs) {
            return make_error("step item {}: top_logprobs {} outside [-1, {}]", i, it.top_logprobs, kMaxTopLogprobs);
        }
        if (it.sample && len0 + it.rows > int64_t{0xffffffff}) {
            return make_error("step item {}: position {} is past the sampler's 2^32 positions", i, len0 + it.rows);
        }
        if (it.mtp_follow && it.draft == 0) {
            int64_t all[kv::kMaxStreams] = {};
            for (int st = 0; st < s->n_streams(); ++st) all[st] = stream_rows_of(it, st);
            if (auto ok = check_reach(*s, it, std::span<const int64_t>(all, static_cast<size_t>(s->n_streams())));
                !ok) {
                return wrap_error(fmt::format("step item {}", i), ok.error());
            }
        }
    }
    for (int s = 0; s < kv::kMaxStreams; ++s) {
        if (rows[s] > cap_.max_rows) {
            return make_error("step: {} rows of {}, the engine's step budget is {} rows",
                              rows[s], s == 0 ? std::string("the trunk") : fmt::format("MTP layer {}", s - 1),
                              cap_.max_rows);
        }
    }
    if (logit_rows > cap_.max_logit_rows) {
        return make_error("step: {} logit rows, the engine was created for at most {}", logit_rows, cap_.max_logit_rows);
    }
    return {};
}

Result<void> Engine::begin_all(std::span<const StepItem> items) {
    for (size_t i = 0; i < items.size(); ++i) {
        Sequence &s = *items[i].seq;
        int64_t rows[kv::kMaxStreams] = {items[i].rows, 0, 0, 0};
        for (int k = 0; k + 1 < s.n_streams(); ++k) rows[1 + k] = items[i].mtp_rows[k];
        const auto staged = std::span<const int64_t>(rows, static_cast<size_t>(s.n_streams()));
        // Cached pages no sequence holds make room first, least recently used first.
        const std::array<int64_t, 2> need = s.kv_.pages_needed(staged);
        if (need[0] > full_.n_free()) prefix_.evict(kv::PoolKind::kFull, need[0] - full_.n_free(), full_, swa_);
        if (need[1] > swa_.n_free()) prefix_.evict(kv::PoolKind::kSwa, need[1] - swa_.n_free(), full_, swa_);
        auto txn = s.kv_.begin(staged, full_, swa_);
        if (!txn) {
            for (size_t j = 0; j < i; ++j) (void)items[j].seq->kv_.rollback(items[j].seq->txn_, full_, swa_);
            return wrap_error(fmt::format("step item {}", i), txn.error());
        }
        s.txn_ = *txn;
    }
    return {};
}

// Packs the step's tables into host_tables_ (each array 8-byte aligned, only what the step uses) and points
// every rank's views at the same offsets of its own table buffer.
void Engine::pack_tables(std::span<const StepItem> items) {
    std::byte *host = host_tables_.data();
    int64_t cursor = 0;
    const auto take = [&](int64_t bytes) {
        const int64_t at = cursor;
        cursor = align_up(cursor + bytes);
        MEMRA_CHECK(cursor <= static_cast<int64_t>(host_tables_.size()), "engine: step tables overflow");
        return at;
    };
    const auto i32_at = [&](int64_t off) { return reinterpret_cast<int32_t *>(host + off); };
    const auto i64_at = [&](int64_t off) { return reinterpret_cast<int64_t *>(host + off); };
    const auto n_items = static_cast<int64_t>(items.size());
    const int64_t blocks = model::max_blocks(cap_);

    struct StreamOffsets {
        int64_t n = 0, n_logits = 0, logit_begin = 0;
        int64_t ids = 0, pos = 0, seq = 0, slot_full = 0, slot_swa = 0, logit_rows = 0, hidden_src = 0,
                carry_dst = 0;
    };
    StreamOffsets so[model::kMaxStreamsPerStep];

    // Counts first: rows and logit rows per stream, each item's first logit row.
    for (int s = 0; s < model::kMaxStreamsPerStep; ++s) {
        so[s] = StreamOffsets{};
        logit_begin_[s].assign(static_cast<size_t>(n_items), 0);
        logit_count_[s].assign(static_cast<size_t>(n_items), 0);
    }
    int64_t logit_total = 0;
    for (int s = 0; s < model::kMaxStreamsPerStep; ++s) {
        so[s].logit_begin = logit_total;
        for (int64_t i = 0; i < n_items; ++i) {
            const StepItem &it = items[static_cast<size_t>(i)];
            const int64_t nl = logit_rows_of(it, s);
            logit_begin_[s][static_cast<size_t>(i)] = logit_total;
            logit_count_[s][static_cast<size_t>(i)] = nl;
            so[s].n += stream_rows_of(it, s);
            so[s].n_logits += nl;
            logit_total += nl;
        }
    }
    n_logit_rows_ = logit_total;
    for (int s = 0; s < model::kMaxStreamsPerStep; ++s) {
        const int64_t n = so[s].n;
        if (n == 0) continue;
        so[s].ids = take(n * 4);
        so[s].pos = take(n * 8);
        so[s].seq = take(n * 4);
        so[s].slot_full = take(n * 4);
        so[s].slot_swa = take(n * 4);
        so[s].logit_rows = take(so[s].n_logits * 4);
        so[s].hidden_src = take(n * 4);
        so[s].carry_dst = take(n * 4);
    }
    const int64_t bt_full = take(n_items * blocks * 4);
    const int64_t bt_swa = take(n_items * blocks * 4);
    // Sample rows: the trunk's (1 + draft per sampling item), then the drafts of each MTP layer in turn.
    int64_t n_groups[1 + model::kMaxMtp] = {};
    for (const StepItem &it : items) {
        if (it.sample) n_groups[0] += 1 + it.draft;
        for (int k = 0; k < it.draft; ++k) ++n_groups[1 + k];
    }
    group_end_[0] = n_groups[0];
    for (int g = 1; g <= model::kMaxMtp; ++g) group_end_[g] = group_end_[g - 1] + n_groups[g];
    n_sample_rows_ = group_end_[model::kMaxMtp];
    sample_offset_ = take(n_sample_rows_ * static_cast<int64_t>(sizeof(SampleRow)));
    // Penalty windows: per sampling item the context tokens its rows look at, then its draft slots.
    const auto window_of = [&](const StepItem &it) {
        const int64_t ctx0 = it.seq->length(0) + it.rows - it.draft;  // the first sampled position
        const int64_t h0 = it.seq->sampling_.penalty_context(ctx0);
        return std::pair<int64_t, int64_t>{ctx0 - h0, h0 > 0 ? h0 + it.draft : 0};
    };
    history_len_ = 0;
    for (const StepItem &it : items) {
        if (it.sample) history_len_ += window_of(it).second;
    }
    history_offset_ = take(history_len_ * 4);
    // Logit biases: per sampling item its list once, which its trunk and draft rows all read.
    bias_len_ = 0;
    for (const StepItem &it : items) {
        if (it.sample) bias_len_ += static_cast<int64_t>(it.seq->logit_bias_.size());
    }
    bias_offset_ = take(bias_len_ * static_cast<int64_t>(sizeof(LogitBias)));
    for (int k = 0; k < model::kMaxMtp; ++k) {
        pairs_count_[k] = 0;
        for (const StepItem &it : items) {
            if (it.draft <= k) continue;
            pairs_count_[k] += 1 + (it.draft - 1 - k);  // the trunk row and the later layers' draft rows
            if (window_of(it).second > 0) ++pairs_count_[k];
        }
        pairs_offset_[k] = take(pairs_count_[k] * 8);
    }
    table_bytes_ = cursor;

    // Fill: item after item, row j of stream s at position length(s) + j. An item's first row per stream
    // (the sum of the earlier items' rows) locates the hidden rows its next stream reads.
    int64_t row[model::kMaxStreamsPerStep] = {};
    int64_t item_first[model::kMaxStreamsPerStep] = {};
    int64_t starts[model::kMaxStreamsPerStep] = {};
    int64_t logit_fill[model::kMaxStreamsPerStep] = {};
    int64_t group_fill[1 + model::kMaxMtp] = {0, group_end_[0], group_end_[1], group_end_[2]};
    int64_t pair_fill[model::kMaxMtp] = {};
    int64_t history_fill = 0;
    int64_t bias_fill = 0;
    sample_row_of_item_.assign(static_cast<size_t>(n_items), -1);
    auto *sample_rows = reinterpret_cast<SampleRow *>(host + sample_offset_);
    const auto carry_index = [&](const Sequence &sq, int half, int64_t p) {
        return static_cast<int32_t>((int64_t{sq.carry_slot_} * 2 + half) * kCarryRows + p % kCarryRows);
    };
    for (int64_t i = 0; i < n_items; ++i) {
        const StepItem &it = items[static_cast<size_t>(i)];
        const Sequence &sq = *it.seq;
        const kv::SeqKv &kv = sq.kv_;
        Spec &sp = spec_[static_cast<size_t>(i)];
        for (int s = 0; s < model::kMaxStreamsPerStep; ++s) item_first[s] = starts[s];
        for (int s = 0; s < model::kMaxStreamsPerStep; ++s) {
            const int64_t n = stream_rows_of(it, s);
            const int64_t p0 = s < sq.n_streams() ? kv.length(s) : 0;
            // The streams another MTP layer of the sequence reads save their last rows to the carry.
            const bool carries = sq.carry_slot_ >= 0 && s + 1 < sq.n_streams();
            for (int64_t j = 0; j < n; ++j) {
                const int64_t r = row[s]++;
                const int64_t p = p0 + j;
                const int64_t token_at = s == 0 ? p : p + 1;
                // A draft row's token is the previous MTP layer's draft, which scatter_ids writes in the run.
                i32_at(so[s].ids)[r] = token_at < static_cast<int64_t>(sq.tokens.size())
                                           ? sq.tokens[static_cast<size_t>(token_at)]
                                           : 0;
                i64_at(so[s].pos)[r] = p;
                i32_at(so[s].seq)[r] = static_cast<int32_t>(i);
                i32_at(so[s].slot_full)[r] =
                    s == 0 && seq_shape_.trunk_full ? kv.slot(kv::PoolKind::kFull, p) : -1;
                i32_at(so[s].slot_swa)[r] =
                    (s > 0 || seq_shape_.trunk_sliding) ? kv.slot(kv::PoolKind::kSwa, p) : -1;
                // The previous stream's row (the trunk's at p, or MTP layer s - 2's at p - 1): this step's, or
                // the carried one past the step rows.
                int32_t src = -1;
                if (s >= 1) {
                    const int ps = s - 1;
                    const int64_t q = ps == 0 ? p : p - 1;
                    const int64_t in0 = kv.length(ps);
                    const int64_t in1 = in0 + ((ps == 0 && mtp_first_) ? 0 : stream_rows_of(it, ps));
                    src = q >= in0 && q < in1
                              ? static_cast<int32_t>(item_first[ps] + (q - in0))
                              : static_cast<int32_t>(cap_.max_rows + carry_index(sq, sq.carry_[ps].half, q));
                }
                i32_at(so[s].hidden_src)[r] = src;
                i32_at(so[s].carry_dst)[r] =
                    carries && j >= n - kCarryRows ? carry_index(sq, 1 - sq.carry_[s].half, p) : -1;
            }
            // Logit rows: the stream rows whose logits are computed (a drafting MTP layer: its last row).
            const int64_t nl = logit_count_[s][static_cast<size_t>(i)];
            MEMRA_CHECK(nl == 0 || n > 0, "engine: item {} stream {}: {} logit rows of no rows", i, s, nl);
            for (int64_t j = 0; j < nl; ++j) {
                const bool last = s == 0 ? it.logits == LogitRows::kLast : it.draft > s - 1;
                i32_at(so[s].logit_rows)[logit_fill[s]++] = static_cast<int32_t>(item_first[s] + (last ? n - 1 : j));
            }
            starts[s] += n;
        }
        std::memcpy(host + bt_full + i * blocks * 4, kv.block_table(kv::PoolKind::kFull).data(),
                    static_cast<size_t>(blocks * 4));
        std::memcpy(host + bt_swa + i * blocks * 4, kv.block_table(kv::PoolKind::kSwa).data(),
                    static_cast<size_t>(blocks * 4));
        if (!it.sample) continue;
        // The trunk's samples: row j of the item's logit rows samples position ctx0 + j, its penalty window
        // the context before it (draft slots included, written in the run).
        const SamplingParams &p = sq.sampling_;
        const auto [win0, win_len] = window_of(it);
        const int64_t ctx0 = kv.length(0) + it.rows - it.draft;
        const int64_t first_logit = logit_begin_[0][static_cast<size_t>(i)] + logit_count_[0][static_cast<size_t>(i)] -
                                    (1 + it.draft);
        sample_row_of_item_[static_cast<size_t>(i)] = group_fill[0];
        const auto bias_begin = static_cast<int32_t>(bias_fill);
        const auto bias_len = static_cast<int32_t>(sq.logit_bias_.size());
        if (bias_len > 0) {
            std::memcpy(host + bias_offset_ + bias_fill * static_cast<int64_t>(sizeof(LogitBias)),
                        sq.logit_bias_.data(), sq.logit_bias_.size() * sizeof(LogitBias));
            bias_fill += bias_len;
        }
        for (int64_t j = 0; j <= it.draft; ++j) {
            const int64_t hist = p.penalty_context(ctx0 + j);  // none when the penalties are off
            SampleRow sr;
            sr.params = p;
            sr.choice = sq.choice_;
            sr.position = ctx0 + j;
            sr.logit_row = static_cast<int32_t>(first_logit + j);
            sr.history_begin = hist > 0 ? static_cast<int32_t>(history_fill + (ctx0 + j - hist - win0)) : 0;
            sr.history_len = static_cast<int32_t>(hist);
            sr.bias_begin = bias_begin;
            sr.bias_len = bias_len;
            sr.top_logprobs = it.top_logprobs;
            std::memcpy(&sample_rows[group_fill[0]++], &sr, sizeof(SampleRow));
        }
        if (win_len > 0) {
            std::memcpy(host + history_offset_ + history_fill * 4, sq.tokens.data() + win0,
                        static_cast<size_t>((ctx0 - win0) * 4));
            std::memset(host + history_offset_ + (history_fill + ctx0 - win0) * 4, 0, static_cast<size_t>(it.draft * 4));
        }
        // The drafts: MTP layer k's last row predicts position ctx0 + k; its token feeds the trunk's row 1 + k,
        // the later layers' draft rows at that position, and the trunk's penalty windows.
        for (int k = 0; k < it.draft; ++k) {
            SampleRow sr;
            sr.params = draft_params(p);
            sr.choice = sq.choice_;
            sr.position = ctx0 + k;
            sr.logit_row = static_cast<int32_t>(logit_begin_[1 + k][static_cast<size_t>(i)]);
            sr.bias_begin = bias_begin;  // the trunk's bias: drafts aim at the tokens the trunk will sample
            sr.bias_len = bias_len;
            const int64_t at = group_fill[1 + k]++;
            std::memcpy(&sample_rows[at], &sr, sizeof(SampleRow));
            sp.draft_row[k] = at;
            int32_t *pairs = i32_at(pairs_offset_[k]);
            const auto add = [&](int64_t table_byte_offset) {
                const int64_t f = pair_fill[k]++;
                pairs[2 * f] = static_cast<int32_t>(at);
                pairs[2 * f + 1] = static_cast<int32_t>(table_byte_offset / 4);
            };
            add(so[0].ids + (item_first[0] + 1 + k) * 4);
            for (int m = k + 1; m < it.draft; ++m) {
                // MTP layer m's draft rows follow its catch-up rows: the one at position ctx0 - 1 + k takes
                // draft k.
                add(so[1 + m].ids + (item_first[1 + m] + sp.catch_up[m] + k) * 4);
            }
            if (win_len > 0) add(history_offset_ + (history_fill + ctx0 - win0 + k) * 4);
        }
        history_fill += win_len;
    }

    // Every rank's views: the same offsets of its own buffer.
    for (const std::unique_ptr<Rank> &rk : ranks_) {
        model::StepTables &t = rk->step;
        t.n_seqs = n_items;
        for (int s = 0; s < model::kMaxStreamsPerStep; ++s) {
            model::StreamTables &st = t.streams[s];
            st.n_rows = so[s].n;
            st.n_logit_rows = so[s].n_logits;
            st.logit_begin = so[s].logit_begin;
            st.ids = table_view(rk->tables, so[s].ids, DType::kI32, so[s].n);
            st.pos = table_view(rk->tables, so[s].pos, DType::kI64, so[s].n);
            st.seq = table_view(rk->tables, so[s].seq, DType::kI32, so[s].n);
            st.slot_full = table_view(rk->tables, so[s].slot_full, DType::kI32, so[s].n);
            st.slot_swa = table_view(rk->tables, so[s].slot_swa, DType::kI32, so[s].n);
            st.logit_rows = table_view(rk->tables, so[s].logit_rows, DType::kI32, so[s].n_logits);
            st.hidden_src = table_view(rk->tables, so[s].hidden_src, DType::kI32, so[s].n);
            st.carry_dst = table_view(rk->tables, so[s].carry_dst, DType::kI32, so[s].n);
        }
        t.bt_full = table_view(rk->tables, bt_full, DType::kI32, n_items, blocks);
        t.bt_swa = table_view(rk->tables, bt_swa, DType::kI32, n_items, blocks);
        rk->sample_rows = table_view(rk->tables, sample_offset_, DType::kU8,
                                     n_sample_rows_ * static_cast<int64_t>(sizeof(SampleRow)));
        rk->history = table_view(rk->tables, history_offset_, DType::kI32, history_len_);
        rk->bias =
            table_view(rk->tables, bias_offset_, DType::kU8, bias_len_ * static_cast<int64_t>(sizeof(LogitBias)));
    }
}

Result<void> Engine::plan(std::span<const StepItem> items) {
    const int64_t before = count_allocations_ ? count_allocations_() : 0;
    if (phase_ != Phase::kIdle) return make_error("step: a step is already planned; finish or abandon it first");
    if (items.empty() || static_cast<int64_t>(items.size()) > options_.max_seqs) {
        return make_error("step: {} sequences, expected 1 .. {}", items.size(), options_.max_seqs);
    }
    results_ = false;
    if (auto ok = resolve_items(items); !ok) return ok;
    if (auto ok = check_items(step_items_); !ok) return ok;
    if (auto ok = begin_all(step_items_); !ok) return ok;
    step_seqs_.clear();
    for (const StepItem &it : step_items_) step_seqs_.push_back(it.seq);
    pack_tables(step_items_);
    for (const std::unique_ptr<Rank> &rk : ranks_) {
        rk->d2h_at_plan = rk->d2h_at_run_end = rk->backend->counters().d2h_copies;
        rk->backend->copy_from_host(host_tables_.data(), rk->tables.row_slice(0, table_bytes_));
    }
    run_error_.clear();
    collected_ = false;
    phase_ = Phase::kPlanned;
    alloc_before_ = before;
    return {};
}

Engine::Rank &Engine::local(int rank) const {
    const int first = first_rank_;
    const int end = first_rank_ + static_cast<int>(ranks_.size());
    MEMRA_CHECK(rank >= first && rank < end, "engine: rank {} is not run by this process (it runs ranks {} .. {})",
                rank, first, end - 1);
    return *ranks_[static_cast<size_t>(rank - first)];
}

Result<void> Engine::run_rank(int rank) {
    Rank &rk = local(rank);
    Backend &be = *rk.backend;
    be.bind_thread();
    const auto sz = static_cast<int64_t>(sizeof(SampleRow));
    const auto out_sz = static_cast<int64_t>(sizeof(SampledToken));
    const TensorView logits = rk.forward->logits(n_logit_rows_);
    const auto sample_group = [&](int64_t g0, int64_t g1) {
        if (g1 > g0) be.sample(logits, options_.sample_vocab, rk.sample_rows.row_slice(g0 * sz, g1 * sz), rk.history,
                               rk.bias, rk.sample_out.row_slice(g0 * out_sz, g1 * out_sz));
    };
    if (!mtp_first_) {
        if (auto ok = rk.forward->run(rk.step); !ok) return ok;
        sample_group(0, group_end_[0]);
        return {};
    }
    // Speculation: each MTP layer drafts from its last rows and writes the drafts into the later layers' and the
    // trunk's tables; the trunk then verifies.
    const TensorView table_ids = table_view(rk.tables, 0, DType::kI32, rk.tables.numel() / 4);
    for (int k = 0; k < cap_.n_mtp; ++k) {
        if (auto ok = rk.forward->run_stream(rk.step, 1 + k); !ok) return ok;
        if (pairs_count_[k] == 0) continue;
        sample_group(group_end_[k], group_end_[k + 1]);
        be.scatter_ids(rk.sample_out.row_slice(0, n_sample_rows_ * out_sz),
                       table_view(rk.tables, pairs_offset_[k], DType::kI32, pairs_count_[k] * 2), table_ids);
    }
    if (auto ok = rk.forward->run_stream(rk.step, 0); !ok) return ok;
    sample_group(0, group_end_[0]);
    return {};
}

void Engine::build_step_key() {
    std::vector<int64_t> &k = step_key_;
    k.clear();
    const Rank &rk = *ranks_.front();
    const auto view = [&k](const TensorView &v) {
        k.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(v.data)));
        k.push_back(static_cast<int64_t>(v.dtype));
        k.push_back(v.rank);
        for (int i = 0; i < v.rank; ++i) k.push_back(v.shape[static_cast<size_t>(i)]);
    };
    k.push_back(mtp_first_ ? 1 : 0);
    k.push_back(cap_.n_mtp);
    k.push_back(n_logit_rows_);
    k.push_back(n_sample_rows_);
    k.push_back(options_.sample_vocab);
    for (const int64_t g : group_end_) k.push_back(g);
    for (int j = 0; j < model::kMaxMtp; ++j) {
        k.push_back(pairs_offset_[j]);
        k.push_back(pairs_count_[j]);
    }
    const model::StepTables &t = rk.step;
    k.push_back(t.n_seqs);
    for (const model::StreamTables &s : t.streams) {
        k.push_back(s.n_rows);
        k.push_back(s.n_logit_rows);
        k.push_back(s.logit_begin);
        for (const TensorView *v : {&s.ids, &s.pos, &s.seq, &s.slot_full, &s.slot_swa, &s.logit_rows, &s.hidden_src,
                                    &s.carry_dst}) {
            view(*v);
        }
    }
    for (const TensorView *v : {&t.bt_full, &t.bt_swa, &rk.sample_rows, &rk.history, &rk.bias}) view(*v);
    MEMRA_CHECK(k.size() <= kStepKeyCapacity, "engine: a step key of {} values", k.size());
}

void Engine::run() {
    MEMRA_CHECK(phase_ == Phase::kPlanned, "engine: run() without a planned step");
    Result<void> ok;
    if (group_) {
        ok = group_->run([this](int r, parallel::Communicator &) { return run_rank(r); });
    } else if (options_.tp == 1 && !ranks_.front()->forward->tapped()) {
        // One rank, no tap: the step may be recorded and replayed (CUDA graphs).
        build_step_key();
        ok = ranks_.front()->backend->run_recorded(step_key_, [this] { return run_rank(0); });
    } else {
        ok = run_rank(first_rank_);  // one rank, tapped; or this process's rank of a multi-process launch
    }
    if (!ok) run_error_ = ok.error().message;
    for (const std::unique_ptr<Rank> &rk : ranks_) rk->d2h_at_run_end = rk->backend->counters().d2h_copies;
    phase_ = Phase::kRun;
}

void Engine::rollback_all() {
    for (Sequence *s : step_seqs_) {
        auto r = s->kv_.rollback(s->txn_, full_, swa_);
        MEMRA_CHECK(r.has_value(), "engine: rollback failed: {}", r ? "" : r.error().message);
    }
    step_seqs_.clear();
    phase_ = Phase::kIdle;
}

void Engine::abandon() {
    if (phase_ == Phase::kIdle) return;
    rollback_all();
    count(alloc_before_);
}

Result<void> Engine::collect() {
    if (phase_ != Phase::kRun) return make_error("step: collect() without a run step");
    if (collected_) return {};
    if (!run_error_.empty()) {
        rollback_all();
        count(alloc_before_);
        return make_error("step failed: {}", run_error_);
    }
    Rank &r0 = *ranks_.front();
    if (n_sample_rows_ > 0) {
        r0.backend->copy_to_host(r0.sample_out.row_slice(0, n_sample_rows_ * static_cast<int64_t>(sizeof(SampledToken))),
                                 sampled_.data());
    }
    // Exact-match acceptance (DETERMINISM.md rule 8): draft k stands while it equals the trunk's own sample at
    // its position, so the emitted tokens are the ones a step without drafts samples.
    for (size_t i = 0; i < step_items_.size(); ++i) {
        Spec &sp = spec_[i];
        sp.accepted = 0;
        const int64_t first = sample_row_of_item_[i];
        while (sp.accepted < step_items_[i].draft &&
               sampled_[static_cast<size_t>(sp.draft_row[sp.accepted])].id ==
                   sampled_[static_cast<size_t>(first + sp.accepted)].id) {
            ++sp.accepted;
        }
    }
    collected_ = true;
    results_ = true;
    return {};
}

Result<void> Engine::finish(std::span<const Keep> keep) {
    if (phase_ != Phase::kRun) return make_error("step: finish() without a run step");
    if (auto ok = collect(); !ok) return ok;
    if (!keep.empty() && keep.size() != step_seqs_.size()) {
        rollback_all();
        count(alloc_before_);
        return make_error("step finish: {} keep counts for {} sequences", keep.size(), step_seqs_.size());
    }
    // Every keep count is checked before any sequence commits, so a refusal leaves the whole step rolled back.
    for (size_t i = 0; i < step_seqs_.size(); ++i) {
        if (auto ok = check_keep(i, keep.empty() ? Keep{} : keep[i]); !ok) {
            rollback_all();
            count(alloc_before_);
            return wrap_error(fmt::format("step item {} keep", i), ok.error());
        }
    }
    Rank &r0 = *ranks_.front();
    logits_copied_ = std::any_of(step_items_.begin(), step_items_.end(),
                                 [](const StepItem &it) { return it.return_logits; });
    if (logits_copied_ && n_logit_rows_ > 0) {
        const auto need = static_cast<size_t>(n_logit_rows_ * cfg_.vocab_size);
        if (logits_host_.size() < need) logits_host_.resize(need);  // once per size: return_logits is not hot
        r0.backend->copy_to_host(r0.forward->logits(n_logit_rows_), logits_host_.data());
    }
    for (size_t i = 0; i < step_seqs_.size(); ++i) {
        Sequence &s = *step_seqs_[i];
        int64_t rows[kv::kMaxStreams] = {};
        for (int st = 0; st < s.n_streams(); ++st) {
            const int64_t want = keep.empty() ? -1 : keep[i].rows[st];
            rows[st] = want < 0 ? default_keep(i, st) : want;
        }
        const auto kept = std::span<const int64_t>(rows, static_cast<size_t>(s.n_streams()));
        update_carry(i, kept);
        // Blocks are published before their sliding pages leave the window, so the cache keeps them.
        const bool publishing = options_.prefix_cache && s.n_streams() == 1;
        auto ok = s.kv_.commit(s.txn_, kept, full_, swa_, !publishing);
        MEMRA_CHECK(ok.has_value(), "engine: item {}'s checked keep counts were refused: {}", i,
                    ok ? "" : ok.error().message);
        if (publishing) {
            publish(s);
            s.kv_.release_out_of_window(swa_);
        }
    }
    step_seqs_.clear();
    phase_ = Phase::kIdle;
    count(alloc_before_);
    return {};
}

int64_t Engine::default_keep(size_t item, int stream) const {
    const StepItem &it = step_items_[item];
    if (it.draft == 0) return step_seqs_[item]->kv_.staged(stream);
    return stream == 0 ? 1 + spec_[item].accepted : spec_[item].catch_up[stream - 1];
}

// Before the commit (the staged rows' positions start at the committed lengths): a stream that keeps rows of
// this step carries its last ones, which the run wrote into the half that was not valid.
void Engine::update_carry(size_t item, std::span<const int64_t> kept) {
    Sequence &s = *step_seqs_[item];
    if (s.carry_slot_ < 0) return;
    for (int st = 0; st + 1 < s.n_streams(); ++st) {
        const int64_t n = stream_rows_of(step_items_[item], st);
        const int64_t keep = kept[static_cast<size_t>(st)];
        if (n == 0 || keep == 0) continue;
        const int64_t p0 = s.kv_.length(st);
        Sequence::Carry &c = s.carry_[st];
        c.half = 1 - c.half;
        c.lo = std::max(p0, p0 + n - kCarryRows);
        c.hi = p0 + keep;
        if (c.hi < c.lo) c.lo = c.hi;
    }
}

Result<void> Engine::check_keep(size_t item, const Keep &keep) const {
    const Sequence &s = *step_seqs_[item];
    const StepItem &it = step_items_[item];
    int64_t len[kv::kMaxStreams] = {};
    for (int st = 0; st < s.n_streams(); ++st) {
        const int64_t staged = s.kv_.staged(st);
        const int64_t want = keep.rows[st] < 0 ? default_keep(item, st) : keep.rows[st];
        if (want > staged) return make_error("stream {} keeps {} rows, {} were staged", st, want, staged);
        if (it.draft > 0 && want > default_keep(item, st)) {
            return st == 0 ? make_error("the trunk keeps {} rows, past the {} whose tokens the drafts' acceptance "
                                        "confirms (1 + {} accepted)",
                                        want, default_keep(item, st), spec_[item].accepted)
                           : make_error("MTP layer {} keeps {} rows, past its {} catch-up rows (draft rows are never "
                                        "kept)",
                                        st - 1, want, default_keep(item, st));
        }
        len[st] = s.kv_.length(st) + want;
    }
    if (it.mtp_follow) {
        int64_t kept[kv::kMaxStreams] = {};
        for (int st = 0; st < s.n_streams(); ++st) kept[st] = len[st] - s.kv_.length(st);
        if (auto ok = check_reach(s, it, std::span<const int64_t>(kept, static_cast<size_t>(s.n_streams()))); !ok) {
            return ok;
        }
    }
    // MTP layer 0's row p was computed from the trunk's row p, MTP layer k's from MTP layer k - 1's row p - 1:
    // a kept row whose source row is dropped would stay in the cache computed from a state that never was.
    for (int k = 0; k + 1 < s.n_streams(); ++k) {
        const int64_t reach = k == 0 ? len[0] : len[k] + 1;
        if (len[1 + k] > reach) {
            return make_error("MTP layer {} would keep rows up to position {}, past the {} rows its source keeps "
                              "(reaching position {})",
                              k, len[1 + k] - 1, k == 0 ? std::string("trunk") : fmt::format("MTP layer {}", k - 1),
                              reach - 1);
        }
    }
    return {};
}

void Engine::count(int64_t before) {
    step_allocations_ = count_allocations_ ? count_allocations_() - before : -1;
}

Result<void> Engine::step(std::span<const StepItem> items) {
    if (auto ok = plan(items); !ok) return ok;
    run();
    return finish();
}

const SampledToken &Engine::sampled(size_t item, int64_t j) const {
    MEMRA_CHECK(results_ && item < sample_row_of_item_.size() && sample_row_of_item_[item] >= 0 && j >= 0 &&
                    j <= step_items_[item].draft,
                "engine: item {} did not sample a token {}", item, j);
    return sampled_[static_cast<size_t>(sample_row_of_item_[item] + j)];
}

int64_t Engine::sampled_count(size_t item) const {
    MEMRA_CHECK(results_ && item < sample_row_of_item_.size(), "engine: no results for item {}", item);
    return sample_row_of_item_[item] < 0 ? 0 : 1 + step_items_[item].draft;
}

int32_t Engine::draft(size_t item, int j) const {
    MEMRA_CHECK(results_ && item < spec_.size() && j >= 0 && j < step_items_[item].draft,
                "engine: item {} has no draft {}", item, j);
    return sampled_[static_cast<size_t>(spec_[item].draft_row[j])].id;
}

int64_t Engine::accepted(size_t item) const {
    MEMRA_CHECK(results_ && item < spec_.size(), "engine: no results for item {}", item);
    return spec_[item].accepted;
}

std::span<const float> Engine::logits(size_t item, int stream) const {
    MEMRA_CHECK(logits_copied_ && stream >= 0 && stream < kv::kMaxStreams && item < logit_begin_[stream].size(),
                "engine: no host logits for item {} stream {}", item, stream);
    const auto v = static_cast<size_t>(cfg_.vocab_size);
    return {logits_host_.data() + static_cast<size_t>(logit_begin_[stream][item]) * v,
            static_cast<size_t>(logit_count_[stream][item]) * v};
}

std::pair<int64_t, int64_t> Engine::logit_range(size_t item, int stream) const {
    MEMRA_CHECK(stream >= 0 && stream < kv::kMaxStreams && item < logit_begin_[stream].size(),
                "engine: no logit rows for item {} stream {}", item, stream);
    return {logit_begin_[stream][item], logit_count_[stream][item]};
}

// ---- Facts and inspection ----

const kv::PagePool &Engine::page_pool(kv::PoolKind kind) const { return kind == kv::PoolKind::kFull ? full_ : swa_; }

int64_t Engine::kv_bytes() const {
    int64_t n = 0;
    for (const std::unique_ptr<Rank> &rk : ranks_) {
        n += int64_t{full_.n_pages()} * rk->full_layout.page_bytes + int64_t{swa_.n_pages()} * rk->swa_layout.page_bytes;
    }
    return n;
}

Backend &Engine::backend(int rank) { return *local(rank).backend; }

model::Step35Forward &Engine::forward(int rank) { return *local(rank).forward; }

std::vector<float> Engine::rank_logits(int rank) const {
    const Rank &rk = local(rank);
    std::vector<float> out(static_cast<size_t>(n_logit_rows_ * cfg_.vocab_size));
    if (!out.empty()) rk.backend->copy_to_host(rk.forward->logits(n_logit_rows_), out.data());
    return out;
}

Result<void> Engine::kv_row(int rank, const Sequence &seq, int layer, int64_t position, std::vector<std::byte> &k,
                            std::vector<std::byte> &v) const {
    if (layer < 0 || static_cast<size_t>(layer) >= cfg_.layers.size() ||
        pools_.pool_layer[static_cast<size_t>(layer)] < 0) {
        return make_error("kv_row: layer {} keeps no KV rows in this engine", layer);
    }
    const Rank &rk = local(rank);
    const bool swa = pools_.in_swa[static_cast<size_t>(layer)];
    const kv::PoolKind kind = swa ? kv::PoolKind::kSwa : kv::PoolKind::kFull;
    const int stream = cfg_.layers[static_cast<size_t>(layer)].is_mtp ? 1 + layer - cfg_.n_layers : 0;
    if (stream >= seq.n_streams() || position < seq.kv_.first(stream) || position >= seq.length(stream) ||
        !seq.kv_.has_page(kind, position)) {
        return make_error("kv_row: position {} of layer {} is not a live row of the sequence", position, layer);
    }
    const int pl = pools_.pool_layer[static_cast<size_t>(layer)];
    const KvPageLayout &lay = swa ? rk.swa_layout : rk.full_layout;
    const TensorView storage = rk.backend->kv_pool_storage(swa ? rk.kv.swa : rk.kv.full);
    const int32_t slot = seq.kv_.slot(kind, position);
    const int64_t kb = lay.k_row_bytes[static_cast<size_t>(pl)];
    const int64_t vb = lay.v_row_bytes[static_cast<size_t>(pl)];
    k.resize(static_cast<size_t>(kb));
    v.resize(static_cast<size_t>(vb));
    rk.backend->copy_to_host(storage.row_slice(lay.k_at(pl, slot), lay.k_at(pl, slot) + kb), k.data());
    rk.backend->copy_to_host(storage.row_slice(lay.v_at(pl, slot), lay.v_at(pl, slot) + vb), v.data());
    return {};
}

Result<void> Engine::check_pages() const {
    for (const kv::PoolKind kind : {kv::PoolKind::kFull, kv::PoolKind::kSwa}) {
        const kv::PagePool &pool = page_pool(kind);
        std::vector<int32_t> refs(static_cast<size_t>(pool.n_pages()), 0);
        for (const Sequence *s : live_) {
            int64_t held = 0;
            for (const int32_t page : s->kv_.block_table(kind)) {
                if (page < 0) continue;
                ++refs[static_cast<size_t>(page)];
                ++held;
            }
            if (held != s->kv_.pages_held(kind)) {
                return make_error("{} KV pool: a sequence counts {} pages, its block table holds {}",
                                  kv::pool_kind_name(kind), s->kv_.pages_held(kind), held);
            }
        }
        int32_t free = 0, evictable = 0;
        for (int32_t p = 0; p < pool.n_pages(); ++p) {
            if (refs[static_cast<size_t>(p)] != pool.refcount(p)) {
                return make_error("{} KV pool: page {} has reference count {}, {} block tables hold it",
                                  kv::pool_kind_name(kind), p, pool.refcount(p), refs[static_cast<size_t>(p)]);
            }
            if (pool.refcount(p) == 0) ++(pool.cached(p) ? evictable : free);
        }
        if (free != pool.n_free() || evictable != pool.n_evictable()) {
            return make_error("{} KV pool: {} pages free and {} evictable, the pool counts {} and {}",
                              kv::pool_kind_name(kind), free, evictable, pool.n_free(), pool.n_evictable());
        }
    }
    return prefix_.check(full_, swa_);
}

StepCounters Engine::counters(int rank) const {
    const Rank &rk = local(rank);
    return StepCounters{rk.backend->counters(), rk.forward->comm_counters(), rk.d2h_at_run_end - rk.d2h_at_plan};
}

void Engine::reset_counters() {
    for (const std::unique_ptr<Rank> &rk : ranks_) {
        rk->backend->reset_counters();
        rk->forward->reset_comm_counters();
        rk->d2h_at_plan = rk->d2h_at_run_end = 0;
    }
}

// ---- Feeding a sequence ----

Result<int32_t> feed(Engine &engine, Sequence &seq) {
    if (seq.pending() <= 0) return make_error("feed: the sequence has no pending tokens");
    while (true) {
        const int64_t rows = std::min(seq.pending(), engine.options().step_rows);
        const bool last = rows == seq.pending();
        StepItem it;
        it.seq = &seq;
        it.rows = rows;
        it.logits = last ? LogitRows::kLast : LogitRows::kNone;
        it.sample = last;
        it.mtp_follow = seq.n_streams() > 1;
        if (auto ok = engine.step(std::span(&it, 1)); !ok) return tl::unexpected(ok.error());
        if (last) return engine.sampled(0).id;
    }
}

int64_t draft_limit(const Engine &engine, const Sequence &seq, int64_t draft, int64_t max_new) {
    const int64_t len0 = seq.length(0);
    // MTP layer j drafts from its row at position len0 - 1 + j, and has no rows before position j.
    if (len0 == 0) return 0;
    return std::max<int64_t>(0, std::min<int64_t>({draft, seq.n_streams() - 1, engine.options().spec_draft,
                                                   max_new - 1, engine.max_positions() - 1 - len0, len0 + 1}));
}

Result<Decoded> decode(Engine &engine, Sequence &seq, const DecodeOptions &options) {
    if (seq.pending() != 1) {
        return make_error("decode: the sequence has {} pending tokens, expected 1 (feed the prompt first)",
                          seq.pending());
    }
    if (options.max_new < 1) return make_error("decode: max_new {}, expected >= 1", options.max_new);
    const int64_t draft = draft_limit(engine, seq, options.draft, options.max_new);
    StepItem it;
    it.seq = &seq;
    it.rows = 1;
    it.sample = true;
    it.mtp_follow = seq.n_streams() > 1;
    it.draft = static_cast<int>(draft);
    it.top_logprobs = options.top_logprobs;
    it.return_logits = options.return_logits;
    auto planned = engine.plan(std::span(&it, 1));
    if (!planned && draft > 0) {
        // Drafts change speed, never what can be decoded: a step the drafts make impossible (an MTP layer
        // behind, pages for the draft rows) decodes without them.
        it.draft = 0;
        planned = engine.plan(std::span(&it, 1));
    }
    if (!planned) return tl::unexpected(planned.error());
    engine.run();
    if (auto ok = engine.collect(); !ok) return tl::unexpected(ok.error());
    Decoded out;
    out.drafted = it.draft;
    out.accepted = engine.accepted(0);
    int32_t emitted[1 + model::kMaxMtp] = {};
    while (out.emitted < 1 + out.accepted && out.emitted < options.max_new) {
        const int32_t id = engine.sampled(0, out.emitted).id;
        emitted[out.emitted++] = id;
        if (std::find(options.stop_ids.begin(), options.stop_ids.end(), int64_t{id}) != options.stop_ids.end()) break;
    }
    // The trunk rows whose inputs are the tokens before the last emitted one.
    Keep keep;
    keep.rows[0] = out.emitted;
    if (auto ok = engine.finish(std::span(&keep, 1)); !ok) return tl::unexpected(ok.error());
    seq.tokens.insert(seq.tokens.end(), emitted, emitted + out.emitted);
    return out;
}

}  // namespace memra::runtime
