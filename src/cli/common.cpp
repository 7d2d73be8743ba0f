// Helpers shared by the subcommands: the embedded default model and error reporting.
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <limits>
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

namespace {

// An integer validator for [lo, hi]: the whole text must be a decimal number in range (no sign, no
// spaces, no hex), so nothing is wrapped, saturated or truncated on the way to the option's value.
CLI::Validator integer_validator(uint64_t lo, uint64_t hi, const std::string &name) {
    return CLI::Validator(
        [lo, hi](std::string &text) -> std::string {
            uint64_t value = 0;
            const char *end = text.data() + text.size();
            const auto [ptr, ec] = std::from_chars(text.data(), end, value);
            if (text.empty() || ec != std::errc() || ptr != end || value < lo || value > hi) {
                return fmt::format("expected an integer in [{}, {}], found {}", lo, hi, text);
            }
            return {};
        },
        name);
}

}  // namespace

CLI::Validator uint64_validator() {
    return integer_validator(0, std::numeric_limits<uint64_t>::max(), "");  // the type already reads UINT
}

CLI::Validator positive_int_validator() {
    return integer_validator(1, static_cast<uint64_t>(std::numeric_limits<int>::max()), "POSITIVE");
}

int report_error(const std::string &message) {
    std::fprintf(stderr, "error: %s\n", message.c_str());
    return kExitInvalidInput;
}

}  // namespace memra::cli
