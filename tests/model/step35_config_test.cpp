// Step35Config tests: the release-shaped fixture resolves to STEP35.md section 3 layer by layer; legacy
// and alternative spellings; one test per validation error (message fragments); and a seeded mutation
// run that must never crash the parser.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/step35_config.h"

namespace memra::model {
namespace {

using Json = nlohmann::json;

std::string read_text(const std::filesystem::path &path) {
    std::ifstream in(path, std::ios::binary);
    EXPECT_TRUE(in.good()) << path;
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
}

std::string release_text() {
    return read_text(std::filesystem::path(MEMRA_SOURCE_DIR) / "tests/data/step35_flash_config.json");
}

Json release_json() { return Json::parse(release_text()); }

Step35Config parse_ok(const Json &j) {
    auto cfg = parse_step35_config(j.dump());
    EXPECT_TRUE(cfg.has_value()) << (cfg ? "" : cfg.error().message);
    return cfg ? *cfg : Step35Config{};
}

// The error message for a config that must be refused ("" and a test failure when it is accepted).
std::string error_of(const Json &j) {
    auto cfg = parse_step35_config(j.dump());
    EXPECT_FALSE(cfg.has_value()) << "accepted: " << j.dump().substr(0, 200);
    return cfg ? std::string() : cfg.error().message;
}

#define EXPECT_ERROR(json, fragment) EXPECT_PRED_FORMAT2(::testing::IsSubstring, fragment, error_of(json))

TEST(Step35Config, ReleaseGlobals) {
    auto parsed = parse_step35_config(release_text());
    ASSERT_TRUE(parsed.has_value()) << parsed.error().message;
    const Step35Config &c = *parsed;
    EXPECT_EQ(c.model_type, "step3p5");
    EXPECT_EQ(c.architectures, std::vector<std::string>{"Step3p5ForCausalLM"});
    EXPECT_EQ(c.torch_dtype, "bfloat16");
    EXPECT_EQ(c.d_model, 4096);
    EXPECT_EQ(c.d_ff, 11264);
    EXPECT_EQ(c.n_layers, 45);
    EXPECT_EQ(c.n_mtp_layers, 3);
    EXPECT_EQ(c.n_total_layers(), 48);
    EXPECT_EQ(c.vocab_size, 128896);
    EXPECT_EQ(c.max_seq_len, 262144);
    EXPECT_EQ(c.max_position_embeddings, 262144);
    EXPECT_EQ(c.context_length, 262144);
    EXPECT_EQ(c.n_heads, 64);
    EXPECT_EQ(c.n_kv_heads, 8);
    EXPECT_EQ(c.head_dim, 128);
    EXPECT_TRUE(c.attention_other.present);
    EXPECT_EQ(c.attention_other.attention_type, "sliding_attention");
    EXPECT_EQ(c.attention_other.n_heads, 96);
    EXPECT_EQ(c.att_impl_type, "GQA");
    EXPECT_TRUE(c.use_qk_norm);
    EXPECT_TRUE(c.use_head_wise_attn_gate);
    EXPECT_EQ(c.sliding_window, 512);
    EXPECT_TRUE(c.layer_types_given);
    EXPECT_TRUE(c.rope_scaling.present);
    EXPECT_EQ(c.rope_scaling.type, "llama3");
    EXPECT_EQ(c.rope_scaling.factor, 2.0);
    EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 131072);
    EXPECT_EQ(c.rope_scaling.low_freq_factor, 1.0);
    EXPECT_EQ(c.rope_scaling.high_freq_factor, 32.0);
    EXPECT_TRUE(c.yarn_only_types_given);
    EXPECT_EQ(c.yarn_only_types, std::vector<std::string>{"full_attention"});
    EXPECT_TRUE(c.moe_layers_given);
    ASSERT_EQ(c.moe_layers.size(), 42u);
    EXPECT_EQ(c.moe_layers.front(), 3);
    EXPECT_EQ(c.moe_layers.back(), 44);
    EXPECT_EQ(c.n_experts, 288);
    EXPECT_EQ(c.top_k, 8);
    EXPECT_EQ(c.d_expert, 1280);
    EXPECT_EQ(c.d_shared, 1280);
    EXPECT_EQ(c.moe_router_activation, "sigmoid");
    EXPECT_TRUE(c.use_moe_router_bias);
    EXPECT_TRUE(c.norm_expert_weight);
    EXPECT_EQ(c.moe_router_scaling_factor, 3.0);
    EXPECT_TRUE(c.need_fp32_gate);
    EXPECT_TRUE(c.use_moe);
    EXPECT_EQ(c.moe_layer_offset, 0);
    EXPECT_EQ(c.moe_every_n_layer, 1);
    EXPECT_EQ(c.rms_norm_eps, 1e-5);
    EXPECT_FALSE(c.tie_word_embeddings);
    EXPECT_EQ(c.bos_token_id, 0);
    EXPECT_EQ(c.pad_token_id, 1);
    EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{1, 2, 128007}));
    EXPECT_FALSE(c.quantization.present);
    EXPECT_FALSE(c.is_fp8());
    EXPECT_TRUE(c.unknown_keys.empty()) << c.unknown_keys.front();
}

// STEP35.md section 3, every layer.
TEST(Step35Config, ReleaseLayerGeometry) {
    const Step35Config c = parse_ok(release_json());
    ASSERT_EQ(c.layers.size(), 48u);
    int n_full = 0;
    for (int i = 0; i < 48; ++i) {
        SCOPED_TRACE(i);
        const LayerGeometry &g = c.layers[static_cast<size_t>(i)];
        const bool mtp = i >= 45;
        const bool full = !mtp && i % 4 == 0;
        n_full += full ? 1 : 0;
        EXPECT_EQ(g.index, i);
        EXPECT_EQ(g.is_mtp, mtp);
        EXPECT_EQ(g.attn, full ? AttnKind::kFull : AttnKind::kSliding);
        EXPECT_EQ(g.n_heads, full ? 64 : 96);
        EXPECT_EQ(g.n_kv_heads, 8);
        EXPECT_EQ(g.head_dim, 128);
        EXPECT_EQ(g.rot_dim, full ? 64 : 128);
        EXPECT_EQ(g.rope_theta, full ? 5e6 : 1e4);
        EXPECT_EQ(g.rope_scaled, full);
        EXPECT_TRUE(g.uses_rope);
        EXPECT_EQ(g.window, full ? 0 : 512);
        const bool moe = i >= 3 && i <= 44;
        EXPECT_EQ(g.ffn, moe ? FfnKind::kMoe : FfnKind::kDense);
        EXPECT_EQ(g.d_ff, moe ? 0 : 11264);
        EXPECT_EQ(g.n_experts, moe ? 288 : 0);
        EXPECT_EQ(g.top_k, moe ? 8 : 0);
        EXPECT_EQ(g.d_expert, moe ? 1280 : 0);
        EXPECT_EQ(g.d_shared, moe ? 1280 : 0);
        EXPECT_EQ(g.clamp_routed, (i == 43 || i == 44) ? 7.0f : 0.0f);
        EXPECT_EQ(g.clamp_shared, i == 44 ? 16.0f : 0.0f);
    }
    EXPECT_EQ(n_full, 12);
    EXPECT_EQ(attn_kind_name(c.layers[0].attn), "full");
    EXPECT_EQ(attn_kind_name(c.layers[1].attn), "sliding");
    EXPECT_EQ(ffn_kind_name(c.layers[0].ffn), "dense");
    EXPECT_EQ(ffn_kind_name(c.layers[3].ffn), "moe");
}

TEST(Step35Config, Fp8Fixture) {
    const std::string text =
        read_text(std::filesystem::path(MEMRA_SOURCE_DIR) / "tests/data/step35_flash_fp8_config.json");
    auto c = parse_step35_config(text);
    ASSERT_TRUE(c.has_value()) << c.error().message;
    EXPECT_TRUE(c->is_fp8());
    EXPECT_EQ(c->quantization.quant_method, "fp8");
    EXPECT_EQ(c->quantization.fmt, "e4m3");
    EXPECT_EQ(c->quantization.activation_scheme, "dynamic");
    EXPECT_EQ(c->quantization.block_out, 128);
    EXPECT_EQ(c->quantization.block_in, 128);
    EXPECT_TRUE(c->quantization.unquantized_key.empty());
    EXPECT_TRUE(c->unknown_keys.empty());
    EXPECT_EQ(c->layers.size(), 48u);
}

// A small config written with the alternative spellings: num_key_value_heads, scalar rope_theta and
// partial_rotary_factor, legacy rope_scaling "type", share_expert_dims, moe_layers_enum as an int list,
// eos as an int, "dtype", 0/1 in use_rope_layers, null clamps, unknown keys at several levels.
TEST(Step35Config, AlternativeSpellings) {
    const Json j = {
        {"model_type", "step3p5"},
        {"hidden_size", 64},
        {"intermediate_size", 96},
        {"num_hidden_layers", 4},
        {"vocab_size", 256},
        {"max_seq_len", 1024},
        {"num_attention_heads", 4},
        {"num_key_value_heads", 2},
        {"rope_theta", 10000},
        {"partial_rotary_factor", 0.5},
        {"rope_scaling",
         {{"type", "llama3"},
          {"factor", 8},
          {"original_max_position_embeddings", 512},
          {"low_freq_factor", 1},
          {"high_freq_factor", 4},
          {"extra", 1}}},
        {"moe_layers_enum", {3, 1}},
        {"moe_num_experts", 4},
        {"moe_top_k", 2},
        {"moe_intermediate_size", 24},
        {"share_expert_dims", 32},
        {"eos_token_id", 7},
        {"dtype", "float32"},
        {"use_rope_layers", {true, 0, 1, false}},
        {"swiglu_limits", {nullptr, 5, nullptr, nullptr}},
        {"swiglu_limits_shared", {1.5, nullptr, nullptr, 2}},
        {"initializer_range", 0.02},
        {"use_cache", true},
        {"sliding_window", nullptr},
        {"quantization_config",
         {{"quant_method", "fp8"}, {"weight_block_size", {32, 16}}, {"ignored_layers", {"lm_head"}}, {"foo", 1}}},
    };
    const Step35Config c = parse_ok(j);
    EXPECT_EQ(c.n_kv_heads, 2);
    EXPECT_EQ(c.head_dim, 16);  // hidden_size / num_attention_heads
    EXPECT_EQ(c.context_length, 1024);
    EXPECT_EQ(c.torch_dtype, "float32");
    EXPECT_EQ(c.d_shared, 32);
    EXPECT_EQ(c.moe_layers, (std::vector<int>{1, 3}));
    EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{7});
    EXPECT_FALSE(c.bos_token_id.has_value());
    EXPECT_TRUE(c.tie_word_embeddings);  // PretrainedConfig default
    EXPECT_FALSE(c.use_head_wise_attn_gate);
    EXPECT_FALSE(c.layer_types_given);
    EXPECT_FALSE(c.yarn_only_types_given);
    EXPECT_EQ(c.sliding_window, 0);
    EXPECT_EQ(c.rope_scaling.type, "llama3");
    EXPECT_EQ(c.quantization.block_out, 32);
    EXPECT_EQ(c.quantization.block_in, 16);
    EXPECT_EQ(c.quantization.unquantized_key, "ignored_layers");
    EXPECT_EQ(c.quantization.unquantized_modules, std::vector<std::string>{"lm_head"});
    EXPECT_EQ(c.unknown_keys, (std::vector<std::string>{"initializer_range", "quantization_config.foo",
                                                        "rope_scaling.extra", "use_cache"}));
    ASSERT_EQ(c.layers.size(), 4u);
    const bool rope[] = {true, false, true, false};
    for (size_t i = 0; i < 4; ++i) {
        SCOPED_TRACE(i);
        const LayerGeometry &g = c.layers[i];
        EXPECT_EQ(g.attn, AttnKind::kFull);  // no layer_types: every trunk layer is full
        EXPECT_EQ(g.n_heads, 4);
        EXPECT_EQ(g.n_kv_heads, 2);
        EXPECT_EQ(g.rot_dim, 8);
        EXPECT_EQ(g.rope_theta, 10000.0);
        EXPECT_EQ(g.uses_rope, rope[i]);
        EXPECT_EQ(g.rope_scaled, rope[i]);  // no yarn_only_types: every layer that uses RoPE is scaled
        EXPECT_EQ(g.window, 0);
        const bool moe = i == 1 || i == 3;
        EXPECT_EQ(g.ffn, moe ? FfnKind::kMoe : FfnKind::kDense);
        EXPECT_EQ(g.d_ff, moe ? 0 : 96);
    }
    EXPECT_EQ(c.layers[1].clamp_routed, 5.0f);
    EXPECT_EQ(c.layers[0].clamp_routed, 0.0f);
    EXPECT_EQ(c.layers[0].clamp_shared, 1.5f);
    EXPECT_EQ(c.layers[3].clamp_shared, 2.0f);
    EXPECT_EQ(c.layers[3].clamp_routed, 0.0f);
}

// Absent moe_layers_enum -> layers 1..L-1 (HF remote code); absent layer_types with MTP -> MTP sliding.
TEST(Step35Config, DefaultsWithMtp) {
    const Json j = {
        {"model_type", "step3p5"},     {"hidden_size", 32},      {"intermediate_size", 48},
        {"num_hidden_layers", 3},      {"vocab_size", 100},      {"max_position_embeddings", 64},
        {"num_attention_heads", 2},    {"num_attention_groups", 1}, {"head_dim", 8},
        {"num_nextn_predict_layers", 2}, {"rope_theta", 500000.0}, {"sliding_window", 16},
        {"moe_num_experts", 4},        {"moe_top_k", 1},         {"moe_intermediate_size", 8},
        {"share_expert_dim", 8},
        {"attention_other_setting",
         {{"attention_type", "sliding_attention"}, {"num_attention_heads", 3}, {"num_attention_groups", 1}}},
    };
    const Step35Config c = parse_ok(j);
    EXPECT_FALSE(c.moe_layers_given);
    EXPECT_EQ(c.moe_layers, (std::vector<int>{1, 2}));
    ASSERT_EQ(c.layers.size(), 5u);
    for (size_t i = 0; i < 5; ++i) {
        SCOPED_TRACE(i);
        const LayerGeometry &g = c.layers[i];
        const bool mtp = i >= 3;
        EXPECT_EQ(g.is_mtp, mtp);
        EXPECT_EQ(g.attn, mtp ? AttnKind::kSliding : AttnKind::kFull);
        EXPECT_EQ(g.n_heads, mtp ? 3 : 2);
        EXPECT_EQ(g.head_dim, 8);  // override without head_dim keeps the top-level one
        EXPECT_EQ(g.window, mtp ? 16 : 0);
        EXPECT_EQ(g.rot_dim, 8);
        EXPECT_FALSE(g.rope_scaled);
        EXPECT_EQ(g.ffn, (i == 1 || i == 2) ? FfnKind::kMoe : FfnKind::kDense);
        EXPECT_EQ(g.d_ff, (i == 1 || i == 2) ? 0 : 48);
    }
    EXPECT_EQ(c.layer_types[3], "sliding_attention");
}

TEST(Step35Config, PerLayerListsWithoutMtp) {
    // Without MTP layers the lists have exactly num_hidden_layers entries.
    Json j = release_json();
    j.erase("num_nextn_predict_layers");
    for (const char *key : {"layer_types", "rope_theta", "partial_rotary_factors", "swiglu_limits",
                            "swiglu_limits_shared"}) {
        j[key].erase(j[key].end() - 3, j[key].end());
    }
    const Step35Config c = parse_ok(j);
    EXPECT_EQ(c.n_mtp_layers, 0);
    EXPECT_EQ(c.layers.size(), 45u);
    EXPECT_EQ(c.layers[44].clamp_shared, 16.0f);
    // 48-entry lists without MTP layers are refused.
    Json long_lists = release_json();
    long_lists["num_nextn_predict_layers"] = 0;
    EXPECT_ERROR(long_lists, "layer_types: expected 45 entries (one per layer), found 48");
}

TEST(Step35Config, RopeVariants) {
    Json j = release_json();
    j["yarn_only_types"] = Json::array();  // a present empty list scales nothing (HF remote code)
    Step35Config c = parse_ok(j);
    for (const LayerGeometry &g : c.layers) {
        EXPECT_FALSE(g.rope_scaled) << g.index;
    }
    j = release_json();
    j.erase("yarn_only_types");  // absent: every layer
    c = parse_ok(j);
    for (const LayerGeometry &g : c.layers) {
        EXPECT_TRUE(g.rope_scaled) << g.index;
    }
    j = release_json();
    j["rope_scaling"] = {{"rope_type", "default"}};  // plain RoPE
    c = parse_ok(j);
    EXPECT_FALSE(c.rope_scaling.present);
    EXPECT_FALSE(c.layers[0].rope_scaled);
    j = release_json();
    j["rope_scaling"] = nullptr;
    EXPECT_FALSE(parse_ok(j).rope_scaling.present);
    j = release_json();
    j["rope_theta"] = 1e4;  // a scalar applies to every layer
    c = parse_ok(j);
    EXPECT_EQ(c.layers[0].rope_theta, 1e4);
    EXPECT_EQ(c.layers[47].rope_theta, 1e4);
    j = release_json();
    j["partial_rotary_factor"] = 0.25;  // the list wins over the scalar
    EXPECT_EQ(parse_ok(j).layers[0].rot_dim, 64);
    j = release_json();
    j["use_rope_layers"] = Json::array();  // empty: every layer
    EXPECT_TRUE(parse_ok(j).layers[5].uses_rope);
    j = release_json();
    j["moe_layers_enum"] = " 3, 4 ,5,";  // spaces and an empty token
    EXPECT_EQ(parse_ok(j).moe_layers, (std::vector<int>{3, 4, 5}));
    j["moe_layers_enum"] = "";
    EXPECT_TRUE(parse_ok(j).moe_layers.empty());
}

TEST(Step35Config, ErrorsMissingAndTypes) {
    Json j = release_json();
    j.erase("hidden_size");
    EXPECT_ERROR(j, "hidden_size: required key is missing");
    j = release_json();
    j.erase("model_type");
    EXPECT_ERROR(j, "model_type: required key is missing");
    j = release_json();
    j.erase("rope_theta");
    EXPECT_ERROR(j, "rope_theta: required key is missing");
    j = release_json();
    j.erase("num_attention_groups");
    EXPECT_ERROR(j, "num_attention_groups: required key is missing");
    j = release_json();
    j.erase("moe_num_experts");
    EXPECT_ERROR(j, "moe_num_experts: required key is missing");
    j = release_json();
    j.erase("share_expert_dim");
    EXPECT_ERROR(j, "share_expert_dim: required key is missing");
    j = release_json();
    j.erase("max_seq_len");
    j.erase("max_position_embeddings");
    EXPECT_ERROR(j, "max_position_embeddings: required key is missing (and no max_seq_len either)");
    j = release_json();
    j.erase("sliding_window");
    EXPECT_ERROR(j, "sliding_window: required key is missing (layer_types has sliding_attention layers)");

    j = release_json();
    j["hidden_size"] = "4096";
    EXPECT_ERROR(j, "hidden_size: expected a positive integer, found \"4096\"");
    j = release_json();
    j["num_hidden_layers"] = 45.5;
    EXPECT_ERROR(j, "num_hidden_layers: expected a positive integer, found 45.5");
    j = release_json();
    j["hidden_size"] = 18446744073709551615ull;
    EXPECT_ERROR(j, "hidden_size: expected a positive integer, found 18446744073709551615");
    j = release_json();
    j["tie_word_embeddings"] = "false";
    EXPECT_ERROR(j, "tie_word_embeddings: expected true or false, found \"false\"");
    j = release_json();
    j["layer_types"] = "sliding_attention";
    EXPECT_ERROR(j, "layer_types: expected a list of 48 entries (45 trunk + 3 MTP layers), found "
                    "\"sliding_attention\"");
    j = release_json();
    j["rope_theta"][7] = "1e4";
    EXPECT_ERROR(j, "rope_theta[7]: expected a number, found \"1e4\"");
    j = release_json();
    j["eos_token_id"] = {1, "a"};
    EXPECT_ERROR(j, "eos_token_id[1]: expected a token id >= 0, found \"a\"");
    j = release_json();
    j["eos_token_id"] = -2;
    EXPECT_ERROR(j, "eos_token_id: expected a token id >= 0, found -2");
    // eos ids stay int64 and must index the vocabulary (release vocab_size 128896), so that narrowing
    // them to int32 token ids is exact.
    j = release_json();
    j["eos_token_id"] = {1, 128896, 2};
    EXPECT_ERROR(j, "eos_token_id[1]: expected a token id below vocab_size 128896, found 128896");
    j = release_json();
    j["eos_token_id"] = 128896;
    EXPECT_ERROR(j, "eos_token_id: expected a token id below vocab_size 128896, found 128896");
    j = release_json();
    j["eos_token_id"] = {1, -7};
    EXPECT_ERROR(j, "eos_token_id[1]: expected a token id >= 0, found -7");
    j = release_json();
    j["eos_token_id"] = int64_t{1} << 40;
    EXPECT_ERROR(j, "eos_token_id: expected a token id below vocab_size 128896, found 1099511627776");
    j = release_json();
    j["eos_token_id"] = {1, int64_t{1} << 40};
    EXPECT_ERROR(j, "eos_token_id[1]: expected a token id below vocab_size 128896, found 1099511627776");
    j = release_json();
    j["eos_token_id"] = {0, 128895};  // both ends of the vocabulary are fine
    EXPECT_EQ(parse_ok(j).eos_token_ids, (std::vector<int64_t>{0, 128895}));
    j = release_json();
    j["bos_token_id"] = -1;
    EXPECT_ERROR(j, "bos_token_id: expected a token id >= 0, found -1");
    j = release_json();
    j["attention_other_setting"] = {1, 2};
    EXPECT_ERROR(j, "attention_other_setting: expected an object, found an array of 2 entries");
    j = release_json();
    j["architectures"] = {"Step3p5ForCausalLM", 3};
    EXPECT_ERROR(j, "architectures[1]: expected a string, found 3");
    j = release_json();
    j["moe_router_scaling_factor"] = -3.0;
    EXPECT_ERROR(j, "moe_router_scaling_factor: expected a positive number, found -3.0");
    j = release_json();
    j["rms_norm_eps"] = 0;
    EXPECT_ERROR(j, "rms_norm_eps: expected a positive number, found 0");
    j = release_json();
    j["num_nextn_predict_layers"] = -1;
    EXPECT_ERROR(j, "num_nextn_predict_layers: expected an integer >= 0, found -1");
    j = release_json();
    j["use_rope_layers"] = Json::array();
    for (int i = 0; i < 48; ++i) {
        j["use_rope_layers"].push_back(i == 9 ? Json(2) : Json(true));
    }
    EXPECT_ERROR(j, "use_rope_layers[9]: expected true or false, found 2");
}

TEST(Step35Config, ErrorsSizes) {
    Json j = release_json();
    j["intermediate_size"] = 0;
    EXPECT_ERROR(j, "intermediate_size: expected a positive integer, found 0");
    j = release_json();
    j["moe_num_experts"] = -3;
    EXPECT_ERROR(j, "moe_num_experts: expected a positive integer, found -3");
    j = release_json();
    j["vocab_size"] = 0;
    EXPECT_ERROR(j, "vocab_size: expected a positive integer, found 0");
    j = release_json();
    j["vocab_size"] = -128896;
    EXPECT_ERROR(j, "vocab_size: expected a positive integer, found -128896");
    j = release_json();
    j["hidden_size"] = kMaxConfigDim + 1;
    EXPECT_ERROR(j, "hidden_size: 16777217 is larger than the limit 16777216");
    j = release_json();
    j["num_hidden_layers"] = 5000;
    EXPECT_ERROR(j, "num_hidden_layers + num_nextn_predict_layers: 5003 layers is more than the limit 4096");
    j = release_json();
    j["moe_num_experts"] = kMaxConfigDim;  // 2^24 experts of 3 x 4096 x 1280: far beyond 2^53 parameters
    EXPECT_ERROR(j, "config: describes about");
    j = release_json();
    j["max_seq_len"] = 0;
    EXPECT_ERROR(j, "max_seq_len: expected a positive integer, found 0");
}

TEST(Step35Config, ErrorsListLengths) {
    Json j = release_json();
    j["rope_theta"].erase(44);
    EXPECT_ERROR(j, "rope_theta: expected 48 entries (45 trunk + 3 MTP layers), found 47");
    j = release_json();
    j["layer_types"].erase(0);
    EXPECT_ERROR(j, "layer_types: expected 48 entries (45 trunk + 3 MTP layers), found 47");
    j = release_json();
    j["partial_rotary_factors"].push_back(1.0);
    EXPECT_ERROR(j, "partial_rotary_factors: expected 48 entries (45 trunk + 3 MTP layers), found 49");
    j = release_json();
    j["swiglu_limits"].erase(0);
    EXPECT_ERROR(j, "swiglu_limits: expected 48 entries (45 trunk + 3 MTP layers), found 47");
    j = release_json();
    j["swiglu_limits_shared"] = Json::array();
    EXPECT_ERROR(j, "swiglu_limits_shared: expected 48 entries (45 trunk + 3 MTP layers), found 0");
    j = release_json();
    j["use_rope_layers"] = {true};
    EXPECT_ERROR(j, "use_rope_layers: expected 48 entries (45 trunk + 3 MTP layers), found 1");
}

TEST(Step35Config, ErrorsGeometry) {
    Json j = release_json();
    j["num_attention_heads"] = 60;
    EXPECT_ERROR(j, "num_attention_heads: 60 query heads are not a multiple of num_attention_groups 8 (layer 0)");
    j = release_json();
    j["attention_other_setting"]["num_attention_heads"] = 100;
    EXPECT_ERROR(j, "attention_other_setting.num_attention_heads: 100 query heads are not a multiple of "
                    "attention_other_setting.num_attention_groups 8 (layer 1)");
    j = release_json();
    j["moe_top_k"] = 300;
    EXPECT_ERROR(j, "moe_top_k: 300 is larger than moe_num_experts 288");
    j = release_json();
    j["moe_layers_enum"] = "3,4,45";
    EXPECT_ERROR(j, "moe_layers_enum: MoE layer index 45 is out of range: trunk layers are 0..44 (MTP layers are "
                    "always dense)");
    j["moe_layers_enum"] = "-1,3";
    EXPECT_ERROR(j, "moe_layers_enum: MoE layer index -1 is out of range");
    j["moe_layers_enum"] = "3,x4";
    EXPECT_ERROR(j, "moe_layers_enum: expected comma-separated layer indices, found \"x4\" in it");
    j["moe_layers_enum"] = "3,4,3";
    EXPECT_ERROR(j, "moe_layers_enum: layer 3 is listed twice");
    j["moe_layers_enum"] = {3, 4.5};
    EXPECT_ERROR(j, "moe_layers_enum[1]: expected a layer index, found 4.5");
    j["moe_layers_enum"] = 3;
    EXPECT_ERROR(j, "moe_layers_enum: expected a comma-separated string of layer indices, found 3");
    j = release_json();
    j["partial_rotary_factors"][0] = 65.0 / 128.0;
    EXPECT_ERROR(j, "partial_rotary_factors[0]: 0.5078125 gives an odd rot_dim 65 (RoPE rotates pairs)");
    j = release_json();
    j["partial_rotary_factors"][4] = 1.5;
    EXPECT_ERROR(j, "partial_rotary_factors[4]: 1.5 gives rot_dim 192 > head_dim 128");
    j = release_json();
    j["partial_rotary_factors"][0] = 0.3;
    EXPECT_ERROR(j, "partial_rotary_factors[0]: 0.3 x head_dim 128 = 38.4 is not a whole number of dimensions");
    j = release_json();
    j["partial_rotary_factors"][2] = 0;
    EXPECT_ERROR(j, "partial_rotary_factors[2]: expected a positive number, found 0");
    j = release_json();
    j.erase("partial_rotary_factors");
    j["partial_rotary_factor"] = 0.6;
    EXPECT_ERROR(j, "partial_rotary_factor: 0.6 x head_dim 128 = 76.8 is not a whole number of dimensions");
    j = release_json();
    j["layer_types"][5] = "local_attention";
    EXPECT_ERROR(j, "layer_types[5]: unknown layer type \"local_attention\"");
    j = release_json();
    j["yarn_only_types"] = {"full"};
    EXPECT_ERROR(j, "yarn_only_types[0]: unknown layer type \"full\"");
    j = release_json();
    j["attention_other_setting"]["attention_type"] = "swa";
    EXPECT_ERROR(j, "attention_other_setting.attention_type: unknown layer type \"swa\"");
    j = release_json();
    j["attention_other_setting"].erase("num_attention_groups");
    EXPECT_ERROR(j, "attention_other_setting.num_attention_groups: required key is missing");
    j = release_json();
    j["attention_other_setting"]["true_head_dim"] = 96;
    EXPECT_ERROR(j, "attention_other_setting.true_head_dim: expected 128 (the head_dim), found 96");
    j = release_json();
    j["head_dim"] = nullptr;  // null counts as absent: hidden_size / num_attention_heads = 64 is used
    j["hidden_size"] = 4000;
    EXPECT_ERROR(j, "head_dim: absent, and hidden_size 4000 is not a multiple of num_attention_heads 64");
    j = release_json();
    j["swiglu_limits"][3] = -7.0;
    EXPECT_ERROR(j, "swiglu_limits[3]: expected a limit >= 0 (0 or null = off), found -7.0");
    j = release_json();
    j["num_key_value_heads"] = 4;
    EXPECT_ERROR(j, "num_key_value_heads: 4 disagrees with num_attention_groups 8");
    j = release_json();
    j["share_expert_dims"] = 2560;
    EXPECT_ERROR(j, "share_expert_dims: 2560 disagrees with share_expert_dim 1280");
}

TEST(Step35Config, ErrorsUnsupported) {
    Json j = release_json();
    j["model_type"] = "step4";
    EXPECT_ERROR(j, "model_type: expected \"step3p5\" (Step-3.5), found \"step4\"");
    j = release_json();
    j["moe_router_activation"] = "softmax";
    EXPECT_ERROR(j, "moe_router_activation: only \"sigmoid\" routing is supported, found \"softmax\"");
    j = release_json();
    j["att_impl_type"] = "MLA";
    EXPECT_ERROR(j, "att_impl_type: only \"GQA\" is supported, found \"MLA\"");
    j = release_json();
    j["use_moe_router_bias"] = false;
    EXPECT_ERROR(j, "use_moe_router_bias: only true is supported");
    j = release_json();
    j["need_fp32_gate"] = false;
    EXPECT_ERROR(j, "need_fp32_gate: only true is supported (router logits in FP32), found false");
    j = release_json();
    j["zero_centered"] = false;
    EXPECT_ERROR(j, "zero_centered: only true is supported");
    j = release_json();
    j["sink"] = true;
    EXPECT_ERROR(j, "sink: attention sinks are not supported, found true");
    j = release_json();
    j["hidden_act"] = "gelu";
    EXPECT_ERROR(j, "hidden_act: only \"silu\" is supported, found \"gelu\"");
    j = release_json();
    j.erase("moe_layers_enum");
    j["use_moe"] = false;
    EXPECT_ERROR(j, "moe_layers_enum: missing while use_moe is false");
    j = release_json();
    j["rope_scaling"]["rope_type"] = "yarn";
    EXPECT_ERROR(j, "rope_scaling.rope_type: only \"llama3\" scaling is supported, found \"yarn\"");
    j = release_json();
    j["rope_scaling"].erase("rope_type");
    j["rope_scaling"]["type"] = "linear";
    EXPECT_ERROR(j, "rope_scaling.type: only \"llama3\" scaling is supported, found \"linear\"");
    j = release_json();
    j["rope_scaling"].erase("rope_type");
    EXPECT_ERROR(j, "rope_scaling.rope_type: required key is missing");
    j = release_json();
    j["rope_scaling"]["high_freq_factor"] = 1.0;
    EXPECT_ERROR(j, "rope_scaling.high_freq_factor: expected a value above low_freq_factor 1, found 1");
    j = release_json();
    j["rope_scaling"].erase("original_max_position_embeddings");
    EXPECT_ERROR(j, "rope_scaling.original_max_position_embeddings: required key is missing");
    j = release_json();
    j["rope_scaling"] = "llama3";
    EXPECT_ERROR(j, "rope_scaling: expected an object or null, found \"llama3\"");
}

TEST(Step35Config, ErrorsQuantization) {
    Json j = release_json();
    j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128}}};
    EXPECT_ERROR(j, "quantization_config.weight_block_size: expected two positive integers, found [128]");
    j["quantization_config"]["weight_block_size"] = {128, 0};
    EXPECT_ERROR(j, "quantization_config.weight_block_size: expected two positive integers, found [128,0]");
    j["quantization_config"]["weight_block_size"] = {256, 16777213};  // each fine, their lcm is not
    EXPECT_ERROR(j, "quantization_config.weight_block_size: tiles 256 x 16777213 have a common multiple above");
    j["quantization_config"]["weight_block_size"] = {128, 128.5};
    EXPECT_ERROR(j, "quantization_config.weight_block_size: expected two positive integers, found [128,128.5]");
    j["quantization_config"]["weight_block_size"] = "128";
    EXPECT_ERROR(j, "quantization_config.weight_block_size: expected two positive integers, found \"128\"");
    j["quantization_config"].erase("weight_block_size");
    EXPECT_ERROR(j, "quantization_config.weight_block_size: required key is missing");
    j["quantization_config"] = {{"quant_method", "awq"}, {"weight_block_size", {128, 128}}};
    EXPECT_ERROR(j, "quantization_config.quant_method: only \"fp8\" (block-scaled E4M3) is supported, found \"awq\"");
    j["quantization_config"] = {{"weight_block_size", {128, 128}}};
    EXPECT_ERROR(j, "quantization_config.quant_method: required key is missing");
    j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e5m2"}, {"weight_block_size", {128, 128}}};
    EXPECT_ERROR(j, "quantization_config.fmt: only \"e4m3\" is supported, found \"e5m2\"");
    j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}, {"ignore", {"a"}},
                                {"ignored_layers", {"b"}}};
    EXPECT_ERROR(j, "quantization_config.ignore: unquantized modules are already listed under "
                    "quantization_config.ignored_layers");
    j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}},
                                {"modules_to_not_convert", "lm_head"}};
    EXPECT_ERROR(j, "quantization_config.modules_to_not_convert: expected a list of strings, found \"lm_head\"");
    j["quantization_config"] = 3;
    EXPECT_ERROR(j, "quantization_config: expected an object, found 3");
    // Unknown keys inside quantization_config are noted, never fatal.
    j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}, {"bits", 8},
                                {"modules_to_not_convert", nullptr}};
    const Step35Config c = parse_ok(j);
    EXPECT_EQ(c.unknown_keys, std::vector<std::string>{"quantization_config.bits"});
    EXPECT_TRUE(c.quantization.unquantized_key.empty());
}

TEST(Step35Config, ErrorsJson) {
    EXPECT_PRED_FORMAT2(::testing::IsSubstring, "config: invalid JSON:",
                        parse_step35_config("{\"hidden_size\": 4096,").error().message);
    EXPECT_PRED_FORMAT2(::testing::IsSubstring, "config: invalid JSON:", parse_step35_config("").error().message);
    EXPECT_EQ(parse_step35_config("[]").error().message,
              "config: expected a JSON object at the top level, found an array of 0 entries");
    EXPECT_EQ(parse_step35_config("42").error().message, "config: expected a JSON object at the top level, found 42");
}

TEST(Step35Config, LoadFromDirectory) {
    const std::filesystem::path dir =
        std::filesystem::temp_directory_path() / ("memra_step35_config_test_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    auto missing = load_step35_config(dir);
    ASSERT_FALSE(missing.has_value());
    EXPECT_EQ(missing.error().message, (dir / "config.json").string() + ": not found");

    std::ofstream(dir / "config.json") << "{\"model_type\": \"llama\"}";
    auto wrong = load_step35_config(dir);
    ASSERT_FALSE(wrong.has_value());
    EXPECT_EQ(wrong.error().message,
              (dir / "config.json").string() + ": model_type: expected \"step3p5\" (Step-3.5), found \"llama\"");

    std::ofstream(dir / "config.json") << release_text();
    auto ok = load_step35_config(dir);
    ASSERT_TRUE(ok.has_value()) << ok.error().message;
    EXPECT_EQ(ok->layers.size(), 48u);

    std::filesystem::remove(dir / "config.json");
    std::filesystem::create_directory(dir / "config.json");
    auto not_file = load_step35_config(dir);
    ASSERT_FALSE(not_file.has_value());
    EXPECT_EQ(not_file.error().message, (dir / "config.json").string() + ": not a regular file");
    std::filesystem::remove_all(dir);
}

// ~2000 seeded mutations of the fixture: byte flips, truncations, deleted keys, type swaps. Each must
// come back as a config or an error with a message; a parsed config must be self-consistent.
TEST(Step35Config, MutationsNeverCrash) {
    const std::string text = release_text();
    const Json base = Json::parse(text);
    std::vector<std::string> keys;
    for (const auto &[key, value] : base.items()) {
        keys.push_back(key);
    }
    const Json replacements[] = {nullptr, true, false, 0, -1, 1, 3, 45, 4096, 1e300, -0.5, 0.5, "", "x",
                                 "3,4", Json::array(), Json::array({1, 2}), Json::object(),
                                 Json::object({{"rope_type", "llama3"}}), 18446744073709551615ull};
    std::mt19937_64 rng(0x5eed'35f1a5);
    auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
    int n_ok = 0;
    int n_err = 0;
    for (int iter = 0; iter < 2000; ++iter) {
        std::string input;
        switch (iter % 5) {
        case 0: {  // flip 1-4 bytes to random values
            input = text;
            const size_t flips = 1 + pick(4);
            for (size_t f = 0; f < flips; ++f) {
                input[pick(input.size())] = static_cast<char>(rng() & 0xff);
            }
            break;
        }
        case 1:  // truncate
            input = text.substr(0, pick(text.size()));
            break;
        case 2: {  // delete one or two top-level keys
            Json j = base;
            j.erase(keys[pick(keys.size())]);
            if (rng() % 2 == 0) {
                j.erase(keys[pick(keys.size())]);
            }
            input = j.dump();
            break;
        }
        case 3: {  // swap the value of a key for one of another type
            Json j = base;
            j[keys[pick(keys.size())]] = replacements[pick(std::size(replacements))];
            input = j.dump();
            break;
        }
        default: {  // swap one element of a per-layer list or of a nested object
            Json j = base;
            const char *lists[] = {"layer_types", "rope_theta", "partial_rotary_factors", "swiglu_limits",
                                   "swiglu_limits_shared", "eos_token_id"};
            Json &list = j[lists[pick(std::size(lists))]];
            list[pick(list.size())] = replacements[pick(std::size(replacements))];
            const char *nested[] = {"attention_other_setting", "rope_scaling"};
            Json &obj = j[nested[pick(std::size(nested))]];
            std::vector<std::string> nested_keys;
            for (const auto &[key, value] : obj.items()) {
                nested_keys.push_back(key);
            }
            obj[nested_keys[pick(nested_keys.size())]] = replacements[pick(std::size(replacements))];
            input = j.dump();
            break;
        }
        }
        auto cfg = parse_step35_config(input);
        if (cfg) {
            ++n_ok;
            ASSERT_EQ(cfg->layers.size(), static_cast<size_t>(cfg->n_total_layers()));
            for (const LayerGeometry &g : cfg->layers) {
                ASSERT_GT(g.n_kv_heads, 0);
                ASSERT_EQ(g.n_heads % g.n_kv_heads, 0);
                ASSERT_TRUE(g.rot_dim >= 0 && g.rot_dim <= g.head_dim && g.rot_dim % 2 == 0);
                ASSERT_TRUE(g.ffn == FfnKind::kDense ? g.d_ff > 0 : g.top_k <= g.n_experts);
            }
        } else {
            ++n_err;
            ASSERT_FALSE(cfg.error().message.empty());
            ASSERT_EQ(cfg.error().message.find('\n'), std::string::npos) << cfg.error().message;
        }
    }
    EXPECT_EQ(n_ok + n_err, 2000);
    EXPECT_GT(n_ok, 100);  // the mutations are not all fatal...
    EXPECT_GT(n_err, 500);  // ...and most are caught
}

}  // namespace
}  // namespace memra::model
