// The parallel plan: maps a model's geometry and a requested topology (pipeline stages x tensor-parallel
// ranks, routed experts expert-parallel over the same ranks) to what every rank holds: query/KV heads per
// layer, slices of the dense FFN, whole routed experts, which canonical K blocks of each row-parallel projection it reduces, its slice of
// the vocabulary, and what is replicated. Pure logic: no I/O, no devices. The model module converts its
// config into ModelShape; everything that shards weights or activations asks this module.
#pragma once

#include <string>
#include <vector>

#include "core/result.h"

namespace memra::parallel {

// Every row-parallel projection cuts its reduction (K) dimension into this many equal canonical blocks,
// at every TP degree including 1 (DETERMINISM.md rule 2). The partials are added as a fixed balanced tree,
// ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)), so a TP rank must own a whole aligned subtree: tp divides 8.
inline constexpr int kCanonicalBlocks = 8;

// A half-open index range [begin, end).
struct Range {
    int begin = 0;
    int end = 0;

    int size() const { return end - begin; }
    bool empty() const { return end <= begin; }
    bool contains(int i) const { return i >= begin && i < end; }
    friend bool operator==(const Range &, const Range &) = default;
};

// ---- Input -------------------------------------------------------------------------------------------

// Geometry of one decoder layer, as far as sharding cares.
struct LayerShape {
    int n_heads = 0;     // query heads (Step-3.5: 64 on full layers, 96 on sliding layers)
    int n_kv_heads = 0;  // K/V heads; query head h reads KV head h / (n_heads / n_kv_heads)
    int head_dim = 0;    // per head; o_proj's reduction width is n_heads * head_dim
    bool is_mtp = false;   // a multi-token-prediction layer (after every trunk layer in ModelShape::layers)
    bool sliding = false;  // sliding-window attention (only a label here; the geometry says the rest)
    // FFN: dense (moe = false, d_ff > 0, expert fields 0) or MoE (moe = true, d_ff = 0).
    bool moe = false;
    int d_ff = 0;       // dense MLP intermediate width, 0 on MoE layers
    int n_experts = 0;  // routed experts, 0 on dense layers
    int top_k = 0;      // experts selected per token, 0 on dense layers
    int d_expert = 0;   // routed expert intermediate width, 0 on dense layers
    int d_shared = 0;   // shared expert intermediate width (0: no shared expert)
    bool fp8_experts = false;  // routed expert weights are fp8 (block-scaled); shown by format_plan
};

struct ModelShape {
    int d_model = 0;
    int vocab_size = 0;              // rows of the embedding, the LM head and each MTP shared_head
    std::vector<LayerShape> layers;  // trunk layers first, then the MTP layers
};

struct PlanRequest {
    int pipeline_stages = 1;
    int tp = 1;          // tensor-parallel ranks per stage; routed experts are expert-parallel over them
    int devices_available = 1;
};

// ---- Output ------------------------------------------------------------------------------------------

// How K/V heads spread over a stage's TP ranks.
enum class KvLayout {
    kSplit,       // n_kv_heads % tp == 0: each rank holds n_kv_heads / tp of them, no copies
    kReplicated,  // tp % n_kv_heads == 0: each rank holds the one KV head its query heads read,
                  // and tp / n_kv_heads ranks hold a copy of each
};

// One layer as a whole: where it runs and the widths every rank shares.
struct LayerPlan {
    int layer = 0;  // index into ModelShape::layers
    int stage = 0;  // pipeline stage that runs it
    KvLayout kv_layout = KvLayout::kSplit;
    int kv_replicas = 1;         // ranks holding each KV head: tp / n_kv_heads when replicated, else 1
    int o_block_width = 0;       // o_proj input columns per canonical block: n_heads * head_dim / 8
    int ff_block_width = 0;      // dense down_proj K per canonical block: d_ff / 8 (0 on MoE layers)
};

// What one rank holds of one layer. Column-parallel slices are output rows of the weight; row-parallel
// slices are the K columns the rank reduces, always the union of its canonical blocks.
struct RankLayerPlan {
    int layer = 0;        // index into ModelShape::layers
    Range q_heads;        // q_proj rows (in heads), g_proj rows (one gate per head), the heads it attends
    Range kv_heads;       // k_proj / v_proj rows (in heads) and the KV-cache heads it keeps
    Range o_cols;         // o_proj input columns it reduces: q_heads scaled by head_dim
    Range o_blocks;       // canonical K blocks of o_proj it owns (o_cols == o_blocks scaled by block width)
    Range ff;             // dense gate/up rows and down_proj K columns; empty on MoE layers
    Range ff_blocks;      // canonical K blocks of the dense down_proj; empty on MoE layers
    Range experts;        // routed experts it owns, whole (all of them at tp = 1); empty if dense
};

struct RankPlan {
    int rank = 0;     // stage * tp + tp_rank: the TP ranks of one stage are consecutive
    int stage = 0;
    int tp_rank = 0;  // position inside the stage, 0 .. tp-1
    Range trunk_layers;  // contiguous trunk layers of this stage
    Range mtp_layers;    // MTP layers (indices into ModelShape::layers); only the last stage has them
    std::vector<RankLayerPlan> layers;  // one per held layer: trunk_layers then mtp_layers, in order
    bool holds_embedding = false;  // first stage; also the last when it runs MTP layers (they embed tokens)
    Range vocab;  // LM head rows (and each MTP shared_head's rows) on the last stage; empty elsewhere
};

struct ParallelPlan {
    PlanRequest request;
    int n_ranks = 0;  // pipeline_stages * tp
    int n_trunk_layers = 0;
    int n_mtp_layers = 0;
    std::vector<Range> stage_layers;  // [stage] -> its trunk layers
    std::vector<LayerPlan> layers;    // [layer], every layer of ModelShape::layers
    std::vector<RankPlan> ranks;      // [rank]

    int rank_of(int stage, int tp_rank) const;
    // The global rank that computes routed expert `expert` of MoE layer `layer`.
    int expert_owner_rank(const ModelShape &shape, int layer, int expert) const;
};

// Builds the plan, or refuses with the reason and the numbers involved. The rules, in the order checked:
//  1. Geometry: positive sizes, n_heads % n_kv_heads == 0, dense layers have d_ff and no expert fields, MoE
//     layers have experts and d_ff 0, MTP layers after every trunk layer, n_heads * head_dim % 8 == 0 and
//     d_ff % 8 == 0 (the canonical blocks exist at every degree, TP=1 included).
//  2. tp >= 1, pipeline_stages >= 1, pipeline_stages <= trunk layers.
//  3. Attention, per layer: n_heads % tp == 0 (a head lives on one rank, DETERMINISM.md rule 4); rank r gets
//     query heads [r*H/tp, (r+1)*H/tp) with their g_proj rows. KV heads: split evenly if n_kv_heads % tp
//     == 0, else one replicated KV head per rank if tp % n_kv_heads == 0 (GQA group H/n_kv is a multiple
//     of the rank's H/tp query heads, so they all read one KV head), else refused.
//  4. tp divides 8, so every rank owns an aligned subtree of the canonical block tree (tp=16 would give
//     half a block per rank). Rank r owns blocks [r*8/tp, (r+1)*8/tp) of o_proj and dense down_proj;
//     those blocks are exactly its heads' / d_ff columns.
//     o_proj blocks are n_heads*head_dim/8 wide and need not each hold whole heads (12 heads -> 1.5 per
//     block); each rank's union of blocks always does (rule 3 and tp | 8).
//  5. Routed experts are never split by width (ENGINE.md section 3): whole experts, n_experts % tp == 0,
//     owner(e) = e / (n_experts / tp), the owner runs the whole K loop of down_proj (one K order).
//  6. LM head and each MTP shared_head: vocabulary rows [r*V/tp, ...) on the last stage; vocab % tp == 0.
//  7. Replicated on every TP rank that holds them: embedding, norms, router and router bias, the shared
//     expert, MTP eh_proj.
//  8. pipeline_stages * tp <= devices_available.
// Pipeline: stage s gets contiguous trunk layers, n_trunk / stages each, and the first n_trunk % stages
// stages one more (the last stage also runs the MTP layers and the LM head). Rank = stage * tp + tp_rank.
Result<ParallelPlan> make_plan(const ModelShape &shape, const PlanRequest &request);

// The readable text `memra plan` prints: header, per-layer table, per-rank holdings, replicated weights.
// Same inputs give the same text.
std::string format_plan(const ParallelPlan &plan, const ModelShape &shape);

// ---- Canonical K blocks --------------------------------------------------------------------------------

// The TP rank (0 .. tp-1) owning canonical block `block` (0..7); tp must divide 8.
int canonical_block_owner(int block, int tp);
// The aligned, contiguous blocks TP rank `tp_rank` owns: [tp_rank * 8/tp, (tp_rank + 1) * 8/tp).
Range canonical_blocks_of(int tp_rank, int tp);

// One addition of the canonical tree: sum(left) + sum(right) = sum of the blocks left.begin .. right.end.
struct CombineStep {
    Range left;
    Range right;
};
// The 7 additions of the fixed tree, bottom-up and left to right: (p0+p1), (p2+p3), (p4+p5), (p6+p7),
// then the two pairs of pairs, then the root. Evaluating them in this order gives the canonical sum.
std::vector<CombineStep> canonical_combine_steps();
// True if a rank at degree tp does this step itself (inside its own subtree) before the all-gather;
// the other steps are finished identically on every rank from the gathered subtree sums.
bool combine_step_is_local(const CombineStep &step, int tp);
// The tree over an aligned block range as text: [0, 8) -> "((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7))".
std::string canonical_subtree_expr(Range blocks);

// ---- Experts -----------------------------------------------------------------------------------------

// The TP rank owning routed expert e: e / (n_experts / tp); n_experts % tp == 0.
int expert_owner(int expert, int n_experts, int tp);
// The experts TP rank `tp_rank` owns.
Range experts_of(int tp_rank, int n_experts, int tp);

// ---- Split kinds -------------------------------------------------------------------------------------

// Every weight the plan places, so later code has one place to ask how it is split.
enum class Projection {
    kEmbed,        // token embedding [vocab, d_model]
    kQ,            // q_proj [n_heads * head_dim, d_model]
    kK,            // k_proj [n_kv_heads * head_dim, d_model]
    kV,            // v_proj [n_kv_heads * head_dim, d_model]
    kG,            // g_proj (head-wise gate) [n_heads, d_model]
    kO,            // o_proj [d_model, n_heads * head_dim]
    kNorm,         // every RMSNorm weight: input, post-attention, q/k norms, final, MTP enorm/hnorm/head norm
    kGate,         // dense gate_proj [d_ff, d_model]
    kUp,           // dense up_proj [d_ff, d_model]
    kDown,         // dense down_proj [d_model, d_ff]
    kRouter,       // router weight [n_experts, d_model], fp32
    kRouterBias,   // router selection bias [n_experts], fp32
    kExpertGate,   // routed gate_proj [n_experts, d_expert, d_model]
    kExpertUp,     // routed up_proj [n_experts, d_expert, d_model]
    kExpertDown,   // routed down_proj [n_experts, d_model, d_expert]
    kSharedGate,   // shared expert gate_proj [d_shared, d_model]
    kSharedUp,     // shared expert up_proj [d_shared, d_model]
    kSharedDown,   // shared expert down_proj [d_model, d_shared]
    kEhProj,       // MTP eh_proj [d_model, 2 * d_model]
    kLmHead,       // LM head [vocab, d_model]
    kMtpHead,      // MTP shared_head output [vocab, d_model]
};

inline constexpr Projection kAllProjections[] = {
    Projection::kEmbed,      Projection::kQ,          Projection::kK,          Projection::kV,
    Projection::kG,          Projection::kO,          Projection::kNorm,       Projection::kGate,
    Projection::kUp,         Projection::kDown,       Projection::kRouter,     Projection::kRouterBias,
    Projection::kExpertGate, Projection::kExpertUp,   Projection::kExpertDown, Projection::kSharedGate,
    Projection::kSharedUp,   Projection::kSharedDown, Projection::kEhProj,     Projection::kLmHead,
    Projection::kMtpHead};

enum class Split {
    kColumn,      // output rows split over the TP ranks (heads, d_ff or vocab)
    kRow,         // reduction dim split in canonical blocks; partials combined by the canonical tree
    kReplicated,  // every rank of the stage holds all of it
    kExpert,      // whole experts, each on its owner rank (expert parallelism of degree tp)
};

Split projection_split(Projection projection);
const char *projection_name(Projection projection);
const char *split_name(Split split);

}  // namespace memra::parallel
