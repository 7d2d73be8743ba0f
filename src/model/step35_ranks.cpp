// Step35RankGroup (step35_ranks.h): plans the model, builds one backend, shard and forward per rank over an
// in-process rank group, and steps all ranks together; after each step it checks that every rank holds the
// same logit bits and that the ranks' caches agree.
#include "model/step35_ranks.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "core/check.h"
#include "model/step35_plan.h"

namespace memra::model {

const kv::KvCache &RankSequence::trunk(int rank) const {
    MEMRA_CHECK(rank >= 0 && static_cast<size_t>(rank) < trunk_.size(), "rank {} of {}", rank, trunk_.size());
    return trunk_[static_cast<size_t>(rank)];
}

const kv::KvCache &RankSequence::mtp(int mtp, int rank) const {
    MEMRA_CHECK(mtp >= 0 && static_cast<size_t>(mtp) < mtp_.size(), "MTP layer {} of {}", mtp, mtp_.size());
    MEMRA_CHECK(rank >= 0 && static_cast<size_t>(rank) < mtp_[static_cast<size_t>(mtp)].size(), "rank {} of {}",
                rank, mtp_[static_cast<size_t>(mtp)].size());
    return mtp_[static_cast<size_t>(mtp)][static_cast<size_t>(rank)];
}

Step35RankGroup::~Step35RankGroup() = default;

Result<std::unique_ptr<Step35RankGroup>> Step35RankGroup::create(const io::Checkpoint &ckpt, const Step35Config &cfg,
                                                                 const RankGroupOptions &options) {
    if (!options.make_backend) return make_error("rank group: no backend factory");
    parallel::PlanRequest request;
    request.tp = options.tp;
    request.ep = options.ep;
    request.devices_available = options.tp;  // in-process ranks: one per requested rank
    auto plan = parallel::make_plan(plan_shape(cfg), request);
    if (!plan) return wrap_error(fmt::format("rank group: tp={} ep={}", options.tp, options.ep), plan.error());
    auto group = parallel::InProcessGroup::create(options.tp);
    if (!group) return wrap_error("rank group", group.error());

    std::unique_ptr<Step35RankGroup> g(new Step35RankGroup());
    g->cfg_ = cfg;
    g->tp_ = options.tp;
    g->plan_ = std::move(*plan);
    g->group_.emplace(std::move(*group));
    const auto n = static_cast<size_t>(options.tp);
    g->backends_.reserve(n);
    g->models_.reserve(n);
    g->forwards_.reserve(n);
    for (int r = 0; r < options.tp; ++r) {
        auto backend = options.make_backend(r);
        if (!backend) return wrap_error(fmt::format("rank {} backend", r), backend.error());
        if (!*backend) return make_error("rank {} backend: the factory returned none", r);
        g->backends_.push_back(std::move(*backend));
        auto model = bind_step35_model(*g->backends_.back(), ckpt, cfg, g->plan_, r);
        if (!model) return wrap_error(fmt::format("rank {} bind", r), model.error());
        g->models_.push_back(std::make_unique<Step35Model>(std::move(*model)));
        const RankContext ctx{&g->plan_, r, &g->group_->communicator(r)};
        auto fwd = Step35Forward::create(*g->backends_.back(), *g->models_.back(), options.capacity, ctx);
        if (!fwd) return wrap_error(fmt::format("rank {} forward", r), fwd.error());
        g->forwards_.push_back(std::move(*fwd));
    }
    const auto max_seqs = static_cast<size_t>(g->forwards_.front().capacity().max_seqs);
    g->seq_chunks_.assign(n, {});
    g->mtp_chunks_.assign(n, {});
    for (size_t r = 0; r < n; ++r) {
        g->seq_chunks_[r].reserve(max_seqs);
        g->mtp_chunks_[r].reserve(max_seqs);
    }
    g->step_seqs_.reserve(max_seqs);
    return g;
}

Result<RankSequence> Step35RankGroup::create_sequence(kv::KvFormat k_format, kv::KvFormat v_format, int64_t capacity,
                                                      int max_stage_rows) {
    RankSequence seq;
    seq.group_ = this;
    for (int r = 0; r < tp_; ++r) {
        const parallel::RankPlan &rank = plan_.ranks[static_cast<size_t>(r)];
        auto c = kv::KvCache::create(trunk_kv_spec(cfg_, rank, k_format, v_format, capacity, max_stage_rows));
        if (!c) return wrap_error(fmt::format("rank {} trunk KV cache", r), c.error());
        seq.trunk_.push_back(std::move(*c));
    }
    for (int m = 0; m < cfg_.n_mtp_layers; ++m) {
        seq.mtp_.emplace_back();
        for (int r = 0; r < tp_; ++r) {
            const parallel::RankPlan &rank = plan_.ranks[static_cast<size_t>(r)];
            auto c = kv::KvCache::create(mtp_kv_spec(cfg_, rank, m, k_format, v_format, capacity, max_stage_rows));
            if (!c) return wrap_error(fmt::format("rank {} MTP {} KV cache", r, m), c.error());
            seq.mtp_.back().push_back(std::move(*c));
        }
    }
    return seq;
}

Result<void> Step35RankGroup::check_sequences(std::span<RankSequence *const> seqs) const {
    if (!broken_.empty()) return make_error("rank group: a previous step failed ({}); create a new group", broken_);
    for (size_t i = 0; i < seqs.size(); ++i) {
        if (seqs[i] == nullptr) return make_error("chunk {}: no sequence", i);
        if (seqs[i]->group_ != this) return make_error("chunk {}: the sequence belongs to another rank group", i);
    }
    return {};
}

Result<void> Step35RankGroup::counted(FunctionRef<Result<void>()> body) {
    step_allocations_ = -1;
    if (!count_allocations_) return body();
    const int64_t before = count_allocations_();
    auto r = body();
    step_allocations_ = count_allocations_() - before;
    return r;
}

Result<void> Step35RankGroup::run_all(FunctionRef<Result<void>(int rank)> fn) {
    auto ran = group_->run([&fn](int rank, parallel::Communicator &) { return fn(rank); });
    if (!ran) {
        broken_ = ran.error().message;
        return wrap_error("rank group step", ran.error());
    }
    return {};
}

// After a step: every rank's logits equal rank 0's bit for bit, and each sequence's caches (trunk, or MTP
// layer `mtp` when mtp >= 0) agree across ranks in committed length and transaction generation.
Result<void> Step35RankGroup::check_after(std::span<RankSequence *const> seqs, int mtp) const {
    const Step35Forward &f0 = forwards_.front();
    for (int r = 1; r < tp_; ++r) {
        const Step35Forward &f = forwards_[static_cast<size_t>(r)];
        const auto rows0 = f0.logit_row_begin();
        const auto rows = f.logit_row_begin();
        if (!std::equal(rows0.begin(), rows0.end(), rows.begin(), rows.end())) {
            return make_error("rank group: rank {} has other logit rows than rank 0", r);
        }
        const auto a = f0.logits();
        const auto b = f.logits();
        if (a.size() != b.size() || std::memcmp(a.data(), b.data(), a.size_bytes()) != 0) {
            size_t at = 0;
            while (at < a.size() && at < b.size() && std::memcmp(&a[at], &b[at], sizeof(float)) == 0) ++at;
            return make_error("rank group: rank {} logits differ from rank 0's (first at element {} of {})", r, at,
                              a.size());
        }
    }
    for (size_t i = 0; i < seqs.size(); ++i) {
        const RankSequence &s = *seqs[i];
        const kv::KvCache &c0 = mtp < 0 ? s.trunk(0) : s.mtp(mtp, 0);
        for (int r = 0; r < tp_; ++r) {
            const kv::KvCache &c = mtp < 0 ? s.trunk(r) : s.mtp(mtp, r);
            if (c.in_txn() || c.length() != c0.length() || c.last_generation() != c0.last_generation()) {
                return make_error("rank group: chunk {}: rank {} cache is at length {} generation {}{}, rank 0 at {} "
                                  "generation {}",
                                  i, r, c.length(), c.last_generation(), c.in_txn() ? " (transaction open)" : "",
                                  c0.length(), c0.last_generation());
            }
        }
    }
    return {};
}

Result<void> Step35RankGroup::step(std::span<const RankSeqChunk> chunks) {
    return counted([&] { return step_body(chunks); });
}

Result<void> Step35RankGroup::mtp_step(int mtp, std::span<const RankMtpChunk> chunks, HiddenRows h_prev) {
    return counted([&] { return mtp_step_body(mtp, chunks, h_prev); });
}

Result<void> Step35RankGroup::step_body(std::span<const RankSeqChunk> chunks) {
    step_seqs_.clear();
    for (const RankSeqChunk &c : chunks) {
        if (step_seqs_.size() < step_seqs_.capacity()) step_seqs_.push_back(c.seq);
    }
    if (chunks.size() > step_seqs_.capacity()) {
        return make_error("step: {} chunks, expected 1 .. {}", chunks.size(), step_seqs_.capacity());
    }
    if (auto ok = check_sequences(step_seqs_); !ok) return ok;
    for (int r = 0; r < tp_; ++r) {
        std::vector<SeqChunk> &rc = seq_chunks_[static_cast<size_t>(r)];
        rc.clear();
        for (const RankSeqChunk &c : chunks) {
            rc.push_back(SeqChunk{&c.seq->trunk_[static_cast<size_t>(r)], c.tokens, c.all_logits, c.commit});
        }
        if (auto ok = forwards_[static_cast<size_t>(r)].check_step(rc); !ok) {
            return wrap_error(fmt::format("rank {}", r), ok.error());
        }
    }
    auto ran = run_all([this](int r) {
        return forwards_[static_cast<size_t>(r)].step(seq_chunks_[static_cast<size_t>(r)]);
    });
    if (!ran) return ran;
    return check_after(step_seqs_, -1);
}

Result<void> Step35RankGroup::mtp_step_body(int mtp, std::span<const RankMtpChunk> chunks, HiddenRows h_prev) {
    if (mtp < 0 || mtp >= cfg_.n_mtp_layers) {
        return make_error("mtp_step: MTP layer {} outside [0, {})", mtp, cfg_.n_mtp_layers);
    }
    step_seqs_.clear();
    for (const RankMtpChunk &c : chunks) {
        if (step_seqs_.size() < step_seqs_.capacity()) step_seqs_.push_back(c.seq);
    }
    if (chunks.size() > step_seqs_.capacity()) {
        return make_error("mtp_step: {} chunks, expected 1 .. {}", chunks.size(), step_seqs_.capacity());
    }
    if (auto ok = check_sequences(step_seqs_); !ok) return ok;
    for (int r = 0; r < tp_; ++r) {
        Step35Forward &f = forwards_[static_cast<size_t>(r)];
        const TensorView src = h_prev.from_mtp ? f.mtp_hidden() : f.hidden();
        if (h_prev.row_begin < 0 || h_prev.row_begin > h_prev.row_end || h_prev.row_end > src.rows()) {
            return make_error("mtp_step: h_prev rows [{}, {}) outside the {} rows of the last {} step",
                              h_prev.row_begin, h_prev.row_end, src.rows(), h_prev.from_mtp ? "MTP" : "trunk");
        }
        std::vector<MtpChunk> &rc = mtp_chunks_[static_cast<size_t>(r)];
        rc.clear();
        for (const RankMtpChunk &c : chunks) {
            rc.push_back(MtpChunk{&c.seq->mtp_[static_cast<size_t>(mtp)][static_cast<size_t>(r)], c.next_tokens,
                                  c.all_logits, c.commit});
        }
        if (auto ok = f.check_mtp_step(mtp, rc, src.row_slice(h_prev.row_begin, h_prev.row_end)); !ok) {
            return wrap_error(fmt::format("rank {}", r), ok.error());
        }
    }
    auto ran = run_all([this, mtp, h_prev](int r) {
        Step35Forward &f = forwards_[static_cast<size_t>(r)];
        const TensorView src = h_prev.from_mtp ? f.mtp_hidden() : f.hidden();
        return f.mtp_step(mtp, mtp_chunks_[static_cast<size_t>(r)], src.row_slice(h_prev.row_begin, h_prev.row_end));
    });
    if (!ran) return ran;
    return check_after(step_seqs_, mtp);
}

Result<void> Step35RankGroup::grow(RankSequence &seq, int64_t new_capacity) {
    if (seq.group_ != this) return make_error("grow: the sequence belongs to another rank group");
    std::vector<kv::KvCache *> caches;
    for (kv::KvCache &c : seq.trunk_) caches.push_back(&c);
    for (std::vector<kv::KvCache> &layer : seq.mtp_) {
        for (kv::KvCache &c : layer) caches.push_back(&c);
    }
    for (const kv::KvCache *c : caches) {
        if (c->in_txn()) return make_error("grow: a cache of the sequence has an open transaction");
        if (new_capacity < c->capacity()) {
            return make_error("grow: new capacity {} is below the capacity {}", new_capacity, c->capacity());
        }
    }
    for (kv::KvCache *c : caches) {
        if (auto ok = c->grow(new_capacity); !ok) return wrap_error("grow", ok.error());
    }
    return {};
}

std::span<const float> Step35RankGroup::logits() const { return forwards_.front().logits(); }

std::span<const int64_t> Step35RankGroup::logit_row_begin() const { return forwards_.front().logit_row_begin(); }

std::span<const float> Step35RankGroup::rank_logits(int rank) const {
    MEMRA_CHECK(rank >= 0 && rank < tp_, "rank {} of {}", rank, tp_);
    return forwards_[static_cast<size_t>(rank)].logits();
}

Backend &Step35RankGroup::backend(int rank) {
    MEMRA_CHECK(rank >= 0 && rank < tp_, "rank {} of {}", rank, tp_);
    return *backends_[static_cast<size_t>(rank)];
}

const Step35Model &Step35RankGroup::model(int rank) const {
    MEMRA_CHECK(rank >= 0 && rank < tp_, "rank {} of {}", rank, tp_);
    return *models_[static_cast<size_t>(rank)];
}

Step35Forward &Step35RankGroup::forward(int rank) {
    MEMRA_CHECK(rank >= 0 && rank < tp_, "rank {} of {}", rank, tp_);
    return forwards_[static_cast<size_t>(rank)];
}

BackendCounters Step35RankGroup::counters(int rank) const {
    MEMRA_CHECK(rank >= 0 && rank < tp_, "rank {} of {}", rank, tp_);
    return backends_[static_cast<size_t>(rank)]->counters();
}

CommCounters Step35RankGroup::comm_counters(int rank) const {
    MEMRA_CHECK(rank >= 0 && rank < tp_, "rank {} of {}", rank, tp_);
    return forwards_[static_cast<size_t>(rank)].comm_counters();
}

void Step35RankGroup::reset_counters() {
    for (int r = 0; r < tp_; ++r) {
        backends_[static_cast<size_t>(r)]->reset_counters();
        forwards_[static_cast<size_t>(r)].reset_comm_counters();
    }
}

}  // namespace memra::model
