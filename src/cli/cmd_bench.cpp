// `memra bench [MODEL_DIR]`: llama-bench's two speed tests on the engine (runtime/engine.h; GPU or CPU, --device). ppN
// prefills N prompt tokens into a fresh sequence in steps of the row budget (-ub; one step at the default 512) and
// samples after the last; tgN decodes N tokens from a fresh sequence, one step each, feeding the token the
// engine sampled (greedy). With -d D every test's sequence first holds D context tokens, prefilled untimed (as
// llama-bench's -d: "pp512 @ d4096"), or with --fill-depth written as seeded K/V rows without a forward
// (Engine::fill_context: decode at 64K without minutes of prefill; "tg32 @ d65536 (filled)"). --synthetic PRESET runs a
// model generated in memory instead of a MODEL_DIR (token ids only: it has no tokenizer). With --spec-draft K a second
// tg test decodes the same tokens with the MTP layers drafting up to K per step (speculation), side by side, with the
// acceptance rate per draft position and the tokens per step. Each test runs once untimed (warm-up), then REPS timed
// runs; the table (Markdown or JSON) gives the mean and sample stddev of tokens/s over those runs and the peak resident
// memory; plain and batched tg rows on one rank also give the ratio to the memory roofline (the bytes a step must
// read, model::decode_traffic, at the copy bandwidth measured on the backend after the tests). Only the engine steps
// are timed: sequences are created (and filled to the depth) outside the clock.
// `memra bench --experts` instead times one MoE layer's routed experts (model::MoeState: refresh + run) on seeded
// hidden rows, on tp CPU ranks (experts whole on their owners), and checks that the output's checksum never changes.
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "backend/cpu/cpu_backend.h"
#include "cli/commands.h"
#include "io/safetensors.h"
#include "core/kv_format.h"
#include "core/sampling.h"
#include "model/step35_config.h"
#include "model/step35_moe.h"
#include "model/step35_plan.h"
#include "model/step35_stats.h"
#include "parallel/comm.h"
#include "parallel/plan.h"
#include "runtime/engine.h"
#include "text/tokenizer.h"

namespace memra::cli {
namespace {

using Json = nlohmann::ordered_json;  // keys in the order written

struct BenchOptions {
    std::string model_dir;
    SyntheticChoice synthetic;  // --synthetic: a model generated in memory instead of model_dir
    int n_prompt = 512;  // pp test size; 0 skips it
    int n_gen = 128;     // tg test size; 0 skips it
    int n_depth = 0;     // context tokens every test's sequence holds before its timed steps
    bool fill_depth = false;  // the depth's rows written with seeded values (Engine::fill_context), not prefilled
    int reps = 5;        // timed runs per test
    int threads = 1;
    Numerics numerics = Numerics::kDevice;
    DeviceChoice device = DeviceChoice::kAuto;  // the pp/tg tests; the experts test runs on the CPU
    std::string kv_k = "bf16";
    std::string kv_v = "bf16";
    int64_t ctx_size = 0;  // 0: the larger test's positions
    int64_t step_rows = runtime::kCpuStepRows;
    uint64_t seed = 0;  // of the prompt token ids
    std::string output = "md";
    bool print_tokens = false;
    int spec_draft = 0;
    int spec_accept = -1;  // >= 0: drafts forced so that this many are accepted per step
    std::vector<int> parallel = {1};  // tg: each B > 1 also times B sequences decoding together, one step for all

    // --experts: the routed-experts test instead of pp / tg.
    bool experts = false;
    int layer = -1;  // MoE layer; -1: the first one
    int tokens = 64;
    int tp = 1;
    int warmup = 3;
    int iterations = 20;
};

// The token ids both tests feed: the pp prompt and the first token of tg, after the depth tokens.
struct BenchTokens {
    std::vector<int32_t> prompt;  // [n_prompt]
    int32_t gen_first = 0;
    std::vector<int32_t> depth;   // [n_depth] the context every test starts from (prefilled untimed)
};

// Marks the bench's Philox stream ("bnch"), apart from the sampler's (core/sampling.h).
constexpr uint32_t kTokenStream = 0x626e6368u;

// Draw i of the token sequence of `seed`, uniform over [0, n_real): word i % 4 of Philox4x32-10 at
// counter (i / 4, 0, 0, kTokenStream) under key (seed low, seed high), scaled by the high half of
// word * n_real (a bias below n_real / 2^32).
int32_t bench_token(uint64_t seed, int64_t i, int32_t n_real) {
    const auto block = static_cast<uint64_t>(i / 4);
    const std::array<uint32_t, 4> words = philox4x32_10(
        {static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 0u, kTokenStream},
        {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
    const uint64_t word = words[static_cast<size_t>(i % 4)];
    return static_cast<int32_t>((word * static_cast<uint64_t>(n_real)) >> 32);
}

// The prompt is draws 0 .. n_prompt-1; tg starts from draw 0 (the prompt's first token when there is one); the
// depth context is draws n_prompt .. n_prompt + n_depth - 1.
BenchTokens bench_tokens(uint64_t seed, int n_prompt, int n_depth, int32_t n_real) {
    BenchTokens t;
    t.prompt.reserve(static_cast<size_t>(n_prompt));
    for (int64_t i = 0; i < n_prompt; ++i) t.prompt.push_back(bench_token(seed, i, n_real));
    t.gen_first = bench_token(seed, 0, n_real);
    t.depth.reserve(static_cast<size_t>(n_depth));
    for (int64_t i = 0; i < n_depth; ++i) t.depth.push_back(bench_token(seed, n_prompt + i, n_real));
    return t;
}

// How a test's sequence comes to hold the depth context (untimed).
struct Depth {
    std::span<const int32_t> tokens;
    bool fill = false;  // seeded rows written without a forward (Engine::fill_context), else prefilled
    uint64_t seed = 0;  // fill's
};

// A fresh sequence holding the depth context when there is one: prefilled in steps of the row budget, or filled.
Result<std::unique_ptr<runtime::Sequence>> depth_sequence(runtime::Engine &engine, const runtime::SequenceOptions &so,
                                                          const Depth &depth) {
    auto seq = engine.create_sequence(so);
    if (!seq) return tl::unexpected(seq.error());
    if (depth.tokens.empty()) return seq;
    (*seq)->tokens.assign(depth.tokens.begin(), depth.tokens.end());
    if (depth.fill) {
        const auto rows = static_cast<int64_t>(depth.tokens.size());
        if (auto ok = engine.fill_context(**seq, rows, depth.seed); !ok) return wrap_error("depth fill", ok.error());
    } else if (auto fed = runtime::feed(engine, **seq); !fed) {
        return wrap_error("depth prefill", fed.error());
    }
    return seq;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// One pp run: a fresh sequence at the depth, then the timed steps over the whole prompt (chunked by the row
// budget) and the sampling after its last token. Returns the milliseconds of those steps.
Result<double> time_prompt(runtime::Engine &engine, const runtime::SequenceOptions &so, const Depth &depth,
                           std::span<const int32_t> prompt) {
    auto seq = depth_sequence(engine, so, depth);
    if (!seq) return tl::unexpected(seq.error());
    (*seq)->tokens.insert((*seq)->tokens.end(), prompt.begin(), prompt.end());
    const auto t0 = std::chrono::steady_clock::now();
    auto r = runtime::feed(engine, **seq);
    const double ms = ms_since(t0);
    if (!r) return tl::unexpected(r.error());
    return ms;
}

// One tg run: a fresh sequence at the depth, then holding `first`, then timed decode steps (runtime::decode: one
// token each, or with drafts 1 + the accepted ones) until n_gen tokens are sampled. Returns the summed
// milliseconds of the steps; the tokens are the sequence's, the acceptance goes into stats.
// With `forcing`, the drafts of every step are forced so that `accept` of them stand (truth: the tokens
// decoding without drafts sampled).
struct Forcing {
    DraftForcing *drafts = nullptr;
    const std::vector<int32_t> *truth = nullptr;
    int accept = 0;
    int32_t vocab = 0;
};

Result<double> time_generation(runtime::Engine &engine, const runtime::SequenceOptions &so, const Depth &depth,
                               int32_t first, int64_t n_gen, int draft, runtime::SpecStats &stats,
                               std::vector<int32_t> &tokens, const Forcing &forcing) {
    auto seq = depth_sequence(engine, so, depth);
    if (!seq) return tl::unexpected(seq.error());
    runtime::Sequence &s = **seq;
    s.tokens.reserve(s.tokens.size() + static_cast<size_t>(n_gen) + 1);
    s.tokens.push_back(first);
    double ms = 0.0;
    for (int64_t done = 0; done < n_gen;) {
        runtime::DecodeOptions d;
        d.draft = draft;
        d.max_new = n_gen - done;
        if (forcing.drafts != nullptr) {
            ++forcing.drafts->step;
            forcing.drafts->ids = drafts_accepting(*forcing.truth, s.tokens.size(), forcing.accept, forcing.vocab);
        }
        const auto t0 = std::chrono::steady_clock::now();
        auto r = runtime::decode(engine, s, d);
        ms += ms_since(t0);
        if (!r) return tl::unexpected(r.error());
        stats.add(*r);
        done += r->emitted;
    }
    tokens = s.tokens;
    return ms;
}

// tg at `parallel` > 1 sequences: each starts at the depth from `first` and decodes n_gen tokens, all of them in one
// engine step per token (batched decode); the time of those steps. tokens: sequence 0's tokens (every sequence
// decodes the same ones: batch invariance).
Result<double> time_batched_generation(runtime::Engine &engine, const runtime::SequenceOptions &so, const Depth &depth,
                                       int32_t first, int64_t n_gen, int parallel, std::vector<int32_t> &tokens) {
    std::vector<std::unique_ptr<runtime::Sequence>> seqs;
    for (int i = 0; i < parallel; ++i) {
        auto seq = depth_sequence(engine, so, depth);
        if (!seq) return tl::unexpected(seq.error());
        (*seq)->tokens.reserve((*seq)->tokens.size() + static_cast<size_t>(n_gen) + 1);
        (*seq)->tokens.push_back(first);
        seqs.push_back(std::move(*seq));
    }
    std::vector<runtime::StepItem> items(static_cast<size_t>(parallel));
    double ms = 0.0;
    for (int64_t done = 0; done < n_gen; ++done) {
        for (int i = 0; i < parallel; ++i) {
            runtime::StepItem &it = items[static_cast<size_t>(i)];
            it = runtime::StepItem{};
            it.seq = seqs[static_cast<size_t>(i)].get();
            it.rows = 1;
            it.sample = true;
        }
        const auto t0 = std::chrono::steady_clock::now();
        if (auto ok = engine.step(items); !ok) return tl::unexpected(ok.error());
        ms += ms_since(t0);
        for (int i = 0; i < parallel; ++i) seqs[static_cast<size_t>(i)]->tokens.push_back(engine.sampled(static_cast<size_t>(i)).id);
    }
    tokens = seqs[0]->tokens;
    return ms;
}

// The process's peak resident memory so far, in bytes (getrusage: ru_maxrss is in KiB on Linux).
int64_t peak_rss_bytes() {
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    return static_cast<int64_t>(ru.ru_maxrss) * 1024;
}

struct TestResult {
    std::string name;  // "pp512", "tg128", "tg128 spec3", "tg128 @ d4096"
    int n_prompt = 0;
    int n_gen = 0;
    int n_depth = 0;   // context tokens before the timed steps
    bool depth_filled = false;  // ... written as seeded rows (--fill-depth), not prefilled
    int parallel = 1;  // sequences decoding together (tg)
    int spec_draft = 0;
    runtime::SpecStats spec;  // the timed runs' decode steps
    std::vector<double> samples_ms;  // one per timed run
    double avg_ts = 0.0;             // mean of the runs' tokens/s
    double stddev_ts = 0.0;          // their sample standard deviation (0 for one run)
    double ceiling_ts = 0.0;         // tg: the memory roofline's tokens/s (set_ceiling), 0: none
    int64_t peak_rss = 0;            // the process's peak resident bytes after the test
};

// Like llama-bench: statistics over each run's tokens/s, not tokens over the summed time.
void summarize(TestResult &t) {
    const double n_tokens = static_cast<double>(t.n_prompt + int64_t{t.n_gen} * t.parallel);
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
    int threads = 0;  // per rank
    int tp = 1;
    std::string type_k, type_v;
    std::string numerics;  // "device" or "exact"
    std::string isa;       // device: the instruction path of its products (cpu::product_isa, or "cuda"); exact: "-"
};

// "device (avx512-bf16)", "exact".
std::string numerics_cell(const BenchFacts &f) { return f.numerics + (f.isa == "-" ? "" : " (" + f.isa + ")"); }

BenchFacts numerics_facts(BenchFacts f, Numerics numerics, Device device = Device::kCpu) {
    f.numerics = numerics_name(numerics);
    f.isa = device == Device::kCuda ? "cuda"
            : numerics == Numerics::kDevice ? cpu::product_isa_name(cpu::product_isa())
                                            : "-";
    return f;
}

// A Markdown table with padded columns: text left-aligned, numbers right-aligned (as llama-bench).
std::string format_table(const std::vector<std::string> &header, const std::vector<bool> &right,
                         const std::vector<std::vector<std::string>> &rows) {
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

// Draft position j's acceptance rates, "0.62 0.41 0.30"; "-" without drafts.
std::string acceptance_cell(const TestResult &t) {
    if (t.spec_draft == 0) return "-";
    std::string out;
    for (int j = 0; j < t.spec_draft; ++j) out += fmt::format("{}{:.2f}", j == 0 ? "" : " ", t.spec.rate(j));
    return out;
}

std::string markdown_table(const BenchFacts &f, const std::vector<TestResult> &tests) {
    const bool spec = std::any_of(tests.begin(), tests.end(), [](const TestResult &t) { return t.spec_draft > 0; });
    std::vector<std::vector<std::string>> rows;
    for (const TestResult &t : tests) {
        rows.push_back({f.model, human_count(f.n_params), f.dtype, fmt::format("{}", f.tp),
                        fmt::format("{}", f.threads), f.type_k + "/" + f.type_v, t.name,
                        fmt::format("{:.2f} ± {:.2f}", t.avg_ts, t.stddev_ts),
                        fmt::format("{:.1f}", static_cast<double>(t.peak_rss) / (1024.0 * 1024.0))});
        if (spec) {
            rows.back().push_back(acceptance_cell(t));
            rows.back().push_back(t.spec_draft > 0 ? fmt::format("{:.2f}", t.spec.tokens_per_step()) : "-");
        }
    }
    std::vector<std::string> header = {"model", "params", "dtype", "tp", "threads", "kv", "test", "t/s", "peak MiB"};
    std::vector<bool> right = {false, true, false, true, true, false, true, true, true};
    if (spec) {
        header.insert(header.end(), {"accept/pos", "tok/step"});
        right.insert(right.end(), {true, true});
    }
    header.insert(header.end(), {"roofline", "numerics"});
    right.insert(right.end(), {true, false});
    for (size_t i = 0; i < rows.size(); ++i) {
        const TestResult &t = tests[i];
        rows[i].push_back(t.ceiling_ts > 0.0 ? fmt::format("{:.0f} %", 100.0 * t.avg_ts / t.ceiling_ts) : "-");
        rows[i].push_back(numerics_cell(f));
    }
    return format_table(header, right, rows);
}

Json json_report(const BenchFacts &f, const std::vector<TestResult> &tests, int reps) {
    Json out = Json::array();
    for (const TestResult &t : tests) {
        out.push_back(Json{{"model", f.model},
                           {"n_params", f.n_params},
                           {"dtype", f.dtype},
                           {"tp", f.tp},
                           {"threads", f.threads},
                           {"type_k", f.type_k},
                           {"type_v", f.type_v},
                           {"numerics", f.numerics},
                           {"isa", f.isa},
                           {"test", t.name},
                           {"n_prompt", t.n_prompt},
                           {"n_gen", t.n_gen},
                           {"n_depth", t.n_depth},
                           {"depth_filled", t.depth_filled},
                           {"parallel", t.parallel},
                           {"reps", reps},
                           {"samples_ms", t.samples_ms},
                           {"avg_ts", t.avg_ts},
                           {"stddev_ts", t.stddev_ts},
                           {"peak_rss_bytes", t.peak_rss}});
        if (t.ceiling_ts > 0.0) {
            out.back()["ceiling_ts"] = t.ceiling_ts;
            out.back()["vs_ceiling"] = t.avg_ts / t.ceiling_ts;
        }
        if (t.spec_draft > 0) {
            std::vector<double> rates;
            for (int j = 0; j < t.spec_draft; ++j) rates.push_back(t.spec.rate(j));
            out.back()["spec_draft"] = t.spec_draft;
            out.back()["acceptance"] = rates;
            out.back()["tokens_per_step"] = t.spec.tokens_per_step();
            out.back()["steps"] = t.spec.steps;
        }
    }
    return out;
}

// ---- --experts: the routed experts of one MoE layer ----

// Marks the hidden-input Philox stream ("hidn"), apart from the token stream above.
constexpr uint32_t kHiddenStream = 0x6869646eu;

// Element i of the seeded hidden rows: uniform over [-2, 2) in steps of 2^-22 (every value exact in f32), from
// the top 24 bits of word i % 4 of Philox4x32-10 at counter (i / 4, 0, 0, kHiddenStream) under key (seed
// low, seed high).
float bench_hidden(uint64_t seed, int64_t i) {
    const auto block = static_cast<uint64_t>(i / 4);
    const std::array<uint32_t, 4> words = philox4x32_10(
        {static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 0u, kHiddenStream},
        {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
    const uint32_t top = words[static_cast<size_t>(i % 4)] >> 8;
    return static_cast<float>(top) * (1.0f / 4194304.0f) - 2.0f;
}

// 64-bit FNV-1a over the output's f32 bit patterns, each taken as 4 little-endian bytes.
uint64_t output_checksum(std::span<const float> values) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const float v : values) {
        uint32_t bits = 0;
        std::memcpy(&bits, &v, sizeof bits);
        for (int b = 0; b < 4; ++b) {
            h ^= (bits >> (8 * b)) & 0xffu;
            h *= 0x100000001b3ull;
        }
    }
    return h;
}

// The nearest-rank percentile of ascending samples: the ceil(p * n / 100)-th smallest (an observed sample).
double nearest_rank(const std::vector<double> &sorted, int percentile) {
    const size_t rank = (static_cast<size_t>(percentile) * sorted.size() + 99) / 100;
    return sorted[std::max<size_t>(rank, 1) - 1];
}

// One rank of the experts test: its backend, the model (whole, or its shard), the state and its rows.
struct ExpertRank {
    std::unique_ptr<cpu::CpuBackend> backend;
    std::unique_ptr<model::Step35Model> model;  // a pointer: the state points into it
    std::optional<model::MoeState> state;
    TensorView x;    // [tokens, d_model] the seeded hidden rows: router input and residual
    TensorView out;  // [tokens, d_model] x + (routed + shared)
    std::vector<float> out_host;
    std::vector<uint64_t> checksums;  // one per run: warm-ups, then timed iterations
};

struct ExpertsResult {
    int layer = 0;
    int64_t top_k = 0;
    int64_t n_experts = 0;
    int threads = 0;  // per rank
    std::vector<double> samples_ms;
    double mean_ms = 0.0, min_ms = 0.0, p50_ms = 0.0, p90_ms = 0.0, p95_ms = 0.0, p99_ms = 0.0, max_ms = 0.0;
    double routes_per_s = 0.0;
    uint64_t checksum = 0;
};

std::string experts_table(const BenchFacts &f, const BenchOptions &opt, const ExpertsResult &r) {
    const auto ms = [](double v) { return fmt::format("{:.3f}", v); };
    const std::vector<std::vector<std::string>> rows = {
        {f.model, f.dtype, fmt::format("{}", r.layer), fmt::format("{}", opt.tokens), fmt::format("{}", r.top_k),
         fmt::format("{}", opt.tp), fmt::format("{}", r.threads),
         fmt::format("{}", opt.warmup), fmt::format("{}", opt.iterations), ms(r.mean_ms), ms(r.min_ms),
         ms(r.p50_ms), ms(r.p90_ms), ms(r.p95_ms), ms(r.p99_ms), ms(r.max_ms), fmt::format("{:.0f}", r.routes_per_s),
         fmt::format("{:016x}", r.checksum), numerics_cell(f)}};
    return format_table({"model", "dtype", "layer", "tokens", "top_k", "tp", "threads", "warm-up", "iters",
                         "mean ms", "min ms", "p50 ms", "p90 ms", "p95 ms", "p99 ms", "max ms", "routes/s",
                         "checksum", "numerics"},
                        {false, false, true, true, true, true, true, true, true, true, true, true, true, true, true,
                         true, true, false, false},
                        rows);
}

Json experts_json(const BenchFacts &f, const BenchOptions &opt, const ExpertsResult &r) {
    return Json::array({Json{{"model", f.model},
                             {"dtype", f.dtype},
                             {"numerics", f.numerics},
                             {"isa", f.isa},
                             {"test", "experts"},
                             {"layer", r.layer},
                             {"tokens", opt.tokens},
                             {"top_k", r.top_k},
                             {"n_experts", r.n_experts},
                             {"routes", opt.tokens * r.top_k},
                             {"tp", opt.tp},
                             {"threads", r.threads},
                             {"seed", opt.seed},
                             {"warmup", opt.warmup},
                             {"iterations", opt.iterations},
                             {"samples_ms", r.samples_ms},
                             {"mean_ms", r.mean_ms},
                             {"min_ms", r.min_ms},
                             {"p50_ms", r.p50_ms},
                             {"p90_ms", r.p90_ms},
                             {"p95_ms", r.p95_ms},
                             {"p99_ms", r.p99_ms},
                             {"max_ms", r.max_ms},
                             {"routes_per_s", r.routes_per_s},
                             {"checksum", fmt::format("{:016x}", r.checksum)}}});
}

// Times refresh + run of one MoE layer's state, warm-ups first, on every rank together (between two barriers,
// so a sample is the slowest rank's time); after each run every rank checksums its own output.
int run_experts_bench(const BenchOptions &opt) {
    if (process_launch().size > 1) {
        return report_error("--experts runs its ranks as threads of one process (--tp); run it without mpirun");
    }
    // The model: a checkpoint directory (its config first, the shards once the request is checked) or a
    // synthetic one (generated as it is bound).
    auto in = load_model_inputs(opt.model_dir, opt.synthetic, opt.threads, opt.kv_k, opt.kv_v);
    if (!in) return kExitInvalidInput;
    const std::string &name = in->name;
    const model::Step35Config *cfg = &in->cfg;
    std::vector<int> moe_layers;
    for (const model::LayerGeometry &g : cfg->layers) {
        if (g.ffn == model::FfnKind::kMoe) moe_layers.push_back(g.index);
    }
    if (moe_layers.empty()) return report_error(fmt::format("{}: the model has no MoE layer", name));
    ExpertsResult res;
    res.layer = opt.layer < 0 ? moe_layers.front() : opt.layer;
    if (static_cast<size_t>(res.layer) >= cfg->layers.size()) {
        return report_error(fmt::format("--layer {}: the model has layers 0 .. {}", res.layer, cfg->layers.size() - 1));
    }
    if (cfg->layers[static_cast<size_t>(res.layer)].ffn != model::FfnKind::kMoe) {
        return report_error(fmt::format("--layer {}: layer {} is a dense layer; the MoE layers are {}", res.layer,
                                        res.layer, fmt::join(moe_layers, ", ")));
    }
    const model::LayerGeometry &g = cfg->layers[static_cast<size_t>(res.layer)];
    res.top_k = g.top_k;
    res.n_experts = g.n_experts;
    res.threads = std::max(1, opt.threads / opt.tp);

    auto store = open_store(*in);
    if (!store) return report_error(store.error().message);
    // A lone rank binds the whole model and runs without a communicator; otherwise the plan decides.
    const bool whole = opt.tp == 1;
    parallel::ParallelPlan plan;
    std::optional<parallel::InProcessGroup> group;
    if (!whole) {
        parallel::PlanRequest req;
        req.tp = opt.tp;
        req.devices_available = opt.tp;
        auto made = parallel::make_plan(model::plan_shape(*cfg), req);
        if (!made) return report_error(fmt::format("--tp {}: {}", opt.tp, made.error().message));
        plan = std::move(*made);
        auto grp = parallel::InProcessGroup::create(opt.tp);
        if (!grp) return report_error(grp.error().message);
        group.emplace(std::move(*grp));
    }
    std::fprintf(stderr, "memra bench: loading %s, experts of layer %d on %d rank%s, %d thread%s each\n",
                 name.c_str(), res.layer, opt.tp, opt.tp == 1 ? "" : "s", res.threads,
                 res.threads == 1 ? "" : "s");

    const int64_t n = opt.tokens;
    const int64_t d = cfg->d_model;
    std::vector<float> hidden(static_cast<size_t>(n * d));
    for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = bench_hidden(opt.seed, static_cast<int64_t>(i));
    const int runs = opt.warmup + opt.iterations;
    std::vector<ExpertRank> ranks(static_cast<size_t>(opt.tp));
    for (int r = 0; r < opt.tp; ++r) {
        ExpertRank &rk = ranks[static_cast<size_t>(r)];
        rk.backend = std::make_unique<cpu::CpuBackend>(res.threads, opt.numerics);
        auto bound = whole ? model::bind_step35_model(*rk.backend, **store, *cfg)
                           : model::bind_step35_model(*rk.backend, **store, *cfg, plan, r);
        if (!bound) return report_error(bound.error().message);
        rk.model = std::make_unique<model::Step35Model>(std::move(*bound));
        auto state = model::MoeState::create(*rk.backend, *rk.model, res.layer, n,
                                             whole ? nullptr : &group->communicator(r));
        if (!state) return report_error(fmt::format("rank {}: {}", r, state.error().message));
        rk.state.emplace(std::move(*state));
        auto x = rk.backend->alloc(DType::kF32, {n, d});
        auto out = rk.backend->alloc(DType::kF32, {n, d});
        if (!x || !out) return report_error(fmt::format("rank {}: {}", r, (x ? out.error() : x.error()).message));
        rk.x = *x;
        rk.out = *out;
        rk.backend->copy_from_host(hidden.data(), rk.x);
        rk.out_host.resize(hidden.size());
        rk.checksums.assign(static_cast<size_t>(runs), 0);
    }

    std::fprintf(stderr, "memra bench: experts: %lld tokens x top-%lld: warm-up %d + %d iterations\n",
                 static_cast<long long>(n), static_cast<long long>(res.top_k), opt.warmup, opt.iterations);
    res.samples_ms.reserve(static_cast<size_t>(opt.iterations));
    const auto iterate = [&](ExpertRank &rk) -> Result<void> {
        if (auto ok = rk.state->refresh(res.layer, rk.x); !ok) return ok;
        return rk.state->run(rk.x, rk.out);
    };
    const auto record = [&](ExpertRank &rk, int i) {
        rk.backend->copy_to_host(rk.out, rk.out_host.data());
        rk.checksums[static_cast<size_t>(i)] = output_checksum(rk.out_host);
    };
    if (whole) {
        ExpertRank &rk = ranks.front();
        for (int i = 0; i < runs; ++i) {
            const auto t0 = std::chrono::steady_clock::now();
            auto ok = iterate(rk);
            const double ms = ms_since(t0);
            if (!ok) return report_error(fmt::format("experts: {}", ok.error().message));
            if (i >= opt.warmup) res.samples_ms.push_back(ms);
            record(rk, i);
        }
    } else {
        auto ran = group->run([&](int r, parallel::Communicator &comm) -> Result<void> {
            ExpertRank &rk = ranks[static_cast<size_t>(r)];
            for (int i = 0; i < runs; ++i) {
                if (auto ok = comm.barrier(); !ok) return ok;
                const auto t0 = std::chrono::steady_clock::now();
                if (auto ok = iterate(rk); !ok) return ok;
                if (auto ok = comm.barrier(); !ok) return ok;
                if (r == 0 && i >= opt.warmup) res.samples_ms.push_back(ms_since(t0));
                record(rk, i);
            }
            return {};
        });
        if (!ran) return report_error(fmt::format("experts: {}", ran.error().message));
    }

    // The output must not change from run to run, and every rank must hold the same output.
    const std::vector<uint64_t> &first = ranks.front().checksums;
    for (int i = 1; i < runs; ++i) {
        if (first[static_cast<size_t>(i)] != first.front()) {
            const std::string at = i < opt.warmup ? fmt::format("warm-up {}", i)
                                                  : fmt::format("iteration {}", i - opt.warmup);
            return report_error(fmt::format("experts: checksum changed at {}", at));
        }
    }
    for (int r = 1; r < opt.tp; ++r) {
        if (ranks[static_cast<size_t>(r)].checksums != first) {
            return report_error(fmt::format("experts: rank {}'s output differs from rank 0's", r));
        }
    }
    res.checksum = first.front();
    std::vector<double> sorted = res.samples_ms;
    std::sort(sorted.begin(), sorted.end());
    double sum = 0.0;
    for (const double v : res.samples_ms) sum += v;
    res.mean_ms = sum / static_cast<double>(res.samples_ms.size());
    res.min_ms = sorted.front();
    res.max_ms = sorted.back();
    res.p50_ms = nearest_rank(sorted, 50);
    res.p90_ms = nearest_rank(sorted, 90);
    res.p95_ms = nearest_rank(sorted, 95);
    res.p99_ms = nearest_rank(sorted, 99);
    res.routes_per_s = res.mean_ms > 0.0 ? static_cast<double>(n * res.top_k) * 1000.0 / res.mean_ms : 0.0;

    BenchFacts facts;
    facts.model = name;
    facts.dtype = cfg->is_fp8() ? "fp8" : "bf16";
    facts = numerics_facts(facts, opt.numerics);
    const std::string report = opt.output == "json" ? experts_json(facts, opt, res).dump(2) + "\n"
                                                    : experts_table(facts, opt, res);
    std::fwrite(report.data(), 1, report.size(), stdout);
    std::fflush(stdout);
    return kExitOk;
}

// The memory roofline of tg tests: a decode step cannot beat the bytes it must read (model::decode_traffic: weights,
// the expected distinct experts of its batch, every sequence's KV rows) over the copy bandwidth measured on the
// engine's backend in the same run. One rank only (TP ranks read replicated parts more than once).

// Buffers of the copy: past any CPU cache; past the GPU's L2 (60 MB on an H200) by far.
constexpr int64_t kRooflineCopyBytesCpu = int64_t{64} << 20;
constexpr int64_t kRooflineCopyBytesGpu = int64_t{256} << 20;

// The copy bandwidth in bytes per second; 0 when not measured (several ranks, no tg test, a refusal).
double roofline_bandwidth(runtime::Engine &engine, const BenchOptions &opt, Device device) {
    if (opt.tp != 1 || opt.n_gen == 0) return 0.0;
    auto bw = engine.backend(engine.local_ranks().first)
                  .copy_bandwidth(device == Device::kCuda ? kRooflineCopyBytesGpu : kRooflineCopyBytesCpu);
    if (!bw) {
        std::fprintf(stderr, "memra bench: no roofline: %s\n", bw.error().message.c_str());
        return 0.0;
    }
    std::fprintf(stderr, "memra bench: copy bandwidth %.1f GB/s (the tg tests' roofline)\n", 1e-9 * *bw);
    return *bw;
}

// t's ceiling: its sequences' tokens per step over the step's bytes at the copy bandwidth (bytes per second), at
// the mean context of its steps (the depth, then 1 .. n_gen generated positions).
void set_ceiling(TestResult &t, double bandwidth, const model::Step35Config &cfg, const io::TensorStore &store,
                 KvFormat k_format, KvFormat v_format) {
    if (bandwidth <= 0.0) return;
    const double context = t.n_depth + (t.n_gen + 1) / 2.0;
    auto traffic = model::decode_traffic(cfg, store, t.parallel, context, k_format, v_format);
    if (!traffic) {
        std::fprintf(stderr, "memra bench: %s: no roofline: %s\n", t.name.c_str(), traffic.error().message.c_str());
        return;
    }
    t.ceiling_ts = t.parallel * bandwidth / traffic->total_bytes();
}

int run_bench(const BenchOptions &opt) {
    if (opt.experts) return run_experts_bench(opt);
    if (opt.n_prompt == 0 && opt.n_gen == 0) {
        std::fputs("error: nothing to measure: -p and -n are both 0\n", stderr);
        return kExitUsage;
    }
    auto in = load_model_inputs(opt.model_dir, opt.synthetic, opt.threads, opt.kv_k, opt.kv_v);
    if (!in) return kExitInvalidInput;
    const std::filesystem::path &dir = in->dir;
    const model::Step35Config &cfg = in->cfg;
    if (opt.fill_depth && opt.n_depth == 0) {
        return report_error("--fill-depth fills the -d context: give -d N > 0");
    }
    if (opt.fill_depth && opt.spec_draft > 0) {
        return report_error(
            "--fill-depth with --spec-draft: the MTP layers read the context's hidden rows, which a "
            "fill does not make; prefill the depth (leave out --fill-depth)");
    }
    // Positions one sequence of each test reaches: the depth, then the prompt or the generated tokens.
    const std::string depth_flag = opt.n_depth > 0 ? fmt::format("-d {} ", opt.n_depth) : "";
    for (const auto &[flag, n] : {std::pair{"-p", opt.n_prompt}, std::pair{"-n", opt.n_gen}}) {
        const int64_t positions = int64_t{opt.n_depth} + n;
        if (n > 0 && positions > cfg.context_length) {
            return report_error(fmt::format("{}{} {}: the test needs {} positions, more than the model's context "
                                            "length {}",
                                            depth_flag, flag, n, positions, cfg.context_length));
        }
    }
    // The KV cache holds every sequence of a test at once: tg's hold their first token and N more.
    const int64_t pp_positions = opt.n_prompt > 0 ? int64_t{opt.n_depth} + opt.n_prompt : 0;
    const int max_parallel = *std::max_element(opt.parallel.begin(), opt.parallel.end());
    const int64_t tg_positions = opt.n_gen > 0 ? (int64_t{opt.n_depth} + opt.n_gen + 1) * max_parallel : 0;
    const int64_t positions = std::max({pp_positions, tg_positions, int64_t{1}});
    if (opt.ctx_size > 0 && opt.ctx_size < positions) {
        const bool pp = pp_positions >= tg_positions;
        const std::string depth = opt.n_depth > 0 ? fmt::format("{} depth + ", opt.n_depth) : "";
        const std::string seqs = max_parallel > 1 ? fmt::format(", x{} sequences", max_parallel) : "";
        const std::string test = pp ? fmt::format("{} prompt", opt.n_prompt)
                                    : fmt::format("{} + 1 generated{}", opt.n_gen, seqs);
        return report_error(fmt::format("-c {}: the KV cache is smaller than the {} positions the {} test needs "
                                        "({}{}); raise -c to at least {} (or leave it 0){}",
                                        opt.ctx_size, positions, pp ? "pp" : "tg", depth, test, positions,
                                        opt.n_depth > 0 ? " or lower -d" : ""));
    }
    // Prompt ids come from the tokenizer's real tokens: the embedding's padding rows past it are never fed. A
    // synthetic model has no tokenizer: every embedding row is a token.
    int32_t n_real = cfg.vocab_size;
    if (!in->synthetic) {
        auto tok = text::Tokenizer::load(dir);
        if (!tok) return report_error(tok.error().message);
        n_real = std::min(cfg.vocab_size, tok->n_tokens());
        if (n_real < 1) return report_error(fmt::format("{}: the tokenizer has no tokens", dir.string()));
    }
    const BenchTokens tokens = bench_tokens(opt.seed, opt.n_prompt, opt.n_depth, n_real);
    if (opt.print_tokens) {
        Json printed{{"prompt", tokens.prompt}, {"gen_first", tokens.gen_first}};
        if (opt.n_depth > 0) printed["depth"] = tokens.depth;
        std::printf("%s\n", printed.dump().c_str());
        return kExitOk;
    }

    BenchFacts facts;
    facts.model = in->name;
    facts.n_params = model::compute_model_stats(cfg).total_params;
    facts.dtype = cfg.is_fp8() ? "fp8" : "bf16";
    facts.tp = opt.tp;
    facts.threads = std::max(1, opt.threads / opt.tp);
    facts.type_k = kv_format_name(in->k_format);
    facts.type_v = kv_format_name(in->v_format);
    auto device = resolve_device(opt.device, opt.numerics);
    if (!device) return report_error(device.error().message);
    facts = numerics_facts(facts, opt.numerics, *device);
    runtime::EngineOptions eo;
    eo.tp = opt.tp;
    eo.k_format = in->k_format;
    eo.v_format = in->v_format;
    eo.ctx_size = opt.ctx_size > 0 ? opt.ctx_size : positions;
    eo.max_seqs = max_parallel;
    eo.step_rows = opt.step_rows;
    eo.sample_vocab = n_real;
    if (auto ok = enable_speculation(eo, cfg, opt.spec_draft, true); !ok) return report_error(ok.error().message);
    if (opt.spec_accept >= 0 && opt.spec_draft == 0) {
        return report_error("--spec-accept needs --spec-draft K > 0: it forces the drafts of the speculative tg test");
    }
    DraftForcing draft_forcing;
    std::fprintf(stderr, "memra bench: loading %s, tp %d, %s\n", in->name.c_str(), opt.tp,
                 *device == Device::kCuda ? "device cuda" : fmt::format("threads {} per rank", facts.threads).c_str());
    const BackendChoice backends{*device, opt.threads, opt.numerics, opt.spec_accept >= 0 ? &draft_forcing : nullptr};
    const tools::SyntheticStore *synthetic = in->synthetic.get();
    auto store = open_store(*in);
    if (!store) return report_error(store.error().message);
    auto loaded = load_engine(std::move(*store), cfg, eo, backends);
    if (!loaded) return report_error(fmt::format("--tp {}: {}", opt.tp, loaded.error().message));
    if (synthetic != nullptr) {
        std::fprintf(stderr, "memra bench: %s: %s\n", in->name.c_str(), synthetic_summary(synthetic->stats()).c_str());
    }
    runtime::Engine &engine = *loaded->engine;
    runtime::SequenceOptions so;
    so.sampling.temperature = 0.0f;  // greedy: the same tokens every run

    // As llama-bench names a test at a depth: "pp512 @ d4096".
    const std::string depth_suffix =
        opt.n_depth > 0 ? fmt::format(" @ d{}{}", opt.n_depth, opt.fill_depth ? " (filled)" : "") : "";
    const Depth depth{tokens.depth, opt.fill_depth, opt.seed};
    std::vector<TestResult> tests;
    if (opt.n_prompt > 0) {
        TestResult t;
        t.name = fmt::format("pp{}", opt.n_prompt) + depth_suffix;
        t.n_prompt = opt.n_prompt;
        t.n_depth = opt.n_depth;
        t.depth_filled = opt.fill_depth;
        std::fprintf(stderr, "memra bench: %s: warm-up + %d runs\n", t.name.c_str(), opt.reps);
        for (int rep = -1; rep < opt.reps; ++rep) {  // rep -1: the warm-up
            auto ms = time_prompt(engine, so, depth, tokens.prompt);
            if (!ms) return report_error(fmt::format("{}: {}", t.name, ms.error().message));
            if (rep >= 0) t.samples_ms.push_back(*ms);
        }
        summarize(t);
        t.peak_rss = peak_rss_bytes();
        tests.push_back(std::move(t));
    }
    // tg without drafts, then (--spec-draft) with them: the same tokens, or the bench fails.
    std::vector<int32_t> plain_tokens, spec_tokens;
    std::vector<int> drafts;
    if (opt.n_gen > 0) drafts.push_back(0);
    if (opt.n_gen > 0 && opt.spec_draft > 0) drafts.push_back(opt.spec_draft);
    for (const int draft : drafts) {
        TestResult t;
        t.name = draft == 0 ? fmt::format("tg{}", opt.n_gen) : fmt::format("tg{} spec{}", opt.n_gen, draft);
        if (draft > 0 && opt.spec_accept >= 0) t.name += fmt::format(" accept{}", opt.spec_accept);
        t.name += depth_suffix;
        t.n_depth = opt.n_depth;
        t.depth_filled = opt.fill_depth;
        Forcing forcing;
        if (draft > 0 && opt.spec_accept >= 0) forcing = Forcing{&draft_forcing, &plain_tokens, opt.spec_accept, n_real};
        t.n_gen = opt.n_gen;
        t.spec_draft = draft;
        runtime::SequenceOptions gso = so;
        gso.mtp_streams = draft > 0 ? eo.mtp_layers : 0;
        std::fprintf(stderr, "memra bench: %s: warm-up + %d runs\n", t.name.c_str(), opt.reps);
        for (int rep = -1; rep < opt.reps; ++rep) {
            runtime::SpecStats stats;
            auto ms = time_generation(engine, gso, depth, tokens.gen_first, opt.n_gen, draft, stats,
                                      draft == 0 ? plain_tokens : spec_tokens, forcing);
            if (!ms) return report_error(fmt::format("{}: {}", t.name, ms.error().message));
            if (rep >= 0) {
                t.samples_ms.push_back(*ms);
                t.spec.steps += stats.steps;
                t.spec.emitted += stats.emitted;
                for (int j = 0; j < model::kMaxMtp; ++j) {
                    t.spec.drafted[j] += stats.drafted[j];
                    t.spec.accepted[j] += stats.accepted[j];
                }
            }
        }
        if (draft > 0 && spec_tokens != plain_tokens) {
            return report_error(fmt::format("{}: the tokens differ from tg{} without drafts (determinism D8 broken)",
                                            t.name, opt.n_gen));
        }
        summarize(t);
        t.peak_rss = peak_rss_bytes();
        tests.push_back(std::move(t));
    }

    for (const int parallel : opt.parallel) {
        if (opt.n_gen == 0 || parallel == 1) continue;  // B = 1: the plain tg test
        TestResult t;
        t.name = fmt::format("tg{} x{}", opt.n_gen, parallel) + depth_suffix;
        t.n_gen = opt.n_gen;
        t.n_depth = opt.n_depth;
        t.depth_filled = opt.fill_depth;
        t.parallel = parallel;
        std::fprintf(stderr, "memra bench: %s: warm-up + %d runs\n", t.name.c_str(), opt.reps);
        std::vector<int32_t> batched_tokens;
        for (int rep = -1; rep < opt.reps; ++rep) {
            auto ms = time_batched_generation(engine, so, depth, tokens.gen_first, opt.n_gen, parallel, batched_tokens);
            if (!ms) return report_error(fmt::format("{}: {}", t.name, ms.error().message));
            if (rep >= 0) t.samples_ms.push_back(*ms);
        }
        if (batched_tokens != plain_tokens) {
            return report_error(fmt::format("{}: the tokens differ from tg{} alone (batch invariance broken)", t.name,
                                            opt.n_gen));
        }
        summarize(t);
        t.peak_rss = peak_rss_bytes();
        tests.push_back(std::move(t));
    }

    // After the tests, so that the copy's buffers stay out of their peak memory.
    const double bandwidth = roofline_bandwidth(engine, opt, *device);
    for (TestResult &t : tests) {
        if (t.n_gen > 0 && t.spec_draft == 0)
            set_ceiling(t, bandwidth, cfg, *loaded->store, in->k_format, in->v_format);
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
        "bench", "Measure prompt (pp) and generation (tg) tokens/s on the engine (GPU or CPU), like llama-bench; with "
                 "--experts, the routed experts of one MoE layer on CPU ranks");
    add_model_dir_option(*sub, opt->model_dir);
    add_synthetic_options(*sub, opt->synthetic);
    sub->add_option("-p,--n-prompt", opt->n_prompt,
                    "ppN test: prefill N prompt tokens into a fresh sequence, in steps of -ub rows (0 = skip)")
        ->envname("MEMRA_N_PROMPT")
        ->check(CLI::Range(0, kMaxInt))
        ->capture_default_str();
    sub->add_option("-n,--n-gen", opt->n_gen,
                    "tgN test: generate N tokens one step each from a fresh sequence (0 = skip)")
        ->envname("MEMRA_N_GEN")
        ->check(CLI::Range(0, kMaxInt))
        ->capture_default_str();
    sub->add_option("-d,--n-depth", opt->n_depth,
                    "Context depth (as llama-bench's -d): every test's sequence first holds N tokens, prefilled "
                    "untimed in steps of -ub rows, then its pp/tg steps are timed at that depth (test names "
                    "\"pp512 @ d4096\"; JSON n_depth)")
        ->envname("MEMRA_N_DEPTH")
        ->check(CLI::Range(0, kMaxInt))
        ->capture_default_str();
    sub->add_flag("--fill-depth", opt->fill_depth,
                  "Write the -d context's KV rows with seeded values (uniform on [-1, 1)) instead of prefilling "
                  "them: decode timed at a depth whose prefill would take minutes. Attention reads the same bytes, "
                  "but the rows are not the tokens', so the generated tokens mean nothing (test names \"tg32 @ "
                  "d65536 (filled)\"; JSON depth_filled). Not with --spec-draft")
        ->envname("MEMRA_FILL_DEPTH");
    sub->add_option("--parallel", opt->parallel,
                    "tgN at B sequences: for each B > 1 of the list (as 32,128) also time B sequences decoding N "
                    "tokens together, one engine step per token (batched decode; tokens/s counts every sequence's "
                    "tokens); the KV cache is sized for the largest B")
        ->envname("MEMRA_BENCH_PARALLEL")
        ->delimiter(',')
        ->check(CLI::Range(1, 4096))
        ->capture_default_str();
    sub->add_option("-r,--repetitions", opt->reps, "Timed runs per test, after one untimed warm-up run")
        ->envname("MEMRA_REPETITIONS")
        ->check(positive_int_validator())
        ->capture_default_str();
    add_threads_option(*sub, opt->threads);
    add_numerics_option(*sub, opt->numerics);
    add_device_option(*sub, opt->device);
    add_kv_format_options(*sub, opt->kv_k, opt->kv_v);
    add_engine_size_options(*sub, opt->ctx_size, opt->step_rows);
    sub->get_option("--ctx-size")
        ->description("KV cache size in positions (default 0: the positions the largest test needs, its depth "
                      "included)");
    add_spec_draft_option(*sub, opt->spec_draft, 0);
    sub->get_option("--spec-draft")
        ->description("Also run tgN with the MTP layers drafting up to K tokens per step, verified by the trunk: "
                      "tokens/s side by side with plain tgN, acceptance per draft position, tokens per step (the "
                      "tokens must equal plain tgN's)");
    sub->add_option("--spec-accept", opt->spec_accept,
                    "With --spec-draft: force the drafts so that exactly N stand per step (the plain tgN's tokens "
                    "as drafts, then a wrong one), to measure speculation at a chosen acceptance on checkpoints "
                    "whose MTP layers draft nothing useful (random ones); -1 = the MTP layers' own drafts")
        ->envname("MEMRA_SPEC_ACCEPT")
        ->check(CLI::Range(-1, model::kMaxMtp))
        ->capture_default_str();
    sub->add_option("-s,--seed", opt->seed,
                    "Seed of the prompt and depth token ids (uniform over the tokenizer's tokens, or every embedding "
                    "row of a --synthetic model; tg starts from the first); with --experts, of the hidden rows "
                    "(uniform over [-2, 2))")
        ->envname("MEMRA_SEED")
        ->check(uint64_validator())
        ->capture_default_str();
    sub->add_option("-o,--output", opt->output, "Report format on stdout: md (a Markdown table) or json")
        ->envname("MEMRA_OUTPUT")
        ->check(CLI::IsMember({"md", "json"}))
        ->capture_default_str();
    CLI::Option *print_tokens =
        sub->add_flag("--print-tokens", opt->print_tokens,
                      "Print the token ids the tests would feed as JSON {\"prompt\": [...], \"gen_first\": id} and "
                      "exit (for running another engine on the same tokens)")
            ->envname("MEMRA_PRINT_TOKENS");

    // The routed-experts test.
    CLI::Option *experts =
        sub->add_flag("--experts", opt->experts,
                      "Instead of pp/tg: time refresh (router, top-k, pair sort) + run (grouped expert projections, "
                      "exchange between ranks, slot-order combine with the shared expert) of one MoE layer on "
                      "seeded hidden rows; reports mean/min/p50/p90/p95/p99/max ms, routes/s and the output "
                      "checksum, which must not change between runs. -t threads are split over the ranks")
            ->envname("MEMRA_EXPERTS");
    add_tp_option(*sub, opt->tp);
    const std::vector<CLI::Option *> needs_experts = {
        sub->add_option("--layer", opt->layer, "--experts: the MoE layer (default: the first MoE layer)")
            ->envname("MEMRA_LAYER")
            ->check(CLI::Range(0, kMaxInt)),
        sub->add_option("--tokens", opt->tokens, "--experts: hidden rows routed per run (each to top_k experts)")
            ->envname("MEMRA_TOKENS")
            ->check(positive_int_validator())
            ->capture_default_str(),
        sub->add_option("--warmup", opt->warmup, "--experts: untimed runs before the timed ones")
            ->envname("MEMRA_WARMUP")
            ->check(CLI::Range(0, kMaxInt))
            ->capture_default_str(),
        sub->add_option("--iterations", opt->iterations, "--experts: timed runs")
            ->envname("MEMRA_ITERATIONS")
            ->check(positive_int_validator())
            ->capture_default_str(),
    };
    for (CLI::Option *o : needs_experts) o->needs(experts);
    for (const char *name : {"--n-prompt", "--n-gen", "--n-depth", "--fill-depth", "--repetitions", "--kv-k", "--kv-v",
                             "--ctx-size", "--ubatch-size"}) {
        experts->excludes(sub->get_option(name));
    }
    experts->excludes(print_tokens);
    return {sub, [opt]() { return run_bench(*opt); }};
}

}  // namespace memra::cli
