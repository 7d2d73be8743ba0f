// Step35RankGroup: a Step-3.5 model on tp tensor-parallel ranks of one process (the ranks are threads of a
// parallel::InProcessGroup), each with its own backend, model shard, forward and KV caches, stepped together
// with the same chunks. Every rank ends a step with the full logits; the group checks that they are bit for
// bit the same on every rank and that every rank's caches agree (DETERMINISM.md D3, D4). The TP tests and
// `memra verify` and `memra bench --tp` drive it; backends come from a factory, so CPU or (later) device ranks
// plug in alike. The rank threads are the group's persistent threads: a step wakes them and allocates nothing.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "core/function_ref.h"
#include "core/result.h"
#include "io/safetensors.h"
#include "kv/kv_cache.h"
#include "model/step35_config.h"
#include "model/step35_forward.h"
#include "model/step35_model.h"
#include "parallel/comm.h"
#include "parallel/plan.h"

namespace memra::model {

// Makes rank r's backend: e.g. a cpu::CpuBackend with its own threads (the model module does not depend on
// a backend implementation, so the caller names it).
using BackendFactory = std::function<Result<std::unique_ptr<Backend>>(int rank)>;

struct RankGroupOptions {
    int tp = 1;                 // tensor-parallel ranks (the plan refuses what the model cannot split)
    bool ep = false;            // routed experts whole on their owner ranks
    ForwardCapacity capacity;   // every rank's forward
    BackendFactory make_backend;
};

class Step35RankGroup;

// One sequence's KV caches on every rank: its trunk cache and one cache per MTP layer, each holding only
// that rank's KV heads. Created by Step35RankGroup::create_sequence and used only with that group.
class RankSequence {
public:
    const kv::KvCache &trunk(int rank) const;
    const kv::KvCache &mtp(int mtp, int rank) const;
    int64_t length() const { return trunk_.front().length(); }  // committed positions (all ranks agree)
    int64_t capacity() const { return trunk_.front().capacity(); }

private:
    friend class Step35RankGroup;
    const Step35RankGroup *group_ = nullptr;
    std::vector<kv::KvCache> trunk_;             // [rank]
    std::vector<std::vector<kv::KvCache>> mtp_;  // [mtp layer][rank]
};

// One sequence's part of a group step (SeqChunk with the sequence's caches on every rank).
struct RankSeqChunk {
    RankSequence *seq = nullptr;
    std::span<const int32_t> tokens;
    bool all_logits = false;
    int64_t commit = -1;
};

// One sequence's part of a group MTP step (MtpChunk on every rank).
struct RankMtpChunk {
    RankSequence *seq = nullptr;
    std::span<const int32_t> next_tokens;
    bool all_logits = false;
    int64_t commit = -1;
};

// The MTP step's h_prev on every rank: rows of its own (replicated, identical) hidden state.
struct HiddenRows {
    bool from_mtp = false;  // false: hidden() of the last trunk step; true: mtp_hidden() of the last MTP step
    int64_t row_begin = 0;
    int64_t row_end = 0;
};

class Step35RankGroup {
public:
    // Plans the model (model::plan_shape + parallel::make_plan, one pipeline stage; a refusal is the error),
    // creates the rank group, and per rank: the backend, the bound shard, the forward. The checkpoint must
    // outlive the group (CPU shards are views of its mmap).
    static Result<std::unique_ptr<Step35RankGroup>> create(const io::Checkpoint &ckpt, const Step35Config &cfg,
                                                           const RankGroupOptions &options);

    Step35RankGroup(const Step35RankGroup &) = delete;
    Step35RankGroup &operator=(const Step35RankGroup &) = delete;
    ~Step35RankGroup();

    // A sequence's caches on every rank (trunk_kv_spec / mtp_kv_spec of each rank; capacity and stage
    // limit as for a single-rank cache). Refused: a bad spec, an allocation failure.
    Result<RankSequence> create_sequence(kv::KvFormat k_format, kv::KvFormat v_format, int64_t capacity,
                                         int max_stage_rows);

    // Runs the chunks on every rank (each rank: one transaction per cache, commit at the end). Every rank's
    // forward checks the step first, so a refused step changes nothing and leaves the group usable. After
    // the ranks ran: their logits must be bit-identical and every sequence's caches must agree in length and
    // transaction generation, else an error. A failure while the ranks run (the communicator aborts) leaves
    // the group broken: later steps are refused.
    Result<void> step(std::span<const RankSeqChunk> chunks);
    // MTP layer `mtp` over the chunks, with h_prev taken on each rank from its own hidden rows.
    Result<void> mtp_step(int mtp, std::span<const RankMtpChunk> chunks, HiddenRows h_prev);

    // Raises the capacity of every cache of the sequence (trunk and MTP layers, every rank) to new_capacity,
    // each keeping its rows' bytes and its transaction generation (kv::KvCache::grow). Refused before any
    // cache changes: a sequence of another group, new_capacity below the capacity, an open transaction.
    // Allocates: not a hot-path call.
    Result<void> grow(RankSequence &seq, int64_t new_capacity);

    // count() returns the process's heap allocations so far (a counting operator new, e.g. memra verify's);
    // empty turns counting off. While on, every step / mtp_step counts the allocations made from its call
    // to its return, on every thread: the caller's checks and dispatch and all ranks' work.
    void set_allocation_counter(std::function<int64_t()> count) { count_allocations_ = std::move(count); }
    // Heap allocations made during the last step / mtp_step; -1 when not counted.
    int64_t step_allocations() const { return step_allocations_; }

    // The last step's logits (rank 0's; all ranks hold the same bits): [rows, vocab_size], rows in chunk
    // order, chunk i owning rows logit_row_begin()[i] .. [i + 1].
    std::span<const float> logits() const;
    std::span<const int64_t> logit_row_begin() const;
    std::span<const float> rank_logits(int rank) const;

    int tp() const { return tp_; }
    bool ep() const { return plan_.request.ep; }
    const Step35Config &config() const { return cfg_; }
    const parallel::ParallelPlan &plan() const { return plan_; }
    Backend &backend(int rank);
    const Step35Model &model(int rank) const;
    Step35Forward &forward(int rank);

    // Work per rank since the last reset: backend launches / host copies, and collective calls.
    BackendCounters counters(int rank) const;
    CommCounters comm_counters(int rank) const;
    void reset_counters();

private:
    Step35RankGroup() = default;
    Result<void> check_sequences(std::span<RankSequence *const> seqs) const;
    Result<void> check_after(std::span<RankSequence *const> seqs, int mtp) const;
    // Runs body and, while counting is on, records the allocations it made in step_allocations_.
    Result<void> counted(FunctionRef<Result<void>()> body);
    Result<void> step_body(std::span<const RankSeqChunk> chunks);
    Result<void> mtp_step_body(int mtp, std::span<const RankMtpChunk> chunks, HiddenRows h_prev);
    // fn(rank) on every rank's thread; the group is broken by a failure.
    Result<void> run_all(FunctionRef<Result<void>(int rank)> fn);

    Step35Config cfg_;
    int tp_ = 1;
    parallel::ParallelPlan plan_;
    std::optional<parallel::InProcessGroup> group_;
    std::vector<std::unique_ptr<Backend>> backends_;  // [rank]
    std::vector<std::unique_ptr<Step35Model>> models_;  // [rank]; the forwards point into them
    std::vector<Step35Forward> forwards_;              // [rank]
    std::string broken_;                               // why the group can no longer step; empty while usable
    std::function<int64_t()> count_allocations_;
    int64_t step_allocations_ = -1;

    // Per-step scratch, sized at create for the capacity's max_seqs.
    std::vector<std::vector<SeqChunk>> seq_chunks_;  // [rank]
    std::vector<std::vector<MtpChunk>> mtp_chunks_;  // [rank]
    std::vector<RankSequence *> step_seqs_;
};

}  // namespace memra::model
