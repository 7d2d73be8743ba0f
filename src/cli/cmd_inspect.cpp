// `memra inspect [MODEL_DIR]`: the model summary (architecture, per-layer table, parameter counts,
// bytes by dtype) and the strict validation of every tensor against config.json.
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/progress.h"
#include "io/safetensors.h"
#include "model/step35_config.h"
#include "model/step35_stats.h"
#include "model/step35_weights.h"

namespace memra::cli {
namespace {

// 196.96B -> "196.96 B", 11534336 -> "11.53 M".
std::string human_bytes(uint64_t n) {
    const double v = static_cast<double>(n);
    if (n >= (uint64_t{1} << 30)) return fmt::format("{:.2f} GiB", v / double(uint64_t{1} << 30));
    if (n >= (uint64_t{1} << 20)) return fmt::format("{:.2f} MiB", v / double(uint64_t{1} << 20));
    if (n >= (uint64_t{1} << 10)) return fmt::format("{:.2f} KiB", v / double(uint64_t{1} << 10));
    return fmt::format("{} B", n);
}

std::string clamp_text(float limit) { return limit > 0.0f ? fmt::format("{:g}", limit) : "-"; }

void print_layer_table(const model::Step35Config &cfg) {
    std::printf("\n%-5s %-8s %-9s %-4s %-4s %-10s %-7s %-6s %-22s %s\n", "layer", "attn", "heads q/kv", "hd",
                "rot", "theta", "scaling", "window", "ffn", "clamp routed/shared");
    for (const model::LayerGeometry &g : cfg.layers) {
        std::string ffn = g.ffn == model::FfnKind::kDense
                              ? fmt::format("dense {}", g.d_ff)
                              : fmt::format("moe {}x{} top-{} +sh {}", g.n_experts, g.d_expert, g.top_k, g.d_shared);
        std::string layer = fmt::format("{}{}", g.index, g.is_mtp ? "*" : "");
        std::string heads = fmt::format("{}/{}", g.n_heads, g.n_kv_heads);
        std::string rot = g.uses_rope ? fmt::format("{}", g.rot_dim) : "none";
        std::string window = g.window > 0 ? fmt::format("{}", g.window) : "-";
        std::string clamps = fmt::format("{}/{}", clamp_text(g.clamp_routed), clamp_text(g.clamp_shared));
        std::printf("%-5s %-8s %-9s %-4d %-4s %-10s %-7s %-6s %-22s %s\n", layer.c_str(),
                    std::string(model::attn_kind_name(g.attn)).c_str(), heads.c_str(), g.head_dim, rot.c_str(),
                    fmt::format("{:g}", g.rope_theta).c_str(), g.rope_scaled ? cfg.rope_scaling.type.c_str() : "-",
                    window.c_str(), ffn.c_str(), clamps.c_str());
    }
    if (cfg.n_mtp_layers > 0) std::printf("(* = MTP layer)\n");
}

int run_inspect(const std::string &model_arg) {
    const std::filesystem::path dir = resolve_model_dir(model_arg);
    if (dir.empty()) return kExitInvalidInput;
    auto cfg = model::load_step35_config(dir);
    if (!cfg) return report_error(cfg.error().message);

    const auto t0 = std::chrono::steady_clock::now();
    auto ckpt = io::Checkpoint::open(dir, shard_progress_printer());
    if (!ckpt) return report_error(ckpt.error().message);
    std::vector<io::TensorInfo> tensors;
    for (size_t s = 0; s < ckpt->n_shards(); ++s) {
        const auto &shard = ckpt->shard(s).tensors();
        tensors.insert(tensors.end(), shard.begin(), shard.end());
    }
    const model::ValidationReport report = model::validate_tensors(*cfg, tensors);
    const model::ModelStats stats = model::compute_model_stats(*cfg, tensors);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    std::printf("model        %s\n", dir.string().c_str());
    std::printf("architecture %s (model_type %s)%s\n",
                cfg->architectures.empty() ? "?" : cfg->architectures.front().c_str(), cfg->model_type.c_str(),
                cfg->is_fp8() ? fmt::format(", FP8 {} {}x{} block scales", cfg->quantization.fmt,
                                            cfg->quantization.block_out, cfg->quantization.block_in)
                                    .c_str()
                              : "");
    std::printf("dims         d_model %d, vocab %d, %d layers + %d MTP, context %lld, rms_norm_eps %g\n",
                cfg->d_model, cfg->vocab_size, cfg->n_layers, cfg->n_mtp_layers,
                static_cast<long long>(cfg->context_length), cfg->rms_norm_eps);
    std::printf("moe          %d experts, top-%d, expert width %d, shared %d, router %s%s, scaling %g%s\n",
                cfg->n_experts, cfg->top_k, cfg->d_expert, cfg->d_shared, cfg->moe_router_activation.c_str(),
                cfg->use_moe_router_bias ? " + selection bias" : "", cfg->moe_router_scaling_factor,
                cfg->norm_expert_weight ? ", renormalised" : "");
    print_layer_table(*cfg);

    std::printf("\nparameters   total %s (%lld): trunk %s, MTP %s\n", human_count(stats.total_params).c_str(),
                static_cast<long long>(stats.total_params), human_count(stats.trunk_params).c_str(),
                human_count(stats.mtp_params).c_str());
    std::printf("             active per token %s (%lld), %s without embedding and LM head\n",
                human_count(stats.active_params).c_str(), static_cast<long long>(stats.active_params),
                human_count(stats.active_params_non_embedding).c_str());
    std::string by_dtype;
    for (const auto &[dtype, bytes] : stats.bytes_by_dtype) {
        by_dtype += fmt::format("{}{} {}", by_dtype.empty() ? "" : ", ", dtype_name(dtype), human_bytes(bytes));
    }
    std::printf("bytes        %s in %zu tensors, %zu shards: %s\n", human_bytes(stats.checkpoint_bytes).c_str(),
                tensors.size(), ckpt->n_shards(), by_dtype.c_str());
    if (!cfg->unknown_keys.empty()) {
        std::string keys;
        for (const std::string &k : cfg->unknown_keys) keys += (keys.empty() ? "" : ", ") + k;
        std::printf("config keys  not used by memra: %s\n", keys.c_str());
    }
    if (!report.ok()) {
        std::printf("validation   FAILED: %zu problems\n%s\n", report.problems.size(),
                    model::format_validation_report(report).c_str());
        return kExitInvalidInput;
    }
    std::printf("validation   OK: %zu tensors match the config%s (%.2f s)\n", report.n_found,
                report.fp8_tensors.empty() ? "" : fmt::format(", {} FP8", report.fp8_tensors.size()).c_str(),
                secs);
    return kExitOk;
}

}  // namespace

Command add_inspect_command(CLI::App &app) {
    auto model_dir = std::make_shared<std::string>();
    CLI::App *sub = app.add_subcommand(
        "inspect", "Summarise a checkpoint (architecture, layers, parameters, bytes) and validate every tensor");
    add_model_dir_option(*sub, *model_dir);
    return {sub, [model_dir]() { return run_inspect(*model_dir); }};
}

}  // namespace memra::cli
