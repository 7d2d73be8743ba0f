// The engine (ENGINE.md sections 1 and 5): one model on one or more tensor-parallel ranks (in-process rank
// threads, each with its own backend; routed experts expert-parallel over them), the paged KV pools, and the
// step every caller runs — `memra run`, `bench`, `verify`, the forward tool, later the server and MTP
// speculation:
//
//   plan(items)   host: check the request, begin one KV transaction per sequence (pages for the staged rows
//                 of every stream), pack every per-step table (tokens, positions, row -> sequence, KV slots,
//                 block tables, logit rows, MTP hidden sources, sampling rows and penalty windows) and copy
//                 it to each rank's backend in one host -> backend copy
//   run()         backend only: the forward's fixed op sequence, then the sampling op; no host read, no
//                 allocation, the same launches for 1 or many sequences
//   finish(keep)  host: one backend -> host copy of the sampled ids (and, when asked, the logits), commit
//                 the kept rows of each stream per sequence, roll back the rest
//
// A planned step can be abandoned instead (every transaction rolled back: every committed row, page table
// and refcount is byte-identical to a cache where the step never ran; the slots past the committed rows that
// run() wrote hold bytes no attention reads). Sampling is keyed by (seed, choice index, position), so a token depends on
// nothing else in the batch. Cross-rank bit checks are verify's (runtime/verify.h), outside any timed step.
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
#include "core/result.h"
#include "core/sampling.h"
#include "io/safetensors.h"
#include "kv/paged_kv.h"
#include "kv/prefix_cache.h"
#include "model/step35_config.h"
#include "model/step35_forward.h"
#include "model/step35_model.h"
#include "parallel/comm.h"
#include "parallel/plan.h"

namespace memra::runtime {

// Makes rank r's backend (e.g. a cpu::CpuBackend with its own threads); the runtime does not depend on a
// backend implementation, so the caller names it.
using BackendFactory = std::function<Result<std::unique_ptr<Backend>>(int rank)>;

// Makes the communicators of tp > 1 ranks from their backends (rank order), e.g. an NCCL group over the ranks'
// GPUs on their streams; none (an empty vector, or no factory): the ranks exchange through the in-process
// group (EngineOptions::rank_copy).
using CommFactory = std::function<Result<std::vector<std::unique_ptr<parallel::Communicator>>>(
    std::span<Backend *const> backends)>;

// The default row budget of a step on the CPU (chunked prefill): scratch is sized by it, never by a prompt.
inline constexpr int64_t kCpuStepRows = 512;

struct EngineOptions {
    int tp = 1;                           // tensor-parallel ranks (routed experts expert-parallel over them)
    KvFormat k_format = KvFormat::kBf16;  // KV cache formats (f32, bf16, q8_0, q5_1)
    KvFormat v_format = KvFormat::kBf16;
    int64_t ctx_size = 4096;              // KV positions of the full-attention pool, all sequences together; a
                                          // sequence reaches at most min(ctx_size, the model's context length)
    int max_seqs = 1;                     // sequences per step
    int64_t step_rows = kCpuStepRows;     // rows per stream per step, all sequences together (>= 1)
    int64_t max_logit_rows = 0;           // logit rows per step, every stream together; 0: max_seqs * (1 +
                                          // 2 spec_draft)
    int mtp_layers = 0;                   // MTP layers with KV space, runnable by steps (0 .. the model's)
    int spec_draft = 0;                   // most drafts one step item verifies (0 .. mtp_layers; sizes the logit
                                          // and sample rows; needs step_rows >= 2 spec_draft)
    int max_mtp_seqs = 0;                 // sequences with MTP streams alive at once (each carries its hidden
                                          // rows between steps); 0: max_seqs
    int32_t sample_vocab = 0;             // ids [0, n) may be sampled (the tokenizer's real ids); 0: every id
    bool prefix_cache = false;            // publish committed whole blocks for reuse (kv/prefix_cache.h)
    BackendFactory make_backend;
    // How tp > 1 ranks exchange their backend buffers (parallel::InProcessGroup::ByteCopy): nullptr for host
    // buffers, cuda::cuda_rank_copy for ranks sharing a GPU.
    parallel::InProcessGroup::ByteCopy rank_copy = nullptr;
    // tp > 1: the ranks' communicators (e.g. NCCL, one GPU per rank); empty: the in-process group's. The
    // in-process group's threads drive the ranks either way.
    CommFactory make_comms;
    // The one rank this process runs when each rank is a process of its own (a multi-process launch: mpirun);
    // -1 (the default): this process runs every rank. With a rank here (tp > 1), make_comms gets this rank's
    // backend alone and returns its communicator (rank process_rank of tp), which reaches the other processes;
    // every process plans the same steps (the host state is replicated, as every rank samples the same tokens),
    // and the inspection methods take only this rank.
    int process_rank = -1;
};

// Which trunk rows of a step item compute logits.
enum class LogitRows {
    kNone,  // none (a prefill chunk that is not the last)
    kLast,  // the last staged row (decode, the last prefill chunk)
    kAll,   // every staged row (verify, perplexity, the forward tool)
};

class Engine;

struct SequenceOptions {
    // MTP layers this sequence stages rows for (0 .. the engine's mtp_layers). Sliding pages go back only
    // once out of every stream's window, so a stream left behind (steps without its rows) holds them.
    int mtp_streams = 0;
    SamplingParams sampling;  // validated here
    uint64_t choice = 0;      // the choice index of the random stream (OpenAI's n: 0, 1, ...)
    // Added to the logits before the penalties (core/sampling_hd.h LogitBias), for the trunk's samples and the
    // drafts alike; validated here against the sampled ids (validate_logit_bias with sample_vocab).
    std::vector<LogitBias> logit_bias;
};

// Rows of each stream a sequence carries from one step to the next for the MTP layers that read them: the
// trunk's rows of a verify step (1 + drafts), the last row of an MTP layer.
inline constexpr int64_t kCarryRows = 1 + model::kMaxMtp;

// One sequence: its tokens, sampling parameters and KV pages. Created by an engine and used only with it;
// destroying it gives its pages back (destroyed inside a planned or run step, it abandons that step: every
// sequence of it rolled back). Must not outlive the engine.
class Sequence {
public:
    Sequence(const Sequence &) = delete;
    Sequence &operator=(const Sequence &) = delete;
    ~Sequence();

    // The sequence's tokens: prompt and generated ones. A step's rows come from here (trunk row p reads
    // tokens[p]; MTP row p reads tokens[p + 1]); the caller appends sampled tokens before feeding them.
    std::vector<int32_t> tokens;

    const SamplingParams &sampling() const { return sampling_; }
    uint64_t choice() const { return choice_; }
    // Replaces the sampling parameters, refusing invalid ones (nothing changes then).
    Result<void> set_sampling(const SamplingParams &params);
    const std::vector<LogitBias> &logit_bias() const { return logit_bias_; }
    // Replaces the logit bias, refusing an invalid one (validate_logit_bias; nothing changes then).
    Result<void> set_logit_bias(std::span<const LogitBias> bias);

    // Committed rows of a stream (0: the trunk, 1 + k: MTP layer k); the next trunk row is position length().
    int64_t length(int stream = 0) const { return kv_.length(stream); }
    // Tokens not yet in the trunk's cache.
    int64_t pending() const { return static_cast<int64_t>(tokens.size()) - kv_.length(0); }
    const kv::SeqKv &kv() const { return kv_; }
    int n_streams() const { return kv_.shape().n_streams; }
    // The positions [lo, hi) of a stream whose hidden rows are carried to the next step (committed rows the
    // stream computed last, at most kCarryRows of them); empty without MTP streams.
    std::pair<int64_t, int64_t> carried(int stream) const { return {carry_[stream].lo, carry_[stream].hi}; }

private:
    friend class Engine;
    Sequence(Engine *engine, const kv::SeqKvShape &shape, const SequenceOptions &options);

    // A stream's carried rows: two halves of kCarryRows rows on the backend, a step writing the half that is
    // not valid, so a step abandoned after its run leaves the valid half intact. Row p sits at p % kCarryRows.
    struct Carry {
        int64_t lo = 0, hi = 0;
        int half = 0;
    };

    Engine *engine_ = nullptr;
    kv::SeqKv kv_;
    kv::TxnId txn_;
    SamplingParams sampling_;
    uint64_t choice_ = 0;
    std::vector<LogitBias> logit_bias_;
    int carry_slot_ = -1;  // the engine's carry slot, -1: none (no MTP streams)
    // The prefix cache's chain: blocks [0, published_) are in the cache (its own pages or an equal block's),
    // chain_ the last one's chain id; published_ = -1 once a block could not be published.
    int64_t published_ = 0;
    uint64_t chain_ = 0;
    Carry carry_[kv::kMaxStreams];
};

// One sequence's part of a step.
struct StepItem {
    Sequence *seq = nullptr;
    int64_t rows = 0;                              // trunk rows: tokens [length(0), length(0) + rows)
    int64_t mtp_rows[model::kMaxMtp] = {0, 0, 0};  // MTP layer k rows from length(1 + k); row p takes token p + 1
    LogitRows logits = LogitRows::kLast;           // trunk rows whose logits are computed
    bool mtp_logits = false;                       // the logits of every MTP row
    bool sample = false;                           // sample the token after the last trunk row (needs its logits)
    bool return_logits = false;                    // copy the item's logit rows to the host at finish
    int32_t top_logprobs = -1;                     // with sample: -1 none, else 0 .. kMaxTopLogprobs alternatives
    // The MTP layers catch up: the engine sets mtp_rows to every row whose token is known and whose source
    // row this step computes or the sequence carries (mtp_rows must be 0). Refused (plan, or finish with a
    // partial keep): a step after which an MTP layer could never catch up, its next source row committed but
    // no longer carried — e.g. a prefill chunk in a drafting step (MTP layers run before the trunk there), or a
    // step budget too small for the MTP rows beside the trunk's.
    bool mtp_follow = false;
    // Speculative decoding (SERVING.md 2.5): with draft = k > 0 the item is one pending token (rows = 1, sample
    // set): the MTP layers catch up, MTP layer j drafts token j + 1 from its last row (sampled with the
    // sequence's noise at the position it predicts, penalties off), each draft feeding the next layer and the
    // trunk inside the run; the trunk then runs 1 + k rows and samples every one (its own noise per position),
    // and finish keeps 1 + the drafts equal to those samples. MTP layers run before the trunk in a step with a
    // drafting item, so no MTP row of such a step reads a trunk row of the same step. Every TP rank samples the
    // drafts itself from the same (replicated, bit-identical) MTP logits, so every rank feeds the same tokens.
    int draft = 0;
};

// Rows to keep per stream at finish; -1 keeps every staged row of that stream.
struct Keep {
    int64_t rows[kv::kMaxStreams] = {-1, -1, -1, -1};
};

// Work on one rank since reset_counters().
struct StepCounters {
    BackendCounters backend;
    model::CommCounters comm;
    // Backend -> host copies (each one a wait for the backend) made by the last step before its finish():
    // plan and run never wait, so this stays 0 unless something hooked into the run (verify's taps) copies.
    int64_t d2h_before_finish = 0;
};

class Engine {
public:
    // Plans the ranks (model::plan_shape + parallel::make_plan; a refusal is the error), binds each rank's
    // shard, sizes the pools and every step buffer. The store (a checkpoint, or a model generated in memory) must
    // outlive the engine: CPU shards are views of its bytes (io/tensor_store.h). Refused: options out of range, a
    // plan the model cannot take, a backend failure.
    static Result<std::unique_ptr<Engine>> create(const io::TensorStore &store, const model::Step35Config &cfg,
                                                  const EngineOptions &options);
    Engine(const Engine &) = delete;
    Engine &operator=(const Engine &) = delete;
    ~Engine();

    // A new empty sequence (allocates its block tables: not a hot-path call). Refused: more MTP streams than
    // the engine runs, invalid sampling parameters.
    Result<std::unique_ptr<Sequence>> create_sequence(const SequenceOptions &options = {});

    // Takes the longest cached prefix of a fresh sequence's tokens (kv/prefix_cache.h: whole blocks, at least one
    // token left to compute) and returns the rows it saved: those positions are committed, their pages shared.
    // 0 without the prefix cache or for a sequence with MTP streams. Refused: a sequence with rows, or one in
    // a planned step.
    Result<int64_t> reuse_prefix(Sequence &seq);
    // Drops every cached block (pages free once no sequence holds them).
    void clear_prefix_cache();
    const kv::PrefixCache &prefix_cache() const { return prefix_; }

    // Benchmarks only: commits the first `rows` of a fresh sequence's tokens with seeded K and V values written
    // straight into its pages instead of computing them (no forward), so decode can be timed at a depth whose
    // prefill would take minutes. Attention reads these rows as it reads computed ones — the same bytes, the
    // same work — but they are not the tokens' rows, so what the sequence samples after them means nothing, and
    // they are never published to the prefix cache. Value (K or V, position, KV head, dimension) is uniform on
    // [-1, 1) from Philox keyed by the seed, by the position modulo the fill's chunk (min(step_rows, 512)) and by
    // the head's index in the whole model, the same on every layer, so every TP degree holds the same rows.
    // Refused, the sequence unchanged: a sequence of another engine, with rows, with MTP streams (their layers
    // read hidden rows a fill does not make) or in a planned step; rows outside 1 .. its tokens or past
    // max_positions(). Pools out of pages: refused at the chunk that finds them empty (the chunks before it stay
    // committed).
    Result<void> fill_context(Sequence &seq, int64_t rows, uint64_t seed);

    // ---- The step ----

    // Checks the items and prepares a step (see the file comment). Refused before anything changes: a step
    // already planned, no items or more than max_seqs, a sequence twice or of another engine, rows without
    // tokens, positions past a sequence's limit, more rows per stream or logit rows than the capacity, an MTP
    // row whose hidden source is not in the step, a token id outside the vocabulary, sampling without the
    // last row's logits; pools out of pages (the transactions begun so far are rolled back).
    Result<void> plan(std::span<const StepItem> items);
    // Runs the planned step on every rank. An error here (a rank failing, a communicator abort) is kept and
    // reported by finish(), which then rolls the step back.
    void run();
    // Reads the sampled tokens back (the step's one backend -> host copy) and decides each drafting item's
    // acceptance, so a caller can choose its keep counts from them; finish() collects when not done. After a
    // failed run: rolls every transaction back and returns the run's error.
    Result<void> collect();
    // Commits keep[i] of item i (an empty span keeps every staged row; a drafting item keeps by default
    // 1 + accepted trunk rows and its MTP layers' catch-up rows, never draft rows). Refused, the whole step
    // then rolled back: no run step, a keep count past what was staged, an MTP row kept whose source row (the
    // trunk's, or the previous MTP layer's) is dropped, a drafting item keeping a trunk row after a rejected
    // draft or an MTP draft row. After a failed run: rolls every transaction back and returns the run's error.
    Result<void> finish(std::span<const Keep> keep = {});
    // Rolls a planned (or run) step back without committing anything.
    void abandon();
    // plan + run + finish, keeping everything.
    Result<void> step(std::span<const StepItem> items);

    // ---- Results of the last finished step ----

    // The sampled token of item i (MEMRA_CHECK: the item sampled); a drafting item samples 1 + draft tokens,
    // j = 0 .. draft (the trunk's row j).
    const SampledToken &sampled(size_t item, int64_t j = 0) const;
    int64_t sampled_count(size_t item) const;
    // A drafting item's draft j (0 .. draft - 1), and how many drafts equal the trunk's samples (a prefix).
    int32_t draft(size_t item, int j) const;
    int64_t accepted(size_t item) const;
    // The host copy of item i's logit rows of a stream ([rows, vocab_size]; MEMRA_CHECK: return_logits).
    std::span<const float> logits(size_t item, int stream = 0) const;
    // Item i's logit rows of a stream in the step's logits buffer: [first, first + count).
    std::pair<int64_t, int64_t> logit_range(size_t item, int stream = 0) const;

    // ---- Facts ----

    const model::Step35Config &config() const { return cfg_; }
    const EngineOptions &options() const { return options_; }
    int tp() const { return options_.tp; }
    // The ranks this process runs: [first, first + count) — every rank, or the one of a multi-process launch.
    std::pair<int, int> local_ranks() const { return {first_rank_, static_cast<int>(ranks_.size())}; }
    int64_t max_positions() const { return seq_shape_.max_positions; }
    const parallel::ParallelPlan &plan_of_ranks() const { return plan_; }
    const model::KvPoolLayout &pool_layout() const { return pools_; }
    const kv::PagePool &page_pool(kv::PoolKind kind) const;
    int64_t kv_bytes() const;  // both pools on every rank this process runs

    // ---- Inspection (verification and tests; never on the hot path): ranks this process runs ----

    Backend &backend(int rank);
    model::Step35Forward &forward(int rank);
    // Rank r's logits of the last run ([rows, vocab], rows of every item and stream in step order) on the
    // host: verify compares the ranks' bits.
    std::vector<float> rank_logits(int rank) const;
    // The raw K and V bytes of one committed row of a sequence on a rank: config layer `layer` (its pool and
    // pool layer), position `position`. Refused: a row that is not live.
    Result<void> kv_row(int rank, const Sequence &seq, int layer, int64_t position, std::vector<std::byte> &k,
                        std::vector<std::byte> &v) const;
    // Page accounting: every page free or held by exactly the sequences that hold it (SERVING.md 5.2 I2).
    Result<void> check_pages() const;

    // Work since the last reset, per rank.
    StepCounters counters(int rank) const;
    void reset_counters();
    // count() returns the process's heap allocations so far; empty turns counting off. While on, a step's
    // allocations from plan() to finish()'s (or abandon()'s) return are counted, on every thread.
    void set_allocation_counter(std::function<int64_t()> count) { count_allocations_ = std::move(count); }
    // Heap allocations of the last step's plan + run + finish together; -1 when not counted.
    int64_t step_allocations() const { return step_allocations_; }

private:
    friend class Sequence;
    struct Rank;
    Engine() = default;
    // Copies the items into step_items_ with the MTP rows of mtp_follow and draft items resolved.
    Result<void> resolve_items(std::span<const StepItem> items);
    // Whether every MTP layer of s can still catch up after the step's rows of `it` are committed, kept[st] of
    // each stream: its next row's source row is carried, or not yet computed.
    Result<void> check_reach(const Sequence &s, const StepItem &it, std::span<const int64_t> kept) const;
    // Whether stream `stream` of s (1 + k: MTP layer k) can read its source row for position p: a row of this
    // step (it: the resolved item) or a carried one.
    bool source_ready(const Sequence &s, const StepItem &it, int stream, int64_t p) const;
    Result<void> check_items(std::span<const StepItem> items) const;
    Result<void> begin_all(std::span<const StepItem> items);
    void pack_tables(std::span<const StepItem> items);
    void rollback_all();
    Result<void> run_rank(int rank);
    // Rank `rank`'s state (MEMRA_CHECK: a rank this process runs).
    Rank &local(int rank) const;
    // step_key_ for the planned step: every host-side value run_rank(0) and its forward depend on, so two
    // steps with equal keys issue the same ops on the same buffers (Backend::run_recorded).
    void build_step_key();
    // keep against what s staged, and the MTP chain: no stream keeps a row whose source row is dropped.
    Result<void> check_keep(size_t item, const Keep &keep) const;
    // The keep count of a stream of item i when the caller leaves it at -1.
    int64_t default_keep(size_t item, int stream) const;
    void update_carry(size_t item, std::span<const int64_t> kept);
    void release(Sequence &seq);
    // Publishes the sequence's committed whole blocks not yet in its chain (finish, after the commit).
    void publish(Sequence &seq);
    void count(int64_t before);
    // fill_context's rows on a rank: its buffers at the first call, the seeded values whenever the seed changes.
    Result<void> prepare_fill(Rank &rk, int rank, int64_t chunk, uint64_t seed);

    model::Step35Config cfg_;
    EngineOptions options_;
    parallel::ParallelPlan plan_;
    model::KvPoolLayout pools_;
    kv::SeqKvShape seq_shape_;  // without MTP streams (a sequence's own count is set at create)
    model::ForwardCapacity cap_;
    std::optional<parallel::InProcessGroup> group_;
    std::vector<std::unique_ptr<Rank>> ranks_;  // the ranks this process runs, from first_rank_ on
    int first_rank_ = 0;
    kv::PagePool full_, swa_;
    kv::PrefixCache prefix_;  // empty unless options_.prefix_cache
    std::vector<Sequence *> live_;  // every sequence not yet destroyed

    // The planned step.
    enum class Phase { kIdle, kPlanned, kRun };
    Phase phase_ = Phase::kIdle;
    std::vector<Sequence *> step_seqs_;  // [item]
    std::vector<StepItem> step_items_;   // [item]
    std::vector<std::byte> host_tables_;  // the packed tables, copied to every rank
    int64_t table_bytes_ = 0;             // used by this step
    int64_t n_logit_rows_ = 0;
    int64_t n_sample_rows_ = 0;
    int64_t sample_offset_ = 0, history_offset_ = 0, history_len_ = 0;
    int64_t bias_offset_ = 0, bias_len_ = 0;  // the sampling items' logit biases (LogitBias entries)
    std::vector<int64_t> sample_row_of_item_;            // [item] its first sample row, -1
    bool mtp_first_ = false;                             // a drafting step: MTP layers before the trunk
    // Per item: the catch-up rows of each MTP layer (its draft rows follow them), its drafts' sample rows and
    // how many drafts the trunk accepted.
    struct Spec {
        int64_t catch_up[model::kMaxMtp] = {0, 0, 0};
        int64_t draft_row[model::kMaxMtp] = {-1, -1, -1};
        int64_t accepted = 0;
    };
    std::vector<Spec> spec_;                              // [item]
    // Sample rows: [0, group_end_[0]) the trunk's, then the drafts of MTP layer j in [group_end_[j],
    // group_end_[j + 1]); and each drafting layer's (sample row, table i32 index) pairs.
    int64_t group_end_[1 + model::kMaxMtp] = {};
    int64_t pairs_offset_[model::kMaxMtp] = {}, pairs_count_[model::kMaxMtp] = {};
    std::vector<int32_t> free_carry_;                     // carry slots not held by a sequence
    bool collected_ = false;
    bool results_ = false;  // sampled() and friends describe the last collected step (false after a new plan)
    std::vector<int64_t> logit_begin_[kv::kMaxStreams];  // [stream][item] first logit row of the item
    std::vector<int64_t> logit_count_[kv::kMaxStreams];  // [stream][item]
    std::string run_error_;
    std::vector<int64_t> step_key_;  // capacity reserved at create: building it never allocates

    // Results.
    std::vector<SampledToken> sampled_;  // [sample row]
    std::vector<float> logits_host_;     // [logit rows, vocab] when some item returned logits
    bool logits_copied_ = false;

    std::function<int64_t()> count_allocations_;
    int64_t alloc_before_ = 0;  // the count when the step was planned
    int64_t step_allocations_ = -1;
};

// The KV positions (the full pool's, all sequences together: an EngineOptions::ctx_size) that a budget of `bytes`
// for both pools on every rank holds with these options (formats, tp, max_seqs, step_rows, MTP layers; ctx_size is
// ignored): the sliding pool first, as the model's longest context would size it, the full pool the rest. Refused:
// a budget that does not hold the sliding pool and a full page per sequence plus one (the message names the sizes).
Result<int64_t> kv_budget_tokens(const model::Step35Config &cfg, const EngineOptions &options, int64_t bytes);

// Feeds every pending token of one sequence through as many steps as the row budget needs (chunked prefill:
// logits only on the last chunk) and samples the next token from the last one, which it returns; the
// sequence's cache then holds every token. Refused: nothing pending; a step's refusal (nothing of that step
// committed; earlier chunks stay).
Result<int32_t> feed(Engine &engine, Sequence &seq);

struct DecodeOptions {
    int draft = 0;                       // drafts to verify (speculation; 0: off), fewer where they cannot help
    int64_t max_new = 1;                 // most tokens to emit (>= 1)
    std::span<const int64_t> stop_ids;   // emitting one of these ends the step's tokens (it is emitted)
    int32_t top_logprobs = -1;           // as StepItem
    bool return_logits = false;          // the trunk's logit rows to the host: engine.logits(0), row j token j
};

// What one decode step emitted.
struct Decoded {
    int64_t emitted = 0;   // tokens appended to the sequence: 1 + accepted, cut after max_new or a stop id
    int64_t drafted = 0;   // drafts the step verified
    int64_t accepted = 0;  // drafts equal to the trunk's own samples
};

// Acceptance over decode steps: per draft position j, the steps that drafted it and the ones whose trunk
// accepted it (every draft before it accepted too).
struct SpecStats {
    int64_t steps = 0;
    int64_t emitted = 0;
    int64_t drafted[model::kMaxMtp] = {0, 0, 0};
    int64_t accepted[model::kMaxMtp] = {0, 0, 0};

    void add(const Decoded &d) {
        ++steps;
        emitted += d.emitted;
        for (int j = 0; j < model::kMaxMtp; ++j) {
            drafted[j] += d.drafted > j ? 1 : 0;
            accepted[j] += d.accepted > j ? 1 : 0;
        }
    }
    // Draft position j's acceptance rate (0 when never drafted).
    double rate(int j) const {
        return drafted[j] > 0 ? static_cast<double>(accepted[j]) / static_cast<double>(drafted[j]) : 0.0;
    }
    double tokens_per_step() const {
        return steps > 0 ? static_cast<double>(emitted) / static_cast<double>(steps) : 0.0;
    }
};

// The drafts a decode step of seq can verify (its last token pending): at most `draft`, the engine's spec_draft,
// the sequence's MTP layers, max_new - 1 (the step emits 1 + accepted tokens), the positions left and position + 1
// (MTP layer j has no rows before position j); 0 at position 0.
int64_t draft_limit(const Engine &engine, const Sequence &seq, int64_t draft, int64_t max_new);

// One decode step of a sequence whose last token is pending (appended, not yet fed). With draft > 0 and MTP
// streams the MTP layers draft up to `draft` tokens (at most the engine's spec_draft, the sequence's MTP
// layers, max_new - 1, the positions left and position + 1; none at position 0) which the trunk verifies in
// the same step. Appends the emitted
// tokens — each the token a step without drafts samples at its position — and commits the rows behind them:
// the last emitted token stays pending. Their SampledTokens: engine.sampled(0, j), j < emitted. Refused (the
// sequence unchanged): not exactly one pending token, max_new < 1, a step's refusal.
Result<Decoded> decode(Engine &engine, Sequence &seq, const DecodeOptions &options);

}  // namespace memra::runtime
