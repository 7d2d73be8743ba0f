// Step-3.5 config.json: the parsed, validated configuration (Step35Config) and the per-layer geometry
// resolved from it (LayerGeometry: heads, rotary slice, window, FFN kind, clamps), trunk layers first,
// then the MTP layers. Every legacy spelling the HF remote code accepts is accepted here; every value
// memra cannot honour is refused with an error naming the JSON key (STEP35.md sections 2-3).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"

namespace memra::model {

// Upper bounds that keep every shape product and parameter sum far inside int64_t. They are sanity
// limits against corrupt configs, not capacities: the release model is orders of magnitude below them.
inline constexpr int kMaxConfigLayers = 4096;        // num_hidden_layers + num_nextn_predict_layers
inline constexpr int kMaxConfigDim = 1 << 24;        // any width, head count, expert count or vocab size
inline constexpr int64_t kMaxConfigParams = int64_t{1} << 53;  // total parameters the config may describe

enum class AttnKind {
    kFull,     // causal attention over the whole context ("full_attention")
    kSliding,  // causal attention over the last `window` positions, current one included ("sliding_attention")
};

enum class FfnKind {
    kDense,  // SwiGLU MLP of width d_ff (mlp.{gate,up,down}_proj)
    kMoe,    // sigmoid-routed experts (moe.*) plus one always-on shared expert (share_expert.*)
};

// llama3 RoPE frequency scaling ("rope_scaling"), HF _compute_llama3_parameters.
struct RopeScaling {
    bool present = false;                          // "rope_scaling" is an object (not absent/null)
    std::string type;                              // "rope_type" or legacy "type": only "llama3" is accepted
    double factor = 1.0;                           // "factor": low frequencies are divided by it
    int64_t original_max_position_embeddings = 0;  // "original_max_position_embeddings" (L0)
    double low_freq_factor = 1.0;                  // "low_freq_factor": wavelengths > L0 / low are scaled
    double high_freq_factor = 1.0;                 // "high_freq_factor": wavelengths < L0 / high are kept
};

// "attention_other_setting": head geometry for the layers whose layer_types entry equals attention_type
// (release: the sliding layers get 96 query heads instead of num_attention_heads = 64).
struct AttentionOverride {
    bool present = false;        // the object is in config.json
    std::string attention_type;  // "attention_type": the layer_types value it applies to
    int n_heads = 0;             // "num_attention_heads"
    int n_kv_heads = 0;          // "num_attention_groups"
    int head_dim = 0;            // "head_dim" (defaults to the top-level head_dim when absent)
};

// "quantization_config" of the FP8 checkpoint. Only block-scaled FP8 E4M3 weights are supported.
struct QuantizationConfig {
    bool present = false;                         // the object is in config.json
    std::string quant_method;                     // "quant_method": must be "fp8"
    std::string fmt;                              // "fmt": "e4m3" or absent
    std::string activation_scheme;                // "activation_scheme" (release: "dynamic"); informational
    int block_out = 0;                            // "weight_block_size"[0]: scale tile rows (output dim)
    int block_in = 0;                             // "weight_block_size"[1]: scale tile columns (input dim)
    std::string unquantized_key;                  // which key listed unquantized modules ("" if none)
    std::vector<std::string> unquantized_modules; // "ignored_layers" / "modules_to_not_convert" / "ignore"
};

// One decoder layer, fully resolved. Trunk layers are 0 .. n_layers-1, MTP layers follow.
struct LayerGeometry {
    int index = 0;                    // position in Step35Config::layers (= HF layer index)
    bool is_mtp = false;              // index >= num_hidden_layers
    AttnKind attn = AttnKind::kFull;  // from layer_types[index]
    int n_heads = 0;                  // query heads (release: 64 full, 96 sliding)
    int n_kv_heads = 0;               // K/V heads (release: 8)
    int head_dim = 0;                 // per-head width of q, k and v (release: 128)
    int rot_dim = 0;                  // rotated leading dims of each head: head_dim * partial_rotary_factor
    double rope_theta = 0.0;          // RoPE base for this layer (release: 5e6 full, 1e4 sliding)
    bool rope_scaled = false;         // llama3 rope_scaling applies to this layer's frequencies
    bool uses_rope = true;            // use_rope_layers[index] (absent/empty list: every layer)
    int window = 0;                   // sliding window incl. the current token; 0 = unlimited (full layers)
    FfnKind ffn = FfnKind::kDense;
    int d_ff = 0;                     // dense MLP width (0 on MoE layers)
    int n_experts = 0;                // routed experts (0 on dense layers)
    int top_k = 0;                    // experts selected per token (0 on dense layers)
    int d_expert = 0;                 // routed expert width (0 on dense layers)
    int d_shared = 0;                 // shared expert width (0 on dense layers)
    float clamp_routed = 0.0f;        // routed SwiGLU limit, swiglu_limits[index]; 0 = off (always 0 when dense)
    float clamp_shared = 0.0f;        // shared-expert / dense-MLP limit, swiglu_limits_shared[index]; 0 = off
};

struct Step35Config {
    // ---- identity ----
    std::string model_type;                  // "model_type": must be "step3p5"
    std::vector<std::string> architectures;  // "architectures" (informational; release ["Step3p5ForCausalLM"])
    std::string torch_dtype;                 // "torch_dtype" (or transformers-5 "dtype"); "" when absent

    // ---- sizes ----
    int d_model = 0;       // "hidden_size": residual width (release 4096)
    int d_ff = 0;          // "intermediate_size": dense MLP width of dense trunk layers and MTP layers (11264)
    int n_layers = 0;      // "num_hidden_layers": trunk decoder layers (45)
    int n_mtp_layers = 0;  // "num_nextn_predict_layers": MTP layers stored after the trunk (3); 0 if absent
    int vocab_size = 0;    // "vocab_size": rows of embed_tokens, lm_head and each MTP shared_head (128896)
    int64_t max_seq_len = 0;              // "max_seq_len"; 0 when absent
    int64_t max_position_embeddings = 0;  // "max_position_embeddings"; 0 when absent
    int64_t context_length = 0;  // max_position_embeddings if given, else max_seq_len (one of them is required)

    // ---- attention (defaults for layers the override does not cover) ----
    int n_heads = 0;     // "num_attention_heads": query heads of full-attention layers (64)
    int n_kv_heads = 0;  // "num_attention_groups" (or "num_key_value_heads"): K/V heads (8)
    int head_dim = 0;    // "head_dim"; absent: hidden_size / num_attention_heads (HF fallback)
    AttentionOverride attention_other;  // "attention_other_setting"
    std::string att_impl_type;          // "att_impl_type": only "GQA" (default when absent)
    bool use_qk_norm = true;            // "use_qk_norm"; q_norm/k_norm are applied (and expected) regardless,
                                        // as in the HF remote code
    bool use_head_wise_attn_gate = false;  // "use_head_wise_attn_gate": g_proj present (vLLM default false)
    int sliding_window = 0;  // "sliding_window": window of sliding layers; 0 when absent (then no layer
                             // may be sliding)
    std::vector<std::string> layer_types;  // "layer_types" as resolved, one per layer (trunk + MTP):
                                           // "full_attention" or "sliding_attention"
    bool layer_types_given = false;        // false: layer_types came from the default (see .cpp)

    // ---- RoPE ----
    RopeScaling rope_scaling;                  // "rope_scaling"
    bool yarn_only_types_given = false;        // "yarn_only_types" present; absent: scaling on every layer
    std::vector<std::string> yarn_only_types;  // "yarn_only_types": layer types rope_scaling applies to

    // ---- MoE ----
    std::vector<int> moe_layers;  // "moe_layers_enum" (comma string or int list), sorted trunk indices
    bool moe_layers_given = false;  // false: the HF default 1 .. num_hidden_layers-1 was used
    int n_experts = 0;            // "moe_num_experts" (288); required when a layer is MoE
    int top_k = 0;                // "moe_top_k" (8)
    int d_expert = 0;             // "moe_intermediate_size" (1280)
    int d_shared = 0;             // "share_expert_dim" or alias "share_expert_dims" (1280)
    std::string moe_router_activation;      // "moe_router_activation": only "sigmoid" (default when absent)
    bool use_moe_router_bias = true;        // "use_moe_router_bias": must be true (selection bias router_bias)
    bool norm_expert_weight = true;         // "norm_expert_weight": renormalise the top-k weights
    double moe_router_scaling_factor = 1.0; // "moe_router_scaling_factor": multiplies routed weights (3.0)
    bool need_fp32_gate = true;             // "need_fp32_gate": router GEMM in FP32; must be true
    bool use_moe = false;                   // legacy "use_moe" (recorded, not used: see moe_layers)
    int64_t moe_layer_offset = 0;           // legacy "moe_layer_offset" (recorded, not used)
    int64_t moe_every_n_layer = 0;          // legacy "moe_every_n_layer" (recorded, not used)

    // ---- norms, head, tokens ----
    double rms_norm_eps = 1e-5;        // "rms_norm_eps" (all RMSNorms, zero-centred (1 + w))
    bool tie_word_embeddings = true;   // "tie_word_embeddings" (HF PretrainedConfig default true; release false)
    std::optional<int64_t> bos_token_id;  // "bos_token_id"
    std::optional<int64_t> pad_token_id;  // "pad_token_id"
    std::vector<int64_t> eos_token_ids;   // "eos_token_id": an int or a list of ints (release [1, 2, 128007]);
                                          // each in [0, vocab_size), so narrowing to int32 is exact

    QuantizationConfig quantization;  // "quantization_config"

    // ---- resolved ----
    std::vector<LayerGeometry> layers;      // n_layers + n_mtp_layers entries, trunk first
    std::vector<std::string> unknown_keys;  // keys memra does not read, sorted; nested ones as "parent.key"

    int n_total_layers() const { return n_layers + n_mtp_layers; }
    bool is_fp8() const { return quantization.present; }
};

// Parses and validates the text of a config.json. Errors name the JSON key ("rope_theta[7]: ...").
Result<Step35Config> parse_step35_config(std::string_view json_text);

// Reads model_dir/config.json and parses it; errors start with the file's path.
Result<Step35Config> load_step35_config(const std::filesystem::path &model_dir);

// "full" / "sliding" and "dense" / "moe", for messages and `memra inspect`.
std::string_view attn_kind_name(AttnKind kind);
std::string_view ffn_kind_name(FfnKind kind);

}  // namespace memra::model
