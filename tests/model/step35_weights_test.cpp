// Tensor catalogue and checkpoint validation: the release catalogue (BF16 and FP8) against STEP35.md
// section 5, and exact validation messages for synthetic tensor lists built from the catalogue and then
// broken one way at a time. No file is read except the config fixtures.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/model_test_util.h"
#include "model/step35_config.h"
#include "model/step35_weights.h"

namespace memra::model {
namespace {

using Json = nlohmann::json;

// 4 trunk layers (0 full, 1-2 sliding, 3 full; 2-3 MoE with 16 experts of width 96 over d_model 256)
// and n_mtp MTP layers, small enough to read every message.
Step35Config tiny_config(int n_mtp, bool fp8, bool tied = false) {
    const int n = 4 + n_mtp;
    Json types = Json::array();
    Json theta = Json::array();
    Json partial = Json::array();
    for (int i = 0; i < n; ++i) {
        const bool full = i == 0 || i == 3;
        types.push_back(full ? "full_attention" : "sliding_attention");
        theta.push_back(full ? 5e6 : 1e4);
        partial.push_back(full ? 0.5 : 1.0);
    }
    Json j = {
        {"model_type", "step3p5"},
        {"hidden_size", 256},
        {"intermediate_size", 512},
        {"num_hidden_layers", 4},
        {"num_nextn_predict_layers", n_mtp},
        {"vocab_size", 1000},
        {"max_seq_len", 4096},
        {"num_attention_heads", 4},
        {"num_attention_groups", 2},
        {"head_dim", 64},
        {"attention_other_setting",
         {{"attention_type", "sliding_attention"}, {"num_attention_heads", 6}, {"num_attention_groups", 2}}},
        {"layer_types", types},
        {"sliding_window", 128},
        {"rope_theta", theta},
        {"partial_rotary_factors", partial},
        {"moe_layers_enum", "2,3"},
        {"moe_num_experts", 16},
        {"moe_top_k", 4},
        {"moe_intermediate_size", 96},
        {"share_expert_dim", 64},
        {"use_head_wise_attn_gate", true},
        {"tie_word_embeddings", tied},
    };
    if (fp8) {
        j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}};
    }
    auto cfg = parse_step35_config(j.dump());
    EXPECT_TRUE(cfg.has_value()) << (cfg ? "" : cfg.error().message);
    return cfg ? *cfg : Step35Config{};
}

io::TensorInfo &find_info(std::vector<io::TensorInfo> &list, std::string_view name) {
    auto it = std::find_if(list.begin(), list.end(), [&](const io::TensorInfo &t) { return t.name == name; });
    EXPECT_NE(it, list.end()) << name;
    return *it;
}

const ExpectedTensor &find_expected(const std::vector<ExpectedTensor> &cat, std::string_view name) {
    auto it = std::find_if(cat.begin(), cat.end(), [&](const ExpectedTensor &t) { return t.name == name; });
    EXPECT_NE(it, cat.end()) << name;
    return *it;
}

void erase_info(std::vector<io::TensorInfo> &list, std::string_view name) {
    const auto before = list.size();
    std::erase_if(list, [&](const io::TensorInfo &t) { return t.name == name; });
    EXPECT_EQ(list.size() + 1, before) << name;
}

using Shape = std::vector<int64_t>;

TEST(Step35Weights, ReleaseCatalogue) {
    const Step35Config cfg = load_fixture("step35_flash_config.json");
    const std::vector<ExpectedTensor> cat = expected_tensors(cfg);
    // 3 dense trunk layers x 12, 42 MoE layers x 17, 3 MTP layers x 17, embedding + final norm + lm_head.
    EXPECT_EQ(cat.size(), 3u * 12 + 42u * 17 + 3u * 17 + 3);
    EXPECT_EQ(cat.front().name, "model.embed_tokens.weight");
    EXPECT_EQ(cat.back().name, "lm_head.weight");
    std::set<std::string> names;
    for (const ExpectedTensor &e : cat) {
        EXPECT_TRUE(names.insert(e.name).second) << "duplicate " << e.name;
        EXPECT_EQ(e.fp8, Fp8Rule::kNever) << e.name;
        EXPECT_NE(e.role, TensorRole::kFp8Scale);
    }
    const std::vector<DType> floats = {DType::kBF16, DType::kF32, DType::kF16};
    auto expect = [&](std::string_view name, const Shape &shape, TensorRole role, int layer) {
        const ExpectedTensor &e = find_expected(cat, name);
        EXPECT_EQ(e.shape, shape) << name;
        EXPECT_EQ(e.role, role) << name;
        EXPECT_EQ(e.layer, layer) << name;
    };
    expect("model.embed_tokens.weight", {128896, 4096}, TensorRole::kEmbedding, -1);
    expect("lm_head.weight", {128896, 4096}, TensorRole::kLmHead, -1);
    expect("model.norm.weight", {4096}, TensorRole::kNorm, -1);
    expect("model.layers.0.input_layernorm.weight", {4096}, TensorRole::kNorm, 0);
    expect("model.layers.0.self_attn.q_proj.weight", {8192, 4096}, TensorRole::kAttention, 0);
    expect("model.layers.1.self_attn.q_proj.weight", {12288, 4096}, TensorRole::kAttention, 1);
    expect("model.layers.1.self_attn.k_proj.weight", {1024, 4096}, TensorRole::kAttention, 1);
    expect("model.layers.4.self_attn.v_proj.weight", {1024, 4096}, TensorRole::kAttention, 4);
    expect("model.layers.0.self_attn.o_proj.weight", {4096, 8192}, TensorRole::kAttention, 0);
    expect("model.layers.1.self_attn.o_proj.weight", {4096, 12288}, TensorRole::kAttention, 1);
    expect("model.layers.44.self_attn.g_proj.weight", {64, 4096}, TensorRole::kAttention, 44);
    expect("model.layers.43.self_attn.g_proj.weight", {96, 4096}, TensorRole::kAttention, 43);
    expect("model.layers.7.self_attn.q_norm.weight", {128}, TensorRole::kNorm, 7);
    expect("model.layers.2.mlp.gate_proj.weight", {11264, 4096}, TensorRole::kDenseMlp, 2);
    expect("model.layers.2.mlp.down_proj.weight", {4096, 11264}, TensorRole::kDenseMlp, 2);
    expect("model.layers.3.moe.gate.weight", {288, 4096}, TensorRole::kRouter, 3);
    expect("model.layers.3.moe.router_bias", {288}, TensorRole::kRouterBias, 3);
    expect("model.layers.3.moe.gate_proj.weight", {288, 1280, 4096}, TensorRole::kRoutedExperts, 3);
    expect("model.layers.44.moe.up_proj.weight", {288, 1280, 4096}, TensorRole::kRoutedExperts, 44);
    expect("model.layers.44.moe.down_proj.weight", {288, 4096, 1280}, TensorRole::kRoutedExperts, 44);
    expect("model.layers.3.share_expert.gate_proj.weight", {1280, 4096}, TensorRole::kSharedExpert, 3);
    expect("model.layers.3.share_expert.down_proj.weight", {4096, 1280}, TensorRole::kSharedExpert, 3);
    expect("model.layers.45.enorm.weight", {4096}, TensorRole::kNorm, 45);
    expect("model.layers.46.hnorm.weight", {4096}, TensorRole::kNorm, 46);
    expect("model.layers.45.eh_proj.weight", {4096, 8192}, TensorRole::kMtpProj, 45);
    expect("model.layers.47.transformer.shared_head.norm.weight", {4096}, TensorRole::kNorm, 47);
    expect("model.layers.47.transformer.shared_head.output.weight", {128896, 4096}, TensorRole::kMtpHead, 47);
    expect("model.layers.45.self_attn.q_proj.weight", {12288, 4096}, TensorRole::kAttention, 45);
    expect("model.layers.46.mlp.up_proj.weight", {11264, 4096}, TensorRole::kDenseMlp, 46);
    EXPECT_FALSE(names.contains("model.layers.2.moe.gate.weight"));
    EXPECT_FALSE(names.contains("model.layers.3.mlp.gate_proj.weight"));
    EXPECT_FALSE(names.contains("model.layers.44.enorm.weight"));
    EXPECT_FALSE(names.contains("model.layers.48.enorm.weight"));
    EXPECT_EQ(find_expected(cat, "model.layers.3.moe.router_bias").dtypes, std::vector<DType>{DType::kF32});
    EXPECT_EQ(find_expected(cat, "model.layers.3.moe.gate.weight").dtypes,
              (std::vector<DType>{DType::kBF16, DType::kF32}));
    EXPECT_EQ(find_expected(cat, "model.layers.3.moe.gate_proj.weight").dtypes, floats);
    EXPECT_EQ(find_expected(cat, "model.norm.weight").dtypes, floats);
}

TEST(Step35Weights, ReleaseFp8Catalogue) {
    const Step35Config cfg = load_fixture("step35_flash_fp8_config.json");
    const std::vector<ExpectedTensor> cat = expected_tensors(cfg);
    EXPECT_EQ(cat.size(), 3u * 12 + 42u * 17 + 3u * 17 + 3 + 42u * 3);
    size_t n_scales = 0;
    for (size_t i = 0; i < cat.size(); ++i) {
        const ExpectedTensor &e = cat[i];
        if (e.role == TensorRole::kRoutedExperts) {
            EXPECT_EQ(e.fp8, Fp8Rule::kRequired);
            EXPECT_EQ(e.dtypes, std::vector<DType>{DType::kF8E4M3});
            ASSERT_LT(i + 1, cat.size());
            EXPECT_EQ(cat[i + 1].name, e.name + "_scale_inv");  // the scale follows its weight
        }
        if (e.role == TensorRole::kFp8Scale) {
            ++n_scales;
            EXPECT_EQ(e.dtypes, std::vector<DType>{DType::kF32});
        }
    }
    EXPECT_EQ(n_scales, 126u);
    const ExpectedTensor &gate_scale = find_expected(cat, "model.layers.3.moe.gate_proj.weight_scale_inv");
    EXPECT_EQ(gate_scale.shape, (Shape{288, 10, 32}));
    EXPECT_EQ(gate_scale.layer, 3);
    EXPECT_EQ(find_expected(cat, "model.layers.44.moe.up_proj.weight_scale_inv").shape, (Shape{288, 10, 32}));
    EXPECT_EQ(find_expected(cat, "model.layers.44.moe.down_proj.weight_scale_inv").shape, (Shape{288, 32, 10}));
    EXPECT_EQ(find_expected(cat, "model.layers.3.moe.gate_proj.weight").shape, (Shape{288, 1280, 4096}));
    EXPECT_EQ(find_expected(cat, "model.layers.0.self_attn.q_proj.weight").fp8, Fp8Rule::kAllowed);
    EXPECT_EQ(find_expected(cat, "model.layers.3.share_expert.up_proj.weight").fp8, Fp8Rule::kAllowed);
    EXPECT_EQ(find_expected(cat, "lm_head.weight").fp8, Fp8Rule::kAllowed);
    EXPECT_EQ(find_expected(cat, "model.layers.3.moe.gate.weight").fp8, Fp8Rule::kNever);
    EXPECT_EQ(find_expected(cat, "model.embed_tokens.weight").fp8, Fp8Rule::kNever);
    EXPECT_EQ(find_expected(cat, "model.norm.weight").fp8, Fp8Rule::kNever);
}

TEST(Step35Weights, TiedAndGateless) {
    Step35Config cfg = tiny_config(0, false, /*tied=*/true);
    std::vector<ExpectedTensor> cat = expected_tensors(cfg);
    EXPECT_EQ(cat.size(), 2u * 12 + 2u * 17 + 2);
    EXPECT_EQ(cat.back().name, "model.norm.weight");
    cfg.use_head_wise_attn_gate = false;
    cat = expected_tensors(cfg);
    EXPECT_EQ(cat.size(), 2u * 11 + 2u * 16 + 2);
    for (const ExpectedTensor &e : cat) {
        EXPECT_EQ(e.name.find("g_proj"), std::string::npos) << e.name;
    }
}

TEST(Step35Weights, Helpers) {
    EXPECT_EQ(format_shape(Shape{}), "[]");
    EXPECT_EQ(format_shape(Shape{16, 96, 256}), "[16, 96, 256]");
    EXPECT_EQ(fp8_scale_shape(Shape{288, 1280, 4096}, 128, 128), (Shape{288, 10, 32}));
    EXPECT_EQ(fp8_scale_shape(Shape{288, 4096, 1280}, 128, 128), (Shape{288, 32, 10}));
    EXPECT_EQ(fp8_scale_shape(Shape{96, 4096}, 128, 128), (Shape{1, 32}));
    EXPECT_EQ(fp8_scale_shape(Shape{129, 257}, 128, 64), (Shape{2, 5}));
}

TEST(Step35Weights, ReleaseListsValidate) {
    for (const char *file : {"step35_flash_config.json", "step35_flash_fp8_config.json"}) {
        SCOPED_TRACE(file);
        const Step35Config cfg = load_fixture(file);
        const std::vector<io::TensorInfo> list = as_checkpoint(expected_tensors(cfg));
        const ValidationReport r = validate_tensors(cfg, list);
        EXPECT_TRUE(r.ok()) << format_validation_report(r);
        EXPECT_EQ(r.n_found, list.size());
        EXPECT_EQ(r.n_expected, list.size());
        EXPECT_EQ(r.fp8_tensors.size(), cfg.is_fp8() ? 126u : 0u);
        EXPECT_TRUE(check_tensors(cfg, list).has_value());
    }
}

// Validates `list` and compares the problems exactly.
void expect_problems(const Step35Config &cfg, const std::vector<io::TensorInfo> &list,
                     const std::vector<std::string> &expected) {
    const ValidationReport r = validate_tensors(cfg, list);
    EXPECT_EQ(r.problems, expected);
}

TEST(Step35Weights, MissingTensor) {
    const Step35Config cfg = tiny_config(1, false);
    std::vector<io::TensorInfo> list = as_checkpoint(expected_tensors(cfg));
    erase_info(list, "model.layers.3.moe.gate_proj.weight");
    erase_info(list, "model.norm.weight");
    expect_problems(cfg, list,
                    {"model.layers.3.moe.gate_proj.weight: missing from the checkpoint (expected shape [16, 96, 256])",
                     "model.norm.weight: missing from the checkpoint (expected shape [256])"});
}

TEST(Step35Weights, UnexpectedTensors) {
    const Step35Config cfg = tiny_config(0, false, /*tied=*/true);
    std::vector<io::TensorInfo> list = as_checkpoint(expected_tensors(cfg));
    list.push_back({"model.layers.4.enorm.weight", DType::kBF16, {256}, 0, 512});
    list.push_back({"model.layers.1.moe.gate.weight", DType::kBF16, {16, 256}, 0, 8192});
    list.push_back({"model.layers.2.mlp.up_proj.weight", DType::kBF16, {512, 256}, 0, 262144});
    list.push_back({"model.layers.0.eh_proj.weight", DType::kBF16, {256, 512}, 0, 262144});
    list.push_back({"lm_head.weight", DType::kBF16, {1000, 256}, 0, 512000});
    list.push_back({"model.layers.1.self_attn.q_proj.weight_scale_inv", DType::kF32, {1, 2}, 0, 8});
    list.push_back({"model.rotary_emb.inv_freq", DType::kF32, {32}, 0, 128});
    expect_problems(
        cfg, list,
        {"model.layers.4.enorm.weight: unexpected tensor (layer 4 does not exist: the config has 4 trunk layers and "
         "no MTP layers (num_nextn_predict_layers))",
         "model.layers.1.moe.gate.weight: unexpected tensor (layer 1 is a dense layer)",
         "model.layers.2.mlp.up_proj.weight: unexpected tensor (layer 2 is a MoE layer)",
         "model.layers.0.eh_proj.weight: unexpected tensor (layer 0 is a trunk layer, not an MTP layer)",
         "lm_head.weight: unexpected tensor (tie_word_embeddings is true, so the embedding is the LM head)",
         "model.layers.1.self_attn.q_proj.weight_scale_inv: unexpected tensor (an FP8 scale, but config.json has no "
         "quantization_config)",
         "model.rotary_emb.inv_freq: unexpected tensor (not part of the Step-3.5 layout for this config)"});

    // A checkpoint with MTP layers against a config without them: every MTP tensor is unexpected.
    const std::vector<io::TensorInfo> with_mtp = as_checkpoint(expected_tensors(tiny_config(1, false, true)));
    const ValidationReport r = validate_tensors(cfg, with_mtp);
    EXPECT_EQ(r.problems.size(), 17u);
    for (const std::string &p : r.problems) {
        EXPECT_EQ(p.rfind("model.layers.4.", 0), 0u) << p;
        EXPECT_NE(p.find("layer 4 does not exist"), std::string::npos) << p;
    }
    // And a config with more MTP layers than the checkpoint holds.
    const std::vector<io::TensorInfo> one_mtp = as_checkpoint(expected_tensors(tiny_config(1, false)));
    const ValidationReport r2 = validate_tensors(tiny_config(2, false), one_mtp);
    EXPECT_EQ(r2.problems.size(), 17u);
    EXPECT_EQ(r2.problems[0],
              "model.layers.5.input_layernorm.weight: missing from the checkpoint (expected shape [256])");
}

TEST(Step35Weights, WrongShapeAndDtype) {
    const Step35Config cfg = tiny_config(1, false);
    std::vector<io::TensorInfo> list = as_checkpoint(expected_tensors(cfg));
    find_info(list, "model.layers.3.moe.gate_proj.weight").shape = {16, 256, 96};
    find_info(list, "model.layers.1.self_attn.q_proj.weight").shape = {256, 384};
    find_info(list, "model.layers.0.self_attn.q_norm.weight").shape = {1, 64};
    find_info(list, "model.norm.weight").dtype = DType::kI32;
    find_info(list, "model.layers.2.moe.router_bias").dtype = DType::kBF16;
    find_info(list, "model.layers.2.moe.gate.weight").dtype = DType::kF16;
    find_info(list, "model.layers.2.moe.down_proj.weight").dtype = DType::kF8E4M3;  // BF16 checkpoint
    io::TensorInfo &both = find_info(list, "model.layers.4.eh_proj.weight");
    both.shape = {512, 256};
    both.dtype = DType::kU8;
    expect_problems(cfg, list,
                    {"model.layers.0.self_attn.q_norm.weight: expected shape [64], found [1, 64]",
                     "model.layers.1.self_attn.q_proj.weight: expected shape [384, 256], found [256, 384]",
                     "model.layers.2.moe.gate.weight: expected dtype BF16 or F32, found F16",
                     "model.layers.2.moe.router_bias: expected dtype F32, found BF16",
                     "model.layers.2.moe.down_proj.weight: expected dtype BF16, F32 or F16, found F8_E4M3",
                     "model.layers.3.moe.gate_proj.weight: expected shape [16, 96, 256], found [16, 256, 96]",
                     "model.layers.4.eh_proj.weight: expected shape [256, 512], found [512, 256]",
                     "model.layers.4.eh_proj.weight: expected dtype BF16, F32 or F16, found U8",
                     "model.norm.weight: expected dtype BF16, F32 or F16, found I32"});
    // F32 and F16 stand in for BF16 anywhere outside the router bias and FP8 tensors.
    std::vector<io::TensorInfo> mixed = as_checkpoint(expected_tensors(cfg));
    for (size_t i = 0; i < mixed.size(); ++i) {
        if (mixed[i].name.find("router_bias") == std::string::npos) {
            mixed[i].dtype = i % 2 == 0 ? DType::kF32 : DType::kF16;
        }
    }
    find_info(mixed, "model.layers.2.moe.gate.weight").dtype = DType::kF32;
    find_info(mixed, "model.layers.3.moe.gate.weight").dtype = DType::kBF16;
    expect_problems(cfg, mixed, {});
}

TEST(Step35Weights, Fp8Scales) {
    const Step35Config cfg = tiny_config(1, true);
    const std::vector<ExpectedTensor> cat = expected_tensors(cfg);
    EXPECT_EQ(find_expected(cat, "model.layers.3.moe.gate_proj.weight_scale_inv").shape, (Shape{16, 1, 2}));
    EXPECT_EQ(find_expected(cat, "model.layers.3.moe.down_proj.weight_scale_inv").shape, (Shape{16, 2, 1}));

    std::vector<io::TensorInfo> list = as_checkpoint(cat);
    {
        const ValidationReport r = validate_tensors(cfg, list);
        EXPECT_TRUE(r.ok()) << format_validation_report(r);
        const std::vector<std::string> experts = {
            "model.layers.2.moe.gate_proj.weight", "model.layers.2.moe.up_proj.weight",
            "model.layers.2.moe.down_proj.weight", "model.layers.3.moe.gate_proj.weight",
            "model.layers.3.moe.up_proj.weight",   "model.layers.3.moe.down_proj.weight"};
        EXPECT_EQ(r.fp8_tensors, experts);
    }
    erase_info(list, "model.layers.3.moe.gate_proj.weight_scale_inv");
    find_info(list, "model.layers.3.moe.down_proj.weight_scale_inv").shape = {16, 2, 2};
    find_info(list, "model.layers.3.moe.up_proj.weight_scale_inv").dtype = DType::kBF16;
    find_info(list, "model.layers.2.moe.up_proj.weight").dtype = DType::kBF16;  // routed experts must be FP8
    // A scale next to a weight that stays BF16, and one next to a tensor that is never quantized.
    list.push_back({"model.layers.0.self_attn.q_proj.weight_scale_inv", DType::kF32, {2, 2}, 0, 16});
    list.push_back({"model.layers.0.input_layernorm.weight_scale_inv", DType::kF32, {1}, 0, 4});
    expect_problems(
        cfg, list,
        {"model.layers.2.moe.up_proj.weight: expected dtype F8_E4M3, found BF16",
         "model.layers.3.moe.gate_proj.weight: F8_E4M3 weight without its scale tensor "
         "model.layers.3.moe.gate_proj.weight_scale_inv",
         "model.layers.3.moe.up_proj.weight_scale_inv: expected dtype F32, found BF16",
         "model.layers.3.moe.down_proj.weight_scale_inv: expected shape [16, 2, 1], found [16, 2, 2]",
         "model.layers.0.self_attn.q_proj.weight_scale_inv: scale tensor for a weight that is not FP8 "
         "(model.layers.0.self_attn.q_proj.weight is BF16, not F8_E4M3)",
         "model.layers.0.input_layernorm.weight_scale_inv: scale tensor for a weight that is not FP8 "
         "(model.layers.0.input_layernorm.weight is never quantized)"});

    // A required scale whose weight is missing too is simply missing.
    std::vector<io::TensorInfo> no_expert = as_checkpoint(cat);
    erase_info(no_expert, "model.layers.2.moe.gate_proj.weight");
    erase_info(no_expert, "model.layers.2.moe.gate_proj.weight_scale_inv");
    expect_problems(cfg, no_expert,
                    {"model.layers.2.moe.gate_proj.weight: missing from the checkpoint (expected shape [16, 96, 256])",
                     "model.layers.2.moe.gate_proj.weight_scale_inv: missing from the checkpoint (expected shape "
                     "[16, 1, 2])"});
}

// Outside the routed experts, an FP8 checkpoint may store a linear weight as F8_E4M3 with its scale.
TEST(Step35Weights, Fp8OptionalLinear) {
    const Step35Config cfg = tiny_config(1, true);
    std::vector<io::TensorInfo> list = as_checkpoint(expected_tensors(cfg));
    find_info(list, "model.layers.1.self_attn.q_proj.weight").dtype = DType::kF8E4M3;  // [384, 256]
    list.push_back({"model.layers.1.self_attn.q_proj.weight_scale_inv", DType::kF32, {3, 2}, 0, 24});
    find_info(list, "lm_head.weight").dtype = DType::kF8E4M3;  // [1000, 256], no scale
    find_info(list, "model.layers.0.mlp.down_proj.weight").dtype = DType::kF8E4M3;  // [256, 512]
    list.push_back({"model.layers.0.mlp.down_proj.weight_scale_inv", DType::kF32, {2, 3}, 0, 24});
    find_info(list, "model.embed_tokens.weight").dtype = DType::kF8E4M3;  // never FP8
    find_info(list, "model.layers.3.moe.gate.weight").dtype = DType::kF8E4M3;
    const ValidationReport r = validate_tensors(cfg, list);
    EXPECT_EQ(r.problems, (std::vector<std::string>{
                              "model.embed_tokens.weight: expected dtype BF16, F32 or F16, found F8_E4M3",
                              "model.layers.0.mlp.down_proj.weight_scale_inv: expected shape [2, 4], found [2, 3]",
                              "model.layers.3.moe.gate.weight: expected dtype BF16 or F32, found F8_E4M3",
                              "lm_head.weight: F8_E4M3 weight without its scale tensor lm_head.weight_scale_inv",
                          }));
    EXPECT_EQ(std::count(r.fp8_tensors.begin(), r.fp8_tensors.end(), "model.layers.1.self_attn.q_proj.weight"), 1);
    EXPECT_EQ(std::count(r.fp8_tensors.begin(), r.fp8_tensors.end(), "lm_head.weight"), 1);
    EXPECT_EQ(r.fp8_tensors.size(), 6u + 3u);
}

TEST(Step35Weights, DuplicateNames) {
    const Step35Config cfg = tiny_config(0, false);
    std::vector<io::TensorInfo> list = as_checkpoint(expected_tensors(cfg));
    list.push_back(list[5]);
    expect_problems(cfg, list, {list[5].name + ": listed more than once in the checkpoint"});
}

TEST(Step35Weights, ReportFormatting) {
    const Step35Config cfg = tiny_config(0, false);
    std::vector<io::TensorInfo> list = as_checkpoint(expected_tensors(cfg));
    for (int i = 0; i < 25; ++i) {
        list.push_back({fmt::format("extra.{}", i), DType::kF32, {1}, 0, 4});
    }
    const ValidationReport r = validate_tensors(cfg, list);
    ASSERT_EQ(r.problems.size(), 25u);
    const std::string text = format_validation_report(r);
    EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 21);
    EXPECT_EQ(text.substr(0, text.find('\n')),
              "extra.0: unexpected tensor (not part of the Step-3.5 layout for this config)");
    EXPECT_NE(text.find("extra.19: unexpected"), std::string::npos);
    EXPECT_EQ(text.find("extra.20: unexpected"), std::string::npos);
    EXPECT_TRUE(text.ends_with("\n... and 5 more\n"));
    EXPECT_EQ(format_validation_report(r, 25).find("more"), std::string::npos);
    EXPECT_EQ(format_validation_report(ValidationReport{}), "");

    auto err = check_tensors(cfg, list);
    ASSERT_FALSE(err.has_value());
    EXPECT_EQ(err.error().message, "checkpoint does not match the config: extra.0: unexpected tensor (not part of the "
                                   "Step-3.5 layout for this config) (and 24 more problems)");
    list.resize(list.size() - 24);
    EXPECT_EQ(check_tensors(cfg, list).error().message,
              "checkpoint does not match the config: extra.0: unexpected tensor (not part of the Step-3.5 layout for "
              "this config)");
}

}  // namespace
}  // namespace memra::model
