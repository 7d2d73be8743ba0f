// The engine (engine.h): ranks, pools, sequences, and the plan -> run -> finish step.
#include "runtime/engine.h"

#include <algorithm>
#include <cstring>
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
    : engine_(engine), kv_(shape), sampling_(options.sampling), choice_(options.choice) {}

Sequence::~Sequence() { engine_->release(*this); }

Result<void> Sequence::set_sampling(const SamplingParams &params) {
    if (auto ok = validate_sampling_params(params); !ok) return ok;
    sampling_ = params;
    return {};
}

// ---- Engine: creation ----

struct Engine::Rank {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<model::Step35Model> model;  // the forward points into it
    std::optional<model::Step35Forward> forward;
    model::ForwardKv kv;
    KvPageLayout full_layout, swa_layout;
    TensorView tables;      // [table capacity] kU8: the packed step tables
    TensorView sample_out;  // [max sample rows * sizeof(SampledToken)] kU8
    model::StepTables step;  // this step's views into tables
    TensorView sample_rows, history;
    int64_t d2h_at_run_end = 0;  // the backend's d2h count when run() returned (counters' d2h_before_finish)
    int64_t d2h_at_plan = 0;     // ... and when plan() began
};

Engine::~Engine() = default;

namespace {

// Bytes the packed tables of a step need at most (the layout pack_tables uses, at the capacity).
int64_t table_capacity(const model::ForwardCapacity &cap, int64_t max_blocks, int64_t max_sample_rows,
                       int64_t max_positions) {
    int64_t n = 0;
    for (int s = 0; s < model::kMaxStreamsPerStep; ++s) {
        n += 6 * align_up(cap.max_rows * 4) + align_up(cap.max_rows * 8) + align_up(cap.max_logit_rows * 4);
    }
    n += 2 * align_up(cap.max_seqs * max_blocks * 4);
    n += align_up(max_sample_rows * static_cast<int64_t>(sizeof(SampleRow)));
    n += align_up(max_sample_rows * max_positions * 4);
    return n;
}

}  // namespace

Result<std::unique_ptr<Engine>> Engine::create(const io::Checkpoint &ckpt, const model::Step35Config &cfg,
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
    if (o.sample_vocab < 0 || o.sample_vocab > cfg.vocab_size) {
        return make_error("engine: sample_vocab {} outside [0, {}]", o.sample_vocab, cfg.vocab_size);
    }
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
    e->cap_.max_logit_rows = o.max_logit_rows > 0 ? o.max_logit_rows : o.max_seqs;
    e->cap_.n_mtp = o.mtp_layers;
    const int64_t blocks = model::max_blocks(e->cap_);

    // Pages: the full pool holds ctx_size positions plus one partial page per sequence; the sliding pool per
    // sequence its window, a step's rows and an MTP lag of up to a step behind the trunk, plus two pages of
    // slack at the edges (SERVING.md 1.6).
    const int64_t full_pages =
        e->pools_.full_layers.empty() ? 0 : (o.ctx_size + kKvPageRows - 1) / kKvPageRows + o.max_seqs;
    int64_t swa_pages = 0;
    if (!e->pools_.swa_layers.empty()) {
        const int64_t live = (e->pools_.window - 1 + 2 * o.step_rows + kKvPageRows - 1) / kKvPageRows + 2;
        swa_pages = int64_t{o.max_seqs} * std::min(live, blocks);
    }
    if (full_pages > INT32_MAX / kKvPageRows || swa_pages > INT32_MAX / kKvPageRows) {
        return make_error("engine: {} full and {} sliding pages of {} rows exceed 2^31 slots", full_pages, swa_pages,
                          kKvPageRows);
    }
    e->full_ = kv::PagePool(static_cast<int32_t>(full_pages));
    e->swa_ = kv::PagePool(static_cast<int32_t>(swa_pages));

    if (o.tp > 1) {
        auto group = parallel::InProcessGroup::create(o.tp);
        if (!group) return wrap_error("engine", group.error());
        e->group_.emplace(std::move(*group));
    }
    const int64_t max_sample_rows = o.max_seqs;
    if (max_sample_rows * max_positions > INT32_MAX) {
        return make_error("engine: the sampling history of {} sequences of {} positions exceeds 2^31 tokens; lower "
                          "the context (-c) or the sequences",
                          max_sample_rows, max_positions);
    }
    const int64_t capacity = table_capacity(e->cap_, blocks, max_sample_rows, max_positions);
    for (int r = 0; r < o.tp; ++r) {
        auto rk = std::make_unique<Rank>();
        auto backend = o.make_backend(r);
        if (!backend) return wrap_error(fmt::format("rank {} backend", r), backend.error());
        if (!*backend) return make_error("rank {} backend: the factory returned none", r);
        rk->backend = std::move(*backend);
        Backend &be = *rk->backend;
        const parallel::RankPlan *rank_plan = o.tp > 1 ? &e->plan_.ranks[static_cast<size_t>(r)] : nullptr;
        auto bound = o.tp > 1 ? model::bind_step35_model(be, ckpt, cfg, e->plan_, r)
                              : model::bind_step35_model(be, ckpt, cfg);
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
                                                           model::RankContext{&e->plan_, r, &e->group_->communicator(r)})
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
    for (int s = 0; s < kv::kMaxStreams; ++s) {
        e->logit_begin_[s].reserve(static_cast<size_t>(o.max_seqs));
        e->logit_count_[s].reserve(static_cast<size_t>(o.max_seqs));
    }
    e->run_error_.reserve(256);
    return e;
}

Result<std::unique_ptr<Sequence>> Engine::create_sequence(const SequenceOptions &options) {
    if (options.mtp_streams < 0 || options.mtp_streams > options_.mtp_layers) {
        return make_error("sequence: {} MTP streams, the engine runs {} MTP layers", options.mtp_streams,
                          options_.mtp_layers);
    }
    if (auto ok = validate_sampling_params(options.sampling); !ok) return tl::unexpected(ok.error());
    kv::SeqKvShape shape = seq_shape_;
    shape.n_streams = 1 + options.mtp_streams;
    std::unique_ptr<Sequence> seq(new Sequence(this, shape, options));
    live_.push_back(seq.get());
    return seq;
}

void Engine::release(Sequence &seq) {
    // The step cannot finish without it (a client unwinding between plan and finish): nothing of it commits.
    if (phase_ != Phase::kIdle && std::find(step_seqs_.begin(), step_seqs_.end(), &seq) != step_seqs_.end()) {
        abandon();
    }
    seq.kv_.release_all(full_, swa_);
    live_.erase(std::remove(live_.begin(), live_.end(), &seq), live_.end());
}

// ---- The step ----

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
        if (it.rows < 0 || it.rows > n_tokens - len0) {
            return make_error("step item {}: {} trunk rows, the sequence has {} tokens past its {} cached ones", i,
                              it.rows, n_tokens - len0, len0);
        }
        for (int64_t p = len0; p < len0 + it.rows; ++p) {
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
            if (p0 + n + 1 > n_tokens) {
                return make_error("step item {}: MTP layer {} row {} needs the token at position {}, the sequence has {} "
                                  "tokens",
                                  i, k, p0 + n - 1, p0 + n, n_tokens);
            }
            for (int64_t p = p0 + 1; p <= p0 + n; ++p) {
                const int32_t id = s->tokens[static_cast<size_t>(p)];
                if (id < 0 || id >= cfg_.vocab_size) {
                    return make_error("step item {}: token id {} at position {} outside the vocabulary [0, {})", i, id,
                                      p, cfg_.vocab_size);
                }
            }
            // Row p reads the hidden row of the trunk at p (k = 0) or of MTP layer k - 1 at p - 1, which must
            // be a row of this step.
            const int64_t src0 = k == 0 ? len0 : s->length(k);
            const int64_t src1 = k == 0 ? len0 + it.rows : s->length(k) + it.mtp_rows[k - 1];
            const int64_t need0 = k == 0 ? p0 : p0 - 1;
            const int64_t need1 = need0 + n;
            if (need0 < src0 || need1 > src1) {
                return make_error("step item {}: MTP layer {} rows at positions [{}, {}) read {} rows [{}, {}), but "
                                  "this step computes [{}, {})",
                                  i, k, p0, p0 + n, k == 0 ? std::string("trunk") : fmt::format("MTP layer {}", k - 1),
                                  need0, need1, src0, src1);
            }
            rows[1 + k] += n;
            if (it.mtp_logits) logit_rows += n;
        }
        if (item_rows == 0) return make_error("step item {}: no rows to run", i);
        if (it.logits == LogitRows::kAll) logit_rows += it.rows;
        if (it.logits == LogitRows::kLast && it.rows > 0) logit_rows += 1;
        if (it.sample && (it.rows == 0 || it.logits == LogitRows::kNone)) {
            return make_error("step item {}: sampling needs the last trunk row's logits", i);
        }
        if (it.top_logprobs < -1 || it.top_logprobs > kMaxTopLogprobs) {
            return make_error("step item {}: top_logprobs {} outside [-1, {}]", i, it.top_logprobs, kMaxTopLogprobs);
        }
        if (it.sample && len0 + it.rows > int64_t{0xffffffff}) {
            return make_error("step item {}: position {} is past the sampler's 2^32 positions", i, len0 + it.rows);
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
        auto txn = s.kv_.begin(std::span<const int64_t>(rows, static_cast<size_t>(s.n_streams())), full_, swa_);
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
        int64_t ids = 0, pos = 0, seq = 0, slot_full = 0, slot_swa = 0, logit_rows = 0, hidden_src = 0;
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
            const int64_t n = s == 0 ? it.rows : it.mtp_rows[s - 1];
            const int64_t nl = s == 0 ? (it.logits == LogitRows::kAll ? it.rows
                                         : it.logits == LogitRows::kLast && it.rows > 0 ? 1
                                                                                        : 0)
                                      : (it.mtp_logits ? n : 0);
            logit_begin_[s][static_cast<size_t>(i)] = logit_total;
            logit_count_[s][static_cast<size_t>(i)] = nl;
            so[s].n += n;
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
    }
    const int64_t bt_full = take(n_items * blocks * 4);
    const int64_t bt_swa = take(n_items * blocks * 4);
    n_sample_rows_ = 0;
    for (const StepItem &it : items) n_sample_rows_ += it.sample ? 1 : 0;
    sample_offset_ = take(n_sample_rows_ * static_cast<int64_t>(sizeof(SampleRow)));
    history_len_ = 0;
    for (const StepItem &it : items) {
        if (!it.sample) continue;
        history_len_ += it.seq->sampling_.penalty_context(it.seq->length(0) + it.rows);
    }
    history_offset_ = take(history_len_ * 4);
    table_bytes_ = cursor;

    // Fill: item after item, row j of stream s at position length(s) + j. An item's first row per stream
    // (the sum of the earlier items' rows) locates the hidden rows its next stream reads.
    int64_t row[model::kMaxStreamsPerStep] = {};
    int64_t item_first[model::kMaxStreamsPerStep] = {};
    int64_t starts[model::kMaxStreamsPerStep] = {};
    int64_t logit_fill[model::kMaxStreamsPerStep] = {};
    int64_t sample_fill = 0, history_fill = 0;
    sample_row_of_item_.assign(static_cast<size_t>(n_items), -1);
    auto *sample_rows = reinterpret_cast<SampleRow *>(host + sample_offset_);
    for (int64_t i = 0; i < n_items; ++i) {
        const StepItem &it = items[static_cast<size_t>(i)];
        const Sequence &sq = *it.seq;
        const kv::SeqKv &kv = sq.kv_;
        for (int s = 0; s < model::kMaxStreamsPerStep; ++s) item_first[s] = starts[s];
        for (int s = 0; s < model::kMaxStreamsPerStep; ++s) {
            const int64_t n = s == 0 ? it.rows : it.mtp_rows[s - 1];
            const int64_t p0 = s < sq.n_streams() ? kv.length(s) : 0;
            for (int64_t j = 0; j < n; ++j) {
                const int64_t r = row[s]++;
                const int64_t p = p0 + j;
                i32_at(so[s].ids)[r] = sq.tokens[static_cast<size_t>(s == 0 ? p : p + 1)];
                i64_at(so[s].pos)[r] = p;
                i32_at(so[s].seq)[r] = static_cast<int32_t>(i);
                i32_at(so[s].slot_full)[r] =
                    s == 0 && seq_shape_.trunk_full ? kv.slot(kv::PoolKind::kFull, p) : -1;
                i32_at(so[s].slot_swa)[r] =
                    (s > 0 || seq_shape_.trunk_sliding) ? kv.slot(kv::PoolKind::kSwa, p) : -1;
                // The previous stream's row: the trunk's row at p, or MTP layer s - 2's row at p - 1.
                int32_t src = -1;
                if (s == 1) src = static_cast<int32_t>(item_first[0] + (p - kv.length(0)));
                if (s > 1) src = static_cast<int32_t>(item_first[s - 1] + (p - 1 - kv.length(s - 1)));
                i32_at(so[s].hidden_src)[r] = src;
            }
            // Logit rows: the stream rows whose logits are computed.
            const int64_t nl = logit_count_[s][static_cast<size_t>(i)];
            for (int64_t j = 0; j < nl; ++j) {
                const int64_t local = s == 0 && it.logits == LogitRows::kLast ? n - 1 : j;
                i32_at(so[s].logit_rows)[logit_fill[s]++] = static_cast<int32_t>(item_first[s] + local);
            }
            starts[s] += n;
        }
        std::memcpy(host + bt_full + i * blocks * 4, kv.block_table(kv::PoolKind::kFull).data(),
                    static_cast<size_t>(blocks * 4));
        std::memcpy(host + bt_swa + i * blocks * 4, kv.block_table(kv::PoolKind::kSwa).data(),
                    static_cast<size_t>(blocks * 4));
        if (it.sample) {
            const SamplingParams &p = sq.sampling_;
            const int64_t context = kv.length(0) + it.rows;
            const int64_t hist = p.penalty_context(context);  // none when the penalties are off
            SampleRow sr;
            sr.params = p;
            sr.choice = sq.choice_;
            sr.position = context;
            sr.logit_row = static_cast<int32_t>(logit_begin_[0][static_cast<size_t>(i)] +
                                                logit_count_[0][static_cast<size_t>(i)] - 1);
            sr.history_begin = static_cast<int32_t>(history_fill);
            sr.history_len = static_cast<int32_t>(hist);
            sr.top_logprobs = it.top_logprobs;
            std::memcpy(&sample_rows[sample_fill], &sr, sizeof(SampleRow));
            std::memcpy(host + history_offset_ + history_fill * 4, sq.tokens.data() + (context - hist),
                        static_cast<size_t>(hist * 4));
            history_fill += hist;
            sample_row_of_item_[static_cast<size_t>(i)] = sample_fill++;
        }
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
        }
        t.bt_full = table_view(rk->tables, bt_full, DType::kI32, n_items, blocks);
        t.bt_swa = table_view(rk->tables, bt_swa, DType::kI32, n_items, blocks);
        rk->sample_rows = table_view(rk->tables, sample_offset_, DType::kU8,
                                     n_sample_rows_ * static_cast<int64_t>(sizeof(SampleRow)));
        rk->history = table_view(rk->tables, history_offset_, DType::kI32, history_len_);
    }
}

Result<void> Engine::plan(std::span<const StepItem> items) {
    const int64_t before = count_allocations_ ? count_allocations_() : 0;
    if (phase_ != Phase::kIdle) return make_error("step: a step is already planned; finish or abandon it first");
    if (auto ok = check_items(items); !ok) return ok;
    if (auto ok = begin_all(items); !ok) return ok;
    step_seqs_.clear();
    step_items_.clear();
    for (const StepItem &it : items) {
        step_seqs_.push_back(it.seq);
        step_items_.push_back(it);
    }
    pack_tables(items);
    for (const std::unique_ptr<Rank> &rk : ranks_) {
        rk->d2h_at_plan = rk->d2h_at_run_end = rk->backend->counters().d2h_copies;
        rk->backend->copy_from_host(host_tables_.data(), rk->tables.row_slice(0, table_bytes_));
    }
    run_error_.clear();
    phase_ = Phase::kPlanned;
    alloc_before_ = before;
    return {};
}

Result<void> Engine::run_rank(int rank) {
    Rank &rk = *ranks_[static_cast<size_t>(rank)];
    if (auto ok = rk.forward->run(rk.step); !ok) return ok;
    if (n_sample_rows_ > 0) {
        rk.backend->sample(rk.forward->logits(n_logit_rows_), options_.sample_vocab, rk.sample_rows, rk.history,
                           rk.sample_out.row_slice(0, n_sample_rows_ * static_cast<int64_t>(sizeof(SampledToken))));
    }
    return {};
}

void Engine::run() {
    MEMRA_CHECK(phase_ == Phase::kPlanned, "engine: run() without a planned step");
    Result<void> ok;
    if (group_) {
        ok = group_->run([this](int r, parallel::Communicator &) { return run_rank(r); });
    } else {
        ok = run_rank(0);
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

Result<void> Engine::finish(std::span<const Keep> keep) {
    if (phase_ != Phase::kRun) return make_error("step: finish() without a run step");
    if (!run_error_.empty()) {
        rollback_all();
        count(alloc_before_);
        return make_error("step failed: {}", run_error_);
    }
    if (!keep.empty() && keep.size() != step_seqs_.size()) {
        rollback_all();
        count(alloc_before_);
        return make_error("step finish: {} keep counts for {} sequences", keep.size(), step_seqs_.size());
    }
    // Every keep count is checked before any sequence commits, so a refusal leaves the whole step rolled back.
    for (size_t i = 0; i < step_seqs_.size(); ++i) {
        if (auto ok = check_keep(*step_seqs_[i], keep.empty() ? Keep{} : keep[i]); !ok) {
            rollback_all();
            count(alloc_before_);
            return wrap_error(fmt::format("step item {} keep", i), ok.error());
        }
    }
    Rank &r0 = *ranks_.front();
    if (n_sample_rows_ > 0) {
        r0.backend->copy_to_host(r0.sample_out.row_slice(0, n_sample_rows_ * static_cast<int64_t>(sizeof(SampledToken))),
                                 sampled_.data());
    }
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
            rows[st] = want < 0 ? s.kv_.staged(st) : want;
        }
        auto ok = s.kv_.commit(s.txn_, std::span<const int64_t>(rows, static_cast<size_t>(s.n_streams())), full_, swa_);
        MEMRA_CHECK(ok.has_value(), "engine: item {}'s checked keep counts were refused: {}", i,
                    ok ? "" : ok.error().message);
    }
    step_seqs_.clear();
    phase_ = Phase::kIdle;
    count(alloc_before_);
    return {};
}

Result<void> Engine::check_keep(const Sequence &s, const Keep &keep) const {
    int64_t len[kv::kMaxStreams] = {};
    for (int st = 0; st < s.n_streams(); ++st) {
        const int64_t staged = s.kv_.staged(st);
        const int64_t want = keep.rows[st] < 0 ? staged : keep.rows[st];
        if (want > staged) return make_error("stream {} keeps {} rows, {} were staged", st, want, staged);
        len[st] = s.kv_.length(st) + want;
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

const SampledToken &Engine::sampled(size_t item) const {
    MEMRA_CHECK(item < sample_row_of_item_.size() && sample_row_of_item_[item] >= 0, "engine: item {} did not sample",
                item);
    return sampled_[static_cast<size_t>(sample_row_of_item_[item])];
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

Backend &Engine::backend(int rank) { return *ranks_.at(static_cast<size_t>(rank))->backend; }

model::Step35Forward &Engine::forward(int rank) { return *ranks_.at(static_cast<size_t>(rank))->forward; }

std::vector<float> Engine::rank_logits(int rank) const {
    const Rank &rk = *ranks_.at(static_cast<size_t>(rank));
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
    const Rank &rk = *ranks_.at(static_cast<size_t>(rank));
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
        int64_t held = 0;
        for (const Sequence *s : live_) {
            held += s->kv_.pages_held(kind);
            for (const int32_t page : s->kv_.block_table(kind)) {
                if (page >= 0) ++refs[static_cast<size_t>(page)];
            }
        }
        if (held + pool.n_free() != pool.n_pages()) {
            return make_error("{} KV pool: {} pages held + {} free != {} pages", kv::pool_kind_name(kind), held,
                              pool.n_free(), pool.n_pages());
        }
        for (int32_t p = 0; p < pool.n_pages(); ++p) {
            if (refs[static_cast<size_t>(p)] != pool.refcount(p)) {
                return make_error("{} KV pool: page {} has reference count {}, {} block tables hold it",
                                  kv::pool_kind_name(kind), p, pool.refcount(p), refs[static_cast<size_t>(p)]);
            }
        }
    }
    return {};
}

StepCounters Engine::counters(int rank) const {
    const Rank &rk = *ranks_.at(static_cast<size_t>(rank));
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
        if (auto ok = engine.step(std::span(&it, 1)); !ok) return tl::unexpected(ok.error());
        if (last) return engine.sampled(0).id;
    }
}

}  // namespace memra::runtime
