// The whole model on the GPU: against the CPU in device numerics, and the schedule gates (chunked prefill, a
// teacher-forced prefill against decode) on the GPU itself.
// Against the CPU: the CPU engine decodes greedily after a prompt; the GPU engine prefills the prompt and the
// CPU's tokens (teacher forcing), so both compute the same rows. The GPU's bf16 products run on the tensor cores
// in their own order (DETERMINISM.md: a measured tolerance against the CPU), so the logits are compared within a
// tolerance measured on the H200 with a margin, and each row's greedy token must agree wherever the CPU's top two
// logits are further apart than that row's difference. Runs on the embedded default model and, when the GPU
// script generated it (MEMRA_RELEASE_MODEL), the release-width preset. Skips without a GPU.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/float_formats.h"
#include "cuda/cuda_test_util.h"
#include "io/safetensors.h"
#include "model/step35_config.h"
#include "runtime/engine.h"

namespace memra {
namespace {

namespace fs = std::filesystem;

// What one engine computed: every prefill row's logits, then each decode step's, and the greedy tokens.
struct Trace {
    std::vector<float> logits;
    std::vector<int32_t> tokens;
    std::vector<int64_t> launches;  // [step] the GPU backend's launches
    int64_t graph_replays = 0;      // the GPU backend's, at the end
    int64_t graph_captures = 0;
};

Trace run_engine(const fs::path &dir, Device device, KvFormat k, KvFormat v, const std::vector<int32_t> &prompt,
                 int decode_steps, const SamplingParams *sampling = nullptr,
                 const std::vector<LogitBias> &logit_bias = {}) {
    Trace t;
    auto cfg = model::load_step35_config(dir);
    EXPECT_TRUE(cfg.has_value()) << cfg.error().message;
    if (!cfg) return t;
    auto ckpt = io::Checkpoint::open(dir);
    EXPECT_TRUE(ckpt.has_value()) << ckpt.error().message;
    if (!ckpt) return t;
    runtime::EngineOptions o;
    o.k_format = k;
    o.v_format = v;
    o.ctx_size = 1024;
    o.step_rows = static_cast<int64_t>(prompt.size());
    o.max_logit_rows = o.step_rows;
    cuda::CudaBackend *gpu = nullptr;  // owned by the engine
    o.make_backend = [device, &gpu](int) -> Result<std::unique_ptr<Backend>> {
        if (device == Device::kCuda) {
            auto be = cuda::CudaBackend::create(0, Numerics::kDevice);
            if (!be) return tl::unexpected(be.error());
            gpu = be->get();
            return std::unique_ptr<Backend>(std::move(*be));
        }
        return std::unique_ptr<Backend>(std::make_unique<cpu::CpuBackend>(8, Numerics::kDevice));
    };
    auto engine = runtime::Engine::create(*ckpt, *cfg, o);
    EXPECT_TRUE(engine.has_value()) << engine.error().message;
    if (!engine) return t;
    runtime::SequenceOptions so;
    so.sampling.temperature = 0.0f;
    if (sampling != nullptr) so.sampling = *sampling;
    so.logit_bias = logit_bias;
    auto seq = (*engine)->create_sequence(so);
    EXPECT_TRUE(seq.has_value()) << seq.error().message;
    if (!seq) return t;
    runtime::Sequence &s = **seq;
    s.tokens = prompt;
    runtime::StepItem it;
    it.seq = &s;
    it.rows = static_cast<int64_t>(prompt.size());
    it.logits = runtime::LogitRows::kAll;
    it.sample = true;
    it.return_logits = true;
    for (int step = 0; step <= decode_steps; ++step) {
        const int64_t launched = gpu != nullptr ? gpu->counters().launches : 0;
        auto ok = (*engine)->step(std::span(&it, 1));
        EXPECT_TRUE(ok.has_value()) << ok.error().message;
        if (!ok) return t;
        if (gpu != nullptr) t.launches.push_back(gpu->counters().launches - launched);
        const auto lg = (*engine)->logits(0);
        t.logits.insert(t.logits.end(), lg.begin(), lg.end());
        const int32_t next = (*engine)->sampled(0).id;
        t.tokens.push_back(next);
        s.tokens.push_back(next);
        it.rows = 1;
        it.logits = runtime::LogitRows::kLast;
    }
    if (gpu != nullptr) {
        t.graph_replays = gpu->graph_replays();
        t.graph_captures = gpu->graph_captures();
    }
    return t;
}

// Seeded prompt ids among the tokenizer's first ids (the same on both devices).
std::vector<int32_t> prompt_ids(int n, int32_t vocab) {
    std::vector<int32_t> p;
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < n; ++i) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        p.push_back(static_cast<int32_t>((x >> 33) % static_cast<uint64_t>(std::min<int32_t>(vocab, 700))));
    }
    return p;
}

// How far the GPU's logits may be from the CPU's: the median row's largest difference, relative to the largest
// CPU logit of the run. (Single rows may differ more: a router whose top-8 scores nearly tie can pick another
// expert on either side.)
constexpr double kLogitTolerance = 2e-2;

void compare(const fs::path &dir, KvFormat k, KvFormat v) {
    auto cfg = model::load_step35_config(dir);
    ASSERT_TRUE(cfg.has_value()) << cfg.error().message;
    const std::vector<int32_t> prompt = prompt_ids(200, static_cast<int32_t>(cfg->vocab_size));
    const Trace cpu = run_engine(dir, Device::kCpu, k, v, prompt, 32);
    ASSERT_EQ(cpu.tokens.size(), 33u);
    std::vector<int32_t> forced = prompt;
    forced.insert(forced.end(), cpu.tokens.begin(), cpu.tokens.end() - 1);
    const Trace gpu = run_engine(dir, Device::kCuda, k, v, forced, 0);
    ASSERT_EQ(cpu.logits.size(), gpu.logits.size());
    ASSERT_FALSE(cpu.logits.empty());
    const size_t vocab = static_cast<size_t>(cfg->vocab_size);
    const size_t rows = cpu.logits.size() / vocab;
    int64_t mismatches = 0;
    double max_ref = 0.0;
    for (size_t i = 0; i < cpu.logits.size(); ++i) {
        if (f32_as_u32(cpu.logits[i]) != f32_as_u32(gpu.logits[i])) ++mismatches;
        max_ref = std::max(max_ref, static_cast<double>(std::fabs(cpu.logits[i])));
    }
    std::vector<double> row_diffs;
    // Greedy tokens: equal on every row whose CPU top-2 margin exceeds twice the row's largest difference.
    int64_t decided = 0;
    int64_t agree = 0;
    for (size_t r = 0; r < rows; ++r) {
        const float *c = cpu.logits.data() + r * vocab;
        const float *g = gpu.logits.data() + r * vocab;
        const size_t best_c = static_cast<size_t>(std::max_element(c, c + vocab) - c);
        const size_t best_g = static_cast<size_t>(std::max_element(g, g + vocab) - g);
        float second = -INFINITY;
        double row_diff = 0.0;
        for (size_t i = 0; i < vocab; ++i) {
            if (i != best_c) second = std::max(second, c[i]);
            row_diff = std::max(row_diff, static_cast<double>(std::fabs(c[i] - g[i])));
        }
        row_diffs.push_back(row_diff);
        if (static_cast<double>(c[best_c] - second) > 2 * row_diff) {
            ++decided;
            agree += best_c == best_g ? 1 : 0;
        }
    }
    std::sort(row_diffs.begin(), row_diffs.end());
    const double median = row_diffs[rows / 2];
    const double p90 = row_diffs[rows * 9 / 10];
    const std::string where =
        fmt::format("{} kv {}/{}: {} rows, {} of {} logits differ in bits; largest |diff| per row: median {:.3g}, "
                    "90th percentile {:.3g}, max {:.3g} (max |logit| {:.3g}); greedy tokens agree on {} of {} "
                    "decided rows",
                    dir.filename().string(), kv_format_name(k), kv_format_name(v), rows, mismatches,
                    cpu.logits.size(), median, p90, row_diffs.back(), max_ref, agree, decided);
    std::printf("%s\n", where.c_str());
    EXPECT_LE(median, kLogitTolerance * max_ref) << where;
    EXPECT_EQ(agree, decided) << where;
    EXPECT_GT(decided, static_cast<int64_t>(rows / 2)) << where;
}

fs::path default_model() { return fs::path(MEMRA_BINARY_DIR) / "models" / "default"; }

// An engine on the GPU over the default model with step_rows rows per step.
struct GpuEngine {
    std::unique_ptr<io::Checkpoint> ckpt;
    model::Step35Config cfg;
    std::unique_ptr<runtime::Engine> engine;
};

GpuEngine gpu_engine(int64_t step_rows) {
    GpuEngine g;
    auto cfg = model::load_step35_config(default_model());
    EXPECT_TRUE(cfg.has_value());
    g.cfg = *cfg;
    auto ckpt = io::Checkpoint::open(default_model());
    EXPECT_TRUE(ckpt.has_value());
    g.ckpt = std::make_unique<io::Checkpoint>(std::move(*ckpt));
    runtime::EngineOptions o;
    o.ctx_size = 1024;
    o.step_rows = step_rows;
    o.max_logit_rows = step_rows;
    o.make_backend = [](int) -> Result<std::unique_ptr<Backend>> {
        auto be = cuda::CudaBackend::create(0, Numerics::kDevice);
        if (!be) return tl::unexpected(be.error());
        return std::unique_ptr<Backend>(std::move(*be));
    };
    auto engine = runtime::Engine::create(*g.ckpt, g.cfg, o);
    EXPECT_TRUE(engine.has_value()) << engine.error().message;
    if (engine) g.engine = std::move(*engine);
    return g;
}

// Feeds the sequence's pending tokens in steps of the engine's step_rows; the last row's logits.
std::vector<float> prefill_last_logits(runtime::Engine &e, runtime::Sequence &s) {
    while (s.pending() > 0) {
        runtime::StepItem it;
        it.seq = &s;
        it.rows = std::min(s.pending(), e.options().step_rows);
        const bool last = it.rows == s.pending();
        it.logits = last ? runtime::LogitRows::kLast : runtime::LogitRows::kNone;
        it.return_logits = last;
        auto ok = e.step(std::span(&it, 1));
        EXPECT_TRUE(ok.has_value()) << ok.error().message;
        if (!ok) return {};
        if (last) {
            const auto lg = e.logits(0);
            return std::vector<float>(lg.begin(), lg.end());
        }
    }
    return {};
}

int64_t bit_mismatches(const std::vector<float> &a, const std::vector<float> &b) {
    if (a.size() != b.size()) return -1;
    int64_t n = 0;
    for (size_t i = 0; i < a.size(); ++i) n += f32_as_u32(a[i]) != f32_as_u32(b[i]) ? 1 : 0;
    return n;
}

// Chunked prefill (chunks of 1, 7, 64, 512) gives the unchunked prefill's last-row logits bit for bit on the GPU.
TEST(CudaEngine, ChunkedPrefillEqualsUnchunked) {
    MEMRA_SKIP_WITHOUT_GPU();
    const std::vector<int32_t> prompt = prompt_ids(600, 1024);
    std::vector<float> whole;
    for (const int64_t chunk : {int64_t{600}, int64_t{512}, int64_t{64}, int64_t{7}, int64_t{1}}) {
        GpuEngine g = gpu_engine(chunk);
        ASSERT_TRUE(g.engine);
        runtime::SequenceOptions so;
        auto seq = g.engine->create_sequence(so);
        ASSERT_TRUE(seq.has_value());
        (*seq)->tokens = prompt;
        const std::vector<float> last = prefill_last_logits(*g.engine, **seq);
        ASSERT_FALSE(last.empty());
        if (whole.empty()) {
            whole = last;
        } else {
            EXPECT_EQ(bit_mismatches(last, whole), 0) << "chunks of " << chunk;
        }
    }
}

// A teacher-forced prefill of the prompt and the greedy tokens reproduces every decode step's logits.
TEST(CudaEngine, TeacherForcedPrefillReproducesEveryDecodeStep) {
    MEMRA_SKIP_WITHOUT_GPU();
    const std::vector<int32_t> prompt = prompt_ids(150, 1024);
    const Trace decoded = run_engine(default_model(), Device::kCuda, KvFormat::kBf16, KvFormat::kBf16, prompt, 24);
    ASSERT_EQ(decoded.tokens.size(), 25u);
    GpuEngine g = gpu_engine(256);
    ASSERT_TRUE(g.engine);
    auto seq = g.engine->create_sequence(runtime::SequenceOptions{});
    ASSERT_TRUE(seq.has_value());
    (*seq)->tokens = prompt;
    (*seq)->tokens.insert((*seq)->tokens.end(), decoded.tokens.begin(), decoded.tokens.end() - 1);
    runtime::StepItem it;
    it.seq = seq->get();
    it.rows = static_cast<int64_t>((*seq)->tokens.size());
    it.logits = runtime::LogitRows::kAll;
    it.return_logits = true;
    ASSERT_TRUE(g.engine->step(std::span(&it, 1)).has_value());
    const auto all = g.engine->logits(0);
    const size_t vocab = static_cast<size_t>(g.cfg.vocab_size);
    // Trace rows: the prompt's 150 rows, then one per decode step; the forced prefill has the same rows.
    ASSERT_EQ(all.size(), decoded.logits.size());
    EXPECT_EQ(bit_mismatches(std::vector<float>(all.begin(), all.end()), decoded.logits), 0)
        << all.size() / vocab << " rows";
}

TEST(CudaEngine, DefaultModelLogitsStayNearTheCpu) {
    MEMRA_SKIP_WITHOUT_GPU();
    compare(default_model(), KvFormat::kBf16, KvFormat::kBf16);
    compare(default_model(), KvFormat::kF32, KvFormat::kF32);
    compare(default_model(), KvFormat::kQ8_0, KvFormat::kQ5_1);
}

// Decode steps recorded as a CUDA graph and replayed give the bits of the same steps issued op by op
// (MEMRA_CUDA_GRAPHS=0), and a replayed step counts the launches of an issued one.
TEST(CudaEngine, ReplayedStepsEqualIssuedSteps) {
    MEMRA_SKIP_WITHOUT_GPU();
    auto cfg = model::load_step35_config(default_model());
    ASSERT_TRUE(cfg.has_value()) << cfg.error().message;
    const std::vector<int32_t> prompt = prompt_ids(40, static_cast<int32_t>(cfg->vocab_size));
    ASSERT_EQ(setenv("MEMRA_CUDA_GRAPHS", "0", 1), 0);
    const Trace issued = run_engine(default_model(), Device::kCuda, KvFormat::kQ8_0, KvFormat::kQ5_1, prompt, 16);
    ASSERT_EQ(unsetenv("MEMRA_CUDA_GRAPHS"), 0);
    const Trace replayed = run_engine(default_model(), Device::kCuda, KvFormat::kQ8_0, KvFormat::kQ5_1, prompt, 16);
    ASSERT_FALSE(issued.logits.empty());
    EXPECT_EQ(bit_mismatches(issued.logits, replayed.logits), 0);
    EXPECT_EQ(issued.tokens, replayed.tokens);
    EXPECT_EQ(issued.launches, replayed.launches);
    EXPECT_EQ(issued.graph_replays, 0);
    EXPECT_EQ(issued.graph_captures, 0);
    // The prefill and the first decode step run as issued, the second decode step is captured, the rest replay.
    EXPECT_EQ(replayed.graph_captures, 1);
    EXPECT_EQ(replayed.graph_replays, 14);
}

// A sampled sequence with a logit bias, decode steps replayed as CUDA graphs included: a forced token wins every
// step (the CPU's tokens exactly), a banned one never comes, and a second run draws the same tokens and logits.
TEST(CudaEngine, LogitBiasHoldsOnTheGpu) {
    MEMRA_SKIP_WITHOUT_GPU();
    auto cfg = model::load_step35_config(default_model());
    ASSERT_TRUE(cfg.has_value()) << cfg.error().message;
    const std::vector<int32_t> prompt = prompt_ids(40, static_cast<int32_t>(cfg->vocab_size));
    SamplingParams p;
    p.temperature = 0.8f;
    p.seed = 17;
    for (const bool forced : {true, false}) {
        std::vector<LogitBias> bias = {{3, -100.0f}, {10, 2.5f}, {32, -3.0f}, {101, 1.5f}, {640, 4.0f}};
        if (forced) bias.push_back(LogitBias{700, 100.0f});
        const Trace gpu =
            run_engine(default_model(), Device::kCuda, KvFormat::kBf16, KvFormat::kBf16, prompt, 12, &p, bias);
        const Trace again =
            run_engine(default_model(), Device::kCuda, KvFormat::kBf16, KvFormat::kBf16, prompt, 12, &p, bias);
        ASSERT_EQ(gpu.tokens.size(), 13u);
        EXPECT_EQ(gpu.tokens, again.tokens) << (forced ? "forced" : "nudged");
        EXPECT_EQ(bit_mismatches(gpu.logits, again.logits), 0) << (forced ? "forced" : "nudged");
        if (forced) {
            const Trace cpu =
                run_engine(default_model(), Device::kCpu, KvFormat::kBf16, KvFormat::kBf16, prompt, 12, &p, bias);
            EXPECT_EQ(cpu.tokens, gpu.tokens);
        }
        for (const int32_t t : gpu.tokens) {
            if (forced) {
                EXPECT_EQ(t, 700);
            }
            EXPECT_NE(t, 3);
        }
    }
}

TEST(CudaEngine, ReleaseWidthPresetLogitsStayNearTheCpu) {
    MEMRA_SKIP_WITHOUT_GPU();
    const char *dir = std::getenv("MEMRA_RELEASE_MODEL");
    if (dir == nullptr || *dir == '\0') GTEST_SKIP() << "MEMRA_RELEASE_MODEL is not set (scripts/gpu.sh makes it)";
    compare(dir, KvFormat::kBf16, KvFormat::kBf16);
}

}  // namespace
}  // namespace memra
