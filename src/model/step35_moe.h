// MoeState: one Step-3.5 MoE layer's routed and shared experts as a prepared state (DETERMINISM.md rule 5,
// D4, ENGINE.md section 3). create() allocates every backend buffer for a token capacity; refresh() routes new
// input rows (router product, sigmoid top-k, stable counting sort of the (token, slot) pairs by expert, the
// rank's own pairs' rows in expert order), issues the shared expert on the backend's side branch and bumps a
// generation counter; run() projects the own pairs through their whole experts (gate, up, SwiGLU, down) as
// grouped work, exchanges the owners' rows (MoeExchange) and adds them in canonical top-k slot order (separate
// multiply and add) with the shared expert onto the residual, so every rank holds the layer's output with the
// TP = 1 bits. Neither refresh() nor run() allocates; only the exact exchange of a large step on a device backend
// reads the routing's counts back to the host. The forward keeps one state per distinct MoE shape and refreshes
// it layer by layer; the bench times one directly.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "core/result.h"
#include "model/step35_model.h"
#include "parallel/comm.h"
#include "parallel/plan.h"

namespace memra::model {

// Collective calls made since the last reset (a forward's, or one MoE state's).
struct CommCounters {
    int64_t all_gathers = 0;
    int64_t exchanges = 0;  // grouped send/recv exchanges (the MoE combine's exact counts)
    int64_t bytes = 0;      // bytes received: all slots of an all-gather, the rows an exchange brings in

    CommCounters &operator+=(const CommCounters &o) {
        all_gathers += o.all_gathers;
        exchanges += o.exchanges;
        bytes += o.bytes;
        return *this;
    }
};

// How the owners of routed experts exchange their rows at TP > 1 (ENGINE.md section 3). Every rank can compute
// every owner's row count from the replicated routing; the question is only whether the host knows it without
// waiting for the backend.
enum class MoeExchange : uint8_t {
    // kExact on a host-memory backend (the counts are on the host as soon as the sort ran) and for steps of more
    // than kFixedExchangeMaxRows rows (prefill: one read of the counts per layer, traffic 1 / tp of the fixed
    // one's); kFixed for the small steps of a device backend (decode, graph-capturable).
    kAuto,
    // One all-gather of every owner's rows at the fixed capacity n * min(top_k, experts held): no host read.
    kFixed,
    // One grouped send/recv: each owner sends exactly its rows to every other rank.
    kExact,
};
inline constexpr int64_t kFixedExchangeMaxRows = 64;

// The all-gather of a row-split buffer, counted: all is [tp, m] with row `rank` (this rank's slot) filled;
// afterwards every rank holds every slot. The error names `what`.
Result<void> gather_rank_slots(parallel::Communicator &comm, int tp, int rank, TensorView all, const char *what,
                               CommCounters &counters);

// What a MoE state's buffers are shaped for: the layer as the model (whole, or a rank's shard) holds it.
// MoE layers of equal shape can share one state.
struct MoeShape {
    int64_t d_model = 0;
    int64_t n_experts = 0;    // routed experts of the layer (all of them, also on a TP rank)
    int64_t top_k = 0;        // experts per token
    int64_t d_expert = 0;     // routed expert width (experts are never split by width)
    int64_t d_shared = 0;     // shared expert width (replicated whole on every rank)
    parallel::Range experts;  // experts held whole: all of them, or the rank's own

    bool operator==(const MoeShape &) const = default;
};

// The shape of MoE layer `layer` of `model` (MEMRA_CHECK: a MoE layer of the model).
MoeShape moe_shape(const Step35Model &model, int layer);

// Rows an owner of `held` experts reserves for n tokens of top-k routing: each token sends at most
// min(top_k, held) of its pairs to one owner (its k experts are distinct), so this fixed capacity never
// overflows and needs no host read of the routing (the decode exchange of ENGINE.md section 3).
int64_t moe_owner_capacity(int64_t n_tokens, int64_t top_k, int64_t held);

// The routing of the last refresh as host data, for tests, `memra verify` and reports (read_routing).
struct MoeRouting {
    int64_t n_tokens = 0;
    int64_t top_k = 0;
    int64_t n_experts = 0;
    std::vector<int32_t> expert_ids;   // [n_tokens * top_k] selected experts, slot order per token
    std::vector<float> weights;        // [n_tokens * top_k] their combine weights
    std::vector<int32_t> offsets;      // [n_experts + 1] expert e's sorted rows are offsets[e] .. offsets[e + 1]
    std::vector<int32_t> sorted_pair;  // [n_tokens * top_k] pair index t * top_k + k of each sorted row
    std::vector<int32_t> row_of_pair;  // [n_tokens * top_k] sorted row of each pair (the reverse map)
};

// Views of the state's backend buffers at the row count of the last refresh: what the last refresh / run
// left there (the intermediates `memra verify` compares). "Own rows" are this rank's pairs in compact sorted
// order: row j is sorted row offsets[first held expert] + j; the rows past the rank's pair count are stale.
struct MoeBuffers {
    int64_t capacity = 0;       // own rows reserved for the last refresh (moe_owner_capacity)
    TensorView router_logits;   // [n, n_experts] f32
    TensorView expert_ids;      // [n, top_k] i32
    TensorView expert_weights;  // [n, top_k] f32
    TensorView offsets;         // [n_experts + 1, 1] i32
    TensorView sorted_pair;     // [n * top_k, 1] i32
    TensorView row_of_pair;     // [n * top_k, 1] i32
    TensorView x_own;           // [capacity, d_model] the input rows of the rank's own pairs
    TensorView expert_act;      // [capacity, d_expert] SwiGLU(gate, up) of the own pairs
    TensorView expert_up;       // [capacity, d_expert] up projection of the own pairs
    TensorView expert_out;      // [tp * capacity, d_model] every owner's down projections, gathered in rank order
    TensorView src_row;         // [n * top_k, 1] i32: the row of expert_out holding pair q's output
    TensorView shared_out;      // [n, d_model] the shared expert's output
};

// The intermediates refresh() and run() can hand to an observer, each right after the op that completes it,
// as a view of the state's backend buffer (valid only during the call). The expert stages hold the rank's own
// pairs in compact order (MoeBuffers), valid up to its pair count.
enum class MoeStage {
    kRouterLogits,   // [n, n_experts] f32
    kExpertIds,      // [n, top_k] i32
    kExpertWeights,  // [n, top_k] f32
    kExpertGate,     // [capacity, d_expert] grouped gate projection of the own pairs
    kExpertUp,       // [capacity, d_expert] grouped up projection
    kExpertAct,      // [capacity, d_expert] swiglu(gate, up)
    kExpertDownOwn,  // [capacity, d_model] down projections of the own pairs, before the exchange
    kExpertDown,     // [tp * capacity, d_model] every owner's rows after the exchange (rank order)
    kSharedOut,      // [n, d_model] shared expert output
};
// Called on the thread running refresh() / run(); must not call back into the state.
using MoeObserver = std::function<void(MoeStage stage, TensorView view)>;

class MoeState {
public:
    // A state for up to `capacity` token rows of MoE layers shaped like `layer` of `model` (moe_shape). A whole
    // model runs alone (comm == nullptr); a rank's shard (bind_step35_model with a plan) needs the rank's
    // communicator on its TP group, and every rank of the group must refresh and run in step. Refused: a
    // layer that is not MoE, capacity < 1 or more than 2^31 - 1 pairs, a missing or mismatched communicator,
    // a backend allocation failure.
    static Result<MoeState> create(Backend &backend, const Step35Model &model, int layer, int64_t capacity,
                                   parallel::Communicator *comm);

    // Whether refresh() takes `layer`: a MoE layer of the model with this state's shape.
    bool serves(int layer) const;

    // Routes the rows of x through layer `layer`'s router: logits, top-k ids and weights, the stable counting
    // sort of the pairs by expert (offsets, sorted pairs, reverse map), each pair's source row among the owners'
    // gathered rows (one Backend::moe_route), and the input rows of the rank's own pairs in compact sorted order;
    // then issues the shared expert on the backend's side branch (Backend::side_fork: it may run alongside the
    // routing and the routed experts; run() joins it) and the generation goes up by one. x: [n, d_model] f32
    // backend rows, 1 <= n <= capacity(); the side branch reads x until run(), so it must hold the same values
    // until then. Refused before anything runs, leaving the previous routing and generation intact: a layer the
    // state does not serve, an x of another shape or dtype, n outside [1, capacity()].
    // observe (when not empty) sees kRouterLogits, kExpertIds, kExpertWeights.
    Result<void> refresh(int layer, TensorView x, const MoeObserver &observe = {});

    // out = residual + (routed + shared) for the rows of the last refresh: each owner computes its own pairs'
    // experts whole (gate, up, SwiGLU, down: one K order), the owners' compact rows are exchanged (MoeExchange:
    // placed in each owner's slot, whichever way they travel), and every rank adds each token's rows in top-k slot order
    // (rounded multiply, then add), placed by (token, slot) through the refresh's source rows, plus the shared
    // expert.
    // Every rank ends with the same bits, equal to TP = 1. residual, out: [n, d_model] f32; out may be
    // residual. Refused: no refresh yet, shapes that do not match the refresh; a communicator failure (the
    // group is then aborted). observe (when not empty) sees the expert and shared-expert stages.
    Result<void> run(TensorView residual, TensorView out, const MoeObserver &observe = {});

    // Every routing fact of the last refresh (host copies; resizes out's vectors, so not for the hot path).
    void read_routing(MoeRouting &out) const;
    MoeBuffers buffers() const;

    uint64_t generation() const { return generation_; }  // successful refreshes so far
    int64_t capacity() const { return capacity_; }
    int64_t n_tokens() const { return n_; }  // rows of the last refresh (0 before the first)
    int layer() const { return layer_; }    // layer of the last refresh (-1 before the first)
    const MoeShape &shape() const { return shape_; }
    int tp() const { return tp_; }

    const CommCounters &comm_counters() const { return comm_counters_; }
    void reset_comm_counters() { comm_counters_ = {}; }
    // The exchange run() uses from now on (kAuto unless set; tests force each one). Every rank must use the same.
    void set_exchange(MoeExchange e) { exchange_ = e; }

private:
    MoeState() = default;
    Result<void> routed_experts(const MoeObserver &observe);
    // Sends this rank's rows to every other rank and receives theirs into their slots, exact counts.
    Result<void> exchange_exact(TensorView all);
    int64_t own_capacity() const;  // own rows of the last refresh

    Backend *backend_ = nullptr;
    const Step35Model *model_ = nullptr;
    MoeShape shape_;
    int64_t capacity_ = 0;

    // Rank context: no communicator for a whole model.
    parallel::Communicator *comm_ = nullptr;
    int tp_ = 1;
    int tp_rank_ = 0;
    CommCounters comm_counters_;
    MoeExchange exchange_ = MoeExchange::kAuto;
    std::vector<int32_t> host_offsets_;  // [n_experts + 1]: the counts' host copy (device backends)

    // The last refresh.
    uint64_t generation_ = 0;
    int layer_ = -1;
    int64_t n_ = 0;

    // Backend buffers, flat, sized for the capacity (T rows, T * top_k pairs, C = own capacity of T rows).
    TensorView router_;                              // [T, n_experts]
    TensorView ids_, weights_;                       // [T * top_k]
    TensorView offsets_;                             // [n_experts + 1] i32
    TensorView sorted_pair_, row_of_pair_, src_row_;  // [T * top_k] i32
    TensorView x_own_;                               // [C, d_model]
    TensorView e_gate_, e_up_;                       // [C, d_expert]
    TensorView e_out_;                               // [tp * C, d_model]: the owners' rows, rank order
    TensorView s_gate_, s_up_;                       // [T, d_shared]
    TensorView shared_;                              // [T, d_model]
    TensorView workspace_;                           // the shared expert's canonical down_proj
};

}  // namespace memra::model
