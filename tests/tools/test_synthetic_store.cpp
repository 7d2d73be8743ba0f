// The synthetic store (tools/make_tiny/synthetic_store.h): the same tensors as make-tiny (names, dtypes, shapes,
// order and bytes, on disk and in memory) for several presets, formats and overrides, whatever the thread count;
// its memory rule (a tensor held while a get is not released, the FP8 halves together); the make-tiny config; and
// the Step-3.5-E128 catalogue, counted without generating any tensor.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "io/safetensors.h"
#include "make_tiny/make_tiny.h"
#include "make_tiny/synthetic_store.h"
#include "make_tiny/tiny_weights.h"
#include "model/step35_config.h"

namespace memra::tools {
namespace {

namespace fs = std::filesystem;

struct Case {
    const char *label;
    TinyOptions options;
    bool on_disk;  // also compared with the files make-tiny writes
};

TinyOptions opts(const char *preset, const char *dtype, uint64_t seed) {
    TinyOptions o;
    o.preset = preset;
    o.dtype = dtype;
    o.seed = seed;
    return o;
}

std::vector<Case> cases() {
    std::vector<Case> out = {
        {"tiny_bf16", opts("tiny", "bf16", 7), true},
        {"tiny_fp8", opts("tiny", "fp8", 7), true},
        {"small_bf16", opts("small", "bf16", 3), false},
        {"small_fp8", opts("small", "fp8", 3), false},
    };
    // Every override at once, with an expert width (200) that leaves partial FP8 blocks.
    TinyOptions o = opts("tiny", "fp8", 11);
    o.experts = 12;
    o.layers = 5;
    o.mtp_layers = 2;
    o.moe_intermediate_size = 200;
    o.sliding_window = 24;
    out.push_back({"tiny_fp8_overrides", o, true});
    return out;
}

std::string read_file(const fs::path &p) {
    std::ifstream f(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

bool same_bytes(std::span<const std::byte> a, std::span<const std::byte> b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size()) == 0;
}

TEST(SyntheticStore, EveryTensorIsMakeTinysInOrderWithTheSameBytes) {
    for (const Case &c : cases()) {
        SCOPED_TRACE(c.label);
        auto model = resolve_tiny_model(c.options, "test");
        ASSERT_TRUE(model.has_value()) << model.error().message;
        const SyntheticStore store(model->preset, c.options.seed, model->fp8, 3);
        const std::vector<io::TensorData> expected = make_tiny_tensors(model->preset, c.options.seed, model->fp8);
        ASSERT_EQ(store.tensors().size(), expected.size());
        ASSERT_EQ(store.n_tensors(), expected.size());
        uint64_t total = 0;
        for (size_t i = 0; i < expected.size(); ++i) {
            const io::TensorInfo &info = store.tensors()[i].info;
            EXPECT_EQ(info.name, expected[i].name) << i;
            EXPECT_EQ(info.dtype, expected[i].dtype) << info.name;
            EXPECT_EQ(info.shape, expected[i].shape) << info.name;
            EXPECT_EQ(store.find(info.name), &info) << info.name;
            auto ref = store.get(info.name);
            ASSERT_TRUE(ref.has_value()) << ref.error().message;
            EXPECT_TRUE(same_bytes(ref->bytes, expected[i].bytes)) << info.name;
            store.release(info.name);
            total += expected[i].bytes.size();
        }
        EXPECT_EQ(store.total_bytes(), total);
        std::vector<std::string> sorted;
        for (const io::TensorData &t : expected) sorted.push_back(t.name);
        std::sort(sorted.begin(), sorted.end());
        EXPECT_EQ(store.names(), sorted);
        EXPECT_EQ(store.stats().held_bytes, 0u) << "every get was released";
    }
}

TEST(SyntheticStore, MatchesTheCheckpointMakeTinyWritesAndItsConfig) {
    const fs::path root = fs::temp_directory_path() / fmt::format("memra_synthetic_store_{}", ::getpid());
    for (const Case &c : cases()) {
        if (!c.on_disk) continue;
        SCOPED_TRACE(c.label);
        TinyOptions o = c.options;
        o.out_dir = root / c.label;
        o.force = true;
        auto summary = make_tiny_checkpoint(o);
        ASSERT_TRUE(summary.has_value()) << summary.error().message;
        auto ckpt = io::Checkpoint::open(o.out_dir);
        ASSERT_TRUE(ckpt.has_value()) << ckpt.error().message;
        auto model = resolve_tiny_model(c.options, "test");
        ASSERT_TRUE(model.has_value()) << model.error().message;
        const SyntheticStore store(model->preset, c.options.seed, model->fp8, 2);
        EXPECT_EQ(store.names(), ckpt->names());
        EXPECT_EQ(store.total_bytes(), ckpt->total_bytes());
        for (const std::string &name : ckpt->names()) {
            auto want = ckpt->get(name);
            auto got = store.get(name);
            ASSERT_TRUE(want.has_value() && got.has_value()) << name;
            EXPECT_EQ(got->info->dtype, want->info->dtype) << name;
            EXPECT_EQ(got->info->shape, want->info->shape) << name;
            EXPECT_TRUE(same_bytes(got->bytes, want->bytes)) << name;
            store.release(name);
        }
        // The config the synthetic model is validated with is the file make-tiny writes.
        EXPECT_EQ(store.config_json(), read_file(o.out_dir / "config.json"));
    }
    std::error_code ec;
    fs::remove_all(root, ec);
}

TEST(SyntheticStore, BytesDoNotDependOnTheThreadCount) {
    auto model = resolve_tiny_model(opts("small", "fp8", 5), "test");
    ASSERT_TRUE(model.has_value());
    const SyntheticStore one(model->preset, 5, true, 1);
    const SyntheticStore four(model->preset, 5, true, 4);
    for (const TinyTensor &t : one.tensors()) {
        auto a = one.get(t.info.name);
        auto b = four.get(t.info.name);
        ASSERT_TRUE(a.has_value() && b.has_value());
        EXPECT_TRUE(same_bytes(a->bytes, b->bytes)) << t.info.name;
        one.release(t.info.name);
        four.release(t.info.name);
    }
    EXPECT_EQ(one.stats().threads, 1);
    EXPECT_EQ(four.stats().threads, 4);
}

// A tensor is held while some get of it is not released; an FP8 tensor's codes and scales are generated together
// and the second half goes when the first is released and nobody holds it; a freed tensor comes back the same.
TEST(SyntheticStore, HoldsATensorUntilEveryGetIsReleased) {
    auto model = resolve_tiny_model(opts("tiny", "fp8", 7), "test");
    ASSERT_TRUE(model.has_value());
    const SyntheticStore store(model->preset, 7, true, 2);
    EXPECT_EQ(store.stats().bytes, 0u) << "nothing is generated before a get";
    const std::string codes = "model.layers.2.moe.up_proj.weight";
    const std::string scales = codes + "_scale_inv";
    const uint64_t codes_bytes = store.find(codes)->n_bytes();
    const uint64_t scales_bytes = store.find(scales)->n_bytes();

    auto first = store.get(codes);
    ASSERT_TRUE(first.has_value());
    const std::vector<std::byte> copy(first->bytes.begin(), first->bytes.end());
    EXPECT_EQ(store.stats().held_bytes, codes_bytes + scales_bytes) << "codes and scales come out of one pass";
    EXPECT_EQ(store.stats().tensors, 2u);
    auto second = store.get(codes);
    auto scale_ref = store.get(scales);
    ASSERT_TRUE(second.has_value() && scale_ref.has_value());
    EXPECT_EQ(second->bytes.data(), first->bytes.data()) << "a held tensor is not generated again";
    EXPECT_EQ(store.stats().tensors, 2u);
    store.release(codes);
    EXPECT_EQ(store.stats().held_bytes, codes_bytes + scales_bytes) << "one get of the codes is still out";
    store.release(codes);
    EXPECT_EQ(store.stats().held_bytes, scales_bytes) << "the scales are still held";
    store.release(scales);
    EXPECT_EQ(store.stats().held_bytes, 0u);
    store.release(scales);  // more releases than gets, and unknown names, change nothing
    store.release("nope");
    EXPECT_EQ(store.stats().held_bytes, 0u);

    // The codes alone: their scales (generated with them, never asked for) go with them.
    auto again = store.get(codes);
    ASSERT_TRUE(again.has_value());
    EXPECT_TRUE(same_bytes(again->bytes, copy)) << "regenerated bytes equal the first ones";
    store.release(codes);
    EXPECT_EQ(store.stats().held_bytes, 0u);
    EXPECT_EQ(store.stats().peak_held_bytes, codes_bytes + scales_bytes);

    // The scales while their codes are held: the held codes keep their bytes (and address).
    auto held = store.get(codes);
    const std::byte *address = held->bytes.data();
    store.release(scales);
    EXPECT_EQ(store.stats().held_bytes, codes_bytes + scales_bytes) << "the scales of held codes stay";
    auto scales_again = store.get(scales);
    ASSERT_TRUE(scales_again.has_value());
    EXPECT_EQ(store.get(codes)->bytes.data(), address);

    auto missing = store.get("model.layers.99.mlp.up_proj.weight");
    ASSERT_FALSE(missing.has_value());
    EXPECT_EQ(missing.error().message,
              "synthetic tiny: tensor 'model.layers.99.mlp.up_proj.weight' not found in the model");
}

TEST(SyntheticStore, UnknownPresetAndBadOverridesNameTheCaller) {
    auto bad = resolve_tiny_model(opts("huge", "bf16", 0), "--synthetic");
    ASSERT_FALSE(bad.has_value());
    EXPECT_EQ(bad.error().message, "--synthetic: unknown preset 'huge' (valid presets: tiny, small, release, e128)");
    TinyOptions o = opts("tiny", "bf16", 0);
    o.experts = 4;
    auto few = resolve_tiny_model(o, "--synthetic");
    ASSERT_FALSE(few.has_value());
    EXPECT_EQ(few.error().message,
              "--synthetic: experts must be in [8, 512] (top-k .. max; 0 keeps the preset's 16), found 4");
    // make-tiny will not try to hold a synthetic-only preset in memory.
    TinyOptions e = opts("e128", "fp8", 0);
    e.out_dir = fs::temp_directory_path() / fmt::format("memra_synthetic_e128_{}", ::getpid());
    auto refused = make_tiny_checkpoint(e);
    ASSERT_FALSE(refused.has_value());
    EXPECT_NE(refused.error().message.find("make-tiny: preset e128 is "), std::string::npos) << refused.error().message;
    EXPECT_NE(refused.error().message.find("memra bench --synthetic e128"), std::string::npos);
    EXPECT_FALSE(fs::exists(e.out_dir));
}

// Step-3.5-E128 (PERFORMANCE.md section 8): the release architecture of STEP35.md with 128 routed experts. Its
// catalogue is counted here from the architecture, independently of the generator, and nothing is generated.
TEST(SyntheticStore, E128CatalogueIsTheReleaseArchitectureWith128Experts) {
    auto model = resolve_tiny_model(opts("e128", "fp8", 0), "test");
    ASSERT_TRUE(model.has_value());
    const TinyPreset &p = model->preset;
    const SyntheticStore store(p, 0, true, 1);
    auto cfg = model::parse_step35_config(store.config_json());
    ASSERT_TRUE(cfg.has_value()) << cfg.error().message;
    EXPECT_EQ(cfg->n_layers, 45);
    EXPECT_EQ(cfg->n_mtp_layers, 3);
    EXPECT_EQ(cfg->d_model, 4096);
    EXPECT_EQ(cfg->vocab_size, 128896);
    EXPECT_EQ(cfg->context_length, 262144);
    EXPECT_TRUE(cfg->is_fp8());
    int moe = 0, full = 0;
    for (const model::LayerGeometry &g : cfg->layers) {
        if (g.ffn == model::FfnKind::kMoe) {
            ++moe;
            EXPECT_EQ(g.n_experts, 128);
            EXPECT_EQ(g.top_k, 8);
            EXPECT_EQ(g.d_expert, 1280);
        }
        if (g.attn == model::AttnKind::kFull) ++full;
    }
    EXPECT_EQ(moe, 42);
    EXPECT_EQ(full, 12);
    EXPECT_EQ(p.swiglu_limits[43], 7.0);
    EXPECT_EQ(p.swiglu_limits[44], 7.0);
    EXPECT_EQ(p.swiglu_limits_shared[44], 16.0);

    // Bytes from the architecture: BF16 everything but the routed experts (FP8 + f32 128x128 block scales).
    const int64_t d = 4096, hd = 128, kv = 8 * hd, vocab = 128896, dff = 11264, de = 1280, e = 128;
    const auto attn = [&](int64_t heads) { return 2 * (2 * heads * hd * d + 2 * kv * d + heads * d + 2 * hd + 2 * d); };
    const int64_t dense_mlp = 2 * 3 * dff * d;
    const int64_t scales = 4 * e * (10 * 32 + 10 * 32 + 32 * 10);  // gate/up [1280, 4096], down [4096, 1280]
    const int64_t moe_ffn = 2 * (e * d + 3 * de * d) + 4 * e + 3 * e * de * d + scales;
    int64_t trunk = 0;
    for (int64_t l = 0; l < 45; ++l) trunk += attn(l % 4 == 0 ? 64 : 96) + (l < 3 ? dense_mlp : moe_ffn);
    const int64_t mtp = 3 * (attn(96) + dense_mlp + 2 * (2 * d * d + 2 * d + vocab * d + d));
    const int64_t ends = 2 * (2 * vocab * d + d);
    EXPECT_EQ(store.total_bytes(), static_cast<uint64_t>(trunk + mtp + ends));
    // 1 embedding + 3 dense layers x 12 + 42 MoE layers x 20 + 3 MTP layers x 17 + final norm and lm_head.
    EXPECT_EQ(store.n_tensors(), 930u);
    EXPECT_EQ(store.stats().bytes, 0u) << "counting generates nothing";

    const double gb = 1e-9 * static_cast<double>(store.total_bytes());
    const double trunk_gb = 1e-9 * static_cast<double>(trunk + ends);
    const SyntheticStore bf16(p, 0, false, 1);
    std::printf("Step-3.5-E128: %zu tensors, %.2f GB official layout (fp8 routed experts), %.2f GB without the 3 "
                "MTP layers; %.2f GB bf16\n",
                store.n_tensors(), gb, trunk_gb, 1e-9 * static_cast<double>(bf16.total_bytes()));
    // PERFORMANCE.md's 98.0 GB (official layout) is the model without its MTP layers; they add 3 x 1.6 GB.
    EXPECT_NEAR(trunk_gb, 98.0, 0.1);
    EXPECT_NEAR(gb, trunk_gb + 3 * 1.62, 0.05);
}

}  // namespace
}  // namespace memra::tools
