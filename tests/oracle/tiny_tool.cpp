// memra_tiny_tool: a thin driver of tools::make_tiny_checkpoint for the Python oracle suite (the same
// options as `memra make-tiny`): OUT_DIR [--seed S] [--preset NAME] [--dtype bf16|fp8] [--force].
// Prints a one-line summary and the generation time.
#include <chrono>
#include <cstdio>
#include <string>

#include <fmt/format.h>

#include "make_tiny/make_tiny.h"

int main(int argc, char **argv) {
    memra::tools::TinyOptions options;
    bool have_dir = false;
    for (int i = 1; i < argc; ++i) {
        std::string arg = argv[i];
        auto value = [&](const char *flag) -> const char * {
            if (i + 1 >= argc) {
                fmt::print(stderr, "memra_tiny_tool: {} needs a value\n", flag);
                return nullptr;
            }
            return argv[++i];
        };
        if (arg == "--seed") {
            const char *v = value("--seed");
            if (v == nullptr) return 2;
            try {
                size_t used = 0;
                options.seed = std::stoull(v, &used);
                if (used != std::string(v).size()) throw std::invalid_argument(v);
            } catch (const std::exception &) {
                fmt::print(stderr, "memra_tiny_tool: --seed expects an unsigned integer, found '{}'\n", v);
                return 2;
            }
        } else if (arg == "--preset") {
            const char *v = value("--preset");
            if (v == nullptr) return 2;
            options.preset = v;
        } else if (arg == "--dtype") {
            const char *v = value("--dtype");
            if (v == nullptr) return 2;
            options.dtype = v;
        } else if (arg == "--force") {
            options.force = true;
        } else if (!arg.empty() && arg[0] != '-' && !have_dir) {
            options.out_dir = arg;
            have_dir = true;
        } else {
            fmt::print(stderr, "memra_tiny_tool: unexpected argument '{}'\n", arg);
            return 2;
        }
    }
    if (!have_dir) {
        fmt::print(stderr, "usage: memra_tiny_tool OUT_DIR [--seed S] [--preset NAME] [--dtype bf16|fp8] [--force]\n");
        return 2;
    }
    auto t0 = std::chrono::steady_clock::now();
    auto summary = memra::tools::make_tiny_checkpoint(options);
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (!summary) {
        fmt::print(stderr, "{}\n", summary.error().message);
        return 1;
    }
    fmt::print("wrote {}: {} files, {} shards, {} tensors, {} params, {} tensor bytes, {} file bytes, {} real tokens "
               "of vocab {}, {:.1f} ms\n",
               summary->out_dir.string(), summary->files.size(), summary->n_shards, summary->n_tensors,
               summary->n_params, summary->tensor_bytes, summary->total_bytes, summary->real_token_count,
               summary->vocab_size, ms);
    return 0;
}
