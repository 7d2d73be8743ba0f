// MoeState (step35_moe.h) on the tiny checkpoint (bf16 and fp8 experts) through the CPU backend: refresh within
// capacity bumps the generation, refusals (capacity, shapes, layers) leave the routing and generation intact,
// the routing equals an independent host router and stable counting sort, the output equals a per-expert
// oracle (one plain product per pair on the full weights, combined in top-k slot order with a separate
// multiply and add) bit for bit, TP = 2 / 4 / 8 ranks (experts whole on their owners) give the TP = 1 bits on
// every rank after the fixed-capacity and the exact-count exchanges, and refresh / run allocate nothing and
// read nothing back.

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/ops_elementwise.h"
#include "backend/cpu/ops_moe.h"
#include "core/thread_pool.h"
#include "io/safetensors.h"
#include "model/step35_config.h"
#include "model/step35_model.h"
#include "model/step35_moe.h"
#include "model/step35_plan.h"
#include "model/step35_weights.h"
#include "parallel/comm.h"
#include "parallel/plan.h"

#include "alloc_counter.h"

#include "model/model_test_util.h"
#include "model/tiny_dirs.h"

namespace memra::model {
namespace {

namespace fs = std::filesystem;

// The tiny model: layers 2 .. 5 are MoE (16 experts, top-8, width 96, shared 64); layer 4 clamps the routed
// SwiGLU at 1.5, layer 5 also the shared one at 2.5; layers 0, 1 are dense.
constexpr int kMoeLayer = 2;
constexpr int kClampedLayer = 5;
constexpr int kDenseLayer = 0;

TinyDirs *g_dirs = nullptr;

// n rows of width d from a 64-bit LCG keyed by seed, uniform in [-2, 2) (normed hidden states' range).
std::vector<float> make_rows(uint64_t seed, int64_t n, int64_t d) {
    std::vector<float> out(static_cast<size_t>(n * d));
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
    for (float &v : out) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        v = static_cast<float>(static_cast<double>(s >> 40) / 16777216.0 * 4.0 - 2.0);
    }
    return out;
}

// One whole model on one CPU backend. Not movable: states point into it.
struct Engine {
    std::unique_ptr<cpu::CpuBackend> backend;
    std::optional<io::Checkpoint> ckpt;
    Step35Config cfg;
    Step35Model model;
};

std::unique_ptr<Engine> make_engine(const fs::path &dir, int threads = 1) {
    auto e = std::make_unique<Engine>();
    e->backend = std::make_unique<cpu::CpuBackend>(threads, Numerics::kExact);
    auto cfg = load_step35_config(dir);
    EXPECT_TRUE(cfg.has_value()) << cfg.error().message;
    e->cfg = *cfg;
    auto ckpt = io::Checkpoint::open(dir);
    EXPECT_TRUE(ckpt.has_value()) << ckpt.error().message;
    e->ckpt.emplace(std::move(*ckpt));
    auto model = bind_step35_model(*e->backend, *e->ckpt, e->cfg);
    EXPECT_TRUE(model.has_value()) << model.error().message;
    e->model = std::move(*model);
    return e;
}

// Host rows uploaded into a fresh backend buffer [rows, cols].
TensorView upload(Backend &backend, const std::vector<float> &host, int64_t rows, int64_t cols) {
    auto v = backend.alloc(DType::kF32, {rows, cols});
    EXPECT_TRUE(v.has_value());
    backend.copy_from_host(host.data(), *v);
    return *v;
}

std::vector<float> download(Backend &backend, TensorView v) {
    std::vector<float> out(static_cast<size_t>(v.numel()));
    backend.copy_to_host(v, out.data());
    return out;
}

// The first `rows` rows of a [capacity, cols] buffer.
TensorView first_rows(TensorView v, int64_t rows) { return v.row_slice(0, rows); }

// ---- The per-expert oracle: the layer's weights straight from the checkpoint, one product per pair ----

struct HostLayer {
    cpu::WeightRef router;
    const float *router_bias = nullptr;
    cpu::WeightBankRef gate, up, down;
    cpu::WeightRef shared_gate, shared_up, shared_down;
};

cpu::WeightRef host_matrix(const Engine &e, const std::string &name) {
    auto ref = e.ckpt->get(name);
    EXPECT_TRUE(ref.has_value()) << name;
    cpu::WeightRef w;
    w.dtype = ref->info->dtype;
    w.data = ref->bytes.data();
    w.rows = ref->info->shape[0];
    w.cols = ref->info->shape[1];
    if (w.dtype == DType::kF8E4M3) {
        auto scale = e.ckpt->get(name + std::string(kFp8ScaleSuffix));
        EXPECT_TRUE(scale.has_value()) << name;
        w.scale_inv = reinterpret_cast<const float *>(scale->bytes.data());
        w.block_rows = e.cfg.quantization.block_out;
        w.block_cols = e.cfg.quantization.block_in;
    }
    return w;
}

cpu::WeightBankRef host_bank(const Engine &e, const std::string &name) {
    auto ref = e.ckpt->get(name);
    EXPECT_TRUE(ref.has_value()) << name;
    cpu::WeightBankRef b;
    b.dtype = ref->info->dtype;
    b.data = ref->bytes.data();
    b.n_experts = ref->info->shape[0];
    b.rows = ref->info->shape[1];
    b.cols = ref->info->shape[2];
    if (b.dtype == DType::kF8E4M3) {
        auto scale = e.ckpt->get(name + std::string(kFp8ScaleSuffix));
        EXPECT_TRUE(scale.has_value()) << name;
        b.scale_inv = reinterpret_cast<const float *>(scale->bytes.data());
        b.block_rows = e.cfg.quantization.block_out;
        b.block_cols = e.cfg.quantization.block_in;
    }
    return b;
}

HostLayer host_layer(const Engine &e, int layer) {
    const std::string p = fmt::format("model.layers.{}.", layer);
    HostLayer h;
    h.router = host_matrix(e, p + "moe.gate.weight");
    auto bias = e.ckpt->get(p + "moe.router_bias");
    EXPECT_TRUE(bias.has_value());
    h.router_bias = reinterpret_cast<const float *>(bias->bytes.data());
    h.gate = host_bank(e, p + "moe.gate_proj.weight");
    h.up = host_bank(e, p + "moe.up_proj.weight");
    h.down = host_bank(e, p + "moe.down_proj.weight");
    h.shared_gate = host_matrix(e, p + "share_expert.gate_proj.weight");
    h.shared_up = host_matrix(e, p + "share_expert.up_proj.weight");
    h.shared_down = host_matrix(e, p + "share_expert.down_proj.weight");
    return h;
}

// residual + (sum over slots of weight * expert(x) + shared(x)) per token: every (token, slot) pair through
// its expert alone (gate, up, SwiGLU, down: the whole expert, one K order), the slots added in order (or in
// reverse order, to show the gate notices), each product rounded before its add.
std::vector<float> oracle_output(const Engine &e, int layer, const std::vector<float> &x,
                                 const std::vector<float> &residual, const MoeRouting &routing,
                                 bool reverse_slots = false) {
    const LayerGeometry &g = e.cfg.layers[static_cast<size_t>(layer)];
    const HostLayer h = host_layer(e, layer);
    ThreadPool pool(1);
    const int64_t n = routing.n_tokens;
    const int64_t k = routing.top_k;
    const int64_t d = e.cfg.d_model;
    std::vector<float> gate(static_cast<size_t>(std::max(g.d_expert, g.d_shared)));
    std::vector<float> up(gate.size());
    std::vector<float> ws(static_cast<size_t>(cpu::matmul_canonical_workspace_floats(1, h.shared_down)));
    std::vector<float> y(static_cast<size_t>(k * d));  // the token's expert rows, slot order
    std::vector<float> shared(static_cast<size_t>(d));
    std::vector<float> out(static_cast<size_t>(n * d));
    for (int64_t t = 0; t < n; ++t) {
        const float *xt = &x[static_cast<size_t>(t * d)];
        for (int64_t s = 0; s < k; ++s) {
            const int32_t expert = routing.expert_ids[static_cast<size_t>(t * k + s)];
            cpu::matmul(pool, xt, 1, cpu::weight_bank_expert(h.gate, expert), gate.data());
            cpu::matmul(pool, xt, 1, cpu::weight_bank_expert(h.up, expert), up.data());
            cpu::swiglu(pool, gate.data(), up.data(), g.d_expert, 1, g.d_expert, g.clamp_routed, gate.data());
            cpu::matmul(pool, gate.data(), 1, cpu::weight_bank_expert(h.down, expert), &y[static_cast<size_t>(s * d)]);
        }
        cpu::matmul(pool, xt, 1, h.shared_gate, gate.data());
        cpu::matmul(pool, xt, 1, h.shared_up, up.data());
        cpu::swiglu(pool, gate.data(), up.data(), g.d_shared, 1, g.d_shared, g.clamp_shared, gate.data());
        cpu::matmul_canonical(pool, gate.data(), 1, h.shared_down, shared.data(), ws.data());
        for (int64_t j = 0; j < d; ++j) {
            float routed = 0.0f;
            for (int64_t i = 0; i < k; ++i) {
                const int64_t s = reverse_slots ? k - 1 - i : i;
                const float w = routing.weights[static_cast<size_t>(t * k + s)];
                const float product = w * y[static_cast<size_t>(s * d + j)];
                routed = routed + product;
            }
            const auto at = static_cast<size_t>(t * d + j);
            out[at] = residual[at] + (routed + shared[static_cast<size_t>(j)]);
        }
    }
    return out;
}

// The stable counting sort of the pairs by expert, written out here independently of cpu::moe_sort_pairs.
struct HostSort {
    std::vector<int32_t> counts, offsets, sorted_pair, row_of_pair;
};

HostSort host_sort(const std::vector<int32_t> &ids, int64_t n_experts) {
    HostSort s;
    s.counts.assign(static_cast<size_t>(n_experts), 0);
    for (const int32_t e : ids) ++s.counts[static_cast<size_t>(e)];
    s.offsets.assign(static_cast<size_t>(n_experts + 1), 0);
    for (int64_t e = 0; e < n_experts; ++e) {
        s.offsets[static_cast<size_t>(e + 1)] = s.offsets[static_cast<size_t>(e)] + s.counts[static_cast<size_t>(e)];
    }
    std::vector<int32_t> next(s.offsets.begin(), s.offsets.end() - 1);
    s.sorted_pair.assign(ids.size(), -1);
    s.row_of_pair.assign(ids.size(), -1);
    for (size_t q = 0; q < ids.size(); ++q) {
        const int32_t row = next[static_cast<size_t>(ids[q])]++;
        s.sorted_pair[static_cast<size_t>(row)] = static_cast<int32_t>(q);
        s.row_of_pair[q] = row;
    }
    return s;
}

bool same_routing(const MoeRouting &a, const MoeRouting &b) {
    return a.n_tokens == b.n_tokens && a.top_k == b.top_k && a.n_experts == b.n_experts &&
           a.expert_ids == b.expert_ids && bit_mismatches(a.weights, b.weights) == 0 && a.offsets == b.offsets &&
           a.sorted_pair == b.sorted_pair && a.row_of_pair == b.row_of_pair;
}

// ---- Fixture ----

// Generates the tiny bf16 and fp8 checkpoints once per suite.
class TinyModels : public ::testing::Test {
protected:
    static void SetUpTestSuite() { g_dirs = new TinyDirs("moe_test", 7, 7); }
    static void TearDownTestSuite() {
        delete g_dirs;
        g_dirs = nullptr;
    }
    static fs::path dir(const std::string &dtype) { return g_dirs->at(dtype); }
};

class MoeStateTest : public TinyModels, public ::testing::WithParamInterface<const char *> {};

TEST_P(MoeStateTest, RefreshWithinCapacityRoutesAndBumpsTheGeneration) {
    auto e = make_engine(dir(GetParam()));
    const int64_t d = e->cfg.d_model;
    auto state = MoeState::create(*e->backend, e->model, kMoeLayer, 12, nullptr);
    ASSERT_TRUE(state.has_value()) << state.error().message;
    EXPECT_EQ(state->generation(), 0u);
    EXPECT_EQ(state->n_tokens(), 0);
    EXPECT_EQ(state->layer(), -1);
    EXPECT_EQ(state->capacity(), 12);
    EXPECT_EQ(state->shape(), (MoeShape{256, 16, 8, 96, 64, parallel::Range{0, 16}}));
    for (int l = 0; l < e->cfg.n_layers + e->cfg.n_mtp_layers; ++l) {
        EXPECT_EQ(state->serves(l), l >= 2 && l <= 5) << "layer " << l;
    }
    const TensorView x = upload(*e->backend, make_rows(1, 12, d), 12, d);
    uint64_t gen = 0;
    for (const auto &[layer, rows] : {std::pair{kMoeLayer, 5}, std::pair{4, 12}, std::pair{kMoeLayer, 1}}) {
        ASSERT_TRUE(state->refresh(layer, first_rows(x, rows)).has_value());
        EXPECT_EQ(state->generation(), ++gen);
        EXPECT_EQ(state->layer(), layer);
        EXPECT_EQ(state->n_tokens(), rows);
        MoeRouting routing;
        state->read_routing(routing);
        ASSERT_EQ(routing.offsets.size(), 17u);
        EXPECT_EQ(routing.offsets.front(), 0);
        EXPECT_EQ(routing.offsets.back(), rows * 8);
        const MoeBuffers b = state->buffers();
        EXPECT_EQ(b.capacity, rows * 8);  // one owner: every pair is its own
        EXPECT_EQ(b.router_logits.rows(), rows);
        EXPECT_EQ(b.x_own.rows(), rows * 8);
        EXPECT_EQ(b.expert_out.rows(), rows * 8);
        EXPECT_EQ(b.expert_act.row_elems(), 96);
        EXPECT_EQ(b.shared_out.rows(), rows);
    }
}

TEST_P(MoeStateTest, RefusalsLeaveTheRoutingAndGenerationIntact) {
    auto e = make_engine(dir(GetParam()));
    const int64_t d = e->cfg.d_model;
    Backend &be = *e->backend;
    auto state = MoeState::create(be, e->model, kMoeLayer, 12, nullptr);
    ASSERT_TRUE(state.has_value()) << state.error().message;
    const TensorView x = upload(be, make_rows(2, 13, d), 13, d);
    const TensorView res = upload(be, make_rows(3, 12, d), 12, d);
    auto out_buf = be.alloc(DType::kF32, {12, d});
    ASSERT_TRUE(out_buf.has_value());

    // Before any refresh there is nothing to run.
    auto r = state->run(first_rows(res, 7), first_rows(*out_buf, 7));
    ASSERT_FALSE(r.has_value());
    EXPECT_NE(r.error().message.find("moe run: nothing routed yet; refresh the state first"), std::string::npos)
        << r.error().message;

    ASSERT_TRUE(state->refresh(kMoeLayer, first_rows(x, 7)).has_value());
    ASSERT_TRUE(state->run(first_rows(res, 7), first_rows(*out_buf, 7)).has_value());
    const std::vector<float> out0 = download(be, first_rows(*out_buf, 7));
    MoeRouting routing0;
    state->read_routing(routing0);

    auto expect_refused = [&](Result<void> got, const std::string &fragment) {
        ASSERT_FALSE(got.has_value()) << fragment;
        EXPECT_NE(got.error().message.find(fragment), std::string::npos) << got.error().message;
        EXPECT_EQ(state->generation(), 1u) << fragment;
        EXPECT_EQ(state->n_tokens(), 7) << fragment;
        EXPECT_EQ(state->layer(), kMoeLayer) << fragment;
        MoeRouting now;
        state->read_routing(now);
        EXPECT_TRUE(same_routing(routing0, now)) << fragment;
    };
    expect_refused(state->refresh(kMoeLayer, x), "moe refresh: 13 rows, the state was prepared for 1 .. 12 rows");
    expect_refused(state->refresh(kMoeLayer, first_rows(x, 0)),
                   "moe refresh: 0 rows, the state was prepared for 1 .. 12 rows");
    expect_refused(state->refresh(kMoeLayer, x.reshaped({26, 128})),
                   "moe refresh: x is [26, 128] F32, expected [n, 256] F32");
    TensorView ints = first_rows(x, 4);
    ints.dtype = DType::kI32;
    expect_refused(state->refresh(kMoeLayer, ints), "moe refresh: x is [4, 256] I32, expected [n, 256] F32");
    expect_refused(state->refresh(kDenseLayer, first_rows(x, 4)), "moe refresh: layer 0 is not a MoE layer");
    expect_refused(state->refresh(99, first_rows(x, 4)), "moe refresh: layer 99 is not a MoE layer");
    expect_refused(state->run(first_rows(res, 6), first_rows(*out_buf, 7)),
                   "moe run: residual is [6, 256] F32, expected [7, 256] F32 (the rows of the last refresh)");
    expect_refused(state->run(first_rows(res, 7), x.reshaped({26, 128}).row_slice(0, 7)),
                   "moe run: out is [7, 128] F32, expected [7, 256] F32");

    // The routing survived: running again gives the same bits.
    ASSERT_TRUE(state->run(first_rows(res, 7), first_rows(*out_buf, 7)).has_value());
    EXPECT_EQ(0, bit_mismatches(out0, download(be, first_rows(*out_buf, 7))));

    // create() refusals.
    auto expect_create_error = [&](Result<MoeState> got, const std::string &fragment) {
        ASSERT_FALSE(got.has_value()) << fragment;
        EXPECT_NE(got.error().message.find(fragment), std::string::npos) << got.error().message;
    };
    expect_create_error(MoeState::create(be, e->model, kDenseLayer, 4, nullptr),
                        "moe state: layer 0 is a dense layer, not MoE");
    expect_create_error(MoeState::create(be, e->model, 7, 4, nullptr),
                        "moe state: layer 7 outside the model's 7 layers");
    expect_create_error(MoeState::create(be, e->model, kMoeLayer, 0, nullptr),
                        "moe state: capacity 0 rows, expected 1 .. 268435455");
    expect_create_error(MoeState::create(be, e->model, kMoeLayer, int64_t{1} << 28, nullptr),
                        "moe state: capacity 268435456 rows, expected 1 .. 268435455");
    auto group = parallel::InProcessGroup::create(2);
    ASSERT_TRUE(group.has_value());
    expect_create_error(MoeState::create(be, e->model, kMoeLayer, 4, &group->communicator(0)),
                        "moe state: the model is bound whole; a whole model runs without a communicator");
    parallel::PlanRequest req;
    req.tp = 2;
    req.devices_available = 2;
    auto plan = parallel::make_plan(plan_shape(e->cfg), req);
    ASSERT_TRUE(plan.has_value());
    auto shard = bind_step35_model(be, *e->ckpt, e->cfg, *plan, 1);
    ASSERT_TRUE(shard.has_value()) << shard.error().message;
    expect_create_error(MoeState::create(be, *shard, kMoeLayer, 4, nullptr),
                        "moe state: the model is the shard of TP rank 1 of 2; it needs the rank's communicator");
    expect_create_error(MoeState::create(be, *shard, kMoeLayer, 4, &group->communicator(0)),
                        "moe state: the communicator is rank 0 of 2, the model the shard of rank 1 of tp=2");
    // A rank's state serves only layers of its own shape.
    auto rank_state = MoeState::create(be, *shard, kMoeLayer, 4, &group->communicator(1));
    ASSERT_TRUE(rank_state.has_value()) << rank_state.error().message;
    EXPECT_EQ(rank_state->shape(), (MoeShape{256, 16, 8, 96, 64, parallel::Range{8, 16}}));
    EXPECT_TRUE(rank_state->serves(kClampedLayer));
    EXPECT_FALSE(rank_state->serves(kDenseLayer));
}

TEST_P(MoeStateTest, RoutingMatchesAHostRouterAndCountingSort) {
    auto e = make_engine(dir(GetParam()), 2);
    const int64_t d = e->cfg.d_model;
    const int64_t n = 20;
    Backend &be = *e->backend;
    auto state = MoeState::create(be, e->model, kMoeLayer, n, nullptr);
    ASSERT_TRUE(state.has_value()) << state.error().message;
    for (const int layer : {kMoeLayer, kClampedLayer}) {
        const std::vector<float> xh = make_rows(10 + static_cast<uint64_t>(layer), n, d);
        const TensorView x = upload(be, xh, n, d);
        ASSERT_TRUE(state->refresh(layer, x).has_value());
        MoeRouting got;
        state->read_routing(got);
        ASSERT_EQ(got.n_tokens, n);
        ASSERT_EQ(got.top_k, 8);
        ASSERT_EQ(got.n_experts, 16);

        // The router on the host: the fp32 product with the router weight, then the sigmoid top-k.
        const HostLayer h = host_layer(*e, layer);
        ThreadPool pool(1);
        std::vector<float> logits(static_cast<size_t>(n * 16));
        cpu::matmul(pool, xh.data(), n, h.router, logits.data());
        std::vector<int32_t> ids(static_cast<size_t>(n * 8));
        std::vector<float> weights(ids.size());
        cpu::router_topk(pool, cpu::RouterParams{16, 8, e->cfg.norm_expert_weight,
                                                 static_cast<float>(e->cfg.moe_router_scaling_factor)},
                         logits.data(), h.router_bias, n, ids.data(), weights.data());
        EXPECT_EQ(0, bit_mismatches(logits, download(be, state->buffers().router_logits)));
        EXPECT_EQ(got.expert_ids, ids);
        EXPECT_EQ(0, bit_mismatches(got.weights, weights));

        // The sort: counts, prefix offsets, sorted pairs (stable: token then slot order per expert) and the
        // reverse map, against the host counting sort of the same ids.
        const HostSort s = host_sort(got.expert_ids, 16);
        EXPECT_EQ(got.offsets, s.offsets);
        EXPECT_EQ(got.sorted_pair, s.sorted_pair);
        EXPECT_EQ(got.row_of_pair, s.row_of_pair);
        int used = 0;
        for (int ex = 0; ex < 16; ++ex) used += s.counts[static_cast<size_t>(ex)] > 0 ? 1 : 0;
        EXPECT_GE(used, 12) << "20 tokens of top-8 over 16 experts reach most experts";
        for (int64_t r = 0; r < n * 8; ++r) {
            EXPECT_EQ(got.row_of_pair[static_cast<size_t>(got.sorted_pair[static_cast<size_t>(r)])], r);
        }
        // The permuted input (one owner: every sorted row): row r is token sorted_pair[r] / top_k's row, exactly.
        const std::vector<float> xs = download(be, state->buffers().x_own);
        int64_t bad = 0;
        for (int64_t r = 0; r < n * 8; ++r) {
            const int64_t t = got.sorted_pair[static_cast<size_t>(r)] / 8;
            bad += std::memcmp(&xs[static_cast<size_t>(r * d)], &xh[static_cast<size_t>(t * d)],
                               static_cast<size_t>(d) * sizeof(float)) != 0;
        }
        EXPECT_EQ(bad, 0);
    }
    // Neither refresh nor run reads anything back to the host.
    const TensorView x = upload(be, make_rows(30, 3, d), 3, d);
    be.reset_counters();
    ASSERT_TRUE(state->refresh(kMoeLayer, x).has_value());
    ASSERT_TRUE(state->run(x, x).has_value());
    EXPECT_EQ(be.counters().host_copies(), 0);
    // router product, top-k, sort, source rows (Backend::moe_route's four ops on the CPU), permute; gate, up,
    // swiglu, down; shared x4; combine.
    EXPECT_EQ(be.counters().launches, 14);
}

TEST_P(MoeStateTest, OutputEqualsThePerExpertOracle) {
    auto e = make_engine(dir(GetParam()), 2);
    const int64_t d = e->cfg.d_model;
    Backend &be = *e->backend;
    auto state = MoeState::create(be, e->model, kMoeLayer, 16, nullptr);
    ASSERT_TRUE(state.has_value()) << state.error().message;
    // One state serves every MoE layer: plain, routed clamp (4), both clamps (5).
    for (const auto &[layer, rows] : {std::pair{kMoeLayer, 16}, std::pair{4, 5}, std::pair{kClampedLayer, 11}}) {
        const std::vector<float> xh = make_rows(40 + static_cast<uint64_t>(layer), rows, d);
        const std::vector<float> rh = make_rows(50 + static_cast<uint64_t>(layer), rows, d);
        const TensorView x = upload(be, xh, rows, d);
        const TensorView res = upload(be, rh, rows, d);
        auto out = be.alloc(DType::kF32, {rows, d});
        ASSERT_TRUE(out.has_value());
        ASSERT_TRUE(state->refresh(layer, x).has_value());
        be.reset_counters();
        ASSERT_TRUE(state->run(res, *out).has_value());
        // gate, up, swiglu, down; combine (the source rows came with the routing, the shared expert's four ops
        // with the refresh, on the side branch). No host copy.
        EXPECT_EQ(be.counters().launches, 5);
        EXPECT_EQ(be.counters().host_copies(), 0);
        const std::vector<float> got = download(be, *out);
        MoeRouting routing;
        state->read_routing(routing);
        const std::vector<float> want = oracle_output(*e, layer, xh, rh, routing);
        EXPECT_EQ(0, bit_mismatches(want, got)) << "layer " << layer;
        int64_t moved = 0;
        for (size_t i = 0; i < got.size(); ++i) {
            ASSERT_TRUE(std::isfinite(got[i]));
            moved += got[i] != rh[i] ? 1 : 0;
        }
        EXPECT_GT(moved, static_cast<int64_t>(got.size()) / 2) << "the experts add something";
        // The gate can fail: the same sums in reverse slot order round differently somewhere.
        EXPECT_GT(bit_mismatches(oracle_output(*e, layer, xh, rh, routing, true), got), 0) << "layer " << layer;
        // In place (out = residual), as the forward runs it.
        ASSERT_TRUE(state->run(res, res).has_value());
        EXPECT_EQ(0, bit_mismatches(want, download(be, res)));
    }
}

TEST_P(MoeStateTest, RefreshWithNewInputsRoutesThemAfresh) {
    auto e = make_engine(dir(GetParam()));
    const int64_t d = e->cfg.d_model;
    Backend &be = *e->backend;
    auto state = MoeState::create(be, e->model, kMoeLayer, 10, nullptr);
    ASSERT_TRUE(state.has_value()) << state.error().message;
    const TensorView a = upload(be, make_rows(60, 10, d), 10, d);
    const TensorView b = upload(be, make_rows(61, 6, d), 6, d);
    auto out = be.alloc(DType::kF32, {10, d});
    ASSERT_TRUE(out.has_value());
    auto run = [&](MoeState &s, int layer, TensorView x) {
        EXPECT_TRUE(s.refresh(layer, x).has_value());
        const TensorView o = first_rows(*out, x.rows());
        EXPECT_TRUE(s.run(x, o).has_value());
        return download(be, o);
    };
    const std::vector<float> out_a = run(*state, kMoeLayer, a);
    MoeRouting ra;
    state->read_routing(ra);
    const std::vector<float> out_b = run(*state, kClampedLayer, b);
    MoeRouting rb;
    state->read_routing(rb);
    EXPECT_FALSE(same_routing(ra, rb));
    EXPECT_EQ(0, bit_mismatches(out_a, run(*state, kMoeLayer, a)));  // back to the first input: its bits
    EXPECT_EQ(state->generation(), 3u);
    // A fresh state made for the clamped layer gives what the shared, reused one gave.
    auto fresh = MoeState::create(be, e->model, kClampedLayer, 6, nullptr);
    ASSERT_TRUE(fresh.has_value());
    EXPECT_EQ(0, bit_mismatches(out_b, run(*fresh, kClampedLayer, b)));
}

TEST_P(MoeStateTest, RefreshAndRunDoNotAllocate) {
    auto e = make_engine(dir(GetParam()), 2);
    const int64_t d = e->cfg.d_model;
    Backend &be = *e->backend;
    auto state = MoeState::create(be, e->model, kMoeLayer, 12, nullptr);
    ASSERT_TRUE(state.has_value());
    const TensorView x = upload(be, make_rows(70, 12, d), 12, d);
    auto out = be.alloc(DType::kF32, {12, d});
    ASSERT_TRUE(out.has_value());
    const int64_t before = g_allocations.load();
    for (const auto &[layer, rows] : {std::pair{kMoeLayer, 12}, std::pair{kClampedLayer, 3}}) {
        ASSERT_TRUE(state->refresh(layer, first_rows(x, rows)).has_value());
        ASSERT_TRUE(state->run(first_rows(x, rows), first_rows(*out, rows)).has_value());
    }
    EXPECT_EQ(g_allocations.load() - before, 0);
}

INSTANTIATE_TEST_SUITE_P(Tiny, MoeStateTest, ::testing::Values("bf16", "fp8"),
                         [](const ::testing::TestParamInfo<const char *> &p) { return std::string(p.param); });

// ---- Ranks ----

struct Combo {
    const char *dtype;
    int tp;
};

class MoeRanksTest : public TinyModels {};
class MoeRanksMatrixTest : public TinyModels, public ::testing::WithParamInterface<Combo> {};

// Per rank: a backend, the model's shard and a state over the group's communicator. Inputs are replicated.
struct RankSet {
    parallel::ParallelPlan plan;
    std::optional<parallel::InProcessGroup> group;
    std::vector<std::unique_ptr<cpu::CpuBackend>> backends;
    std::vector<Step35Model> models;
    std::vector<MoeState> states;
};

Result<void> make_ranks(RankSet &rs, const Engine &e, int tp, int64_t capacity) {
    parallel::PlanRequest req;
    req.tp = tp;
    req.devices_available = tp;
    auto plan = parallel::make_plan(plan_shape(e.cfg), req);
    if (!plan) return tl::unexpected(plan.error());
    rs.plan = std::move(*plan);
    auto group = parallel::InProcessGroup::create(tp);
    if (!group) return tl::unexpected(group.error());
    rs.group.emplace(std::move(*group));
    rs.models.reserve(static_cast<size_t>(tp));
    for (int r = 0; r < tp; ++r) {
        rs.backends.push_back(std::make_unique<cpu::CpuBackend>(1, Numerics::kExact));
        auto m = bind_step35_model(*rs.backends.back(), *e.ckpt, e.cfg, rs.plan, r);
        if (!m) return tl::unexpected(m.error());
        rs.models.push_back(std::move(*m));
        auto s = MoeState::create(*rs.backends.back(), rs.models.back(), kMoeLayer, capacity,
                                  &rs.group->communicator(r));
        if (!s) return tl::unexpected(s.error());
        rs.states.push_back(std::move(*s));
    }
    return {};
}

TEST_P(MoeRanksMatrixTest, EveryRankHoldsTheSingleRankBits) {
    const Combo c = GetParam();
    const std::string name = fmt::format("{} tp={}", c.dtype, c.tp);
    auto e = make_engine(dir(c.dtype));
    const int64_t d = e->cfg.d_model;
    constexpr int64_t kCap = 24;
    // Two refreshes of one state: 24 rows of layer 2, then 9 rows of the clamped layer 5.
    const std::vector<std::pair<int, int64_t>> steps = {{kMoeLayer, kCap}, {kClampedLayer, 9}};
    const std::vector<float> xh = make_rows(80, kCap, d);
    const std::vector<float> rh = make_rows(81, kCap, d);

    std::vector<std::vector<float>> want;
    {
        auto state = MoeState::create(*e->backend, e->model, kMoeLayer, kCap, nullptr);
        ASSERT_TRUE(state.has_value());
        const TensorView x = upload(*e->backend, xh, kCap, d);
        const TensorView res = upload(*e->backend, rh, kCap, d);
        auto out = e->backend->alloc(DType::kF32, {kCap, d});
        ASSERT_TRUE(out.has_value());
        for (const auto &[layer, rows] : steps) {
            ASSERT_TRUE(state->refresh(layer, first_rows(x, rows)).has_value());
            ASSERT_TRUE(state->run(first_rows(res, rows), first_rows(*out, rows)).has_value());
            want.push_back(download(*e->backend, first_rows(*out, rows)));
        }
    }

    RankSet rs;
    auto made = make_ranks(rs, *e, c.tp, kCap);
    ASSERT_TRUE(made.has_value()) << name << ": " << made.error().message;
    std::vector<TensorView> xs, res, outs;
    for (int r = 0; r < c.tp; ++r) {
        Backend &be = *rs.backends[static_cast<size_t>(r)];
        xs.push_back(upload(be, xh, kCap, d));
        res.push_back(upload(be, rh, kCap, d));
        auto o = be.alloc(DType::kF32, {kCap, d});
        ASSERT_TRUE(o.has_value());
        outs.push_back(*o);
    }
    // kAuto on a host-memory backend is the exact exchange; the fixed one is what a device backend's decode uses.
    for (const MoeExchange exchange : {MoeExchange::kAuto, MoeExchange::kFixed}) {
        for (size_t step = 0; step < steps.size(); ++step) {
            const auto [layer, rows] = steps[step];
            std::vector<CommCounters> counters(static_cast<size_t>(c.tp));
            auto ran = rs.group->run([&, layer = layer, rows = rows](int r, parallel::Communicator &) -> Result<void> {
                const auto ur = static_cast<size_t>(r);
                MoeState &s = rs.states[ur];
                s.reset_comm_counters();
                s.set_exchange(exchange);
                if (auto ok = s.refresh(layer, first_rows(xs[ur], rows)); !ok) return ok;
                if (auto ok = s.run(first_rows(res[ur], rows), first_rows(outs[ur], rows)); !ok) return ok;
                counters[ur] = s.comm_counters();
                return {};
            });
            ASSERT_TRUE(ran.has_value()) << name << ": " << ran.error().message;
            MoeRouting routing0;
            rs.states[0].read_routing(routing0);
            const int per_owner = 16 / c.tp;
            int owners_with_pairs = 0;
            for (int o = 0; o < c.tp; ++o) {
                owners_with_pairs += routing0.offsets[static_cast<size_t>((o + 1) * per_owner)] >
                                             routing0.offsets[static_cast<size_t>(o * per_owner)]
                                         ? 1
                                         : 0;
            }
            const auto owned = [&](int o) {
                return routing0.offsets[static_cast<size_t>((o + 1) * per_owner)] -
                       routing0.offsets[static_cast<size_t>(o * per_owner)];
            };
            for (int r = 0; r < c.tp; ++r) {
                const auto ur = static_cast<size_t>(r);
                const std::vector<float> got = download(*rs.backends[ur], first_rows(outs[ur], rows));
                EXPECT_EQ(0, bit_mismatches(want[step], got)) << name << " layer " << layer << " rank " << r;
                MoeRouting routing;
                rs.states[ur].read_routing(routing);
                EXPECT_TRUE(same_routing(routing0, routing)) << name << " rank " << r;
                const CommCounters &cc = counters[ur];
                if (exchange == MoeExchange::kFixed) {
                    // One all-gather of every owner's compact rows at the fixed capacity rows * min(top_k, experts
                    // per owner): no host read of the routing decides its size.
                    EXPECT_EQ(cc.all_gathers, 1) << name;
                    EXPECT_EQ(cc.exchanges, 0) << name;
                    EXPECT_EQ(cc.bytes, c.tp * rows * std::min(8, per_owner) * d * 4) << name;
                } else {
                    // Exact counts: the rank receives each other owner's rows, nothing more.
                    int64_t others = 0;
                    for (int o = 0; o < c.tp; ++o) others += o == r ? 0 : owned(o);
                    EXPECT_EQ(cc.all_gathers, 0) << name;
                    EXPECT_EQ(cc.exchanges, 1) << name;
                    EXPECT_EQ(cc.bytes, others * d * 4) << name << " rank " << r;
                }
            }
            EXPECT_GT(owners_with_pairs, 1) << name << ": the routing should reach several owners";
        }
    }
}

std::vector<Combo> rank_combos() {
    return {{"bf16", 2}, {"bf16", 4}, {"bf16", 8}, {"fp8", 2}, {"fp8", 4}, {"fp8", 8}};
}

INSTANTIATE_TEST_SUITE_P(Tiny, MoeRanksMatrixTest, ::testing::ValuesIn(rank_combos()),
                         [](const ::testing::TestParamInfo<Combo> &p) {
                             return fmt::format("{}_tp{}", p.param.dtype, p.param.tp);
                         });

TEST_F(MoeRanksTest, RankRefreshAndRunDoNotAllocate) {
    auto e = make_engine(dir("bf16"));
    const int64_t d = e->cfg.d_model;
    for (const int tp : {2, 4}) {
        RankSet rs;
        ASSERT_TRUE(make_ranks(rs, *e, tp, 12).has_value());
        std::vector<TensorView> xs, outs;
        for (int r = 0; r < tp; ++r) {
            Backend &be = *rs.backends[static_cast<size_t>(r)];
            xs.push_back(upload(be, make_rows(90, 12, d), 12, d));
            auto o = be.alloc(DType::kF32, {12, d});
            ASSERT_TRUE(o.has_value());
            outs.push_back(*o);
        }
        int64_t before = 0;
        int64_t after = 0;
        auto ran = rs.group->run([&](int r, parallel::Communicator &comm) -> Result<void> {
            const auto ur = static_cast<size_t>(r);
            MoeState &s = rs.states[ur];
            if (auto ok = comm.barrier(); !ok) return ok;
            if (r == 0) before = g_allocations.load();
            if (auto ok = comm.barrier(); !ok) return ok;
            for (const auto &[layer, rows] :
                 {std::pair{kMoeLayer, int64_t{12}}, std::pair{kClampedLayer, int64_t{2}}}) {
                if (auto ok = s.refresh(layer, first_rows(xs[ur], rows)); !ok) return ok;
                if (auto ok = s.run(first_rows(xs[ur], rows), first_rows(outs[ur], rows)); !ok) return ok;
            }
            if (auto ok = comm.barrier(); !ok) return ok;
            if (r == 0) after = g_allocations.load();
            return {};
        });
        ASSERT_TRUE(ran.has_value()) << ran.error().message;
        EXPECT_EQ(after - before, 0) << "tp " << tp;
    }
}

}  // namespace
}  // namespace memra::model
