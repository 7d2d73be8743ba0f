// Size presets of the tiny Step-3.5 checkpoint and the config.json each one produces. A preset
// keeps the release's structure (full/sliding schedule, different head counts per layer type,
// dense then MoE layers, MTP layers, clamps on the last layers) at toy sizes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace memra::tools {

struct TinyPreset {
    std::string name;
    std::string description;          // one line for --help
    int64_t d_model = 0;              // hidden_size
    int64_t head_dim = 0;             // all layers
    int64_t n_heads_full = 0;         // q heads on full-attention layers
    int64_t n_heads_sliding = 0;      // q heads on sliding-window layers
    int64_t n_kv_heads = 0;           // num_attention_groups, all layers
    int64_t n_layers = 0;             // trunk layers (num_hidden_layers)
    int64_t n_mtp = 0;                // num_nextn_predict_layers, stored as layers n_layers..
    int64_t window = 0;               // sliding_window
    int64_t d_ff = 0;                 // dense MLP width (non-MoE trunk layers and MTP layers)
    std::vector<int64_t> moe_layers;  // trunk layers with routed experts
    int64_t n_experts = 0;
    int64_t top_k = 0;
    int64_t d_expert = 0;             // moe_intermediate_size
    int64_t d_shared = 0;             // share_expert_dim
    int64_t vocab_size = 0;           // embedding rows (tokenizer tokens + padding rows)
    int64_t max_seq_len = 0;
    std::vector<double> swiglu_limits;         // n_layers + n_mtp entries; 0 = no clamp
    std::vector<double> swiglu_limits_shared;  // n_layers + n_mtp entries
    uint64_t max_shard_bytes = 0;              // shard size for write_sharded_checkpoint
    bool synthetic_only = false;               // too large to write: generated in memory only (--synthetic)

    int64_t n_total_layers() const { return n_layers + n_mtp; }
    // Layer i (trunk or MTP) uses full attention: trunk layers with i % 4 == 0; MTP layers never.
    bool is_full(int64_t layer) const { return layer < n_layers && layer % 4 == 0; }
    bool is_moe(int64_t layer) const;
    int64_t n_heads(int64_t layer) const { return is_full(layer) ? n_heads_full : n_heads_sliding; }
};

// All presets, in --help order (built on each call: no shared state).
std::vector<TinyPreset> tiny_preset_table();
// The preset called name; nullopt for an unknown name.
std::optional<TinyPreset> find_tiny_preset(std::string_view name);

// config.json text (keys sorted like Hugging Face's writer, 2-space indent, trailing newline).
// With fp8, the quantization_config of the official FP8 checkpoint is added.
std::string tiny_config_json(const TinyPreset &p, int64_t eos_im_end_id, bool fp8);
// generation_config.json text.
std::string tiny_generation_config_json(int64_t eos_im_end_id);

}  // namespace memra::tools
