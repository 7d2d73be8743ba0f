// Integration of tools + io + model on real files: checkpoints written by the tiny generator are opened
// with io::Checkpoint, their config.json parsed by load_step35_config, their tensors validated against the
// catalogue, their bytes and parameters accounted by compute_model_stats, and their geometry planned by
// model::plan_shape + parallel::make_plan. Presets: tiny in bf16 and fp8, small in bf16.
#include <unistd.h>

#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "io/safetensors.h"
#include "make_tiny/make_tiny.h"
#include "make_tiny/tiny_presets.h"
#include "model/step35_config.h"
#include "model/step35_plan.h"
#include "model/step35_stats.h"
#include "model/step35_weights.h"
#include "parallel/plan.h"

namespace memra::model {
namespace {

namespace fs = std::filesystem;

struct Variant {
    const char *preset;
    const char *dtype;
};

std::string variant_name(const ::testing::TestParamInfo<Variant> &info) {
    return std::string(info.param.preset) + "_" + info.param.dtype;
}

// Every tensor of an opened checkpoint, over all shards.
std::vector<io::TensorInfo> all_tensors(const io::Checkpoint &ckpt) {
    std::vector<io::TensorInfo> out;
    for (size_t s = 0; s < ckpt.n_shards(); ++s) {
        const auto &shard = ckpt.shard(s).tensors();
        out.insert(out.end(), shard.begin(), shard.end());
    }
    return out;
}

// Each variant is generated once per test process (small takes about half a second) into its own temporary
// directory, which the suite removes at the end.
class TinyCheckpointTest : public ::testing::TestWithParam<Variant> {
protected:
    struct Generated {
        fs::path dir;
        tools::TinySummary summary;
    };

    static void SetUpTestSuite() { generated_ = new std::map<std::string, Generated>(); }
    static void TearDownTestSuite() {
        for (const auto &[name, g] : *generated_) {
            std::error_code ec;
            fs::remove_all(g.dir, ec);
        }
        delete generated_;
        generated_ = nullptr;
    }

    void SetUp() override {
        const std::string name = fmt::format("{}_{}", GetParam().preset, GetParam().dtype);
        auto preset = tools::find_tiny_preset(GetParam().preset);
        ASSERT_TRUE(preset.has_value());
        preset_ = *preset;
        auto it = generated_->find(name);
        if (it == generated_->end()) {
            tools::TinyOptions options;
            options.out_dir = fs::temp_directory_path() / fmt::format("memra_tiny_ckpt_{}_{}", ::getpid(), name);
            options.seed = 7;
            options.preset = GetParam().preset;
            options.dtype = GetParam().dtype;
            fs::remove_all(options.out_dir);
            auto summary = tools::make_tiny_checkpoint(options);
            ASSERT_TRUE(summary.has_value()) << summary.error().message;
            it = generated_->emplace(name, Generated{options.out_dir, *summary}).first;
        }
        dir_ = it->second.dir;
        summary_ = it->second.summary;
    }

    bool fp8() const { return std::string(GetParam().dtype) == "fp8"; }

    static std::map<std::string, Generated> *generated_;
    fs::path dir_;
    tools::TinySummary summary_;
    tools::TinyPreset preset_;
};

std::map<std::string, TinyCheckpointTest::Generated> *TinyCheckpointTest::generated_ = nullptr;

TEST_P(TinyCheckpointTest, OpensValidatesAndAccountsConsistently) {
    auto cfg = load_step35_config(dir_);
    ASSERT_TRUE(cfg.has_value()) << cfg.error().message;
    auto ckpt = io::Checkpoint::open(dir_);
    ASSERT_TRUE(ckpt.has_value()) << ckpt.error().message;
    const std::vector<io::TensorInfo> tensors = all_tensors(*ckpt);

    // The generator's config is read back exactly as the preset describes it, with no key left unread.
    EXPECT_TRUE(cfg->unknown_keys.empty()) << fmt::format("{}", fmt::join(cfg->unknown_keys, ", "));
    EXPECT_EQ(cfg->d_model, preset_.d_model);
    EXPECT_EQ(cfg->n_layers, preset_.n_layers);
    EXPECT_EQ(cfg->n_mtp_layers, preset_.n_mtp);
    EXPECT_EQ(cfg->vocab_size, preset_.vocab_size);
    EXPECT_EQ(cfg->n_experts, preset_.n_experts);
    EXPECT_EQ(cfg->d_expert, preset_.d_expert);
    EXPECT_EQ(cfg->is_fp8(), fp8());
    ASSERT_EQ(cfg->layers.size(), static_cast<size_t>(preset_.n_total_layers()));
    for (const LayerGeometry &g : cfg->layers) {
        EXPECT_EQ(g.ffn == FfnKind::kMoe, preset_.is_moe(g.index)) << g.index;
        EXPECT_EQ(g.attn == AttnKind::kFull, preset_.is_full(g.index)) << g.index;
        EXPECT_EQ(g.n_heads, preset_.n_heads(g.index)) << g.index;
        EXPECT_EQ(g.is_mtp, g.index >= preset_.n_layers) << g.index;
    }

    // Every tensor matches the catalogue.
    const ValidationReport report = validate_tensors(*cfg, tensors);
    EXPECT_TRUE(report.ok()) << format_validation_report(report);
    EXPECT_EQ(report.n_found, tensors.size());
    EXPECT_EQ(report.n_expected, tensors.size());
    EXPECT_EQ(ckpt->n_tensors(), summary_.n_tensors);
    EXPECT_EQ(ckpt->n_shards(), summary_.n_shards);
    EXPECT_TRUE(check_tensors(*cfg, tensors).has_value());

    // Bytes: the stats of the real tensor list, the checkpoint's own sum, the generator's summary and the
    // catalogue at released dtypes all agree; parameters agree with the generator's count.
    const ModelStats stats = compute_model_stats(*cfg, tensors);
    EXPECT_EQ(stats.checkpoint_bytes, ckpt->total_bytes());
    EXPECT_EQ(stats.checkpoint_bytes, summary_.tensor_bytes);
    EXPECT_EQ(stats.expected_bytes, ckpt->total_bytes());
    EXPECT_EQ(static_cast<uint64_t>(stats.total_params), summary_.n_params);
    EXPECT_EQ(stats.total_params, stats.trunk_params + stats.mtp_params);
    EXPECT_EQ(stats.bytes_by_dtype.count(DType::kF8E4M3), fp8() ? 1u : 0u);
    if (fp8()) {
        // 1 byte per routed expert parameter.
        EXPECT_EQ(stats.bytes_by_dtype.at(DType::kF8E4M3), static_cast<uint64_t>(stats.routed_expert_params));
    }
}

TEST_P(TinyCheckpointTest, Fp8TensorsAreExactlyTheRoutedExperts) {
    auto cfg = load_step35_config(dir_);
    ASSERT_TRUE(cfg.has_value()) << cfg.error().message;
    auto ckpt = io::Checkpoint::open(dir_);
    ASSERT_TRUE(ckpt.has_value()) << ckpt.error().message;

    std::set<std::string> routed;  // catalogue names of the routed-expert weights
    std::set<std::string> scales;  // their block-scale companions (FP8 only)
    for (const ExpectedTensor &e : expected_tensors(*cfg)) {
        if (e.role == TensorRole::kRoutedExperts) routed.insert(e.name);
        if (e.role == TensorRole::kFp8Scale) scales.insert(e.name);
    }
    const size_t n_moe = preset_.moe_layers.size();
    ASSERT_EQ(routed.size(), 3 * n_moe);  // gate, up, down per MoE layer

    std::set<std::string> f8_in_file;
    std::set<std::string> scale_in_file;
    for (const io::TensorInfo &t : all_tensors(*ckpt)) {
        if (t.dtype == DType::kF8E4M3) f8_in_file.insert(t.name);
        if (t.name.ends_with(kFp8ScaleSuffix)) {
            scale_in_file.insert(t.name);
            EXPECT_EQ(t.dtype, DType::kF32) << t.name;
        }
    }
    const ValidationReport report = validate_tensors(*cfg, all_tensors(*ckpt));
    const std::set<std::string> reported(report.fp8_tensors.begin(), report.fp8_tensors.end());
    if (fp8()) {
        EXPECT_EQ(f8_in_file, routed);
        EXPECT_EQ(reported, routed);
        EXPECT_EQ(scale_in_file, scales);
        EXPECT_EQ(scales.size(), routed.size());
        for (const std::string &w : routed) {
            EXPECT_EQ(scale_in_file.count(w + std::string(kFp8ScaleSuffix)), 1u) << w;
        }
    } else {
        EXPECT_TRUE(f8_in_file.empty());
        EXPECT_TRUE(reported.empty());
        EXPECT_TRUE(scale_in_file.empty());
        EXPECT_TRUE(scales.empty());
    }
}

TEST_P(TinyCheckpointTest, PlansAtEveryDegree) {
    auto cfg = load_step35_config(dir_);
    ASSERT_TRUE(cfg.has_value()) << cfg.error().message;
    const parallel::ModelShape shape = plan_shape(*cfg);
    ASSERT_EQ(shape.layers.size(), cfg->layers.size());
    for (size_t i = 0; i < shape.layers.size(); ++i) {
        EXPECT_EQ(shape.layers[i].fp8_experts, fp8() && shape.layers[i].moe) << i;
    }

    // Every degree plans, fp8 experts included: routed experts stay whole on their owners, so no scale tile
    // is ever cut.
    for (int tp : {1, 2, 4, 8}) {
        parallel::PlanRequest request;
        request.tp = tp;
        request.devices_available = tp;
        auto plan = parallel::make_plan(shape, request);
        ASSERT_TRUE(plan.has_value()) << "tp " << tp << ": " << plan.error().message;
        EXPECT_EQ(plan->n_ranks, tp);
        ASSERT_EQ(plan->ranks.size(), static_cast<size_t>(tp));
        for (const parallel::RankPlan &rank : plan->ranks) {
            ASSERT_EQ(rank.layers.size(), cfg->layers.size());
            for (const parallel::RankLayerPlan &l : rank.layers) {
                const LayerGeometry &g = cfg->layers[static_cast<size_t>(l.layer)];
                EXPECT_EQ(l.q_heads.size(), g.n_heads / tp);
                if (g.ffn != FfnKind::kMoe) continue;
                EXPECT_EQ(l.experts.size(), g.n_experts / tp);
                EXPECT_EQ(l.experts.begin, rank.tp_rank * g.n_experts / tp);
            }
        }
        EXPECT_FALSE(parallel::format_plan(*plan, shape).empty());
    }
}

INSTANTIATE_TEST_SUITE_P(Generated, TinyCheckpointTest,
                         ::testing::Values(Variant{"tiny", "bf16"}, Variant{"tiny", "fp8"}, Variant{"small", "bf16"}),
                         variant_name);

}  // namespace
}  // namespace memra::model
