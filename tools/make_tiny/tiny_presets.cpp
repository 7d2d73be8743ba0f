// The preset table and the config.json / generation_config.json writers. Floats go through
// nlohmann's shortest round-trip formatter (5000000.0, 1e-05), which Python's json reads back
// to the same doubles.
#include "make_tiny/tiny_presets.h"

#include <algorithm>
#include <utility>

#include <nlohmann/json.hpp>

namespace memra::tools {

namespace {

// Clamp lists: 0 everywhere except the given layers.
std::vector<double> limits(int64_t n, std::initializer_list<std::pair<int64_t, double>> set) {
    std::vector<double> out(static_cast<size_t>(n), 0.0);
    for (const auto &[layer, value] : set) {
        out[static_cast<size_t>(layer)] = value;
    }
    return out;
}

std::vector<TinyPreset> make_table() {
    std::vector<TinyPreset> table;

    TinyPreset tiny;
    tiny.name = "tiny";
    tiny.description =
        "6 layers + 1 MTP, d=256, 16 experts top-8, vocab 1024: 8.9M params, 17 MiB bf16 (tests, default model)";
    tiny.d_model = 256;
    tiny.head_dim = 32;
    tiny.n_heads_full = 8;
    tiny.n_heads_sliding = 16;  // both head counts divisible by 8: plans at TP 1, 2, 4, 8
    tiny.n_kv_heads = 2;
    tiny.n_layers = 6;
    tiny.n_mtp = 1;
    tiny.window = 16;
    tiny.d_ff = 512;
    tiny.moe_layers = {2, 3, 4, 5};
    tiny.n_experts = 16;
    tiny.top_k = 8;
    tiny.d_expert = 96;  // not a multiple of 128: FP8 expert gate/up get partial blocks
    tiny.d_shared = 64;
    tiny.vocab_size = 1024;
    tiny.max_seq_len = 4096;
    // Small limits so the clamps actually cut values of O(1) activations.
    tiny.swiglu_limits = limits(7, {{4, 1.5}, {5, 1.5}});
    tiny.swiglu_limits_shared = limits(7, {{1, 2.5}, {5, 2.5}});
    tiny.max_shard_bytes = 4u << 20;  // ~17 MB -> 5 shards
    table.push_back(tiny);

    TinyPreset small;
    small.name = "small";
    small.description =
        "8 layers + 3 MTP, d=512, 32 experts top-8, vocab 4096: 78M params, 149 MiB bf16 (benchmarks)";
    small.d_model = 512;
    small.head_dim = 64;
    small.n_heads_full = 16;
    small.n_heads_sliding = 24;
    small.n_kv_heads = 4;
    small.n_layers = 8;
    small.n_mtp = 3;
    small.window = 64;
    small.d_ff = 1024;
    small.moe_layers = {2, 3, 4, 5, 6, 7};
    small.n_experts = 32;
    small.top_k = 8;
    small.d_expert = 128;
    small.d_shared = 128;
    small.vocab_size = 4096;
    small.max_seq_len = 4096;
    small.swiglu_limits = limits(11, {{6, 1.5}, {7, 1.5}});
    small.swiglu_limits_shared = limits(11, {{1, 2.5}, {7, 2.5}});
    small.max_shard_bytes = 16u << 20;
    table.push_back(small);

    // The release's widths and layer pattern (STEP35.md section 2) at a few layers and experts: the shapes the
    // GPU kernels serve (head_dim 128, widths multiples of 128).
    TinyPreset release;
    release.name = "release";
    release.description =
        "Step-3.5-Flash widths (d=4096, 64/96 heads, 8 KV, head_dim 128, experts 1280 wide top-8, vocab 128896), "
        "4 layers + 1 MTP, 32 experts (--layers, --experts): 3.2B params, 6.0 GiB bf16 (GPU tests)";
    release.d_model = 4096;
    release.head_dim = 128;
    release.n_heads_full = 64;
    release.n_heads_sliding = 96;
    release.n_kv_heads = 8;
    release.n_layers = 4;
    release.n_mtp = 1;
    release.window = 512;
    release.d_ff = 11264;
    release.moe_layers = {3};  // the release's: every layer from 3 on
    release.n_experts = 32;
    release.top_k = 8;
    release.d_expert = 1280;
    release.d_shared = 1280;
    release.vocab_size = 128896;
    release.max_seq_len = 4096;
    release.swiglu_limits = limits(5, {{3, 7.0}});
    release.swiglu_limits_shared = limits(5, {{3, 16.0}});
    release.max_shard_bytes = 1u << 30;
    table.push_back(release);

    // Step-3.5-E128 (PERFORMANCE.md section 8): the release architecture itself (STEP35.md sections 1-3: 45
    // layers with MoE from layer 3, 3 MTP layers, 262144 positions, routed clamps 7 on layers 43-44, shared clamp
    // 16 on layer 44) with 128 routed experts instead of 288. 102.8 GB in the official FP8 layout (PERFORMANCE.md's
    // 98.0 GB is without the 3 MTP layers): built in memory by `--synthetic e128`, never written.
    TinyPreset e128 = release;
    e128.name = "e128";
    e128.description =
        "Step-3.5-E128: the release architecture (45 layers + 3 MTP, context 262144) with 128 routed experts: "
        "102.8 GB with --dtype fp8 (97.9 GB without the MTP layers), 187.3 GB bf16; in memory only (--synthetic)";
    e128.n_layers = 45;
    e128.n_mtp = 3;
    e128.moe_layers.clear();
    for (int64_t l = 3; l < e128.n_layers; ++l) e128.moe_layers.push_back(l);
    e128.n_experts = 128;
    e128.max_seq_len = 262144;
    e128.swiglu_limits = limits(48, {{43, 7.0}, {44, 7.0}});
    e128.swiglu_limits_shared = limits(48, {{44, 16.0}});
    e128.max_shard_bytes = uint64_t{4} << 30;
    e128.synthetic_only = true;
    table.push_back(e128);
    return table;
}

}  // namespace

bool TinyPreset::is_moe(int64_t layer) const {
    return std::find(moe_layers.begin(), moe_layers.end(), layer) != moe_layers.end();
}

std::vector<TinyPreset> tiny_preset_table() {
    return make_table();
}

std::optional<TinyPreset> find_tiny_preset(std::string_view name) {
    for (TinyPreset &p : make_table()) {
        if (p.name == name) {
            return std::move(p);
        }
    }
    return std::nullopt;
}

std::string tiny_config_json(const TinyPreset &p, int64_t eos_im_end_id, bool fp8) {
    // nlohmann::json keeps object keys sorted, as transformers' config writer does.
    using Json = nlohmann::json;
    Json c;
    Json layer_types = Json::array();
    Json rope_theta = Json::array();
    Json partial = Json::array();
    for (int64_t i = 0; i < p.n_total_layers(); ++i) {
        bool full = p.is_full(i);
        layer_types.push_back(full ? "full_attention" : "sliding_attention");
        rope_theta.push_back(full ? 5000000.0 : 10000.0);
        partial.push_back(full ? 0.5 : 1.0);
    }
    std::string moe_enum;
    for (int64_t l : p.moe_layers) {
        if (!moe_enum.empty()) {
            moe_enum += ',';
        }
        moe_enum += std::to_string(l);
    }
    c["architectures"] = Json::array({"Step3p5ForCausalLM"});
    c["model_type"] = "step3p5";
    c["torch_dtype"] = "bfloat16";
    c["hidden_size"] = p.d_model;
    c["head_dim"] = p.head_dim;
    c["num_attention_heads"] = p.n_heads_full;
    c["num_attention_groups"] = p.n_kv_heads;
    c["attention_other_setting"] = Json{{"attention_type", "sliding_attention"},
                                        {"num_attention_heads", p.n_heads_sliding},
                                        {"num_attention_groups", p.n_kv_heads},
                                        {"head_dim", p.head_dim},
                                        {"true_head_dim", p.head_dim}};
    c["att_impl_type"] = "GQA";
    c["num_hidden_layers"] = p.n_layers;
    c["num_nextn_predict_layers"] = p.n_mtp;
    c["layer_types"] = layer_types;
    c["sliding_window"] = p.window;
    c["rope_theta"] = rope_theta;
    c["partial_rotary_factors"] = partial;
    c["rope_scaling"] = Json{{"rope_type", "llama3"},
                             {"factor", 2.0},
                             {"original_max_position_embeddings", 131072},
                             {"low_freq_factor", 1.0},
                             {"high_freq_factor", 32.0}};
    c["yarn_only_types"] = Json::array({"full_attention"});
    c["max_seq_len"] = p.max_seq_len;
    c["max_position_embeddings"] = p.max_seq_len;
    c["intermediate_size"] = p.d_ff;
    c["moe_layers_enum"] = moe_enum;
    c["moe_num_experts"] = p.n_experts;
    c["moe_top_k"] = p.top_k;
    c["moe_intermediate_size"] = p.d_expert;
    c["share_expert_dim"] = p.d_shared;
    c["moe_router_activation"] = "sigmoid";
    c["use_moe_router_bias"] = true;
    c["moe_router_scaling_factor"] = 3.0;
    c["norm_expert_weight"] = true;
    c["need_fp32_gate"] = true;
    c["swiglu_limits"] = p.swiglu_limits;
    c["swiglu_limits_shared"] = p.swiglu_limits_shared;
    c["rms_norm_eps"] = 1e-5;
    c["tie_word_embeddings"] = false;
    c["use_qk_norm"] = true;
    c["use_head_wise_attn_gate"] = true;
    c["vocab_size"] = p.vocab_size;
    c["bos_token_id"] = 0;
    c["eos_token_id"] = Json::array({1, eos_im_end_id});
    c["pad_token_id"] = 1;
    // Legacy keys of the release config; moe_layers_enum takes precedence over them.
    c["use_moe"] = true;
    c["moe_layer_offset"] = 0;
    c["moe_every_n_layer"] = 1;
    if (fp8) {
        c["quantization_config"] = Json{{"activation_scheme", "dynamic"},
                                        {"fmt", "e4m3"},
                                        {"quant_method", "fp8"},
                                        {"weight_block_size", Json::array({128, 128})}};
    }
    return c.dump(2) + "\n";
}

std::string tiny_generation_config_json(int64_t eos_im_end_id) {
    using Json = nlohmann::json;
    Json g;
    g["bos_token_id"] = 0;
    g["eos_token_id"] = Json::array({1, eos_im_end_id});
    g["pad_token_id"] = 1;
    return g.dump(2) + "\n";
}

}  // namespace memra::tools
