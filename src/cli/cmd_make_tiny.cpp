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

    CLI::App *sub = app.add_subcommand(
        "make-tiny", "Write a tiny Step-3.5 checkpoint (config, sharded safetensors, BPE tokenizer) from a seed");
    sub->add_option("OUT_DIR", *out_dir, "Directory to write (created; must be empty unless --force)")->required();
    sub->add_option("--preset", opts->preset, "Size preset:" + tiny_preset_help())
        ->check(CLI::IsMember(tools::tiny_preset_names()))
        ->capture_default_str();
    add_tiny_model_options(*sub, *opts, "");
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
