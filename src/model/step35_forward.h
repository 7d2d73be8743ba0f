// The Step-3.5 forward recipe (STEP35.md section 4), written once against the Backend interface: a step
// runs a batch of sequences, each a chunk of new tokens at absolute positions with its own KV cache
// (prefill = a chunk of many tokens, decode = one), and returns the logits of the requested positions.
// The MTP (next-n) layers run through mtp_step (STEP35.md 4.8). Every buffer is allocated by create() for
// a capacity; a step only fills them. A sequence's bits depend on nothing else in the batch (D2), on no
// thread count (D5) and on no chunking of its prompt (DETERMINISM.md rule 9). On a tensor-parallel rank
// (RankContext) the same recipe runs over the rank's shard, exchanging only subtree sums, expert rows and
// logit slices, and gives the TP = 1 bits on every rank (D3, D4).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "core/result.h"
#include "kv/kv_cache.h"
#include "model/step35_config.h"
#include "model/step35_model.h"
#include "model/step35_moe.h"
#include "parallel/comm.h"
#include "parallel/plan.h"

namespace memra::model {

// What create() sizes every buffer for.
struct ForwardCapacity {
    int64_t max_tokens = 0;      // new tokens per step, summed over the batch (>= 1)
    int64_t max_seqs = 0;        // sequences per step (>= 1)
    int64_t max_context = 0;     // positions a sequence may reach: RoPE tables and KV read-back (>= 1)
    int64_t max_logit_rows = 0;  // logit rows per step; 0 means max_tokens
};

// The trunk KV cache spec of one sequence: layers 0 .. n_layers-1 of cfg, in cfg order.
kv::KvCacheSpec trunk_kv_spec(const Step35Config &cfg, kv::KvFormat k_format, kv::KvFormat v_format,
                              int64_t capacity, int max_stage_rows);
// The KV cache spec of MTP layer `mtp` (0-based; config layer n_layers + mtp): one sliding layer.
kv::KvCacheSpec mtp_kv_spec(const Step35Config &cfg, int mtp, kv::KvFormat k_format, kv::KvFormat v_format,
                            int64_t capacity, int max_stage_rows);

// The KV cache specs of TP rank `rank`: each layer keeps only the rank's KV heads (rank.layers[i].kv_heads;
// under KvLayout::kReplicated the one KV head its query heads read).
kv::KvCacheSpec trunk_kv_spec(const Step35Config &cfg, const parallel::RankPlan &rank, kv::KvFormat k_format,
                              kv::KvFormat v_format, int64_t capacity, int max_stage_rows);
kv::KvCacheSpec mtp_kv_spec(const Step35Config &cfg, const parallel::RankPlan &rank, int mtp, kv::KvFormat k_format,
                            kv::KvFormat v_format, int64_t capacity, int max_stage_rows);

// What a forward on one tensor-parallel rank needs besides its shard of the model.
struct RankContext {
    const parallel::ParallelPlan *plan = nullptr;  // the plan the model shard was bound from
    int rank = 0;                                  // this rank in the plan (= its communicator rank)
    parallel::Communicator *comm = nullptr;        // the rank's handle on its TP group; outlives the forward
};

// What attention rounds the query to for a K cache format: GGML's dot-product partner of the key type
// (f32: none, bf16: bf16, q8_0 / q5_1: q8 blocks), so a cache type means what it means in llama.cpp.
RowRounding query_rounding(kv::KvFormat k_format);

// One sequence's part of a trunk step.
struct SeqChunk {
    kv::KvCache *cache = nullptr;     // the sequence's trunk cache (trunk_kv_spec), no transaction open
    std::span<const int32_t> tokens;  // new tokens, at positions cache->length() .. + tokens.size() - 1
    bool all_logits = false;          // logits of every new token; false: of the last one only
    int64_t commit = -1;              // staged rows to keep at the end of the step; -1: all of them
};

// One sequence's part of an MTP step: the draft pass at positions p = cache->length() .. takes the token
// at p + 1 (next_tokens) and the pre-norm hidden state at p (a row of h_prev).
struct MtpChunk {
    kv::KvCache *cache = nullptr;          // the sequence's cache for this MTP layer (mtp_kv_spec)
    std::span<const int32_t> next_tokens;  // tokens at positions p + 1
    bool all_logits = false;
    int64_t commit = -1;
};

// Intermediates of one layer that a verification tool may observe (`memra verify`'s layer gates). Each is
// handed to the tap right after the op that completes it, as a view of the forward's own backend buffer (the
// MoE stages: of its MoE state's, step35_moe.h MoeStage), valid only during the call; copy it out with the
// backend. On a TP rank a view holds the rank's part: its query / KV heads' columns, its d_expert columns of
// every routed pair (EP: whole rows, valid only for the pairs of its own experts); replicated values are whole.
enum class Tap {
    kLayerIn,        // [n, d_model] x entering the layer
    kAttnNorm,       // [n, d_model] RMSNorm_in(x)
    kQ,              // [n, q heads * head_dim] after q_norm and RoPE (before a K-format rounding)
    kK,              // [n, kv heads * head_dim] after k_norm and RoPE
    kV,              // [n, kv heads * head_dim]
    kAttnGate,       // [n, q heads] head-wise gate logits (only when the model has the gate)
    kAttnOut,        // [n, q heads * head_dim] attention output, before o_proj
    kOProj,          // [n, d_model] o_proj, finished (every rank: the whole product)
    kResidual,       // [n, d_model] h = x + attention
    kFfnNorm,        // [n, d_model] RMSNorm_post(h)
    kRouterLogits,   // [n, n_experts] f32 (MoE layers from here on)
    kExpertIds,      // [n, top_k] i32
    kExpertWeights,  // [n, top_k] f32
    kExpertGate,     // [n * top_k, d_expert held] grouped gate projection, rows in expert-sorted pair order
    kExpertUp,       // [n * top_k, d_expert held] grouped up projection
    kExpertAct,      // [n * top_k, d_expert held] swiglu(gate, up)
    kExpertDownOwn,  // [n * top_k, d_model] EP only: down projections of the rank's own experts' rows, before
                     // the broadcasts (the other rows are stale)
    kExpertDown,     // [n * top_k, d_model] every pair's down projection, on every rank
    kSharedOut,      // [n, d_model] shared expert output
    kLayerOut,       // [n, d_model] x leaving the layer
};
inline constexpr int kTapCount = static_cast<int>(Tap::kLayerOut) + 1;
const char *tap_name(Tap tap);
// Called on the thread running the step; must not call back into the forward.
using TapFn = std::function<void(Tap tap, TensorView view)>;

class Step35Forward {
public:
    // Uploads the RoPE tables and allocates every buffer for `cap`. The backend and the model must outlive
    // the forward. Refused: capacities out of range, a backend allocation failure, a RoPE table error.
    static Result<Step35Forward> create(Backend &backend, const Step35Model &model, const ForwardCapacity &cap);

    // The forward of TP rank ctx.rank over a model bound for that rank (bind_step35_model with the plan).
    // Its caches hold the rank's KV heads (the rank trunk_kv_spec / mtp_kv_spec); x stays replicated; the
    // row-parallel products form the rank's canonical subtree sums and finish the tree after an all-gather;
    // routed experts are split by d_expert (gathered like o_proj) or, under EP, computed whole by their
    // owners and broadcast; the LM head's vocabulary slices are gathered, so every rank ends with every
    // logit. Every rank of the group must run the same steps in the same order. Refused besides: a missing
    // plan or communicator, a communicator or model that does not match the plan and rank.
    static Result<Step35Forward> create(Backend &backend, const Step35Model &model, const ForwardCapacity &cap,
                                        const RankContext &ctx);

    // Runs the trunk over the chunks (in order; their tokens form the step's rows). Per cache: one
    // transaction, begun here, every trunk layer staged, commit(chunk.commit) at the end. Refused before
    // anything runs (nothing changes): no chunks or more than max_seqs, an empty chunk, a missing or
    // mismatched cache, a cache with an open transaction, the same cache twice, more tokens than
    // max_tokens / the cache's max_stage_rows, positions past max_context or the cache's capacity, a token
    // id outside the vocabulary, more logit rows than max_logit_rows, a commit outside [-1, tokens].
    Result<void> step(std::span<const SeqChunk> chunks);

    // The MTP layer `mtp` over the chunks. h_prev: [n_rows, d_model] f32 backend rows, one per next token
    // in chunk order: hidden() of a trunk step, or mtp_hidden() of the previous MTP layer (chain 45 -> 46 ->
    // 47). Refusals as step(), plus an MTP index out of range and an h_prev of the wrong shape.
    Result<void> mtp_step(int mtp, std::span<const MtpChunk> chunks, TensorView h_prev);

    // The refusals of step() / mtp_step() without running anything: no cache, backend buffer or result
    // changes. A rank group checks every rank before it starts one, so a bad request never breaks the group.
    Result<void> check_step(std::span<const SeqChunk> chunks);
    Result<void> check_mtp_step(int mtp, std::span<const MtpChunk> chunks, TensorView h_prev);

    // Logits of the last step (trunk or MTP): [n_logit_rows, vocab_size] f32 on the host, rows in chunk
    // order; chunk i owns rows logit_row_begin()[i] .. logit_row_begin()[i + 1]. Valid until the next step.
    std::span<const float> logits() const;
    std::span<const int64_t> logit_row_begin() const;
    // Pre-norm output of the last trunk layer for every row of the last trunk step: [n_rows, d_model].
    TensorView hidden() const;
    // Pre-norm output of the last MTP step's layer: [n_rows, d_model].
    TensorView mtp_hidden() const;

    const ForwardCapacity &capacity() const { return cap_; }
    int tp() const { return tp_; }
    int tp_rank() const { return tp_rank_; }

    // Collective calls made since the last reset, its MoE states' included (CommCounters, step35_moe.h);
    // launches and host copies are the backend's.
    CommCounters comm_counters() const;
    void reset_comm_counters();

    // Observes config layer `layer` (trunk or MTP) of every later step through fn; layer -1 or an empty fn
    // turns the tap off. Off, a step pays one integer comparison per tap point.
    void set_tap(int layer, TapFn fn);

private:
    struct Slot {  // one chunk of the running step
        kv::KvCache *cache = nullptr;
        kv::KvTxn txn;
        int64_t row0 = 0;  // first row in the step's token matrix
        int64_t n = 0;     // rows
        int64_t pos0 = 0;  // absolute position of the first row
        bool all_logits = false;
        int64_t commit = -1;
    };

    // What this forward computes of one layer: the whole layer, or the rank's part of it.
    struct LayerDims {
        int64_t n_heads = 0;     // query heads
        int64_t n_kv_heads = 0;  // KV heads (the cache layer's width)
        int64_t d_ff = 0;        // dense gate/up rows; 0 on MoE layers
    };

    Step35Forward() = default;
    static Result<Step35Forward> create_impl(Backend &backend, const Step35Model &model, const ForwardCapacity &cap,
                                             parallel::Communicator *comm);
    // The chunk-list checks and the slot of one chunk (its ids staged while they fit), shared by both steps.
    Result<void> begin_slots(size_t n_chunks, const char *op);
    Result<void> add_slot(size_t i, kv::KvCache *cache, std::span<const int32_t> tokens, bool all_logits,
                          int64_t commit, int64_t &rows);
    Result<void> load_trunk_slots(std::span<const SeqChunk> chunks, int64_t &rows);
    Result<void> load_mtp_slots(int mtp, std::span<const MtpChunk> chunks, TensorView h_prev, int64_t &rows);
    Result<void> check_slots(int first_cache_layer, int n_cache_layers, int64_t n_rows, std::span<const int32_t> ids);
    void stage_inputs(int64_t n_rows);
    Result<void> begin_all();
    void rollback_all();
    Result<void> commit_all();
    Result<void> run_layer(int layer, int cache_layer, TensorView x);
    Result<void> attention_block(int layer, int cache_layer, TensorView x);
    Result<void> ffn_block(int layer, TensorView x);
    Result<void> emit_logits(TensorView x, VectorId norm, MatrixId head);
    Result<void> row_parallel(TensorView x, MatrixId w, TensorView y, const char *what);
    // The forward's only calls into the communicator, on backend buffers (host memory on the CPU; a device
    // backend passes device pointers and its stream through these two).
    Result<void> all_gather(TensorView all, const char *what);
    TensorView gathered(int64_t elems_per_rank) const;
    TensorView own_slot(TensorView all, int64_t rows, int64_t cols) const;
    TensorView mat(TensorView buf, int64_t rows, int64_t cols) const;
    void tap(int layer, Tap t, TensorView v) const {
        if (layer == tap_layer_) tap_fn_(t, v);
    }

    Backend *backend_ = nullptr;
    const Step35Model *model_ = nullptr;
    ForwardCapacity cap_;
    float eps_ = 0.0f;
    std::vector<RopeId> rope_;     // per config layer; invalid when the layer has no RoPE
    std::vector<LayerDims> dims_;  // per config layer

    // Tensor parallelism: no communicator for the whole model (TP = 1, the reference path).
    parallel::Communicator *comm_ = nullptr;
    int tp_ = 1;
    int tp_rank_ = 0;
    bool ep_ = false;
    CommCounters comm_counters_;

    // Backend buffers, flat, sized for the capacity; mat() views them with the step's shapes.
    TensorView ids_, pos_, logit_rows_;       // [T] i32, [T] i64, [L] i32
    TensorView x_, a_, f_, mtp_x_, cat_;      // [T, d] f32 (cat_: [T, 2d])
    TensorView q_, k_, v_, g_, att_;          // [T, max q / kv / heads widths]
    TensorView k_ctx_, v_ctx_;                // [max_context, max kv width]: keys read back from a cache
    TensorView ff_gate_, ff_up_;              // [T, max d_ff] dense MLP
    TensorView x_logit_, logits_dev_;         // [L, d], [L, vocab]
    TensorView workspace_;                    // canonical products (o_proj, dense down_proj)
    TensorView gather_;  // [tp, T * d_model] or [tp, L * vocab / tp]: one slot per rank for all-gathers (only
                         // with a communicator)

    // The MoE layers: one state per distinct MoeShape, sized for max_tokens and refreshed layer by layer
    // (a state's buffers are the MoE layers' scratch, so sharing keeps memory at one layer's worth).
    std::vector<MoeState> moe_;      // distinct shapes, in order of first use
    std::vector<int> moe_of_layer_;  // per config layer: index into moe_, -1 on dense layers

    // Host staging, sized for the capacity.
    std::vector<int32_t> ids_host_;
    std::vector<int64_t> pos_host_;
    std::vector<int32_t> logit_rows_host_;
    std::vector<float> kv_host_k_, kv_host_v_;  // [max(max_context, T) * max kv width]
    std::vector<float> logits_host_;            // [L * vocab]
    std::vector<int64_t> logit_row_begin_;      // [n_chunks + 1] of the last step
    std::vector<Slot> slots_;                   // the running step's chunks (capacity max_seqs)
    int64_t n_rows_ = 0;                        // rows of the last trunk step
    int64_t n_mtp_rows_ = 0;                    // rows of the last MTP step
    int64_t n_logit_rows_ = 0;

    int tap_layer_ = -1;  // the observed layer; -1: none
    TapFn tap_fn_;
};

}  // namespace memra::model
