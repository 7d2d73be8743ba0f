// The Step-3.5 forward recipe (STEP35.md section 4), written once against the Backend interface: the `run`
// part of a step (ENGINE.md section 1). The engine (runtime/engine.h) plans a step — which rows of which
// sequences, at which positions, in which KV slots — and writes those tables into backend buffers; run()
// then issues a fixed sequence of backend ops over them: the trunk over every row of every sequence at once
// (each layer's new K/V rows written into the paged pools, then one batched paged attention), the logits of
// the requested rows, and the MTP layers in chain order 45 -> 46 -> 47 (layer k + 1 reads layer k's hidden
// rows). The op sequence does not depend on how many sequences there are or how long they are; run() reads
// nothing back to the host and allocates nothing. A row's bits depend on nothing else in the batch (D2), on
// no thread count (D5) and on no chunking of its sequence (rule 9). On a tensor-parallel rank (RankContext)
// the same recipe runs over the rank's shard, exchanging only subtree sums, expert rows and logit slices,
// and every rank ends with the TP = 1 bits (D3, D4).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "backend/backend.h"
#include "core/result.h"
#include "model/step35_config.h"
#include "model/step35_model.h"
#include "model/step35_moe.h"
#include "parallel/comm.h"
#include "parallel/plan.h"

namespace memra::model {

// Most MTP layers a forward runs (Step-3.5 ships MTP-3).
inline constexpr int kMaxMtp = 3;
// Streams of a step: the trunk (0) and MTP layer k (1 + k).
inline constexpr int kMaxStreamsPerStep = 1 + kMaxMtp;

// What create() sizes every buffer for.
struct ForwardCapacity {
    int64_t max_rows = 0;        // rows per stream per step, over all its sequences (the row budget, >= 1)
    int64_t max_seqs = 0;        // sequences per step (>= 1)
    int64_t max_context = 0;     // positions a sequence may reach: RoPE tables, block-table width (>= 1)
    int64_t max_logit_rows = 0;  // logit rows per step, every stream together (>= 1)
    int n_mtp = 0;               // MTP layers the forward runs (0 .. the model's), each with KV in the pool
    // Rows kept past the step rows of every stream another MTP layer reads (the trunk and MTP layers 0 ..
    // n_mtp - 2): hidden states carried from one step to the next (a sequence's last rows, which the next
    // step's MTP rows read). 0: none.
    int64_t carry_rows = 0;
};

// Block-table entries a sequence of max_context positions needs: one per 64-row page.
int64_t max_blocks(const ForwardCapacity &cap);

// Where one rank keeps its KV rows: the two pools (full-attention layers; sliding + MTP layers) and each
// config layer's index inside its pool.
struct ForwardKv {
    KvPoolId full;                        // invalid when the model has no full-attention layer
    KvPoolId swa;                         // invalid when it has no sliding layer and runs no MTP layer
    std::vector<int> pool_layer;          // [config layer] index in its pool; -1 for an MTP layer not run
    KvFormat k_format = KvFormat::kF32;   // both pools' K format (the query is rounded to its partner)
};

// Which pool each config layer of a model keeps its rows in (true: the sliding pool), and the pool's layer
// list: the full pool holds the trunk's full-attention layers, the sliding pool its sliding layers then the
// first n_mtp MTP layers, in config order. The engine sizes pools from these; the forward addresses them.
struct KvPoolLayout {
    std::vector<int> full_layers;  // config layers in the full pool, in order
    std::vector<int> swa_layers;   // config layers in the sliding pool, in order
    std::vector<int> pool_layer;   // [config layer] index in its pool, -1 when not stored
    std::vector<bool> in_swa;      // [config layer]
    int64_t window = 0;            // the sliding pool's widest window (0 when it is empty)
};
KvPoolLayout kv_pool_layout(const Step35Config &cfg, int n_mtp);

// The pools' per-layer rows as a rank stores them (its KV heads of each layer; the whole model's when
// `rank` is null), for Backend::create_kv_pool.
std::vector<KvPoolLayer> kv_pool_layers(const Step35Config &cfg, const std::vector<int> &layers,
                                        const parallel::RankPlan *rank);

// What attention rounds the query to for a K cache format: GGML's dot-product partner of the key type
// (f32: none, bf16: bf16, q8_0 / q5_1: q8 blocks), so a cache type means what it means in llama.cpp; device
// numerics round it to bf16 over an f32 cache too (q and k enter the scores as bf16, ENGINE.md section 4).
RowRounding query_rounding(KvFormat k_format, Numerics numerics);

// The rows of one stream of a step, as views into the step's table buffer on the backend (written by the
// engine before run()). Host-side counts say how much of each view is used.
struct StreamTables {
    int64_t n_rows = 0;        // rows this step; 0: the stream does not run
    int64_t n_logit_rows = 0;  // rows whose logits it computes
    int64_t logit_begin = 0;   // their first row in the logits buffer
    TensorView ids;            // [n_rows] i32 input tokens (MTP layer: the token at p + 1)
    TensorView pos;            // [n_rows] i64 absolute positions
    TensorView seq;            // [n_rows] i32 the step sequence of each row (its block-table row)
    TensorView slot_full;      // [n_rows] i32 full-pool slot of each row (trunk rows, when the pool exists)
    TensorView slot_swa;       // [n_rows] i32 sliding-pool slot of each row (when the stream uses the pool)
    TensorView logit_rows;     // [n_logit_rows] i32 stream rows whose logits are computed, in output order
    TensorView hidden_src;     // [n_rows] i32 MTP only: the row of the previous stream's hidden state it reads:
                               // < max_rows this step's row, max_rows + c the previous stream's carry row c
    TensorView carry_dst;      // [n_rows] i32 the carry row each row's hidden state is saved to, -1: none (read
                               // only when the capacity has carry rows and a later MTP layer runs)
};

struct StepTables {
    int64_t n_seqs = 0;
    StreamTables streams[kMaxStreamsPerStep];  // [0] the trunk, [1 + k] MTP layer k
    TensorView bt_full;                        // [n_seqs, max_blocks] i32 page of each block, -1: none
    TensorView bt_swa;                         // [n_seqs, max_blocks] i32
};

// What a forward on one tensor-parallel rank needs besides its shard of the model.
struct RankContext {
    const parallel::ParallelPlan *plan = nullptr;  // the plan the model shard was bound from
    int rank = 0;                                  // this rank in the plan (= its communicator rank)
    parallel::Communicator *comm = nullptr;        // the rank's handle on its TP group; outlives the forward
};

// Intermediates of one layer that a verification tool may observe (`memra verify`'s layer gates). Each is
// handed to the tap right after the op that completes it, as a view of the forward's own backend buffer (the
// MoE stages: of its MoE state's, step35_moe.h MoeStage), valid only during the call; copy it out with the
// backend. On a TP rank a view holds the rank's part: its query / KV heads' columns, its own expert pairs'
// rows; replicated values are whole.
enum class Tap {
    kLayerIn,        // [n, d_model] x entering the layer
    kAttnNorm,       // [n, d_model] RMSNorm_in(x)
    kQ,              // [n, q heads * head_dim] after q_norm, RoPE and the rounding for the K format
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
    kExpertGate,     // [capacity, d_expert] grouped gate projection of the rank's own pairs (MoeStage), compact
    kExpertUp,       // [capacity, d_expert] grouped up projection
    kExpertAct,      // [capacity, d_expert] swiglu(gate, up)
    kExpertDownOwn,  // [capacity, d_model] down projections of the own pairs, before the exchange
    kExpertDown,     // [tp * capacity, d_model] every owner's rows after the exchange, on every rank
    kSharedOut,      // [n, d_model] shared expert output
    kLayerOut,       // [n, d_model] x leaving the layer
};
inline constexpr int kTapCount = static_cast<int>(Tap::kLayerOut) + 1;
const char *tap_name(Tap tap);
// Called on the thread running the step; must not call back into the forward.
using TapFn = std::function<void(Tap tap, TensorView view)>;

class Step35Forward {
public:
    // Uploads the RoPE tables and allocates every buffer for `cap` (the backend and model must outlive the
    // forward; kv's pools must be the model's, as kv_pool_layout / kv_pool_layers describe them). Refused:
    // capacities out of range, more MTP layers than the model has, a backend allocation failure, a RoPE
    // table error.
    static Result<Step35Forward> create(Backend &backend, const Step35Model &model, const ForwardCapacity &cap,
                                        const ForwardKv &kv);
    // The forward of TP rank ctx.rank over a model bound for that rank (bind_step35_model with the plan): its
    // pools hold the rank's KV heads; x stays replicated; the row-parallel products form the rank's canonical
    // subtree sums and finish the tree after an all-gather; routed experts are computed whole by their owners
    // and exchanged; the LM head's vocabulary slices are gathered, so every rank ends with every logit. Every
    // rank of the group must run the same steps in the same order. Refused besides: a missing plan or
    // communicator, a communicator or model that does not match the plan and rank.
    static Result<Step35Forward> create(Backend &backend, const Step35Model &model, const ForwardCapacity &cap,
                                        const ForwardKv &kv, const RankContext &ctx);

    // One step over the tables (their counts within the capacity: the engine checked every request). The
    // trunk runs when streams[0] has rows; MTP layer k when streams[1 + k] has rows, reading its hidden rows
    // from stream k (the trunk's last-layer output for k = 0) or from that stream's carry. Errors: an id the
    // embedding refuses, a communicator failure; the caller rolls the step back.
    Result<void> run(const StepTables &tables);
    // One stream of the step (0: the trunk, 1 + k: MTP layer k) when it has rows; run() is every stream in
    // order. Speculation runs the MTP layers first (their drafts feed the trunk's rows) and the trunk last.
    Result<void> run_stream(const StepTables &tables, int stream);

    // The logits of the last run: [rows, vocab_size] f32 on the backend, stream after stream (each stream's
    // rows from its logit_begin).
    TensorView logits(int64_t rows) const;
    // The pre-norm hidden state of a stream's rows of the last run: [n_rows, d_model] (the trunk's last
    // layer output; an MTP layer's output).
    TensorView hidden(int stream, int64_t rows) const;

    const ForwardCapacity &capacity() const { return cap_; }
    int tp() const { return tp_; }
    int tp_rank() const { return tp_rank_; }

    // Collective calls made since the last reset, its MoE states' included; launches and host copies are the
    // backend's.
    CommCounters comm_counters() const;
    void reset_comm_counters();

    // Observes config layer `layer` (trunk or MTP) of every later run through fn; layer -1 or an empty fn
    // turns the tap off. Off, a step pays one integer comparison per tap point.
    void set_tap(int layer, TapFn fn);
    // Whether a tap is on (its host callback runs inside the step: the step cannot be recorded).
    bool tapped() const { return tap_layer_ >= 0; }

private:
    // What this forward computes of one layer: the whole layer, or the rank's part of it.
    struct LayerDims {
        int64_t n_heads = 0;     // query heads
        int64_t n_kv_heads = 0;  // KV heads (the pool layer's width)
        int64_t d_ff = 0;        // dense gate/up rows; 0 on MoE layers
    };

    Step35Forward() = default;
    static Result<Step35Forward> create_impl(Backend &backend, const Step35Model &model, const ForwardCapacity &cap,
                                             const ForwardKv &kv, parallel::Communicator *comm);
    Result<void> run_trunk(const StepTables &t);
    Result<void> run_mtp(const StepTables &t, int mtp);
    Result<void> run_layer(int layer, const StepTables &t, int stream, TensorView x);
    Result<void> attention_block(int layer, const StepTables &t, int stream, TensorView x);
    Result<void> ffn_block(int layer, TensorView x);
    Result<void> emit_logits(const StreamTables &s, TensorView x, VectorId norm, MatrixId head);
    Result<void> row_parallel(TensorView x, MatrixId w, TensorView y, const char *what);
    // The forward's only call into the communicator, on backend buffers (host memory on the CPU; a device
    // backend passes device pointers and its stream through here).
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
    ForwardKv kv_;
    float eps_ = 0.0f;
    std::vector<RopeId> rope_;     // per config layer; invalid when the layer has no RoPE
    std::vector<LayerDims> dims_;  // per config layer

    // Tensor parallelism: no communicator for the whole model (TP = 1, the reference path).
    parallel::Communicator *comm_ = nullptr;
    int tp_ = 1;
    int tp_rank_ = 0;
    CommCounters comm_counters_;

    // Backend buffers, flat, sized for the capacity (T rows per stream, L logit rows); mat() views them.
    TensorView x_;                        // [T, d] the trunk's residual stream, then its hidden state
    TensorView mtp_x_[kMaxMtp];           // [T, d] each MTP layer's residual stream, then its hidden state
    TensorView a_, f_, cat_;              // [T, d] scratch (cat_: [T, 2d])
    TensorView q_, k_, v_, g_, att_;      // [T, max q / kv / heads widths]
    TensorView ff_gate_, ff_up_;          // [T, max d_ff] dense MLP
    TensorView x_logit_, logits_;         // [L, d], [L, vocab]
    TensorView workspace_;                // canonical products (o_proj, dense down_proj)
    TensorView gather_;  // [tp, T * d_model] or [tp, L * vocab / tp]: one slot per rank for all-gathers (only
                         // with a communicator)

    // The MoE layers: one state per distinct MoeShape, sized for T rows and refreshed layer by layer (a
    // state's buffers are the MoE layers' scratch, so sharing keeps memory at one layer's worth).
    std::vector<MoeState> moe_;      // distinct shapes, in order of first use
    std::vector<int> moe_of_layer_;  // per config layer: index into moe_, -1 on dense layers

    int tap_layer_ = -1;
    TapFn tap_fn_;
};

}  // namespace memra::model
