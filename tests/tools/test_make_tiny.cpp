// Tests of the tiny-checkpoint generator: byte-identical output per seed, what a seed or the dtype
// may change, refusals and the force rules, the layout of the tensors, the exact integer RNG
// constants, and the BPE trainer (merge order, tie rule, vocabulary invariants).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/float_formats.h"
#include "core/fp8_block.h"
#include "io/safetensors.h"
#include "make_tiny/bpe_trainer.h"
#include "make_tiny/make_tiny.h"
#include "make_tiny/tiny_presets.h"
#include "make_tiny/tiny_tokenizer.h"
#include "make_tiny/tiny_weights.h"
#include "model/step35_config.h"

namespace memra::tools {
namespace {

namespace fs = std::filesystem;

// A fresh scratch directory per test, removed afterwards (it is the test's own directory).
class MakeTinyTest : public ::testing::Test {
protected:
    void SetUp() override {
        const auto *info = ::testing::UnitTest::GetInstance()->current_test_info();
        root_ = fs::temp_directory_path() /
                fmt::format("memra_make_tiny_{}_{}_{}", ::getpid(), info->test_suite_name(), info->name());
        fs::remove_all(root_);
        fs::create_directories(root_);
    }
    void TearDown() override { fs::remove_all(root_); }

    fs::path root_;
};

std::string read_file(const fs::path &p) {
    std::ifstream f(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void write_file(const fs::path &p, const std::string &text) {
    std::ofstream f(p, std::ios::binary);
    f << text;
}

std::vector<std::string> dir_names(const fs::path &dir) {
    std::vector<std::string> names;
    for (const auto &e : fs::directory_iterator(dir)) {
        names.push_back(e.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
}

TinySummary generate(const fs::path &dir, uint64_t seed, const std::string &dtype = "bf16", bool force = false) {
    TinyOptions o;
    o.out_dir = dir;
    o.seed = seed;
    o.dtype = dtype;
    o.force = force;
    auto r = make_tiny_checkpoint(o);
    EXPECT_TRUE(r.has_value()) << (r ? "" : r.error().message);
    return r ? *r : TinySummary{};
}

io::Checkpoint open_checkpoint(const fs::path &dir) {
    auto ck = io::Checkpoint::open(dir);
    EXPECT_TRUE(ck.has_value()) << (ck ? "" : ck.error().message);
    return std::move(*ck);
}

bool is_routed_expert(const std::string &name) {
    return name.find(".moe.gate_proj.weight") != std::string::npos ||
           name.find(".moe.up_proj.weight") != std::string::npos ||
           name.find(".moe.down_proj.weight") != std::string::npos;
}

std::vector<std::byte> tensor_bytes(const io::Checkpoint &ck, const std::string &name) {
    auto ref = ck.get(name);
    EXPECT_TRUE(ref.has_value()) << name;
    return {ref->bytes.begin(), ref->bytes.end()};
}

// ---- determinism and what may change ----

TEST_F(MakeTinyTest, SameSeedGivesByteIdenticalFiles) {
    TinySummary a = generate(root_ / "a", 7);
    TinySummary b = generate(root_ / "b", 7);
    ASSERT_EQ(a.files, b.files);
    ASSERT_EQ(a.files, dir_names(root_ / "a"));
    for (const std::string &f : a.files) {
        EXPECT_EQ(read_file(root_ / "a" / f), read_file(root_ / "b" / f)) << f;
    }
    // Only the checkpoint directories: no staging directory is left next to them.
    EXPECT_EQ(dir_names(root_), (std::vector<std::string>{"a", "b"}));
}

TEST_F(MakeTinyTest, SummaryDescribesTheCheckpoint) {
    TinySummary s = generate(root_ / "m", 7);
    EXPECT_EQ(s.out_dir, root_ / "m");
    EXPECT_GE(s.n_shards, 3u);
    EXPECT_EQ(s.n_tensors, 112u);
    EXPECT_EQ(s.real_token_count, 739);
    EXPECT_EQ(s.vocab_size, 1024);
    EXPECT_EQ(s.tensor_bytes, 2 * s.n_params + 4 * 16 * 2);  // bf16, except 4 F32 router biases of 16
    io::Checkpoint ck = open_checkpoint(root_ / "m");
    EXPECT_EQ(ck.n_shards(), s.n_shards);
    EXPECT_EQ(ck.n_tensors(), s.n_tensors);
    EXPECT_EQ(ck.total_bytes(), s.tensor_bytes);
    uint64_t file_bytes = 0;
    for (const std::string &f : s.files) {
        file_bytes += fs::file_size(root_ / "m" / f);
    }
    EXPECT_EQ(s.total_bytes, file_bytes);
    std::vector<std::string> expected_text = {"config.json", "generation_config.json", "model.safetensors.index.json",
                                              "tokenizer.json", "tokenizer_config.json"};
    for (const std::string &f : expected_text) {
        EXPECT_TRUE(std::find(s.files.begin(), s.files.end(), f) != s.files.end()) << f;
    }
}

TEST_F(MakeTinyTest, OtherSeedChangesEveryWeightButNotConfigOrTokenizer) {
    generate(root_ / "s7", 7);
    generate(root_ / "s8", 8);
    for (const char *f : {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                          "model.safetensors.index.json"}) {
        EXPECT_EQ(read_file(root_ / "s7" / f), read_file(root_ / "s8" / f)) << f;
    }
    io::Checkpoint a = open_checkpoint(root_ / "s7");
    io::Checkpoint b = open_checkpoint(root_ / "s8");
    ASSERT_EQ(a.names(), b.names());
    for (const std::string &name : a.names()) {
        EXPECT_NE(tensor_bytes(a, name), tensor_bytes(b, name)) << name;
    }
}

TEST_F(MakeTinyTest, Fp8DiffersOnlyInRoutedExpertsScalesAndQuantizationConfig) {
    generate(root_ / "bf16", 7, "bf16");
    generate(root_ / "fp8", 7, "fp8");
    for (const char *f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}) {
        EXPECT_EQ(read_file(root_ / "bf16" / f), read_file(root_ / "fp8" / f)) << f;
    }
    auto cb = nlohmann::json::parse(read_file(root_ / "bf16" / "config.json"));
    auto cf = nlohmann::json::parse(read_file(root_ / "fp8" / "config.json"));
    ASSERT_TRUE(cf.contains("quantization_config"));
    EXPECT_EQ(cf["quantization_config"], nlohmann::json::parse(R"({"activation_scheme": "dynamic", "fmt": "e4m3",
        "quant_method": "fp8", "weight_block_size": [128, 128]})"));
    EXPECT_FALSE(cb.contains("quantization_config"));
    cf.erase("quantization_config");
    EXPECT_EQ(cb, cf);

    io::Checkpoint b = open_checkpoint(root_ / "bf16");
    io::Checkpoint f = open_checkpoint(root_ / "fp8");
    std::set<std::string> fp8_names;
    for (const std::string &n : f.names()) {
        fp8_names.insert(n);
    }
    size_t n_experts_seen = 0;
    for (const std::string &name : b.names()) {
        ASSERT_TRUE(fp8_names.count(name)) << name;
        fp8_names.erase(name);
        const io::TensorInfo *ib = b.find(name);
        const io::TensorInfo *ifp = f.find(name);
        EXPECT_EQ(ib->shape, ifp->shape) << name;
        if (!is_routed_expert(name)) {
            EXPECT_EQ(ib->dtype, ifp->dtype) << name;
            EXPECT_EQ(tensor_bytes(b, name), tensor_bytes(f, name)) << name;
            continue;
        }
        ++n_experts_seen;
        EXPECT_EQ(ib->dtype, DType::kBF16) << name;
        EXPECT_EQ(ifp->dtype, DType::kF8E4M3) << name;
        const io::TensorInfo *is = f.find(name + "_scale_inv");
        ASSERT_NE(is, nullptr) << name;
        fp8_names.erase(name + "_scale_inv");
        EXPECT_EQ(is->dtype, DType::kF32);
        EXPECT_EQ(is->shape, (std::vector<int64_t>{ib->shape[0], fp8_scale_blocks(ib->shape[1]),
                                                   fp8_scale_blocks(ib->shape[2])}))
            << name;
    }
    EXPECT_EQ(n_experts_seen, 12u);  // 4 MoE layers x {gate, up, down}
    EXPECT_TRUE(fp8_names.empty()) << *fp8_names.begin();
}

// The FP8 experts quantize exactly the BF16 weights of the same seed: dequantized, every element is
// within e4m3 precision (half an ulp: 2^-4 relative, or 2^-10 of the block scale when subnormal).
TEST_F(MakeTinyTest, Fp8DequantizesToTheBf16WeightsOfTheSameSeed) {
    generate(root_ / "bf16", 7, "bf16");
    generate(root_ / "fp8", 7, "fp8");
    io::Checkpoint b = open_checkpoint(root_ / "bf16");
    io::Checkpoint f = open_checkpoint(root_ / "fp8");
    for (const char *name : {"model.layers.4.moe.up_proj.weight", "model.layers.5.moe.down_proj.weight"}) {
        const io::TensorInfo *info = b.find(name);
        ASSERT_NE(info, nullptr);
        int64_t n_experts = info->shape[0], rows = info->shape[1], cols = info->shape[2];
        auto wb = b.get(name)->as<uint16_t>();
        auto q = f.get(name)->as<uint8_t>();
        auto s = f.get(std::string(name) + "_scale_inv")->as<float>();
        ASSERT_TRUE(wb && q && s);
        int64_t n_scales = fp8_scale_blocks(rows) * fp8_scale_blocks(cols);
        std::vector<float> deq(static_cast<size_t>(rows * cols));
        for (int64_t e = 0; e < n_experts; ++e) {
            dequantize_fp8_block(q->data() + e * rows * cols, rows, cols, s->data() + e * n_scales, deq.data());
            for (int64_t r = 0; r < rows; ++r) {
                for (int64_t c = 0; c < cols; ++c) {
                    float w = bf16_to_f32((*wb)[static_cast<size_t>(e * rows * cols + r * cols + c)]);
                    int64_t block = (r / 128) * fp8_scale_blocks(cols) + c / 128;
                    float scale = (*s)[static_cast<size_t>(e * n_scales + block)];
                    float d = deq[static_cast<size_t>(r * cols + c)];
                    ASSERT_LE(std::fabs(d - w), std::max(std::fabs(w) * 0.0625f, scale * 0x1p-10f))
                        << name << " expert " << e << " (" << r << ", " << c << ")";
                }
            }
        }
    }
}

// ---- refusals and the force rules ----

TEST_F(MakeTinyTest, RefusesUnknownPresetListingTheValidOnes) {
    TinyOptions o;
    o.out_dir = root_ / "x";
    o.preset = "huge";
    auto r = make_tiny_checkpoint(o);
    ASSERT_FALSE(r.has_value());
    EXPECT_NE(r.error().message.find("unknown preset 'huge'"), std::string::npos) << r.error().message;
    EXPECT_NE(r.error().message.find("tiny, small"), std::string::npos) << r.error().message;
    EXPECT_FALSE(fs::exists(root_ / "x"));
}

TEST_F(MakeTinyTest, RefusesUnknownDtype) {
    TinyOptions o;
    o.out_dir = root_ / "x";
    o.dtype = "fp16";
    auto r = make_tiny_checkpoint(o);
    ASSERT_FALSE(r.has_value());
    EXPECT_NE(r.error().message.find("unknown dtype 'fp16'"), std::string::npos) << r.error().message;
    EXPECT_NE(r.error().message.find("bf16, fp8"), std::string::npos) << r.error().message;
    EXPECT_FALSE(fs::exists(root_ / "x"));
}

TEST_F(MakeTinyTest, RefusesAnEmptyPathAndAFile) {
    TinyOptions o;
    auto r = make_tiny_checkpoint(o);
    ASSERT_FALSE(r.has_value());
    EXPECT_NE(r.error().message.find("no output directory"), std::string::npos) << r.error().message;

    write_file(root_ / "file", "data");
    o.out_dir = root_ / "file";
    o.force = true;
    r = make_tiny_checkpoint(o);
    ASSERT_FALSE(r.has_value());
    EXPECT_NE(r.error().message.find("is not a directory"), std::string::npos) << r.error().message;
    EXPECT_EQ(read_file(root_ / "file"), "data");
}

TEST_F(MakeTinyTest, RefusesNonEmptyDirectoryWithoutForce) {
    fs::create_directories(root_ / "m");
    write_file(root_ / "m" / "notes.txt", "mine");
    TinyOptions o;
    o.out_dir = root_ / "m";
    auto r = make_tiny_checkpoint(o);
    ASSERT_FALSE(r.has_value());
    EXPECT_NE(r.error().message.find("is not empty"), std::string::npos) << r.error().message;
    EXPECT_NE(r.error().message.find("--force"), std::string::npos) << r.error().message;
    EXPECT_EQ(dir_names(root_ / "m"), std::vector<std::string>{"notes.txt"});
    EXPECT_EQ(read_file(root_ / "m" / "notes.txt"), "mine");
}

TEST_F(MakeTinyTest, AcceptsAnExistingEmptyDirectory) {
    fs::create_directories(root_ / "m");
    TinySummary s = generate(root_ / "m", 3);
    EXPECT_EQ(dir_names(root_ / "m"), s.files);
    generate(root_ / "ref", 3);
    for (const std::string &f : s.files) {
        EXPECT_EQ(read_file(root_ / "m" / f), read_file(root_ / "ref" / f)) << f;
    }
}

TEST_F(MakeTinyTest, ForceReplacesOnlyGeneratorFiles) {
    const fs::path m = root_ / "m";
    fs::create_directories(m / "sub");
    fs::create_directories(m / "keep.safetensors");  // a directory, not a generator file
    write_file(m / "notes.txt", "mine");
    write_file(m / "sub" / "model-00001-of-00001.safetensors", "nested, not ours to touch");
    write_file(m / "config.json", "{\"old\": true}");
    write_file(m / "model-00001-of-00009.safetensors", "stale shard");
    write_file(m / "model-00009-of-00009.safetensors", "stale shard");
    write_file(m / "model.safetensors", "a stale single-file checkpoint");
    write_file(m / "special_tokens_map.json", "{}");

    TinySummary s = generate(m, 7, "fp8", /*force=*/true);
    std::vector<std::string> expected = s.files;
    for (const char *f : {"keep.safetensors", "notes.txt", "special_tokens_map.json", "sub"}) {
        expected.emplace_back(f);
    }
    std::sort(expected.begin(), expected.end());
    EXPECT_EQ(dir_names(m), expected);
    EXPECT_EQ(read_file(m / "notes.txt"), "mine");
    EXPECT_EQ(read_file(m / "special_tokens_map.json"), "{}");
    EXPECT_EQ(read_file(m / "sub" / "model-00001-of-00001.safetensors"), "nested, not ours to touch");
    EXPECT_TRUE(fs::is_directory(m / "keep.safetensors"));

    generate(root_ / "ref", 7, "fp8");
    for (const std::string &f : s.files) {
        EXPECT_EQ(read_file(m / f), read_file(root_ / "ref" / f)) << f;
    }
    EXPECT_TRUE(io::Checkpoint::open(m).has_value());
}

TEST_F(MakeTinyTest, ForceOverAnOlderCheckpointDropsItsExtraShards) {
    const fs::path m = root_ / "m";
    TinyOptions o;
    o.out_dir = m;
    o.preset = "tiny";
    ASSERT_TRUE(make_tiny_checkpoint(o).has_value());
    write_file(m / "model-00042-of-00042.safetensors", "left over");
    o.dtype = "fp8";  // fewer shards than bf16
    o.force = true;
    auto r = make_tiny_checkpoint(o);
    ASSERT_TRUE(r.has_value()) << r.error().message;
    EXPECT_EQ(dir_names(m), r->files);
    auto ck = io::Checkpoint::open(m);
    ASSERT_TRUE(ck.has_value()) << ck.error().message;
    EXPECT_EQ(ck->n_shards(), r->n_shards);
}

TEST_F(MakeTinyTest, ReportsADirectoryThatCannotBeCreated) {
    write_file(root_ / "plain_file", "x");
    TinyOptions o;
    o.out_dir = root_ / "plain_file" / "model";
    auto r = make_tiny_checkpoint(o);
    ASSERT_FALSE(r.has_value());
    EXPECT_NE(r.error().message.find("cannot create"), std::string::npos) << r.error().message;
    EXPECT_NE(r.error().message.find("plain_file"), std::string::npos) << r.error().message;
    EXPECT_EQ(dir_names(root_), std::vector<std::string>{"plain_file"});
}

TEST_F(MakeTinyTest, TrailingSeparatorNamesTheSameDirectory) {
    TinyOptions o;
    o.out_dir = (root_ / "m").string() + "/";
    auto r = make_tiny_checkpoint(o);
    ASSERT_TRUE(r.has_value()) << r.error().message;
    EXPECT_EQ(r->out_dir, root_ / "m");
    EXPECT_EQ(dir_names(root_), std::vector<std::string>{"m"});
}

// ---- layout ----

TEST_F(MakeTinyTest, TinyLayoutFollowsTheOfficialNamesAndShapes) {
    generate(root_ / "m", 1);
    io::Checkpoint ck = open_checkpoint(root_ / "m");
    auto expect = [&](const std::string &name, DType dtype, std::vector<int64_t> shape) {
        const io::TensorInfo *t = ck.find(name);
        ASSERT_NE(t, nullptr) << name;
        EXPECT_EQ(t->dtype, dtype) << name;
        EXPECT_EQ(t->shape, shape) << name;
    };
    expect("model.embed_tokens.weight", DType::kBF16, {1024, 256});
    expect("lm_head.weight", DType::kBF16, {1024, 256});
    expect("model.norm.weight", DType::kBF16, {256});
    expect("model.layers.0.self_attn.q_proj.weight", DType::kBF16, {256, 256});  // full: 8 heads x 32
    expect("model.layers.0.self_attn.g_proj.weight", DType::kBF16, {8, 256});
    expect("model.layers.1.self_attn.q_proj.weight", DType::kBF16, {512, 256});  // sliding: 16 heads x 32
    expect("model.layers.1.self_attn.k_proj.weight", DType::kBF16, {64, 256});
    expect("model.layers.1.self_attn.o_proj.weight", DType::kBF16, {256, 512});
    expect("model.layers.1.self_attn.q_norm.weight", DType::kBF16, {32});
    expect("model.layers.1.mlp.down_proj.weight", DType::kBF16, {256, 512});
    expect("model.layers.2.moe.gate.weight", DType::kBF16, {16, 256});
    expect("model.layers.2.moe.router_bias", DType::kF32, {16});
    expect("model.layers.4.moe.gate_proj.weight", DType::kBF16, {16, 96, 256});
    expect("model.layers.4.moe.down_proj.weight", DType::kBF16, {16, 256, 96});
    expect("model.layers.5.share_expert.up_proj.weight", DType::kBF16, {64, 256});
    expect("model.layers.6.eh_proj.weight", DType::kBF16, {256, 512});
    expect("model.layers.6.enorm.weight", DType::kBF16, {256});
    expect("model.layers.6.transformer.shared_head.output.weight", DType::kBF16, {1024, 256});
    expect("model.layers.6.mlp.gate_proj.weight", DType::kBF16, {512, 256});
    expect("model.layers.6.self_attn.q_proj.weight", DType::kBF16, {512, 256});
    EXPECT_EQ(ck.find("model.layers.1.moe.gate.weight"), nullptr);
    EXPECT_EQ(ck.find("model.layers.2.mlp.gate_proj.weight"), nullptr);
    EXPECT_EQ(ck.find("model.layers.7.input_layernorm.weight"), nullptr);
}

TEST_F(MakeTinyTest, MoeIntermediateSizeReplacesThePresetsExpertWidthOnly) {
    TinyOptions o;
    o.out_dir = root_ / "wide";
    o.seed = 5;
    o.dtype = "fp8";
    o.moe_intermediate_size = 1024;
    auto r = make_tiny_checkpoint(o);
    ASSERT_TRUE(r.has_value()) << r.error().message;
    io::Checkpoint ck = open_checkpoint(root_ / "wide");
    const io::TensorInfo *gate = ck.find("model.layers.4.moe.gate_proj.weight");
    const io::TensorInfo *down = ck.find("model.layers.4.moe.down_proj.weight");
    const io::TensorInfo *down_scale = ck.find("model.layers.4.moe.down_proj.weight_scale_inv");
    ASSERT_NE(gate, nullptr);
    ASSERT_NE(down, nullptr);
    ASSERT_NE(down_scale, nullptr);
    EXPECT_EQ(gate->shape, (std::vector<int64_t>{16, 1024, 256}));
    EXPECT_EQ(down->shape, (std::vector<int64_t>{16, 256, 1024}));
    EXPECT_EQ(down_scale->shape, (std::vector<int64_t>{16, 2, 8}));  // 128x128 tiles: 256 rows x 1024 columns
    EXPECT_NE(read_file(root_ / "wide" / "config.json").find("\"moe_intermediate_size\": 1024,"), std::string::npos);
    // Everything but the routed experts is the preset's, weight for weight.
    generate(root_ / "ref", 5, "fp8");
    io::Checkpoint ref = open_checkpoint(root_ / "ref");
    for (const char *name : {"model.layers.1.self_attn.q_proj.weight", "model.layers.5.share_expert.up_proj.weight",
                                    "model.layers.2.moe.gate.weight", "lm_head.weight"}) {
        EXPECT_EQ(tensor_bytes(ck, name), tensor_bytes(ref, name)) << name;
    }
    EXPECT_GT(r->n_params, 50'000'000u);  // 4 MoE layers x 16 experts x 3 x 256 x 1024 = 50.3M expert weights

    for (const int64_t bad : {int64_t{-1}, kMaxTinyMoeIntermediateSize + 1}) {
        o.out_dir = root_ / "bad";
        o.moe_intermediate_size = bad;
        auto refused = make_tiny_checkpoint(o);
        ASSERT_FALSE(refused.has_value()) << bad;
        EXPECT_EQ(refused.error().message,
                  fmt::format("make-tiny: moe_intermediate_size must be in [1, 8192] (0 keeps the preset's 96), "
                              "found {}",
                              bad));
        EXPECT_FALSE(fs::exists(root_ / "bad"));
    }
    // Any width: routed experts are never cut into canonical blocks or per-rank slices (ENGINE.md section 3).
    o.out_dir = root_ / "odd";
    o.moe_intermediate_size = 100;
    ASSERT_TRUE(make_tiny_checkpoint(o).has_value());
    EXPECT_EQ(open_checkpoint(root_ / "odd").find("model.layers.4.moe.gate_proj.weight")->shape,
              (std::vector<int64_t>{16, 100, 256}));
}

// --layers and --experts: the trunk depth (MoE from the preset's first MoE layer on, clamps kept by index) and
// the routed experts; the config says so and the checkpoint loads; out-of-range values are refused.
TEST_F(MakeTinyTest, LayersAndExpertsReplaceThePresetsDepthAndExperts) {
    TinyOptions o;
    o.out_dir = root_ / "deep";
    o.seed = 5;
    o.layers = 8;
    o.experts = 12;
    ASSERT_TRUE(make_tiny_checkpoint(o).has_value());
    const std::string config = read_file(root_ / "deep" / "config.json");
    EXPECT_NE(config.find("\"num_hidden_layers\": 8,"), std::string::npos) << config;
    EXPECT_NE(config.find("\"moe_layers_enum\": \"2,3,4,5,6,7\","), std::string::npos) << config;
    EXPECT_NE(config.find("\"moe_num_experts\": 12,"), std::string::npos) << config;
    auto cfg = model::load_step35_config(root_ / "deep");
    ASSERT_TRUE(cfg.has_value()) << cfg.error().message;
    EXPECT_EQ(cfg->n_layers, 8);
    io::Checkpoint ck = open_checkpoint(root_ / "deep");
    ASSERT_NE(ck.find("model.layers.7.moe.gate_proj.weight"), nullptr);
    EXPECT_EQ(ck.find("model.layers.7.moe.gate_proj.weight")->shape, (std::vector<int64_t>{12, 96, 256}));
    ASSERT_NE(ck.find("model.layers.8.eh_proj.weight"), nullptr);  // the MTP layer follows the trunk

    o.out_dir = root_ / "shallow";
    o.layers = 2;
    o.experts = 0;
    ASSERT_TRUE(make_tiny_checkpoint(o).has_value());
    EXPECT_NE(read_file(root_ / "shallow" / "config.json").find("\"num_hidden_layers\": 2,"), std::string::npos);
    EXPECT_EQ(open_checkpoint(root_ / "shallow").find("model.layers.1.moe.gate_proj.weight"), nullptr);  // all dense

    for (const auto &[layers, experts, message] :
         std::vector<std::tuple<int64_t, int64_t, std::string>>{
             {-1, 0, "make-tiny: layers must be in [1, 64] (0 keeps the preset's 6), found -1"},
             {65, 0, "make-tiny: layers must be in [1, 64] (0 keeps the preset's 6), found 65"},
             {0, 7, "make-tiny: experts must be in [8, 512] (top-k .. max; 0 keeps the preset's 16), found 7"},
             {0, 513, "make-tiny: experts must be in [8, 512] (top-k .. max; 0 keeps the preset's 16), found 513"}}) {
        o.out_dir = root_ / "bad";
        o.layers = layers;
        o.experts = experts;
        auto refused = make_tiny_checkpoint(o);
        ASSERT_FALSE(refused.has_value()) << layers << " " << experts;
        EXPECT_EQ(refused.error().message, message);
        EXPECT_FALSE(fs::exists(root_ / "bad"));
    }
}

// A config.json text with its "sliding_window" line removed.
std::string config_without_window(const std::string &config) {
    const size_t at = config.find("\"sliding_window\"");
    if (at == std::string::npos) return config;
    const size_t begin = config.rfind('\n', at);
    const size_t end = config.find('\n', at);
    return config.substr(0, begin) + config.substr(end);
}

TEST_F(MakeTinyTest, SlidingWindowReplacesThePresetsWindowOnly) {
    TinyOptions o;
    o.out_dir = root_ / "window";
    o.seed = 5;
    o.sliding_window = 192;  // three KV pages of 64 rows
    ASSERT_TRUE(make_tiny_checkpoint(o).has_value());
    const std::string config = read_file(root_ / "window" / "config.json");
    EXPECT_NE(config.find("\"sliding_window\": 192,"), std::string::npos) << config;
    generate(root_ / "ref", 5, "bf16");
    EXPECT_EQ(config_without_window(config), config_without_window(read_file(root_ / "ref" / "config.json")));
    io::Checkpoint ck = open_checkpoint(root_ / "window");
    io::Checkpoint ref = open_checkpoint(root_ / "ref");
    for (const char *name : {"model.layers.1.self_attn.q_proj.weight", "model.layers.2.moe.gate_proj.weight"}) {
        EXPECT_EQ(tensor_bytes(ck, name), tensor_bytes(ref, name)) << name;
    }
    for (const int64_t bad : {int64_t{-1}, int64_t{4097}}) {
        o.out_dir = root_ / "bad";
        o.sliding_window = bad;
        auto refused = make_tiny_checkpoint(o);
        ASSERT_FALSE(refused.has_value()) << bad;
        EXPECT_EQ(refused.error().message,
                  fmt::format("make-tiny: sliding_window must be in [1, 4096] (0 keeps the preset's 16), found {}",
                              bad));
        EXPECT_FALSE(fs::exists(root_ / "bad"));
    }
}

TEST(MakeTinyPresets, NamesAndDescriptions) {
    EXPECT_EQ(tiny_preset_names(), (std::vector<std::string>{"tiny", "small", "release", "e128"}));
    for (const TinyPresetInfo &p : tiny_presets()) {
        EXPECT_FALSE(p.description.empty()) << p.name;
        EXPECT_EQ(p.description.find('\n'), std::string::npos) << p.name;
    }
    for (const TinyPreset &p : tiny_preset_table()) {
        EXPECT_EQ(p.swiglu_limits.size(), static_cast<size_t>(p.n_total_layers())) << p.name;
        EXPECT_EQ(p.swiglu_limits_shared.size(), static_cast<size_t>(p.n_total_layers())) << p.name;
        EXPECT_LT(build_tiny_tokenizer().n_tokens(), p.vocab_size) << p.name;
    }
    EXPECT_FALSE(find_tiny_preset("Tiny").has_value());
}

TEST(MakeTinyPresets, GeneratorFileNames) {
    for (const char *f : {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                          "model.safetensors.index.json", "model-00001-of-00005.safetensors", "model.safetensors"}) {
        EXPECT_TRUE(is_tiny_generator_file(f)) << f;
    }
    for (const char *f : {"notes.txt", ".safetensors", "config.json.bak", "special_tokens_map.json", "README.md"}) {
        EXPECT_FALSE(is_tiny_generator_file(f)) << f;
    }
}

// ---- the integer RNG and scale constants ----

TEST(MakeTinyWeights, IntegerSquareRootIsExact) {
    for (uint64_t n = 0; n < 100000; ++n) {
        uint64_t r = isqrt_u64(n);
        ASSERT_LE(r * r, n) << n;
        ASSERT_GT((r + 1) * (r + 1), n) << n;
    }
    EXPECT_EQ(isqrt_u64(~uint64_t{0}), 4294967295u);
    EXPECT_EQ(isqrt_u64(uint64_t{1} << 62), uint64_t{1} << 31);
    EXPECT_EQ(isqrt_u64((uint64_t{1} << 62) - 1), (uint64_t{1} << 31) - 1);
}

TEST(MakeTinyWeights, AmplitudeIsFloorOfSqrtThreeOverFanIn) {
    EXPECT_EQ(tiny_amplitude_fixed(256), 1816186u);  // floor(sqrt(3) / 16 * 2^24)
    EXPECT_EQ(tiny_amplitude_fixed(3), uint64_t{1} << 24);
    EXPECT_EQ(tiny_amplitude_fixed(12), uint64_t{1} << 23);
    for (uint64_t fan_in : {1u, 64u, 96u, 256u, 384u, 512u, 1024u, 1536u}) {
        uint64_t a = tiny_amplitude_fixed(fan_in);
        long double exact = std::sqrt(3.0L / static_cast<long double>(fan_in)) * 16777216.0L;
        EXPECT_EQ(a, static_cast<uint64_t>(exact)) << fan_in;
    }
}

TEST(MakeTinyWeights, UniformGridIsSymmetricAndExact) {
    EXPECT_EQ(tiny_uniform_odd(0), -((int64_t{1} << 24) - 1));
    EXPECT_EQ(tiny_uniform_odd(~uint64_t{0}), (int64_t{1} << 24) - 1);
    EXPECT_EQ(tiny_uniform_odd(uint64_t{1} << 63), 1);
    // Largest magnitude: (2^24 - 1) / 2^24 * sqrt(3) -- below the amplitude, exactly rounded once.
    EXPECT_EQ(tiny_scaled_uniform(1, uint64_t{1} << 24), 0x1p-24f);
    EXPECT_EQ(tiny_scaled_uniform(-3, uint64_t{1} << 23), -3 * 0x1p-25f);
    EXPECT_LT(std::fabs(tiny_scaled_uniform((int64_t{1} << 24) - 1, tiny_amplitude_fixed(1))), 1.7320509f);
}

TEST(MakeTinyWeights, StreamsDependOnSeedAndNameOnly) {
    uint64_t s = tiny_tensor_stream(7, "model.norm.weight");
    EXPECT_EQ(s, tiny_tensor_stream(7, "model.norm.weight"));
    EXPECT_NE(s, tiny_tensor_stream(8, "model.norm.weight"));
    EXPECT_NE(s, tiny_tensor_stream(7, "lm_head.weight"));
    EXPECT_NE(tiny_random_bits(s, 0), tiny_random_bits(s, 1));
    // Seed 0 is a seed like any other (splitmix64's finalizer maps 0 to 0; the stream must not).
    EXPECT_NE(tiny_tensor_stream(0, ""), 0u);
}

// Pins the generated values: the same bits on every machine and compiler. A change here means the
// tiny checkpoint changed, and with it every golden that depends on it.
TEST(MakeTinyWeights, GoldenDigestOfTinySeed7) {
    auto preset = find_tiny_preset("tiny");
    ASSERT_TRUE(preset.has_value());
    for (bool fp8 : {false, true}) {
        uint64_t h = 0xCBF29CE484222325ull;
        for (const io::TensorData &t : make_tiny_tensors(*preset, 7, fp8)) {
            for (char c : t.name) {
                h = (h ^ static_cast<unsigned char>(c)) * 0x100000001B3ull;
            }
            for (std::byte b : t.bytes) {
                h = (h ^ static_cast<uint8_t>(b)) * 0x100000001B3ull;
            }
        }
        EXPECT_EQ(h, fp8 ? 0x1631380beb7ab1b1ull : 0x39495a6858ca2342ull)
            << (fp8 ? "fp8" : "bf16") << fmt::format(" digest {:#018x}", h);
    }
}

TEST(MakeTinyWeights, NormAndBiasRangesAndEmbeddingSpread) {
    auto preset = find_tiny_preset("tiny");
    ASSERT_TRUE(preset.has_value());
    for (const io::TensorData &t : make_tiny_tensors(*preset, 11, false)) {
        bool norm = t.name.ends_with("norm.weight");
        bool bias = t.name.ends_with("router_bias");
        if (!norm && !bias && t.name != "model.embed_tokens.weight") {
            continue;
        }
        double sum_sq = 0;
        float max_abs = 0;
        size_t n = bias ? t.bytes.size() / 4 : t.bytes.size() / 2;
        for (size_t i = 0; i < n; ++i) {
            float v = 0;
            if (bias) {
                uint32_t u = 0;
                for (int k = 0; k < 4; ++k) {
                    u |= static_cast<uint32_t>(static_cast<uint8_t>(t.bytes[4 * i + k])) << (8 * k);
                }
                std::memcpy(&v, &u, 4);
            } else {
                auto u = static_cast<uint16_t>(static_cast<uint8_t>(t.bytes[2 * i]) |
                                               (static_cast<uint8_t>(t.bytes[2 * i + 1]) << 8));
                v = bf16_to_f32(u);
            }
            sum_sq += static_cast<double>(v) * v;
            max_abs = std::max(max_abs, std::fabs(v));
        }
        if (norm) {
            EXPECT_LE(max_abs, 0.1005f) << t.name;
            EXPECT_GT(max_abs, 0.05f) << t.name;
        } else if (bias) {
            EXPECT_EQ(t.dtype, DType::kF32);
            EXPECT_LE(max_abs, 0.0301f) << t.name;
            EXPECT_GT(max_abs, 0.01f) << t.name;
        } else {
            double rms = std::sqrt(sum_sq / static_cast<double>(n));
            EXPECT_NEAR(rms, 1.0, 0.02) << t.name;
        }
    }
}

// ---- BPE trainer ----

TEST(BpeTrainer, MergesMostFrequentPairFirstAndStopsBelowMinCount) {
    // (a,b) occurs 5 times, (b,c) 3: merge ab; then (ab,c) twice -> abc; (b,c) is left with 1 < 2.
    std::vector<std::string> words = {"ab", "ab", "ab", "abc", "abc", "bc"};
    BpeTrainOptions o;
    o.max_merges = 10;
    std::vector<BpeMerge> m = train_bpe(words, o);
    ASSERT_EQ(m.size(), 2u);
    EXPECT_EQ(m[0].left, "a");
    EXPECT_EQ(m[0].right, "b");
    EXPECT_EQ(m[1].left, "ab");
    EXPECT_EQ(m[1].right, "c");
    o.max_merges = 1;
    EXPECT_EQ(train_bpe(words, o).size(), 1u);
    o.max_merges = 10;
    o.min_count = 1;
    m = train_bpe(words, o);
    ASSERT_EQ(m.size(), 3u);
    EXPECT_EQ(m[2].left, "b");
    EXPECT_EQ(m[2].right, "c");
}

TEST(BpeTrainer, TiesGoToTheLexicographicallySmallestPair) {
    BpeTrainOptions o;
    o.max_merges = 10;
    // All three pairs occur twice: (a,c) < (a,d) < (x,y), left compared first, then right.
    std::vector<BpeMerge> m = train_bpe({"xy", "ad", "ac", "xy", "ad", "ac"}, o);
    ASSERT_EQ(m.size(), 3u);
    EXPECT_EQ(m[0].left + "|" + m[0].right, "a|c");
    EXPECT_EQ(m[1].left + "|" + m[1].right, "a|d");
    EXPECT_EQ(m[2].left + "|" + m[2].right, "x|y");
    // Bytes compare unsigned: 0xC3 sorts after 'z'.
    m = train_bpe({"\xC3\xA9", "za", "\xC3\xA9", "za"}, o);
    ASSERT_EQ(m.size(), 2u);
    EXPECT_EQ(m[0].left, "z");
    EXPECT_EQ(m[1].left, "\xC3");
}

TEST(BpeTrainer, ReservedStringsAreNeverProduced) {
    BpeTrainOptions o;
    o.max_merges = 10;
    o.reserved = {"ab"};
    std::vector<BpeMerge> m = train_bpe({"ab", "ab", "ab", "cd", "cd"}, o);
    ASSERT_EQ(m.size(), 1u);
    EXPECT_EQ(m[0].left + m[0].right, "cd");
}

TEST(BpeTrainer, TrainingSplit) {
    EXPECT_EQ(bpe_training_split("Hello  world 1234567 ab,c\n\tx"),
              (std::vector<std::string>{"Hello", " ", " world", " ", "123", "456", "7", " ab", ",", "c", "\n\t",
                                        "x"}));
    EXPECT_EQ(bpe_training_split("caf\xC3\xA9!!"), (std::vector<std::string>{"caf\xC3\xA9", "!!"}));
    EXPECT_TRUE(bpe_training_split("").empty());
}

TEST(BpeTrainer, ByteLevelAlphabet) {
    EXPECT_EQ(byte_level_char('A'), "A");
    EXPECT_EQ(byte_level_char('~'), "~");
    EXPECT_EQ(byte_level_char(0), "\xC4\x80");     // U+0100
    EXPECT_EQ(byte_level_char(' '), "\xC4\xA0");   // U+0120 'Ġ'
    EXPECT_EQ(byte_level_char('\n'), "\xC4\x8A");  // U+010A 'Ċ'
    EXPECT_EQ(byte_level_char(0x7F), "\xC4\xA1");  // U+0121
    EXPECT_EQ(byte_level_char(0xAD), "\xC5\x83");  // U+0143, the last one
    EXPECT_EQ(byte_level_char(0xE9), "\xC3\xA9");  // printable Latin-1 maps to itself
    std::set<std::string> all;
    for (int b = 0; b < 256; ++b) {
        all.insert(byte_level_char(static_cast<uint8_t>(b)));
    }
    EXPECT_EQ(all.size(), 256u);
    EXPECT_EQ(byte_level_encode("a b"), "a\xC4\xA0" "b");
}

TEST(BpeTrainer, TinyTokenizerVocabularyInvariants) {
    TinyTokenizer tok = build_tiny_tokenizer();
    EXPECT_EQ(tok.n_tokens(), 739);
    EXPECT_EQ(tok.tokens[0], kBosToken);
    EXPECT_EQ(tok.tokens[1], kEosToken);
    EXPECT_EQ(tok.tokens[tok.im_end_id], "<|im_end|>");
    EXPECT_EQ(tok.tokens[2 + 'a'], "a");
    std::map<std::string, int64_t> id_of;
    for (int64_t id = 0; id < tok.n_tokens(); ++id) {
        EXPECT_TRUE(id_of.emplace(tok.tokens[id], id).second) << "duplicate token " << tok.tokens[id];
    }
    int64_t n_special = 0;
    for (int64_t id = 0; id < tok.n_tokens(); ++id) {
        n_special += tok.special[id] ? 1 : 0;
    }
    EXPECT_EQ(n_special, 10);
    ASSERT_EQ(static_cast<int64_t>(tok.merges.size()), tok.n_tokens() - 2 - 256 - 8);
    for (size_t i = 0; i < tok.merges.size(); ++i) {
        auto result = static_cast<int64_t>(258 + i);
        EXPECT_EQ(tok.tokens[result], tok.merges[i].left + tok.merges[i].right) << i;
        ASSERT_TRUE(id_of.count(tok.merges[i].left)) << i;
        ASSERT_TRUE(id_of.count(tok.merges[i].right)) << i;
        EXPECT_LT(id_of[tok.merges[i].left], result) << i;
        EXPECT_LT(id_of[tok.merges[i].right], result) << i;
        EXPECT_GE(id_of[tok.merges[i].left], 2) << i;  // never a special token
        EXPECT_GE(id_of[tok.merges[i].right], 2) << i;
    }
    // The first merge on this corpus: the most frequent pair is two spaces.
    EXPECT_EQ(tok.merges[0].left + tok.merges[0].right, "\xC4\xA0\xC4\xA0");
}

TEST(BpeTrainer, TokenizerFilesAreWellFormedJson) {
    TinyTokenizer tok = build_tiny_tokenizer();
    auto t = nlohmann::json::parse(tiny_tokenizer_json(tok));
    EXPECT_EQ(t["model"]["type"], "BPE");
    EXPECT_EQ(t["model"]["vocab"].size(), static_cast<size_t>(tok.n_tokens()));
    EXPECT_EQ(t["model"]["merges"].size(), tok.merges.size());
    EXPECT_EQ(t["added_tokens"].size(), 10u);
    EXPECT_EQ(t["pre_tokenizer"]["pretokenizers"].size(), 4u);
    EXPECT_EQ(t["post_processor"]["single"][0]["SpecialToken"]["id"], kBosToken);
    auto c = nlohmann::json::parse(tiny_tokenizer_config_json(tok, 4096));
    EXPECT_EQ(c["add_bos_token"], true);
    EXPECT_EQ(c["eos_token"], "<|im_end|>");
    EXPECT_EQ(c["pad_token"], kEosToken);
    EXPECT_EQ(c["chat_template"], tiny_chat_template());
    EXPECT_EQ(c["added_tokens_decoder"][std::to_string(tok.im_end_id)]["content"], "<|im_end|>");
}

}  // namespace
}  // namespace memra::tools
