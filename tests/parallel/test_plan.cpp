// Tests for the parallel plan: exact per-rank ranges on the real Step-3.5-Flash geometry and on a tiny
// geometry, the partition invariants at every accepted topology, every refusal with its reason, the
// canonical block tree as data, the split table, and the text of `memra plan`.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "parallel/plan.h"

namespace memra::parallel {
namespace {

// ---- Geometries ----

LayerShape attention(int n_heads, int n_kv_heads, int head_dim, bool sliding) {
    LayerShape l;
    l.n_heads = n_heads;
    l.n_kv_heads = n_kv_heads;
    l.head_dim = head_dim;
    l.sliding = sliding;
    return l;
}

LayerShape dense(LayerShape l, int d_ff) {
    l.moe = false;
    l.d_ff = d_ff;
    return l;
}

LayerShape moe(LayerShape l, int n_experts, int top_k, int d_expert, int d_shared, bool fp8 = false) {
    l.moe = true;
    l.n_experts = n_experts;
    l.top_k = top_k;
    l.d_expert = d_expert;
    l.d_shared = d_shared;
    l.fp8_experts = fp8;
    return l;
}

// Step-3.5-Flash: 45 trunk layers (full if i % 4 == 0, with 64 query heads; sliding with 96), 8 KV heads of
// 128, layers 0-2 dense 11264, 3-44 MoE 288 experts top-8 of 1280 plus a 1280 shared expert, then 3 MTP
// layers (sliding, dense 11264).
ModelShape step35_shape(bool fp8_experts = false) {
    ModelShape s;
    s.d_model = 4096;
    s.vocab_size = 128896;
    for (int i = 0; i < 45; ++i) {
        const bool full = i % 4 == 0;
        LayerShape a = attention(full ? 64 : 96, 8, 128, !full);
        s.layers.push_back(i < 3 ? dense(a, 11264) : moe(a, 288, 8, 1280, 1280, fp8_experts));
    }
    for (int i = 45; i < 48; ++i) {
        LayerShape a = attention(96, 8, 128, true);
        a.is_mtp = true;
        s.layers.push_back(dense(a, 11264));
    }
    return s;
}

// A tiny model: 6 trunk layers (full if i % 4 == 0 with 8 query heads, sliding with 12), 2 KV heads of 32,
// layer 0 dense 512, layers 1-5 MoE 16 experts of 96, one sliding dense MTP layer. `sliding_heads` lets a
// test give the sliding layers another head count.
ModelShape tiny_shape(int sliding_heads = 12) {
    ModelShape s;
    s.d_model = 256;
    s.vocab_size = 1024;
    for (int i = 0; i < 6; ++i) {
        const bool full = i % 4 == 0;
        LayerShape a = attention(full ? 8 : sliding_heads, 2, 32, !full);
        s.layers.push_back(i == 0 ? dense(a, 512) : moe(a, 16, 4, 96, 96));
    }
    LayerShape m = attention(sliding_heads, 2, 32, true);
    m.is_mtp = true;
    s.layers.push_back(dense(m, 512));
    return s;
}

PlanRequest request(int tp, int stages = 1, int devices = -1) {
    PlanRequest r;
    r.tp = tp;
    r.pipeline_stages = stages;
    r.devices_available = devices < 0 ? tp * stages : devices;
    return r;
}

ParallelPlan plan_ok(const ModelShape &shape, const PlanRequest &r) {
    Result<ParallelPlan> plan = make_plan(shape, r);
    EXPECT_TRUE(plan.has_value()) << (plan ? std::string() : plan.error().message);
    return plan ? *plan : ParallelPlan{};
}

// The refusal text, or a marker that makes the caller's substring assertion fail.
std::string plan_error(const ModelShape &shape, const PlanRequest &r) {
    Result<ParallelPlan> plan = make_plan(shape, r);
    EXPECT_FALSE(plan.has_value()) << "expected a refusal for tp=" << r.tp;
    return plan ? std::string("<accepted>") : plan.error().message;
}

const RankLayerPlan &layer_of(const ParallelPlan &plan, int rank, int layer) {
    for (const RankLayerPlan &p : plan.ranks.at(rank).layers) {
        if (p.layer == layer) {
            return p;
        }
    }
    ADD_FAILURE() << "rank " << rank << " does not hold layer " << layer;
    static const RankLayerPlan kNone{};
    return kNone;
}

Range R(int b, int e) { return Range{b, e}; }

// Asserts that the ranges, taken in rank order, tile [0, total) exactly: contiguous, disjoint, complete.
void expect_partition(const std::vector<Range> &parts, int total, const std::string &what) {
    int next = 0;
    for (const Range &p : parts) {
        EXPECT_EQ(p.begin, next) << what;
        EXPECT_GT(p.size(), 0) << what;
        next = p.end;
    }
    EXPECT_EQ(next, total) << what;
}

// Every invariant the plan promises, for every stage and layer.
void expect_invariants(const ParallelPlan &plan, const ModelShape &shape) {
    const int tp = plan.request.tp;
    const int stages = plan.request.pipeline_stages;
    const int n_layers = static_cast<int>(shape.layers.size());
    ASSERT_EQ(plan.n_ranks, tp * stages);
    ASSERT_EQ(static_cast<int>(plan.ranks.size()), plan.n_ranks);
    ASSERT_EQ(static_cast<int>(plan.layers.size()), n_layers);
    expect_partition(plan.stage_layers, plan.n_trunk_layers, "stage layers");
    EXPECT_EQ(plan.n_trunk_layers + plan.n_mtp_layers, n_layers);

    for (int s = 0; s < stages; ++s) {
        const bool last = s == stages - 1;
        std::vector<Range> vocab;
        for (int t = 0; t < tp; ++t) {
            const RankPlan &rp = plan.ranks[plan.rank_of(s, t)];
            EXPECT_EQ(rp.rank, s * tp + t);
            EXPECT_EQ(rp.stage, s);
            EXPECT_EQ(rp.tp_rank, t);
            EXPECT_EQ(rp.trunk_layers, plan.stage_layers[s]);
            EXPECT_EQ(rp.mtp_layers.size(), last ? plan.n_mtp_layers : 0);
            EXPECT_EQ(rp.holds_embedding, s == 0 || (last && plan.n_mtp_layers > 0));
            std::vector<int> held;
            for (const RankLayerPlan &p : rp.layers) {
                held.push_back(p.layer);
            }
            std::vector<int> want;
            for (int i = rp.trunk_layers.begin; i < rp.trunk_layers.end; ++i) {
                want.push_back(i);
            }
            for (int i = rp.mtp_layers.begin; i < rp.mtp_layers.end; ++i) {
                want.push_back(i);
            }
            EXPECT_EQ(held, want) << "rank " << rp.rank;
            if (last) {
                vocab.push_back(rp.vocab);
            } else {
                EXPECT_TRUE(rp.vocab.empty());
            }
        }
        if (last) {
            expect_partition(vocab, shape.vocab_size, "vocab");
        }

        // Canonical blocks: partitioned over the TP ranks, each rank's run aligned, owner function agrees.
        std::vector<Range> blocks;
        for (int t = 0; t < tp; ++t) {
            const Range b = canonical_blocks_of(t, tp);
            EXPECT_EQ(b.size(), kCanonicalBlocks / tp);
            EXPECT_EQ(b.begin % b.size(), 0);
            for (int k = b.begin; k < b.end; ++k) {
                EXPECT_EQ(canonical_block_owner(k, tp), t);
            }
            blocks.push_back(b);
        }
        expect_partition(blocks, kCanonicalBlocks, "canonical blocks");

        for (int i = 0; i < n_layers; ++i) {
            if (plan.layers[i].stage != s) {
                continue;
            }
            const LayerShape &l = shape.layers[i];
            const LayerPlan &lp = plan.layers[i];
            const std::string where = "layer " + std::to_string(i) + " stage " + std::to_string(s);
            std::vector<Range> q, kv_split, ff, experts;
            std::vector<int> kv_copies(l.n_kv_heads, 0);
            const int group = l.n_heads / l.n_kv_heads;
            for (int t = 0; t < tp; ++t) {
                const RankLayerPlan &p = layer_of(plan, plan.rank_of(s, t), i);
                q.push_back(p.q_heads);
                // Every query head's KV head is on the same rank.
                for (int h = p.q_heads.begin; h < p.q_heads.end; ++h) {
                    EXPECT_TRUE(p.kv_heads.contains(h / group)) << where << " q head " << h;
                }
                for (int k = p.kv_heads.begin; k < p.kv_heads.end; ++k) {
                    ++kv_copies[k];
                }
                kv_split.push_back(p.kv_heads);
                // Row-parallel partials: the rank's blocks are exactly its heads' columns (head-aligned).
                EXPECT_EQ(p.o_blocks, canonical_blocks_of(t, tp)) << where;
                EXPECT_EQ(p.o_cols, R(p.q_heads.begin * l.head_dim, p.q_heads.end * l.head_dim)) << where;
                EXPECT_EQ(p.o_cols, R(p.o_blocks.begin * lp.o_block_width, p.o_blocks.end * lp.o_block_width))
                    << where;
                EXPECT_EQ(lp.o_block_width * kCanonicalBlocks, l.n_heads * l.head_dim) << where;
                if (!l.moe) {
                    ff.push_back(p.ff);
                    EXPECT_EQ(p.ff_blocks, canonical_blocks_of(t, tp)) << where;
                    EXPECT_EQ(p.ff, R(p.ff_blocks.begin * lp.ff_block_width, p.ff_blocks.end * lp.ff_block_width))
                        << where;
                    EXPECT_TRUE(p.experts.empty()) << where;
                } else {
                    experts.push_back(p.experts);
                    for (int e = p.experts.begin; e < p.experts.end; ++e) {
                        EXPECT_EQ(expert_owner(e, l.n_experts, tp), t) << where << " expert " << e;
                        EXPECT_EQ(plan.expert_owner_rank(shape, i, e), plan.rank_of(s, t)) << where;
                    }
                    EXPECT_TRUE(p.ff.empty()) << where;
                }
            }
            expect_partition(q, l.n_heads, where + " q heads");
            if (lp.kv_layout == KvLayout::kSplit) {
                EXPECT_EQ(l.n_kv_heads % tp, 0) << where;
                expect_partition(kv_split, l.n_kv_heads, where + " kv heads");
            } else {
                EXPECT_EQ(lp.kv_replicas, tp / l.n_kv_heads) << where;
                for (int k = 0; k < l.n_kv_heads; ++k) {
                    EXPECT_EQ(kv_copies[k], lp.kv_replicas) << where << " kv head " << k;
                }
            }
            if (!l.moe) {
                expect_partition(ff, l.d_ff, where + " d_ff");
            } else {
                expect_partition(experts, l.n_experts, where + " experts");
            }
        }
    }
}

// ---- Canonical blocks as data ----

TEST(CanonicalBlocks, OwnershipAtEveryDegree) {
    const int want_tp2[] = {0, 0, 0, 0, 1, 1, 1, 1};
    const int want_tp4[] = {0, 0, 1, 1, 2, 2, 3, 3};
    for (int b = 0; b < kCanonicalBlocks; ++b) {
        EXPECT_EQ(canonical_block_owner(b, 1), 0);
        EXPECT_EQ(canonical_block_owner(b, 2), want_tp2[b]);
        EXPECT_EQ(canonical_block_owner(b, 4), want_tp4[b]);
        EXPECT_EQ(canonical_block_owner(b, 8), b);
    }
    EXPECT_EQ(canonical_blocks_of(0, 1), R(0, 8));
    EXPECT_EQ(canonical_blocks_of(1, 2), R(4, 8));
    EXPECT_EQ(canonical_blocks_of(1, 4), R(2, 4));
    EXPECT_EQ(canonical_blocks_of(5, 8), R(5, 6));
}

TEST(CanonicalBlocks, CombineStepsAreTheBalancedTree) {
    const std::vector<CombineStep> steps = canonical_combine_steps();
    ASSERT_EQ(steps.size(), 7u);
    const Range want[7][2] = {{R(0, 1), R(1, 2)}, {R(2, 3), R(3, 4)}, {R(4, 5), R(5, 6)}, {R(6, 7), R(7, 8)},
                              {R(0, 2), R(2, 4)}, {R(4, 6), R(6, 8)}, {R(0, 4), R(4, 8)}};
    for (size_t i = 0; i < steps.size(); ++i) {
        EXPECT_EQ(steps[i].left, want[i][0]) << i;
        EXPECT_EQ(steps[i].right, want[i][1]) << i;
    }
    EXPECT_EQ(canonical_subtree_expr(R(0, 8)), "((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7))");
    EXPECT_EQ(canonical_subtree_expr(R(4, 8)), "(p4+p5)+(p6+p7)");
    EXPECT_EQ(canonical_subtree_expr(R(2, 4)), "p2+p3");
    EXPECT_EQ(canonical_subtree_expr(R(6, 7)), "p6");
}

TEST(CanonicalBlocks, LocalStepsAreTheRanksSubtrees) {
    const std::vector<CombineStep> steps = canonical_combine_steps();
    const int want_local[] = {7, 6, 0, 4, 0, 0, 0, 0};  // indexed by tp; tp = 1, 2, 4, 8 are meaningful
    for (int tp : {1, 2, 4, 8}) {
        int local = 0;
        for (const CombineStep &s : steps) {
            if (combine_step_is_local(s, tp)) {
                ++local;
                // A local step lies inside one rank's blocks.
                EXPECT_EQ(canonical_block_owner(s.left.begin, tp), canonical_block_owner(s.right.end - 1, tp));
            }
        }
        EXPECT_EQ(local, want_local[tp - 1]) << "tp " << tp;
    }
}

uint32_t float_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

// Evaluating the steps in order, whether all on one rank or subtree-per-rank then finished after the
// all-gather, gives the bits of the written-out tree, which differ from a left-to-right sum.
TEST(CanonicalBlocks, StepsReproduceTheTreeBitForBit) {
    std::mt19937 rng(12345);
    std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
    std::uniform_int_distribution<int> exponent(-20, 20);
    int sequential_differs = 0;
    for (int trial = 0; trial < 200; ++trial) {
        float p[kCanonicalBlocks];
        for (float &x : p) {
            x = std::ldexp(mantissa(rng), exponent(rng));
        }
        const float tree = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
        float sequential = 0.0f;
        for (float x : p) {
            sequential += x;
        }
        sequential_differs += float_bits(sequential) != float_bits(tree);
        for (int tp : {1, 2, 4, 8}) {
            // sums[b] holds the sum of the subtree starting at block b once that subtree is formed.
            float sums[kCanonicalBlocks];
            std::copy(p, p + kCanonicalBlocks, sums);
            for (const CombineStep &s : canonical_combine_steps()) {
                if (combine_step_is_local(s, tp)) {
                    sums[s.left.begin] = sums[s.left.begin] + sums[s.right.begin];
                }
            }
            // "All-gather": only each rank's subtree sum survives.
            float gathered[kCanonicalBlocks] = {};
            for (int t = 0; t < tp; ++t) {
                gathered[canonical_blocks_of(t, tp).begin] = sums[canonical_blocks_of(t, tp).begin];
            }
            for (const CombineStep &s : canonical_combine_steps()) {
                if (!combine_step_is_local(s, tp)) {
                    gathered[s.left.begin] = gathered[s.left.begin] + gathered[s.right.begin];
                }
            }
            EXPECT_EQ(float_bits(gathered[0]), float_bits(tree)) << "tp " << tp << " trial " << trial;
        }
    }
    EXPECT_GT(sequential_differs, 0) << "the data cannot tell the tree from a sequential sum";
}

// ---- Step-3.5-Flash ----

class Step35Topologies : public ::testing::TestWithParam<int> {};

TEST_P(Step35Topologies, InvariantsHold) {
    const int tp = GetParam();
    const ModelShape shape = step35_shape();
    const ParallelPlan plan = plan_ok(shape, request(tp));
    expect_invariants(plan, shape);
    EXPECT_EQ(plan.n_trunk_layers, 45);
    EXPECT_EQ(plan.n_mtp_layers, 3);
    for (int r = 0; r < tp; ++r) {
        EXPECT_EQ(plan.ranks[r].vocab.size(), 128896 / tp);
        EXPECT_EQ(layer_of(plan, r, 0).q_heads.size(), 64 / tp);
        EXPECT_EQ(layer_of(plan, r, 1).q_heads.size(), 96 / tp);
        EXPECT_EQ(layer_of(plan, r, 0).ff.size(), 11264 / tp);
        EXPECT_EQ(layer_of(plan, r, 46).ff.size(), 11264 / tp);
        EXPECT_EQ(layer_of(plan, r, 10).experts.size(), 288 / tp);
    }
}

INSTANTIATE_TEST_SUITE_P(AllDegrees, Step35Topologies, ::testing::Values(1, 2, 4, 8));

TEST(Step35Plan, Tp1HoldsEverything) {
    const ModelShape shape = step35_shape();
    const ParallelPlan plan = plan_ok(shape, request(1));
    ASSERT_EQ(plan.ranks.size(), 1u);
    const RankPlan &r = plan.ranks[0];
    EXPECT_EQ(r.trunk_layers, R(0, 45));
    EXPECT_EQ(r.mtp_layers, R(45, 48));
    EXPECT_EQ(r.layers.size(), 48u);
    EXPECT_EQ(r.vocab, R(0, 128896));
    EXPECT_TRUE(r.holds_embedding);
    const RankLayerPlan &l0 = layer_of(plan, 0, 0);
    EXPECT_EQ(l0.q_heads, R(0, 64));
    EXPECT_EQ(l0.kv_heads, R(0, 8));
    EXPECT_EQ(l0.o_cols, R(0, 8192));
    EXPECT_EQ(l0.o_blocks, R(0, 8));
    EXPECT_EQ(l0.ff, R(0, 11264));
    EXPECT_EQ(plan.layers[0].o_block_width, 1024);
    EXPECT_EQ(plan.layers[1].o_block_width, 1536);
    EXPECT_EQ(plan.layers[0].ff_block_width, 1408);
    const RankLayerPlan &l5 = layer_of(plan, 0, 5);
    EXPECT_EQ(l5.experts, R(0, 288));
}

TEST(Step35Plan, Tp2ExactRanges) {
    const ModelShape shape = step35_shape();
    const ParallelPlan plan = plan_ok(shape, request(2));
    const RankLayerPlan &full = layer_of(plan, 1, 4);
    EXPECT_EQ(full.q_heads, R(32, 64));
    EXPECT_EQ(full.kv_heads, R(4, 8));
    EXPECT_EQ(full.o_cols, R(4096, 8192));
    EXPECT_EQ(full.o_blocks, R(4, 8));
    EXPECT_EQ(full.experts, R(144, 288));
    const RankLayerPlan &sliding = layer_of(plan, 0, 45);
    EXPECT_EQ(sliding.q_heads, R(0, 48));
    EXPECT_EQ(sliding.kv_heads, R(0, 4));
    EXPECT_EQ(sliding.ff, R(0, 5632));
    EXPECT_EQ(sliding.ff_blocks, R(0, 4));
    EXPECT_EQ(plan.ranks[1].vocab, R(64448, 128896));
}

TEST(Step35Plan, Tp4ExactRanges) {
    const ModelShape shape = step35_shape();
    const ParallelPlan plan = plan_ok(shape, request(4));
    const RankLayerPlan &p = layer_of(plan, 2, 7);  // sliding MoE
    EXPECT_EQ(p.q_heads, R(48, 72));
    EXPECT_EQ(p.kv_heads, R(4, 6));
    EXPECT_EQ(p.o_blocks, R(4, 6));
    EXPECT_EQ(p.o_cols, R(6144, 9216));
    EXPECT_EQ(p.experts, R(144, 216));
    EXPECT_EQ(plan.ranks[3].vocab, R(96672, 128896));
    EXPECT_EQ(plan.layers[7].kv_layout, KvLayout::kSplit);
}

TEST(Step35Plan, Tp8ExactRanges) {
    const ModelShape shape = step35_shape();
    const ParallelPlan plan = plan_ok(shape, request(8));
    for (int r = 0; r < 8; ++r) {
        const RankLayerPlan &full = layer_of(plan, r, 0);
        EXPECT_EQ(full.q_heads, R(8 * r, 8 * r + 8));
        EXPECT_EQ(full.kv_heads, R(r, r + 1));
        EXPECT_EQ(full.o_blocks, R(r, r + 1));
        EXPECT_EQ(full.ff, R(1408 * r, 1408 * r + 1408));
        const RankLayerPlan &sliding = layer_of(plan, r, 1);
        EXPECT_EQ(sliding.q_heads, R(12 * r, 12 * r + 12));
        EXPECT_EQ(sliding.kv_heads, R(r, r + 1));
        EXPECT_EQ(sliding.o_cols, R(1536 * r, 1536 * r + 1536));
        const RankLayerPlan &expert = layer_of(plan, r, 44);
        EXPECT_EQ(expert.experts, R(36 * r, 36 * r + 36));
        EXPECT_EQ(plan.ranks[r].vocab, R(16112 * r, 16112 * r + 16112));
    }
}

TEST(Step35Plan, Tp8OwnsWholeExperts) {
    const ModelShape shape = step35_shape();
    const ParallelPlan plan = plan_ok(shape, request(8));
    for (int r = 0; r < 8; ++r) {
        EXPECT_EQ(layer_of(plan, r, 3).experts, R(36 * r, 36 * r + 36));
        EXPECT_EQ(experts_of(r, 288, 8), R(36 * r, 36 * r + 36));
    }
    EXPECT_EQ(expert_owner(0, 288, 8), 0);
    EXPECT_EQ(expert_owner(35, 288, 8), 0);
    EXPECT_EQ(expert_owner(36, 288, 8), 1);
    EXPECT_EQ(expert_owner(287, 288, 8), 7);
    EXPECT_EQ(plan.expert_owner_rank(shape, 20, 100), 2);
}

// ---- Refusals ----

TEST(PlanRefusal, Tp3QueryHeads) {
    EXPECT_EQ(plan_error(step35_shape(), request(3)), "tp=3: query heads 64 on layer 0 are not divisible by 3");
}

TEST(PlanRefusal, Tp5QueryHeads) {
    EXPECT_EQ(plan_error(step35_shape(), request(5)), "tp=5: query heads 64 on layer 0 are not divisible by 5");
}

TEST(PlanRefusal, Tp16HalfACanonicalBlock) {
    const std::string msg = plan_error(step35_shape(), request(16));
    EXPECT_NE(msg.find("tp=16: each rank would own half a canonical K block"), std::string::npos) << msg;
    EXPECT_NE(msg.find("tp must divide 8 (1, 2, 4 or 8)"), std::string::npos) << msg;
}

TEST(PlanRefusal, Tp32QuarterBlockAndTp6NotDividing) {
    // 32 divides every head count of this geometry, so only the canonical rule refuses it.
    ModelShape shape = tiny_shape(64);
    for (LayerShape &l : shape.layers) {
        l.n_heads = 64;
        if (l.moe) {
            l.n_experts = 64;
        }
    }
    const std::string quarter = plan_error(shape, request(32));
    EXPECT_NE(quarter.find("tp=32: each rank would own 1/4 of a canonical K block"), std::string::npos) << quarter;
    ModelShape six = tiny_shape(48);
    for (LayerShape &l : six.layers) {
        l.n_heads = 48;
        l.n_kv_heads = 6;
    }
    const std::string msg = plan_error(six, request(6));
    EXPECT_NE(msg.find("tp=6: the 8 canonical K blocks of a row-parallel projection cannot be split into 6"),
              std::string::npos)
        << msg;
}

TEST(PlanRefusal, TooFewDevices) {
    EXPECT_EQ(plan_error(step35_shape(), request(8, 1, 2)),
              "pipeline_stages=1 x tp=8 needs 8 devices, 2 available");
    EXPECT_EQ(plan_error(step35_shape(), request(2, 3, 5)),
              "pipeline_stages=3 x tp=2 needs 6 devices, 5 available");
    EXPECT_TRUE(make_plan(step35_shape(), request(2, 3, 6)).has_value());
}

TEST(PlanRefusal, BadDegreesAndStages) {
    EXPECT_EQ(plan_error(step35_shape(), request(0, 1, 1)), "tp=0: must be at least 1");
    EXPECT_EQ(plan_error(step35_shape(), request(-2, 1, 1)), "tp=-2: must be at least 1");
    EXPECT_EQ(plan_error(step35_shape(), request(1, 0, 1)), "pipeline_stages=0: must be at least 1");
    EXPECT_EQ(plan_error(step35_shape(), request(1, 46, 64)),
              "pipeline_stages=46: more stages than the 45 trunk layers (each stage needs one)");
    EXPECT_TRUE(make_plan(step35_shape(), request(1, 45, 45)).has_value());
}

TEST(PlanRefusal, ImpossibleGqaMapping) {
    // 6 KV heads over 4 ranks: neither an even split nor one replicated head per rank.
    ModelShape shape = tiny_shape();
    for (LayerShape &l : shape.layers) {
        l.n_heads = 12;
        l.n_kv_heads = 6;
    }
    EXPECT_EQ(plan_error(shape, request(4)),
              "tp=4: KV heads 6 on layer 0 neither split evenly over 4 ranks nor divide 4 (a rank must hold whole "
              "KV heads or the single KV head its query heads read)");
    // 3 KV heads over 2 ranks.
    ModelShape three = tiny_shape();
    three.layers[2].n_heads = 24;
    three.layers[2].n_kv_heads = 3;
    const std::string msg = plan_error(three, request(2));
    EXPECT_NE(msg.find("tp=2: KV heads 3 on layer 2 neither split evenly"), std::string::npos) << msg;
    EXPECT_TRUE(make_plan(three, request(1)).has_value());
}

TEST(PlanRefusal, ExpertsNotDivisible) {
    ModelShape shape = tiny_shape(8);
    for (LayerShape &l : shape.layers) {
        if (l.moe) {
            l.n_experts = 12;
        }
    }
    EXPECT_EQ(plan_error(shape, request(8)),
              "tp=8: the 12 routed experts of layer 1 cannot be spread evenly over 8 ranks (each rank owns whole "
              "experts)");
    EXPECT_TRUE(make_plan(shape, request(4)).has_value());
}

TEST(Plan, ExpertWidthIsNeverCut) {
    // Routed experts stay whole, so no expert width is refused: neither one without 8 canonical blocks nor an
    // fp8 one whose per-rank slice would have split a 128-wide scale tile (ENGINE.md section 3).
    ModelShape shape = tiny_shape();
    shape.layers[3].d_expert = 100;
    for (const int tp : {1, 2, 4}) expect_invariants(plan_ok(shape, request(tp)), shape);
    const ModelShape fp8 = step35_shape(true);
    for (const int tp : {1, 2, 4, 8}) expect_invariants(plan_ok(fp8, request(tp)), fp8);
}

TEST(PlanRefusal, VocabNotDivisible) {
    ModelShape shape = tiny_shape();
    shape.vocab_size = 1026;
    EXPECT_EQ(plan_error(shape, request(4)),
              "tp=4: vocab_size 1026 is not divisible by 4 (the LM head is split by vocabulary rows)");
    EXPECT_TRUE(make_plan(shape, request(2)).has_value());
}

TEST(PlanRefusal, MalformedGeometry) {
    struct Case {
        const char *want;
        void (*edit)(ModelShape &);
    };
    const Case cases[] = {
        {"model: d_model and vocab_size must be positive, found 0 and 1024", [](ModelShape &s) { s.d_model = 0; }},
        {"model: needs at least one trunk layer before any MTP layer, found 0 layers",
         [](ModelShape &s) { s.layers.clear(); }},
        {"model: needs at least one trunk layer before any MTP layer, found 7 layers",
         [](ModelShape &s) { s.layers[0].is_mtp = true; }},
        {"model: layer 3 is a trunk layer after MTP layer 2; MTP layers must come last",
         [](ModelShape &s) { s.layers[2].is_mtp = true; }},
        {"layer 1: n_heads, n_kv_heads and head_dim must be positive, found 12, 0, 32",
         [](ModelShape &s) { s.layers[1].n_kv_heads = 0; }},
        {"layer 1: query heads 12 are not a multiple of the KV heads 5",
         [](ModelShape &s) { s.layers[1].n_kv_heads = 5; }},
        {"layer 2: MoE layer must have d_ff 0 (the dense width), found 64",
         [](ModelShape &s) { s.layers[2].d_ff = 64; }},
        {"layer 2: MoE layer needs positive n_experts and d_expert, found 0 and 96",
         [](ModelShape &s) { s.layers[2].n_experts = 0; }},
        {"layer 2: top_k must be in [1, 16] (n_experts), found 17", [](ModelShape &s) { s.layers[2].top_k = 17; }},
        {"layer 2: d_shared must be 0 (no shared expert) or positive, found -1",
         [](ModelShape &s) { s.layers[2].d_shared = -1; }},
        {"layer 0: dense layer needs a positive d_ff, found 0", [](ModelShape &s) { s.layers[0].d_ff = 0; }},
        {"layer 6: dense layer must have no expert fields, found n_experts 16, top_k 0, d_expert 0, d_shared 0, "
         "fp8_experts false",
         [](ModelShape &s) { s.layers[6].n_experts = 16; }},
        {"layer 4: o_proj reduction width 12 (4 heads x 3) cannot be cut into 8 canonical blocks",
         [](ModelShape &s) { s.layers[4] = moe(attention(4, 2, 3, false), 16, 4, 96, 96); }},
        {"layer 4: o_proj reduction width 4294967296 (65536 heads x 65536) exceeds 1073741824",
         [](ModelShape &s) { s.layers[4] = moe(attention(65536, 1, 65536, false), 16, 4, 96, 96); }},
        {"layer 0: dense d_ff 500 cannot be cut into 8 canonical blocks of down_proj",
         [](ModelShape &s) { s.layers[0].d_ff = 500; }},
    };
    for (const Case &c : cases) {
        ModelShape shape = tiny_shape();
        c.edit(shape);
        EXPECT_EQ(plan_error(shape, request(1)), c.want);
    }
}

// ---- Pipeline stages ----

TEST(PipelinePlan, TwoStagesTp2) {
    const ModelShape shape = step35_shape();
    const ParallelPlan plan = plan_ok(shape, request(2, 2));
    expect_invariants(plan, shape);
    ASSERT_EQ(plan.ranks.size(), 4u);
    EXPECT_EQ(plan.stage_layers[0], R(0, 23));  // the first stage takes the odd layer
    EXPECT_EQ(plan.stage_layers[1], R(23, 45));
    EXPECT_EQ(plan.ranks[1].stage, 0);
    EXPECT_EQ(plan.ranks[2].stage, 1);
    EXPECT_EQ(plan.ranks[2].tp_rank, 0);
    EXPECT_EQ(plan.ranks[0].layers.size(), 23u);
    EXPECT_EQ(plan.ranks[3].layers.size(), 25u);  // 22 trunk + 3 MTP
    EXPECT_EQ(plan.ranks[3].mtp_layers, R(45, 48));
    EXPECT_TRUE(plan.ranks[0].vocab.empty());
    EXPECT_EQ(plan.ranks[2].vocab, R(0, 64448));
    EXPECT_EQ(plan.ranks[3].vocab, R(64448, 128896));
    EXPECT_EQ(plan.layers[22].stage, 0);
    EXPECT_EQ(plan.layers[23].stage, 1);
    EXPECT_EQ(plan.layers[47].stage, 1);
    EXPECT_EQ(plan.expert_owner_rank(shape, 3, 0), 0);
    EXPECT_EQ(plan.expert_owner_rank(shape, 3, 144), 1);
    EXPECT_EQ(plan.expert_owner_rank(shape, 30, 287), 3);
    EXPECT_EQ(layer_of(plan, 3, 30).experts, R(144, 288));
    EXPECT_EQ(layer_of(plan, 3, 47).q_heads, R(48, 96));
}

TEST(PipelinePlan, ThreeStagesTp2) {
    const ModelShape shape = step35_shape();
    const ParallelPlan plan = plan_ok(shape, request(2, 3));
    expect_invariants(plan, shape);
    EXPECT_EQ(plan.stage_layers[0], R(0, 15));
    EXPECT_EQ(plan.stage_layers[1], R(15, 30));
    EXPECT_EQ(plan.stage_layers[2], R(30, 45));
    EXPECT_EQ(plan.ranks[2].trunk_layers, R(15, 30));
    EXPECT_TRUE(plan.ranks[2].mtp_layers.empty());
    EXPECT_FALSE(plan.ranks[2].holds_embedding);
    EXPECT_TRUE(plan.ranks[4].holds_embedding);  // the MTP layers embed tokens
    EXPECT_EQ(plan.ranks[5].vocab, R(64448, 128896));
}

TEST(PipelinePlan, RemainderGoesToEarlierStages) {
    const ModelShape shape = tiny_shape();
    const ParallelPlan plan = plan_ok(shape, request(1, 4));
    expect_invariants(plan, shape);
    EXPECT_EQ(plan.stage_layers[0], R(0, 2));
    EXPECT_EQ(plan.stage_layers[1], R(2, 4));
    EXPECT_EQ(plan.stage_layers[2], R(4, 5));
    EXPECT_EQ(plan.stage_layers[3], R(5, 6));
    EXPECT_EQ(plan.ranks[3].mtp_layers, R(6, 7));
}

// ---- Tiny geometry ----

TEST(TinyPlan, Tp1And2) {
    const ModelShape shape = tiny_shape();
    const ParallelPlan one = plan_ok(shape, request(1));
    expect_invariants(one, shape);
    EXPECT_EQ(layer_of(one, 0, 1).q_heads, R(0, 12));
    EXPECT_EQ(one.layers[1].o_block_width, 48);  // 12 heads x 32 / 8: blocks need not hold whole heads
    const ParallelPlan two = plan_ok(shape, request(2));
    expect_invariants(two, shape);
    EXPECT_EQ(layer_of(two, 1, 0).q_heads, R(4, 8));
    EXPECT_EQ(layer_of(two, 1, 0).kv_heads, R(1, 2));
    EXPECT_EQ(layer_of(two, 1, 0).ff, R(256, 512));
    EXPECT_EQ(layer_of(two, 1, 1).q_heads, R(6, 12));
    EXPECT_EQ(layer_of(two, 1, 1).o_cols, R(192, 384));
    EXPECT_EQ(layer_of(two, 1, 1).o_blocks, R(4, 8));
    EXPECT_EQ(layer_of(two, 1, 1).experts, R(8, 16));
    EXPECT_EQ(two.ranks[1].vocab, R(512, 1024));
    EXPECT_EQ(two.layers[1].kv_layout, KvLayout::kSplit);
}

TEST(TinyPlan, Tp4ReplicatesKvHeads) {
    const ModelShape shape = tiny_shape();
    const ParallelPlan plan = plan_ok(shape, request(4));
    expect_invariants(plan, shape);
    EXPECT_EQ(plan.layers[0].kv_layout, KvLayout::kReplicated);
    EXPECT_EQ(plan.layers[0].kv_replicas, 2);
    const int full_kv[] = {0, 0, 1, 1};
    const int sliding_q[] = {0, 3, 6, 9};
    for (int r = 0; r < 4; ++r) {
        EXPECT_EQ(layer_of(plan, r, 0).q_heads, R(2 * r, 2 * r + 2));
        EXPECT_EQ(layer_of(plan, r, 0).kv_heads, R(full_kv[r], full_kv[r] + 1));
        EXPECT_EQ(layer_of(plan, r, 1).q_heads, R(sliding_q[r], sliding_q[r] + 3));
        EXPECT_EQ(layer_of(plan, r, 1).kv_heads, R(full_kv[r], full_kv[r] + 1));
        EXPECT_EQ(layer_of(plan, r, 2).experts, R(4 * r, 4 * r + 4));
        EXPECT_EQ(layer_of(plan, r, 6).ff, R(128 * r, 128 * r + 128));
        EXPECT_EQ(plan.ranks[r].vocab, R(256 * r, 256 * r + 256));
    }
}

TEST(TinyPlan, Tp8RefusedBySlidingHeads) {
    EXPECT_EQ(plan_error(tiny_shape(), request(8)), "tp=8: query heads 12 on layer 1 are not divisible by 8");
}

TEST(TinyPlan, Tp8ReplicatesEachKvHeadOnFourRanks) {
    const ModelShape shape = tiny_shape(16);  // sliding layers with 16 query heads so TP 8 is possible
    const ParallelPlan plan = plan_ok(shape, request(8));
    expect_invariants(plan, shape);
    EXPECT_EQ(plan.layers[0].kv_replicas, 4);
    for (int r = 0; r < 8; ++r) {
        EXPECT_EQ(layer_of(plan, r, 0).q_heads, R(r, r + 1));
        EXPECT_EQ(layer_of(plan, r, 0).kv_heads, R(r / 4, r / 4 + 1));
        EXPECT_EQ(layer_of(plan, r, 1).q_heads, R(2 * r, 2 * r + 2));
        EXPECT_EQ(layer_of(plan, r, 1).kv_heads, R(r / 4, r / 4 + 1));
        EXPECT_EQ(layer_of(plan, r, 3).experts, R(2 * r, 2 * r + 2));
    }
}

// ---- Split kinds ----

TEST(SplitKinds, EveryProjection) {
    for (Projection p : {Projection::kQ, Projection::kK, Projection::kV, Projection::kG, Projection::kGate,
                         Projection::kUp, Projection::kLmHead, Projection::kMtpHead}) {
        EXPECT_EQ(projection_split(p), Split::kColumn) << projection_name(p);
    }
    EXPECT_EQ(projection_split(Projection::kO), Split::kRow);
    EXPECT_EQ(projection_split(Projection::kDown), Split::kRow);
    for (Projection p : {Projection::kEmbed, Projection::kNorm, Projection::kRouter, Projection::kRouterBias,
                         Projection::kSharedGate, Projection::kSharedUp, Projection::kSharedDown, Projection::kEhProj}) {
        EXPECT_EQ(projection_split(p), Split::kReplicated) << projection_name(p);
    }
    for (Projection p : {Projection::kExpertGate, Projection::kExpertUp, Projection::kExpertDown}) {
        EXPECT_EQ(projection_split(p), Split::kExpert) << projection_name(p);
    }
    EXPECT_STREQ(projection_name(Projection::kO), "o_proj");
    EXPECT_STREQ(split_name(Split::kRow), "row");
    // Every projection has a distinct, non-empty name.
    std::vector<std::string> names;
    for (Projection p : kAllProjections) {
        names.emplace_back(projection_name(p));
        EXPECT_FALSE(names.back().empty());
    }
    std::sort(names.begin(), names.end());
    EXPECT_EQ(std::adjacent_find(names.begin(), names.end()), names.end());
}

// ---- Text ----

bool has(const std::string &text, const std::string &needle) { return text.find(needle) != std::string::npos; }

TEST(FormatPlan, Step35Tp8KeyLines) {
    const ModelShape shape = step35_shape();
    const ParallelPlan plan = plan_ok(shape, request(8));
    const std::string text = format_plan(plan, shape);
    EXPECT_TRUE(has(text, "parallel plan: 8 ranks = 1 pipeline stage x tp 8 (routed experts: ep 8), 8 devices available\n")) << text;
    EXPECT_TRUE(has(text, "model: d_model 4096, vocab 128896, 45 trunk + 3 MTP layers\n"));
    EXPECT_TRUE(has(text, "summed as ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7))"));
    EXPECT_TRUE(has(text, "  stage 0: ranks 0-7, trunk layers [0, 45), MTP layers [45, 48)\n"));
    EXPECT_TRUE(has(text, "  layer 0 (full, dense): heads 64 q / 8 kv x 128 (per rank 8 q + 1 kv), o_proj K block "
                          "1024; d_ff 11264 (per rank 1408), down K block 1408\n"))
        << text;
    EXPECT_TRUE(has(text, "  layers 1-2 (sliding, dense): heads 96 q / 8 kv x 128 (per rank 12 q + 1 kv)"));
    EXPECT_TRUE(has(text, "  layers 3,5-7,9-11,13-15,17-19,21-23,25-27,29-31,33-35,37-39,41-43 (sliding, MoE)"));
    EXPECT_TRUE(has(text, "  layers 4,8,12,16,20,24,28,32,36,40,44 (full, MoE)"));
    EXPECT_TRUE(has(text, "288 experts top-8 d_expert 1280 (36 whole experts per rank); shared expert 1280 "
                          "replicated\n"));
    EXPECT_TRUE(has(text, "  layers 45-47 (MTP, sliding, dense)"));
    EXPECT_TRUE(has(text, "rank 7 (stage 0, tp rank 7): canonical blocks [7, 8) = p7\n"));
    EXPECT_TRUE(has(text, "  layer 0 (full, dense): q heads [56, 64), kv heads [7, 8), o_proj blocks [7, 8), d_ff "
                          "[9856, 11264), down blocks [7, 8)\n"));
    EXPECT_TRUE(has(text, "q heads [84, 96), kv heads [7, 8), o_proj blocks [7, 8), experts [252, 288) whole\n"));
    EXPECT_TRUE(has(text, "  lm_head vocab [112784, 128896), each MTP shared_head the same rows\n"));
    EXPECT_TRUE(has(text, "replicated on every rank that holds them: embed, norms, router, router_bias, shared expert "
                          "gate_proj, shared expert up_proj, shared expert down_proj, eh_proj"));
    EXPECT_FALSE(has(text, "kv heads copied"));
    // Deterministic: the same text from the same plan and from a fresh plan.
    EXPECT_EQ(format_plan(plan, shape), text);
    EXPECT_EQ(format_plan(plan_ok(shape, request(8)), shape), text);
    EXPECT_NE(format_plan(plan_ok(shape, request(4)), shape), text);
}

TEST(FormatPlan, OwnedExpertsStagesAndKvCopies) {
    const ModelShape shape = tiny_shape();
    const std::string text = format_plan(plan_ok(shape, request(4, 2)), shape);
    EXPECT_TRUE(has(text, "parallel plan: 8 ranks = 2 pipeline stages x tp 4 (routed experts: ep 4), 8 devices available\n")) << text;
    EXPECT_TRUE(has(text, "  stage 0: ranks 0-3, trunk layers [0, 3)\n"));
    EXPECT_TRUE(has(text, "  stage 1: ranks 4-7, trunk layers [3, 6), MTP layers [6, 7)\n"));
    EXPECT_TRUE(has(text, "(per rank 2 q + 1 kv, each kv head on 2 ranks)"));
    EXPECT_TRUE(has(text, "(4 whole experts per rank)"));
    EXPECT_TRUE(has(text, "rank 1 (stage 0, tp rank 1): canonical blocks [2, 4) = p2+p3\n"));
    EXPECT_TRUE(has(text, "experts [4, 8) whole\n"));
    EXPECT_TRUE(has(text, "kv heads copied on several ranks (tp > kv heads): layers 0-6\n"));
    EXPECT_TRUE(has(text, "  lm_head vocab [768, 1024), each MTP shared_head the same rows\n"));
    // Rank 0 (first stage) holds the embedding but no LM head.
    const size_t rank0 = text.find("rank 0 (");
    const size_t rank1 = text.find("rank 1 (");
    ASSERT_NE(rank0, std::string::npos);
    ASSERT_NE(rank1, std::string::npos);
    const std::string rank0_text = text.substr(rank0, rank1 - rank0);
    EXPECT_TRUE(has(rank0_text, "embedding: all rows (replicated)"));
    EXPECT_FALSE(has(rank0_text, "lm_head"));
}

}  // namespace
}  // namespace memra::parallel
