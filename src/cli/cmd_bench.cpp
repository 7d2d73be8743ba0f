// `memra bench [MODEL_DIR]`: llama-bench's two speed tests on the CPU engine. ppN prefills N prompt tokens
// into an empty KV cache in one step (last logits only); tgN decodes N tokens from an empty cache, one step
// each, feeding the argmax of the previous step's logits. Each test runs once untimed (warm-up), then REPS
// timed runs; the table (Markdown or JSON) gives the mean and sample stddev of tokens/s over those runs.
// Only the forward steps are timed: the KV cache is created and the argmax taken outside the clock.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "kv/kv_cache.h"
#include "kv/kv_format.h"
#include "model/step35_config.h"
#include "model/step35_forward.h"
#include "model/step35_stats.h"
#include "runtime/sampler.h"
#include "text/tokenizer.h"

namespace memra::cli {
namespace {

using Json = nlohmann::ordered_json;  // keys in the order written

struct BenchOptions {
    std::string model_dir;
    int n_prompt = 512;  // pp test size; 0 skips it
    int n_gen = 128;     // tg test size; 0 skips it
    int reps = 5;        // timed runs per test
    int threads = 1;
    std::string kv_k = "bf16";
    std::string kv_v = "bf16";
    uint64_t seed = 0;  // of the prompt token ids
    std::string output = "md";
    bool print_tokens = false;
};

// The token ids both tests feed: the pp prompt and the first token of tg.
struct BenchTokens {
    std::vector<int32_t> prompt;  // [n_prompt]
    int32_t gen_first = 0;
};

// Marks the bench's Philox stream ("bnch"), apart from the sampler's (runtime/sampler.h).
constexpr uint32_t kTokenStream = 0x626e6368u;

// Draw i of the token sequence of `seed`, uniform over [0, n_real): word i % 4 of Philox4x32-10 at
// counter (i / 4, 0, 0, kTokenStream) under key (seed low, seed high), scaled by the high half of
// word * n_real (a bias below n_real / 2^32).
int32_t bench_token(uint64_t seed, int64_t i, int32_t n_real) {
    const auto block = static_cast<uint64_t>(i / 4);
    const std::array<uint32_t, 4> words = runtime::philox4x32_10(
        {static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 0u, kTokenStream},
        {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
    const uint64_t word = words[static_cast<size_t>(i % 4)];
    return static_cast<int32_t>((word * static_cast<uint64_t>(n_real)) >> 32);
}

// The prompt is draws 0 .. n_prompt-1; tg starts from draw 0 (the prompt's first token when there is one).
BenchTokens bench_tokens(uint64_t seed, int n_prompt, int32_t n_real) {
    BenchTokens t;
    t.prompt.reserve(static_cast<size_t>(n_prompt));
    for (int64_t i = 0; i < n_prompt; ++i) t.prompt.push_back(bench_token(seed, i, n_real));
    t.gen_first = bench_token(seed, 0, n_real);
    return t;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// One pp run: a fresh cache, then one timed step over the whole prompt. Returns the step's milliseconds.
Result<double> time_prompt(model::Step35Forward &fwd, const kv::KvCacheSpec &spec, std::span<const int32_t> prompt) {
    auto cache = kv::KvCache::create(spec);
    if (!cache) return wrap_error(fmt::format("KV cache ({} tokens)", spec.capacity), cache.error());
    const model::SeqChunk chunk{&*cache, prompt, false, -1};
    const auto t0 = std::chrono::steady_clock::now();
    auto r = fwd.step(std::span(&chunk, 1));
    const double ms = ms_since(t0);
    if (!r) return tl::unexpected(r.error());
    return ms;
}

// One tg run: a fresh cache, then n_gen timed one-token steps, each feeding the argmax (ties to the lower id)
// of the previous logits. Returns the summed milliseconds of the steps.
Result<double> time_generation(model::Step35Forward &fwd, const kv::KvCacheSpec &spec, int32_t first,
                               int64_t n_gen) {
    auto cache = kv::KvCache::create(spec);
    if (!cache) return wrap_error(fmt::format("KV cache ({} tokens)", spec.capacity), cache.error());
    int32_t token = first;
    double ms = 0.0;
    for (int64_t i = 0; i < n_gen; ++i) {
        const model::SeqChunk chunk{&*cache, std::span(&token, 1), false, -1};
        const auto t0 = std::chrono::steady_clock::now();
        auto r = fwd.step(std::span(&chunk, 1));
        ms += ms_since(t0);
        if (!r) return tl::unexpected(r.error());
        const std::span<const float> logits = fwd.logits();
        token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    }
    return ms;
}

struct TestResult {
    std::string name;  // "pp512", "tg128"
    int n_prompt = 0;
    int n_gen = 0;
    std::vector<double> samples_ms;  // one per timed run
    double avg_ts = 0.0;             // mean of the runs' tokens/s
    double stddev_ts = 0.0;          // their sample standard deviation (0 for one run)
};

// Like llama-bench: statistics over each run's tokens/s, not tokens over the summed time.
void summarize(TestResult &t) {
    const double n_tokens = static_cast<double>(t.n_prompt + t.n_gen);
    std::vector<double> ts;
    for (const double ms : t.samples_ms) ts.push_back(ms > 0.0 ? 1000.0 * n_tokens / ms : 0.0);
    double sum = 0.0;
    for (const double x : ts) sum += x;
    t.avg_ts = sum / static_cast<double>(ts.size());
    double sq = 0.0;
    for (const double x : ts) sq += (x - t.avg_ts) * (x - t.avg_ts);
    t.stddev_ts = ts.size() > 1 ? std::sqrt(sq / static_cast<double>(ts.size() - 1)) : 0.0;
}

// What every row of the report shares.
struct BenchFacts {
    std::string model;  // the model directory
    int64_t n_params = 0;
    std::string dtype;  // "bf16", or "fp8" for FP8 block-scaled routed experts
    int threads = 0;
    std::string type_k, type_v;
};

// A Markdown table with padded columns: text left-aligned, numbers right-aligned (as llama-bench).
std::string markdown_table(const BenchFacts &f, const std::vector<TestResult> &tests) {
    const std::vector<std::string> header = {"model", "params", "dtype", "threads", "kv", "test", "t/s"};
    const std::vector<bool> right = {false, true, false, true, false, true, true};
    std::vector<std::vector<std::string>> rows;
    for (const TestResult &t : tests) {
        rows.push_back({f.model, human_count(f.n_params), f.dtype, fmt::format("{}", f.threads),
                        f.type_k + "/" + f.type_v, t.name, fmt::format("{:.2f} ± {:.2f}", t.avg_ts, t.stddev_ts)});
    }
    // Display width: "±" is one column but two UTF-8 bytes.
    const auto width = [](const std::string &s) {
        size_t w = 0;
        for (const char c : s) w += (static_cast<unsigned char>(c) & 0xC0) != 0x80 ? 1 : 0;
        return w;
    };
    std::vector<size_t> widths;
    for (const std::string &h : header) widths.push_back(width(h));
    for (const auto &row : rows) {
        for (size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], width(row[c]));
    }
    const auto line = [&](const std::vector<std::string> &cells) {
        std::string out = "|";
        for (size_t c = 0; c < cells.size(); ++c) {
            const std::string pad(widths[c] - width(cells[c]), ' ');
            out += " " + (right[c] ? pad + cells[c] : cells[c] + pad) + " |";
        }
        return out + "\n";
    };
    std::string out = line(header) + "|";
    for (size_t c = 0; c < header.size(); ++c) {
        out += " " + std::string(widths[c] - (right[c] ? 1 : 0), '-') + (right[c] ? ":" : "") + " |";
    }
    out += "\n";
    for (const auto &row : rows) out += line(row);
    return out;
}

Json json_report(const BenchFacts &f, const std::vector<TestResult> &tests, int reps) {
    Json out = Json::array();
    for (const TestResult &t : tests) {
        out.push_back(Json{{"model", f.model},
                           {"n_params", f.n_params},
                           {"dtype", f.dtype},
                           {"threads", f.threads},
                           {"type_k", f.type_k},
                           {"type_v", f.type_v},
                           {"test", t.name},
                           {"n_prompt", t.n_prompt},
                           {"n_gen", t.n_gen},
                           {"reps", reps},
                           {"samples_ms", t.samples_ms},
                           {"avg_ts", t.avg_ts},
                           {"stddev_ts", t.stddev_ts}});
    }
    return out;
}

int run_bench(const BenchOptions &opt) {
    if (opt.n_prompt == 0 && opt.n_gen == 0) {
        std::fputs("error: nothing to measure: -p and -n are both 0\n", stderr);
        return kExitUsage;
    }
    auto kv_formats = parse_kv_format_options(opt.kv_k, opt.kv_v);
    if (!kv_formats) return report_error(kv_formats.error().message);
    const auto [k_format, v_format] = *kv_formats;

    const std::filesystem::path dir = resolve_model_dir(opt.model_dir);
    if (dir.empty()) return kExitInvalidInput;
    auto cfg = model::load_step35_config(dir);
    if (!cfg) return report_error(cfg.error().message);
    for (const auto &[flag, n] : {std::pair{"-p", opt.n_prompt}, std::pair{"-n", opt.n_gen}}) {
        if (n > cfg->context_length) {
            return report_error(fmt::format("{} {}: the test needs {} positions, more than the model's context "
                                            "length {}",
                                            flag, n, n, cfg->context_length));
        }
    }
    // Prompt ids come from the tokenizer's real tokens: the embedding's padding rows past it are never fed.
    auto tok = text::Tokenizer::load(dir);
    if (!tok) return report_error(tok.error().message);
    const int32_t n_real = std::min(cfg->vocab_size, tok->n_tokens());
    if (n_real < 1) return report_error(fmt::format("{}: the tokenizer has no tokens", dir.string()));
    const BenchTokens tokens = bench_tokens(opt.seed, opt.n_prompt, n_real);
    if (opt.print_tokens) {
        std::printf("%s\n", Json{{"prompt", tokens.prompt}, {"gen_first", tokens.gen_first}}.dump().c_str());
        return kExitOk;
    }

    std::fprintf(stderr, "memra bench: loading %s, threads %d\n", dir.string().c_str(), opt.threads);
    auto cpu_model = load_cpu_model(dir, *cfg, opt.threads);
    if (!cpu_model) return report_error(cpu_model.error().message);
    const int64_t max_tokens = std::max(opt.n_prompt, 1);
    const int64_t max_context = std::max(opt.n_prompt, opt.n_gen);
    auto fwd = model::Step35Forward::create(*cpu_model->backend, cpu_model->model,
                                            model::ForwardCapacity{max_tokens, 1, max_context, 1});
    if (!fwd) return report_error(fwd.error().message);

    BenchFacts facts;
    facts.model = dir.string();
    facts.n_params = model::compute_model_stats(*cfg).total_params;
    facts.dtype = cfg->is_fp8() ? "fp8" : "bf16";
    facts.threads = opt.threads;
    facts.type_k = kv::kv_format_name(k_format);
    facts.type_v = kv::kv_format_name(v_format);

    std::vector<TestResult> tests;
    if (opt.n_prompt > 0) {
        TestResult t{fmt::format("pp{}", opt.n_prompt), opt.n_prompt, 0, {}, 0.0, 0.0};
        const kv::KvCacheSpec spec = model::trunk_kv_spec(*cfg, k_format, v_format, opt.n_prompt, opt.n_prompt);
        std::fprintf(stderr, "memra bench: %s: warm-up + %d runs\n", t.name.c_str(), opt.reps);
        for (int rep = -1; rep < opt.reps; ++rep) {  // rep -1: the warm-up
            auto ms = time_prompt(*fwd, spec, tokens.prompt);
            if (!ms) return report_error(fmt::format("{}: {}", t.name, ms.error().message));
            if (rep >= 0) t.samples_ms.push_back(*ms);
        }
        summarize(t);
        tests.push_back(std::move(t));
    }
    if (opt.n_gen > 0) {
        TestResult t{fmt::format("tg{}", opt.n_gen), 0, opt.n_gen, {}, 0.0, 0.0};
        const kv::KvCacheSpec spec = model::trunk_kv_spec(*cfg, k_format, v_format, opt.n_gen, 1);
        std::fprintf(stderr, "memra bench: %s: warm-up + %d runs\n", t.name.c_str(), opt.reps);
        for (int rep = -1; rep < opt.reps; ++rep) {
            auto ms = time_generation(*fwd, spec, tokens.gen_first, opt.n_gen);
            if (!ms) return report_error(fmt::format("{}: {}", t.name, ms.error().message));
            if (rep >= 0) t.samples_ms.push_back(*ms);
        }
        summarize(t);
        tests.push_back(std::move(t));
    }

    const std::string report =
        opt.output == "json" ? json_report(facts, tests, opt.reps).dump(2) + "\n" : markdown_table(facts, tests);
    std::fwrite(report.data(), 1, report.size(), stdout);
    std::fflush(stdout);
    return kExitOk;
}

}  // namespace

Command add_bench_command(CLI::App &app) {
    auto opt = std::make_shared<BenchOptions>();
    opt->threads = default_threads();
    const int kMaxInt = std::numeric_limits<int>::max();

    CLI::App *sub = app.add_subcommand(
        "bench", "Measure prompt (pp) and generation (tg) tokens/s on the CPU backend, like llama-bench");
    add_model_dir_option(*sub, opt->model_dir);
    sub->add_option("-p,--n-prompt", opt->n_prompt,
                    "ppN test: prefill N prompt tokens in one step from an empty KV cache (0 = skip)")
        ->envname("MEMRA_N_PROMPT")
        ->check(CLI::Range(0, kMaxInt))
        ->capture_default_str();
    sub->add_option("-n,--n-gen", opt->n_gen,
                    "tgN test: generate N tokens one step each from an empty KV cache (0 = skip)")
        ->envname("MEMRA_N_GEN")
        ->check(CLI::Range(0, kMaxInt))
        ->capture_default_str();
    sub->add_option("-r,--repetitions", opt->reps, "Timed runs per test, after one untimed warm-up run")
        ->envname("MEMRA_REPETITIONS")
        ->check(positive_int_validator())
        ->capture_default_str();
    add_threads_option(*sub, opt->threads);
    add_kv_format_options(*sub, opt->kv_k, opt->kv_v);
    sub->add_option("-s,--seed", opt->seed,
                    "Seed of the prompt token ids (uniform over the tokenizer's tokens; tg starts from the first)")
        ->envname("MEMRA_SEED")
        ->check(uint64_validator())
        ->capture_default_str();
    sub->add_option("-o,--output", opt->output, "Report format on stdout: md (a Markdown table) or json")
        ->envname("MEMRA_OUTPUT")
        ->check(CLI::IsMember({"md", "json"}))
        ->capture_default_str();
    sub->add_flag("--print-tokens", opt->print_tokens,
                  "Print the token ids the tests would feed as JSON {\"prompt\": [...], \"gen_first\": id} and "
                  "exit (for running another engine on the same tokens)")
        ->envname("MEMRA_PRINT_TOKENS");
    return {sub, [opt]() { return run_bench(*opt); }};
}

}  // namespace memra::cli
