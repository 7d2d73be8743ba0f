// Helpers shared by the subcommands: the embedded default model and error reporting.
#include <cstdio>
#include <system_error>

#include <fmt/format.h>

#include "cli/commands.h"

namespace memra::cli {

std::filesystem::path default_model_dir() {
    std::error_code ec;
    std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (ec) return {};
    return exe.parent_path() / "models" / "default";
}

void add_model_dir_option(CLI::App &sub, std::string &model_dir) {
    sub.add_option("MODEL_DIR", model_dir,
                   "Checkpoint directory (config.json + safetensors); default: the embedded tiny model")
        ->envname("MEMRA_MODEL");
}

std::filesystem::path resolve_model_dir(const std::string &model_dir) {
    if (!model_dir.empty()) return model_dir;
    std::filesystem::path dir = default_model_dir();
    if (dir.empty() || !std::filesystem::exists(dir / "config.json")) {
        report_error(fmt::format("no MODEL_DIR given and the embedded default model is missing (expected {}); "
                                 "build it with `cmake --build build` or write one with `memra make-tiny DIR`",
                                 dir.string()));
        return {};
    }
    return dir;
}

int report_error(const std::string &message) {
    std::fprintf(stderr, "error: %s\n", message.c_str());
    return kExitInvalidInput;
}

}  // namespace memra::cli
