// Builds the parallel plan (plan.h): validates the geometry, refuses topologies the canonical reduction
// order or the head/KV/expert/vocab layout cannot support (with the numbers), then derives every rank's
// ranges, and renders the plan as text for `memra plan`.
#include "parallel/plan.h"

#include <fmt/format.h>

#include "core/check.h"

namespace memra::parallel {

namespace {

// The i-th of n equal parts of [0, total): [i * total / n, (i + 1) * total / n). Callers have checked
// total % n == 0, so the parts are equal.
Range even_part(int i, int n, int total) {
    MEMRA_CHECK(n > 0 && total % n == 0 && i >= 0 && i < n, "part {} of {} over {}", i, n, total);
    const int width = total / n;
    return Range{i * width, (i + 1) * width};
}

Range scale(Range r, int factor) { return Range{r.begin * factor, r.end * factor}; }

// Widths are ints; a product of two fields that does not fit is refused rather than overflowed.
constexpr long long kMaxWidth = 1LL << 30;

bool divides_canonical(int tp) { return tp >= 1 && kCanonicalBlocks % tp == 0; }

// ---- Validation of the geometry (independent of the request) ----

Result<void> validate_layer(const LayerShape &l, int i) {
    if (l.n_heads <= 0 || l.n_kv_heads <= 0 || l.head_dim <= 0) {
        return make_error("layer {}: n_heads, n_kv_heads and head_dim must be positive, found {}, {}, {}", i,
                          l.n_heads, l.n_kv_heads, l.head_dim);
    }
    if (l.n_heads % l.n_kv_heads != 0) {
        return make_error("layer {}: query heads {} are not a multiple of the KV heads {}", i, l.n_heads,
                          l.n_kv_heads);
    }
    if (l.moe) {
        if (l.d_ff != 0) {
            return make_error("layer {}: MoE layer must have d_ff 0 (the dense width), found {}", i, l.d_ff);
        }
        if (l.n_experts <= 0 || l.d_expert <= 0) {
            return make_error("layer {}: MoE layer needs positive n_experts and d_expert, found {} and {}", i,
                              l.n_experts, l.d_expert);
        }
        if (l.top_k < 1 || l.top_k > l.n_experts) {
            return make_error("layer {}: top_k must be in [1, {}] (n_experts), found {}", i, l.n_experts, l.top_k);
        }
        if (l.d_shared < 0) {
            return make_error("layer {}: d_shared must be 0 (no shared expert) or positive, found {}", i, l.d_shared);
        }
    } else {
        if (l.d_ff <= 0) {
            return make_error("layer {}: dense layer needs a positive d_ff, found {}", i, l.d_ff);
        }
        if (l.n_experts != 0 || l.top_k != 0 || l.d_expert != 0 || l.d_shared != 0 || l.fp8_experts) {
            return make_error("layer {}: dense layer must have no expert fields, found n_experts {}, top_k {}, "
                              "d_expert {}, d_shared {}, fp8_experts {}",
                              i, l.n_experts, l.top_k, l.d_expert, l.d_shared, l.fp8_experts);
        }
    }
    // The canonical blocks exist at every TP degree (TP=1 included), so the model itself must allow them.
    // o_proj's blocks need not each hold whole heads (12 heads give 1.5 heads per block); what must be
    // head-aligned is each rank's union of blocks, which the tp checks in make_plan ensure.
    const long long o_width = static_cast<long long>(l.n_heads) * l.head_dim;
    if (o_width > kMaxWidth) {
        return make_error("layer {}: o_proj reduction width {} ({} heads x {}) exceeds {}", i, o_width, l.n_heads,
                          l.head_dim, kMaxWidth);
    }
    if (o_width % kCanonicalBlocks != 0) {
        return make_error("layer {}: o_proj reduction width {} ({} heads x {}) cannot be cut into {} canonical "
                          "blocks",
                          i, o_width, l.n_heads, l.head_dim, kCanonicalBlocks);
    }
    if (!l.moe && l.d_ff % kCanonicalBlocks != 0) {
        return make_error("layer {}: dense d_ff {} cannot be cut into {} canonical blocks of down_proj", i, l.d_ff,
                          kCanonicalBlocks);
    }
    return {};
}

Result<void> validate_shape(const ModelShape &s) {
    if (s.d_model <= 0 || s.vocab_size <= 0) {
        return make_error("model: d_model and vocab_size must be positive, found {} and {}", s.d_model,
                          s.vocab_size);
    }
    if (s.layers.empty() || s.layers[0].is_mtp) {
        return make_error("model: needs at least one trunk layer before any MTP layer, found {} layers",
                          s.layers.size());
    }
    for (size_t i = 1; i < s.layers.size(); ++i) {
        if (s.layers[i - 1].is_mtp && !s.layers[i].is_mtp) {
            return make_error("model: layer {} is a trunk layer after MTP layer {}; MTP layers must come last", i,
                              i - 1);
        }
    }
    for (size_t i = 0; i < s.layers.size(); ++i) {
        if (auto ok = validate_layer(s.layers[i], static_cast<int>(i)); !ok) {
            return tl::unexpected(ok.error());
        }
    }
    return {};
}

// ---- Checks that depend on the TP degree ----

// Attention: heads are never split across ranks (DETERMINISM.md rule 4), and each rank must find the KV
// heads its query heads read either as its own share or as one replicated head.
Result<void> check_attention_tp(const LayerShape &l, int i, int tp) {
    if (l.n_heads % tp != 0) {
        return make_error("tp={}: query heads {} on layer {} are not divisible by {}", tp, l.n_heads, i, tp);
    }
    if (l.n_kv_heads % tp != 0 && tp % l.n_kv_heads != 0) {
        return make_error("tp={}: KV heads {} on layer {} neither split evenly over {} ranks nor divide {} (a rank "
                          "must hold whole KV heads or the single KV head its query heads read)",
                          tp, l.n_kv_heads, i, tp, tp);
    }
    return {};
}

std::string canonical_refusal(int tp) {
    if (tp > kCanonicalBlocks && tp % kCanonicalBlocks == 0) {
        const int per_block = tp / kCanonicalBlocks;
        const std::string share = per_block == 2 ? std::string("half") : fmt::format("1/{} of", per_block);
        return fmt::format("tp={}: each rank would own {} a canonical K block; row-parallel projections are cut "
                           "into {} canonical blocks combined by a fixed tree, so tp must divide {} (1, 2, 4 or 8)",
                           tp, share, kCanonicalBlocks, kCanonicalBlocks);
    }
    return fmt::format("tp={}: the {} canonical K blocks of a row-parallel projection cannot be split into {} "
                       "aligned subtrees; tp must divide {} (1, 2, 4 or 8)",
                       tp, kCanonicalBlocks, tp, kCanonicalBlocks);
}

Result<void> check_ffn_tp(const LayerShape &l, int i, const PlanRequest &r) {
    if (!l.moe) {
        return {};  // d_ff % 8 == 0 and tp | 8 already give whole blocks per rank
    }
    // Routed experts are never split by width (ENGINE.md section 3): each is computed whole by its owner,
    // its down_proj in one K order, so every TP degree gives the same bits and no fp8 scale tile is shared.
    if (l.n_experts % r.tp != 0) {
        return make_error("tp={}: the {} routed experts of layer {} cannot be spread evenly over {} ranks (each "
                          "rank owns whole experts)",
                          r.tp, l.n_experts, i, r.tp);
    }
    return {};
}

// ---- Building ----

RankLayerPlan plan_rank_layer(const LayerShape &l, const LayerPlan &lp, int tp_rank, const PlanRequest &r) {
    RankLayerPlan out;
    out.layer = lp.layer;
    out.q_heads = even_part(tp_rank, r.tp, l.n_heads);
    if (lp.kv_layout == KvLayout::kSplit) {
        out.kv_heads = even_part(tp_rank, r.tp, l.n_kv_heads);
    } else {
        const int group = l.n_heads / l.n_kv_heads;  // query heads per KV head
        const int kv = out.q_heads.begin / group;
        out.kv_heads = Range{kv, kv + 1};
    }
    // Query head h reads KV head h / group; every such head must be among the rank's KV heads.
    const int group = l.n_heads / l.n_kv_heads;
    MEMRA_CHECK(out.kv_heads.contains(out.q_heads.begin / group) &&
                    out.kv_heads.contains((out.q_heads.end - 1) / group),
                "layer {} tp rank {}: q heads [{}, {}) read KV heads outside [{}, {})", lp.layer, tp_rank,
                out.q_heads.begin, out.q_heads.end, out.kv_heads.begin, out.kv_heads.end);

    out.o_cols = scale(out.q_heads, l.head_dim);
    out.o_blocks = canonical_blocks_of(tp_rank, r.tp);
    // Head alignment of the rank's partial: its canonical blocks are exactly its heads' columns.
    MEMRA_CHECK(scale(out.o_blocks, lp.o_block_width) == out.o_cols,
                "layer {} tp rank {}: o_proj blocks not head-aligned", lp.layer, tp_rank);

    if (!l.moe) {
        out.ff = even_part(tp_rank, r.tp, l.d_ff);
        out.ff_blocks = canonical_blocks_of(tp_rank, r.tp);
        MEMRA_CHECK(scale(out.ff_blocks, lp.ff_block_width) == out.ff, "layer {}: d_ff slice off block bounds",
                    lp.layer);
    } else {
        out.experts = experts_of(tp_rank, l.n_experts, r.tp);
    }
    return out;
}

// ---- Formatting helpers ----

std::string range_text(Range r) { return fmt::format("[{}, {})", r.begin, r.end); }

const char *plural(int n) { return n == 1 ? "" : "s"; }

// "0", "1-3,5-7,9": sorted layer indices with consecutive runs folded.
std::string layer_list_text(const std::vector<int> &layers) {
    std::string out;
    size_t i = 0;
    while (i < layers.size()) {
        size_t j = i;
        while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1) {
            ++j;
        }
        if (!out.empty()) {
            out += ",";
        }
        out += j == i ? fmt::format("{}", layers[i]) : fmt::format("{}-{}", layers[i], layers[j]);
        i = j + 1;
    }
    return out;
}

std::string layer_kind_text(const LayerShape &l) {
    return fmt::format("{}{}, {}", l.is_mtp ? "MTP, " : "", l.sliding ? "sliding" : "full", l.moe ? "MoE" : "dense");
}

std::string layer_table_text(const LayerShape &l, const LayerPlan &lp, const PlanRequest &r) {
    std::string kv = fmt::format("{} kv", lp.kv_layout == KvLayout::kSplit ? l.n_kv_heads / r.tp : 1);
    if (lp.kv_layout == KvLayout::kReplicated) {
        kv += fmt::format(", each kv head on {} ranks", lp.kv_replicas);
    }
    std::string out = fmt::format("heads {} q / {} kv x {} (per rank {} q + {}), o_proj K block {}", l.n_heads,
                                  l.n_kv_heads, l.head_dim, l.n_heads / r.tp, kv, lp.o_block_width);
    if (!l.moe) {
        out += fmt::format("; d_ff {} (per rank {}), down K block {}", l.d_ff, l.d_ff / r.tp, lp.ff_block_width);
        return out;
    }
    out += fmt::format("; {} experts top-{} d_expert {}{} ({} whole experts per rank)", l.n_experts, l.top_k,
                       l.d_expert, l.fp8_experts ? " fp8" : "", l.n_experts / r.tp);
    if (l.d_shared > 0) {
        out += fmt::format("; shared expert {} replicated", l.d_shared);
    }
    return out;
}

std::string rank_layer_text(const LayerShape &l, const RankLayerPlan &p) {
    std::string out = fmt::format("q heads {}, kv heads {}, o_proj blocks {}", range_text(p.q_heads),
                                  range_text(p.kv_heads), range_text(p.o_blocks));
    if (!l.moe) {
        out += fmt::format(", d_ff {}, down blocks {}", range_text(p.ff), range_text(p.ff_blocks));
    } else {
        out += fmt::format(", experts {} whole", range_text(p.experts));
    }
    return out;
}

// Groups items by their text, keeping the order of first appearance, and prints "prefix<layers> (...)".
struct LayerGroup {
    std::string text;
    std::vector<int> layers;
};

void add_to_groups(std::vector<LayerGroup> &groups, const std::string &text, int layer) {
    for (LayerGroup &g : groups) {
        if (g.text == text) {
            g.layers.push_back(layer);
            return;
        }
    }
    groups.push_back(LayerGroup{text, {layer}});
}

}  // namespace

// ---- Canonical blocks ----

int canonical_block_owner(int block, int tp) {
    MEMRA_CHECK(divides_canonical(tp), "tp {} does not divide {}", tp, kCanonicalBlocks);
    MEMRA_CHECK(block >= 0 && block < kCanonicalBlocks, "block {} outside [0, {})", block, kCanonicalBlocks);
    return block / (kCanonicalBlocks / tp);
}

Range canonical_blocks_of(int tp_rank, int tp) {
    MEMRA_CHECK(divides_canonical(tp), "tp {} does not divide {}", tp, kCanonicalBlocks);
    return even_part(tp_rank, tp, kCanonicalBlocks);
}

std::vector<CombineStep> canonical_combine_steps() {
    std::vector<CombineStep> steps;
    for (int width = 1; width < kCanonicalBlocks; width *= 2) {
        for (int begin = 0; begin < kCanonicalBlocks; begin += 2 * width) {
            steps.push_back(CombineStep{Range{begin, begin + width}, Range{begin + width, begin + 2 * width}});
        }
    }
    return steps;
}

bool combine_step_is_local(const CombineStep &step, int tp) {
    MEMRA_CHECK(divides_canonical(tp), "tp {} does not divide {}", tp, kCanonicalBlocks);
    return step.right.end - step.left.begin <= kCanonicalBlocks / tp;
}

std::string canonical_subtree_expr(Range blocks) {
    const int n = blocks.size();
    MEMRA_CHECK(n >= 1 && (n & (n - 1)) == 0 && blocks.begin >= 0 && blocks.begin % n == 0 &&
                    blocks.end <= kCanonicalBlocks,
                "blocks [{}, {}) are not an aligned subtree", blocks.begin, blocks.end);
    if (n == 1) {
        return fmt::format("p{}", blocks.begin);
    }
    const int mid = blocks.begin + n / 2;
    // A child of more than one block is parenthesised. (fmt rather than string operator+, which trips a
    // false -Wrestrict in g++ 12 at -O3.)
    auto child = [](Range r) {
        return r.size() == 1 ? canonical_subtree_expr(r) : fmt::format("({})", canonical_subtree_expr(r));
    };
    return fmt::format("{}+{}", child(Range{blocks.begin, mid}), child(Range{mid, blocks.end}));
}

// ---- Experts ----

int expert_owner(int expert, int n_experts, int tp) {
    MEMRA_CHECK(tp >= 1 && n_experts % tp == 0 && expert >= 0 && expert < n_experts, "expert {} of {} over tp {}",
                expert, n_experts, tp);
    return expert / (n_experts / tp);
}

Range experts_of(int tp_rank, int n_experts, int tp) { return even_part(tp_rank, tp, n_experts); }

// ---- Split kinds ----

// Column: q/k/v/g by heads (k/v copied when tp > n_kv_heads), dense gate/up by d_ff, LM and MTP heads by
// vocabulary rows. Row: o_proj and dense down_proj in canonical blocks. Routed experts: whole, each on its
// owner (expert parallelism of degree tp). Replicated: embedding, norms, router and its bias
// (the router runs in fp32 on every rank so all ranks select the same experts), the shared expert, eh_proj.
Split projection_split(Projection projection) {
    switch (projection) {
        case Projection::kQ:
        case Projection::kK:
        case Projection::kV:
        case Projection::kG:
        case Projection::kGate:
        case Projection::kUp:
        case Projection::kLmHead:
        case Projection::kMtpHead:
            return Split::kColumn;
        case Projection::kO:
        case Projection::kDown:
            return Split::kRow;
        case Projection::kExpertGate:
        case Projection::kExpertUp:
        case Projection::kExpertDown:
            return Split::kExpert;
        case Projection::kEmbed:
        case Projection::kNorm:
        case Projection::kRouter:
        case Projection::kRouterBias:
        case Projection::kSharedGate:
        case Projection::kSharedUp:
        case Projection::kSharedDown:
        case Projection::kEhProj:
            return Split::kReplicated;
    }
    MEMRA_CHECK(false, "unknown projection {}", static_cast<int>(projection));
    return Split::kReplicated;
}

const char *projection_name(Projection projection) {
    switch (projection) {
        case Projection::kEmbed: return "embed";
        case Projection::kQ: return "q_proj";
        case Projection::kK: return "k_proj";
        case Projection::kV: return "v_proj";
        case Projection::kG: return "g_proj";
        case Projection::kO: return "o_proj";
        case Projection::kNorm: return "norms";
        case Projection::kGate: return "gate_proj";
        case Projection::kUp: return "up_proj";
        case Projection::kDown: return "down_proj";
        case Projection::kRouter: return "router";
        case Projection::kRouterBias: return "router_bias";
        case Projection::kExpertGate: return "expert gate_proj";
        case Projection::kExpertUp: return "expert up_proj";
        case Projection::kExpertDown: return "expert down_proj";
        case Projection::kSharedGate: return "shared expert gate_proj";
        case Projection::kSharedUp: return "shared expert up_proj";
        case Projection::kSharedDown: return "shared expert down_proj";
        case Projection::kEhProj: return "eh_proj";
        case Projection::kLmHead: return "lm_head";
        case Projection::kMtpHead: return "mtp shared_head";
    }
    MEMRA_CHECK(false, "unknown projection {}", static_cast<int>(projection));
    return "";
}

const char *split_name(Split split) {
    switch (split) {
        case Split::kColumn: return "column";
        case Split::kRow: return "row";
        case Split::kReplicated: return "replicated";
        case Split::kExpert: return "expert";
    }
    MEMRA_CHECK(false, "unknown split {}", static_cast<int>(split));
    return "";
}

// ---- The plan ----

int ParallelPlan::rank_of(int stage, int tp_rank) const {
    MEMRA_CHECK(stage >= 0 && stage < request.pipeline_stages && tp_rank >= 0 && tp_rank < request.tp,
                "stage {} tp rank {} outside {} x {}", stage, tp_rank, request.pipeline_stages, request.tp);
    return stage * request.tp + tp_rank;
}

int ParallelPlan::expert_owner_rank(const ModelShape &shape, int layer, int expert) const {
    MEMRA_CHECK(layer >= 0 && layer < static_cast<int>(layers.size()) && shape.layers[layer].moe,
                "layer {} is not an MoE layer", layer);
    return rank_of(layers[layer].stage, expert_owner(expert, shape.layers[layer].n_experts, request.tp));
}

Result<ParallelPlan> make_plan(const ModelShape &shape, const PlanRequest &request) {
    if (auto ok = validate_shape(shape); !ok) {
        return tl::unexpected(ok.error());
    }
    const int n_layers = static_cast<int>(shape.layers.size());
    int n_trunk = 0;
    while (n_trunk < n_layers && !shape.layers[n_trunk].is_mtp) {
        ++n_trunk;
    }
    const int tp = request.tp;
    const int stages = request.pipeline_stages;
    if (tp < 1) {
        return make_error("tp={}: must be at least 1", tp);
    }
    if (stages < 1) {
        return make_error("pipeline_stages={}: must be at least 1", stages);
    }
    if (stages > n_trunk) {
        return make_error("pipeline_stages={}: more stages than the {} trunk layers (each stage needs one)", stages,
                          n_trunk);
    }

    // The model's own divisibility by tp first (the most specific reason), then the canonical-block rule.
    for (int i = 0; i < n_layers; ++i) {
        if (auto ok = check_attention_tp(shape.layers[i], i, tp); !ok) {
            return tl::unexpected(ok.error());
        }
    }
    if (!divides_canonical(tp)) {
        return tl::unexpected(Error{canonical_refusal(tp)});
    }
    for (int i = 0; i < n_layers; ++i) {
        if (auto ok = check_ffn_tp(shape.layers[i], i, request); !ok) {
            return tl::unexpected(ok.error());
        }
    }
    if (shape.vocab_size % tp != 0) {
        return make_error("tp={}: vocab_size {} is not divisible by {} (the LM head is split by vocabulary rows)", tp,
                          shape.vocab_size, tp);
    }
    const long long needed = static_cast<long long>(stages) * tp;
    if (needed > request.devices_available) {
        return make_error("pipeline_stages={} x tp={} needs {} devices, {} available", stages, tp, needed,
                          request.devices_available);
    }

    ParallelPlan plan;
    plan.request = request;
    plan.n_ranks = stages * tp;
    plan.n_trunk_layers = n_trunk;
    plan.n_mtp_layers = n_layers - n_trunk;

    // Pipeline: contiguous trunk layers, as even as possible; the first (n_trunk % stages) stages take one
    // extra layer, because the last stage also runs the MTP layers and the LM head.
    const int base = n_trunk / stages;
    const int extra = n_trunk % stages;
    int next = 0;
    for (int s = 0; s < stages; ++s) {
        const int count = base + (s < extra ? 1 : 0);
        plan.stage_layers.push_back(Range{next, next + count});
        next += count;
    }
    MEMRA_CHECK(next == n_trunk, "stages cover {} of {} trunk layers", next, n_trunk);

    for (int i = 0; i < n_layers; ++i) {
        const LayerShape &l = shape.layers[i];
        LayerPlan lp;
        lp.layer = i;
        lp.stage = stages - 1;
        for (int s = 0; s < stages; ++s) {
            if (plan.stage_layers[s].contains(i)) {
                lp.stage = s;
            }
        }
        if (l.n_kv_heads % tp == 0) {
            lp.kv_layout = KvLayout::kSplit;
            lp.kv_replicas = 1;
        } else {
            lp.kv_layout = KvLayout::kReplicated;
            lp.kv_replicas = tp / l.n_kv_heads;
        }
        lp.o_block_width = l.n_heads * l.head_dim / kCanonicalBlocks;
        lp.ff_block_width = l.moe ? 0 : l.d_ff / kCanonicalBlocks;
        plan.layers.push_back(lp);
    }

    for (int s = 0; s < stages; ++s) {
        const bool last = s == stages - 1;
        for (int t = 0; t < tp; ++t) {
            RankPlan rp;
            rp.rank = s * tp + t;
            rp.stage = s;
            rp.tp_rank = t;
            rp.trunk_layers = plan.stage_layers[s];
            rp.mtp_layers = last ? Range{n_trunk, n_layers} : Range{n_layers, n_layers};
            for (int i = rp.trunk_layers.begin; i < rp.trunk_layers.end; ++i) {
                rp.layers.push_back(plan_rank_layer(shape.layers[i], plan.layers[i], t, request));
            }
            for (int i = rp.mtp_layers.begin; i < rp.mtp_layers.end; ++i) {
                rp.layers.push_back(plan_rank_layer(shape.layers[i], plan.layers[i], t, request));
            }
            rp.holds_embedding = s == 0 || (last && !rp.mtp_layers.empty());
            rp.vocab = last ? even_part(t, tp, shape.vocab_size) : Range{0, 0};
            plan.ranks.push_back(std::move(rp));
        }
    }
    return plan;
}

std::string format_plan(const ParallelPlan &plan, const ModelShape &shape) {
    MEMRA_CHECK(plan.layers.size() == shape.layers.size(), "plan has {} layers, shape {}", plan.layers.size(),
                shape.layers.size());
    const PlanRequest &r = plan.request;
    std::string out;
    out += fmt::format("parallel plan: {} rank{} = {} pipeline stage{} x tp {} (routed experts: ep {}), {} device{} "
                       "available\n",
                       plan.n_ranks, plural(plan.n_ranks), r.pipeline_stages, plural(r.pipeline_stages), r.tp, r.tp,
                       r.devices_available, plural(r.devices_available));
    out += fmt::format("model: d_model {}, vocab {}, {} trunk + {} MTP layers\n", shape.d_model, shape.vocab_size,
                       plan.n_trunk_layers, plan.n_mtp_layers);
    out += fmt::format("canonical K blocks: {} per row-parallel projection, summed as {}; each rank reduces its "
                       "own aligned subtree, the subtree sums are all-gathered and the rest of the tree is "
                       "finished identically on every rank\n",
                       kCanonicalBlocks, canonical_subtree_expr(Range{0, kCanonicalBlocks}));

    out += "stages:\n";
    for (int s = 0; s < r.pipeline_stages; ++s) {
        const bool last = s == r.pipeline_stages - 1;
        const std::string ranks = r.tp == 1 ? fmt::format("rank {}", s) : fmt::format("ranks {}-{}", s * r.tp,
                                                                                         s * r.tp + r.tp - 1);
        out += fmt::format("  stage {}: {}, trunk layers {}{}\n", s, ranks,
                           range_text(plan.stage_layers[s]),
                           last && plan.n_mtp_layers > 0
                               ? fmt::format(", MTP layers {}",
                                             range_text(Range{plan.n_trunk_layers,
                                                              plan.n_trunk_layers + plan.n_mtp_layers}))
                               : std::string());
    }

    out += "layers:\n";
    std::vector<LayerGroup> table;
    for (const LayerPlan &lp : plan.layers) {
        const LayerShape &l = shape.layers[lp.layer];
        add_to_groups(table, fmt::format("({}): {}", layer_kind_text(l), layer_table_text(l, lp, r)), lp.layer);
    }
    for (const LayerGroup &g : table) {
        out += fmt::format("  layer{} {} {}\n", plural(static_cast<int>(g.layers.size())), layer_list_text(g.layers),
                               g.text);
    }

    for (const RankPlan &rp : plan.ranks) {
        out += fmt::format("rank {} (stage {}, tp rank {}): canonical blocks {} = {}\n", rp.rank, rp.stage,
                           rp.tp_rank, range_text(canonical_blocks_of(rp.tp_rank, r.tp)),
                           canonical_subtree_expr(canonical_blocks_of(rp.tp_rank, r.tp)));
        std::vector<LayerGroup> groups;
        for (const RankLayerPlan &p : rp.layers) {
            const LayerShape &l = shape.layers[p.layer];
            add_to_groups(groups, fmt::format("({}): {}", layer_kind_text(l), rank_layer_text(l, p)), p.layer);
        }
        for (const LayerGroup &g : groups) {
            out += fmt::format("  layer{} {} {}\n", plural(static_cast<int>(g.layers.size())), layer_list_text(g.layers),
                               g.text);
        }
        if (rp.holds_embedding) {
            out += "  embedding: all rows (replicated)\n";
        }
        if (!rp.vocab.empty()) {
            out += fmt::format("  lm_head vocab {}{}\n", range_text(rp.vocab),
                               rp.mtp_layers.empty() ? "" : ", each MTP shared_head the same rows");
        }
    }

    std::string replicated;
    for (Projection p : kAllProjections) {
        if (projection_split(p) == Split::kReplicated) {
            replicated += replicated.empty() ? "" : ", ";
            replicated += projection_name(p);
        }
    }
    out += fmt::format("replicated on every rank that holds them: {} (norms: input, post-attention, q/k, final, MTP "
                       "enorm/hnorm/shared_head; router and router_bias in fp32)\n",
                       replicated);
    std::vector<int> copied_kv;
    for (const LayerPlan &lp : plan.layers) {
        if (lp.kv_layout == KvLayout::kReplicated) {
            copied_kv.push_back(lp.layer);
        }
    }
    if (!copied_kv.empty()) {
        out += fmt::format("kv heads copied on several ranks (tp > kv heads): layers {}\n", layer_list_text(copied_kv));
    }
    return out;
}

}  // namespace memra::parallel
