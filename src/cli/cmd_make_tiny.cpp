// `memra make-tiny OUT_DIR`: writes a tiny Step-3.5 checkpoint in the official HF layout.
#include <cstdio>
#include <memory>

#include <fmt/format.h>

#include "cli/commands.h"
#include "make_tiny/make_tiny.h"

namespace memra::cli {

Command add_make_tiny_command(CLI::App &app) {
    auto opts = std::make_shared<tools::TinyOptions>();
    auto out_dir = std::make_shared<std::string>();
    std::string preset_help = "Size preset:";
    for (const tools::TinyPresetInfo &p : tools::tiny_presets()) {
        preset_help += fmt::format("\n  {:<6} {}", p.name, p.description);
    }

    CLI::App *sub = app.add_subcommand(
        "make-tiny", "Write a tiny Step-3.5 checkpoint (config, sharded safetensors, BPE tokenizer) from a seed");
    sub->add_option("OUT_DIR", *out_dir, "Directory to write (created; must be empty unless --force)")->required();
    // CLI11 alone would wrap "-1" into 2^64 - 1 and saturate 2^64; the validator refuses both.
    sub->add_option("-s,--seed", opts->seed, "Weight seed (the files are byte-identical for a seed)")
        ->check(uint64_validator())
        ->capture_default_str();
    sub->add_option("--preset", opts->preset, preset_help)
        ->check(CLI::IsMember(tools::tiny_preset_names()))
        ->capture_default_str();
    sub->add_option("--dtype", opts->dtype, "Weight format: bf16, or fp8 (routed experts F8_E4M3, 128x128 scales)")
        ->check(CLI::IsMember({"bf16", "fp8"}))
        ->capture_default_str();
    sub->add_option("--moe-intermediate-size", opts->moe_intermediate_size,
                    "Routed expert width, replacing the preset's (e.g. 1280, the release's); 0 keeps the preset's")
        ->check(CLI::Range(int64_t{0}, tools::kMaxTinyMoeIntermediateSize))
        ->capture_default_str();
    sub->add_option("--sliding-window", opts->sliding_window,
                    "Sliding window of the sliding-attention layers, replacing the preset's (e.g. 192: three KV "
                    "pages of 64 rows); 0 keeps the preset's")
        ->check(CLI::Range(int64_t{0}, int64_t{1} << 20))
        ->capture_default_str();
    sub->add_option("--mtp-layers", opts->mtp_layers,
                    "MTP layers (num_nextn_predict_layers), replacing the preset's (3: the release's); 0 keeps the "
                    "preset's")
        ->check(CLI::Range(int64_t{0}, int64_t{3}))
        ->capture_default_str();
    sub->add_option("--layers", opts->layers,
                    "Trunk layers (num_hidden_layers), replacing the preset's; MoE layers run from the preset's first "
                    "MoE layer to the last; 0 keeps the preset's")
        ->check(CLI::Range(int64_t{0}, tools::kMaxTinyLayers))
        ->capture_default_str();
    sub->add_option("--experts", opts->experts,
                    "Routed experts (moe_num_experts, at least the preset's top-k), replacing the preset's (288: the "
                    "release's); 0 keeps the preset's")
        ->check(CLI::Range(int64_t{0}, tools::kMaxTinyExperts))
        ->capture_default_str();
    sub->add_flag("-f,--force", opts->force, "Replace the generator's own files in a non-empty OUT_DIR");

    return {sub, [opts, out_dir]() {
                opts->out_dir = *out_dir;
                auto summary = tools::make_tiny_checkpoint(*opts);
                if (!summary) return report_error(summary.error().message);
                std::printf("wrote %s: preset %s, %s, seed %llu, %zu tensors in %zu shards, %llu parameters, "
                            "%.2f MiB, %lld tokens (vocab %lld)\n",
                            summary->out_dir.string().c_str(), opts->preset.c_str(), opts->dtype.c_str(),
                            static_cast<unsigned long long>(opts->seed), summary->n_tensors, summary->n_shards,
                            static_cast<unsigned long long>(summary->n_params),
                            static_cast<double>(summary->total_bytes) / (1024.0 * 1024.0),
                            static_cast<long long>(summary->real_token_count),
                            static_cast<long long>(summary->vocab_size));
                return kExitOk;
            }};
}

}  // namespace memra::cli
