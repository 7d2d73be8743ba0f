// memra verify's gates through the library (runtime/verify.h), on tiny bf16 and fp8 checkpoints: every TP
// degree the plan allows reports zero mismatches and zero hot-path allocations, refused ones are skipped with
// the plan's reason, and the gates can fail: a reduction finished in another order, a grouped expert product
// that differs from the independent per-expert oracle and a rank op that allocates are each caught.

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/forced_draft_backend.h"
#include "io/safetensors.h"
#include "model/step35_config.h"
#include "runtime/verify.h"

#include "model/tiny_dirs.h"
#include "runtime/alloc_count.h"
#include "runtime/skewed_combine_backend.h"

namespace memra::runtime {
namespace {

namespace fs = std::filesystem;
using model::TinyDirs;

// ---- Backends ----

Result<std::unique_ptr<Backend>> cpu(int threads) {
    return std::unique_ptr<Backend>(std::make_unique<cpu::CpuBackend>(threads, Numerics::kDevice));
}

// A grouped product whose first output value has its lowest mantissa bit flipped.
class FlippedGroupedBackend : public cpu::CpuBackend {
public:
    using cpu::CpuBackend::CpuBackend;
    void matmul_grouped(TensorView x, BankId b, TensorView offsets, TensorView y) override {
        cpu::CpuBackend::matmul_grouped(x, b, offsets, y);
        if (y.numel() > 0) {
            auto *p = static_cast<uint32_t *>(y.data);
            p[0] ^= 1u;
        }
    }
};

// An RMSNorm that allocates a scratch vector on every call (the bits are the CPU backend's).
class AllocatingBackend : public cpu::CpuBackend {
public:
    using cpu::CpuBackend::CpuBackend;
    void rms_norm(TensorView x, VectorId w, float eps, TensorView y) override {
        std::vector<float> scratch(static_cast<size_t>(x.row_elems()));
        cpu::CpuBackend::rms_norm(x, w, eps, y);
        scratch_bytes_ += scratch.size();
    }
    size_t scratch_bytes_ = 0;
};

// Feeds the trunk another token than the draft the engine verifies (the lowest bit of the id flipped in the
// trunk's row), so an accepted draft's next sample comes from a token nobody chose.
class MisfedDraftBackend : public cpu::ForcedDraftBackend {
public:
    using cpu::ForcedDraftBackend::ForcedDraftBackend;
    void scatter_ids(TensorView tokens, TensorView pairs, TensorView dst) override {
        cpu::ForcedDraftBackend::scatter_ids(tokens, pairs, dst);
        const int32_t trunk_row = static_cast<const int32_t *>(pairs.data)[1];  // each draft's first pair
        static_cast<int32_t *>(dst.data)[trunk_row] ^= 1;
    }
};

// ---- Fixture ----

TinyDirs *g_dirs = nullptr;

class VerifyTest : public ::testing::Test {
protected:
    static void SetUpTestSuite() { g_dirs = new TinyDirs("verify_test", 17, 18); }
    static void TearDownTestSuite() {
        delete g_dirs;
        g_dirs = nullptr;
    }

    // Small but complete (the sanitizer build runs these too): a prompt just past the 16-token window, one
    // decode step, the probe alone and in batches of 2.
    static VerifyOptions small_options() {
        VerifyOptions o;
        o.tp = {1, 2, 4, 8};
        o.prefill_tokens = 17;
        o.decode_steps = 1;
        o.batch = 2;
        o.make_reference_backend = [] { return cpu(2); };
        o.make_rank_backend = [](int tp, int rank) { return cpu(tp <= 2 ? 1 + rank % 2 : 1); };
        o.count_allocations = test::allocation_count;
        return o;
    }

    // Batch 1 and an 8-token prompt: enough to show a gate failing or skipping (the window-crossing prompt runs
    // in the tests above).
    static VerifyOptions short_options(std::vector<int> tp) {
        VerifyOptions o = small_options();
        o.tp = std::move(tp);
        o.batch = 1;
        o.prefill_tokens = 8;
        return o;
    }

    static Result<VerifyReport> verify(const std::string &dtype, const VerifyOptions &o) {
        const fs::path &dir = g_dirs->at(dtype);
        auto cfg = model::load_step35_config(dir);
        if (!cfg) return tl::unexpected(cfg.error());
        auto ckpt = io::Checkpoint::open(dir);
        if (!ckpt) return tl::unexpected(ckpt.error());
        return run_verify(*ckpt, *cfg, o);
    }
};

const GateResult &gate(const VerifyReport &r, const char *name) {
    const auto it = std::find_if(r.gates.begin(), r.gates.end(), [&](const GateResult &g) { return g.name == name; });
    EXPECT_NE(it, r.gates.end()) << name;
    return *it;
}

// Mismatches of every line of one native run (or of the reference) in one gate.
int64_t mismatches_of(const VerifyReport &r, int tp, const std::string &gate_name, bool reference = false) {
    int64_t n = 0;
    for (const VerifyLine &line : r.lines) {
        if (line.reference != reference || (!reference && line.tp != tp)) continue;
        for (const Comparison &c : line.comparisons) n += c.gate == gate_name ? c.mismatches : 0;
    }
    return n;
}

std::vector<std::string> stages_of(const VerifyReport &r, int tp) {
    std::vector<std::string> out;
    for (const VerifyLine &line : r.lines) {
        if (!line.reference && line.tp == tp) out.push_back(line.stage);
    }
    return out;
}

// ---- Everything passes ----

TEST_F(VerifyTest, EveryDegreeHasZeroMismatches) {
    // The whole tp 1, 2, 4, 8 matrix on both dtypes runs in the CLI test (VerifyTinyCheckpointsAtEveryDegree);
    // here fewer runs (the sanitizer build runs this too) check the report itself: fp8 experts of width 96 (no
    // whole 128-wide scale tile) at tp 1 and 8, which routed experts kept whole make possible.
    VerifyOptions o = small_options();
    o.tp = {1, 8};
    auto report = verify("fp8", o);
    ASSERT_TRUE(report.has_value()) << report.error().message;
    std::string text;
    for (const VerifyLine &line : report->lines) text += format_verify_line(line) + "\n";
    const std::string summary = format_verify_summary(*report);
    EXPECT_FALSE(report->any_fail()) << text << summary;
    for (const GateResult &g : report->gates) {
        EXPECT_EQ(g.status, GateStatus::kPass) << g.name << ": " << g.detail;
        EXPECT_EQ(g.mismatches, 0) << g.name;
    }
    EXPECT_EQ(report->runs, 2) << summary;
    ASSERT_EQ(report->combos.size(), 2u);
    for (const VerifyCombo &c : report->combos) {
        EXPECT_FALSE(c.skipped) << "tp " << c.tp << ": " << c.reason;
        EXPECT_TRUE(c.reason.empty()) << c.reason;
    }
    // Every native step was counted, allocated nothing (the warm-up step included), copied its tables in
    // once, and the ranks agree on their work.
    int64_t counted = 0;
    for (const VerifyLine &line : report->lines) {
        if (!line.has_counts) continue;
        ++counted;
        EXPECT_EQ(line.counts.allocations, 0) << format_verify_line(line);
        EXPECT_FALSE(line.counts.ranks_differ) << format_verify_line(line);
        EXPECT_GT(line.counts.launches, 0);
        EXPECT_EQ(line.counts.h2d, 1) << format_verify_line(line);
        EXPECT_LE(line.counts.d2h, 1) << format_verify_line(line);
        EXPECT_EQ(line.counts.syncs, 0) << format_verify_line(line);
    }
    // The stages of one run. Prompt 17: 17 + 1 decode + 1 kept of the partial + 3 recommitted = 22 positions;
    // then steps of 16 rows until the first sliding page (window 16) is released at 64 + 16 = 80: 16, 16, 16,
    // 10. Then the MTP stage, speculation (the MTP layer's own drafts, greedy and T 0.7) and 2 batch lines.
    std::vector<std::string> want = {"prefill",      "L2 prefill",     "decode 1",     "L2 decode 1",
                                     "txn partial",  "L2 txn partial", "txn rollback", "L2 txn rollback",
                                     "txn recommit", "L2 txn recommit", "txn abandon"};
    for (int i = 1; i <= 4; ++i) want.push_back(fmt::format("slide {}", i));
    want.push_back("mtp");
    want.push_back("spec greedy own drafts");
    want.push_back("spec T0.7 own drafts");
    for (int b = 1; b <= 2; ++b) want.push_back(fmt::format("batch {}", b));
    EXPECT_EQ(stages_of(*report, 8), want);
    EXPECT_EQ(counted, 15 * report->runs);
    for (const VerifyLine &line : report->lines) {
        if (line.reference || line.tp != 8) continue;
        if (line.stage == "txn rollback" || line.stage == "txn abandon") {
            // The step leaves the caches as they were: the digest check ran on all 8 ranks.
            const auto it = std::find_if(line.comparisons.begin(), line.comparisons.end(),
                                         [](const Comparison &c) { return c.what == "unchanged"; });
            ASSERT_NE(it, line.comparisons.end()) << line.stage;
            EXPECT_EQ(it->compared, 8);
            EXPECT_EQ(it->mismatches, 0);
        }
        if (line.stage == "L2 decode 1") {
            EXPECT_EQ(line.note, "8 pairs");
        }
        if (line.stage == "slide 4") {
            // The first sliding page went back to the pool at this step's commit.
            EXPECT_NE(line.note.find("sliding 1 of"), std::string::npos) << line.note;
        }
    }
    std::printf("[ verify ] fp8: %d runs, %zu lines, %lld counted steps\n", report->runs, report->lines.size(),
                static_cast<long long>(counted));
}

// ---- The gates can fail ----

TEST_F(VerifyTest, AReductionInAnotherOrderFails) {
    VerifyOptions o = short_options({2, 4});
    o.make_rank_backend = [](int, int) -> Result<std::unique_ptr<Backend>> {
        return std::unique_ptr<Backend>(std::make_unique<SkewedCombineBackend>(1, Numerics::kDevice));
    };
    auto report = verify("bf16", o);
    ASSERT_TRUE(report.has_value()) << report.error().message;
    EXPECT_TRUE(report->any_fail());
    // Two subtree sums have one order: tp=2 still equals TP=1. At tp=4 the o_proj and down_proj sums differ.
    EXPECT_EQ(mismatches_of(*report, 2, "LOGITS_PREFILL"), 0);
    EXPECT_EQ(mismatches_of(*report, 2, "ATTENTION_CACHELESS"), 0);
    const int64_t bad = mismatches_of(*report, 4, "LOGITS_PREFILL");
    EXPECT_GT(bad, 0);
    EXPECT_GT(mismatches_of(*report, 4, "ATTENTION_CACHELESS"), 0);
    EXPECT_GT(mismatches_of(*report, 4, "KV_BYTES"), 0);  // later layers' K/V follow the drift
    for (const char *name : {"LOGITS_PREFILL", "LOGITS_DECODE", "ATTENTION_CACHELESS", "DECODER_LAYER"}) {
        const GateResult &g = gate(*report, name);
        EXPECT_EQ(g.status, GateStatus::kFail) << name;
        EXPECT_NE(g.detail.find("tp=4 "), std::string::npos) << name << ": " << g.detail;
    }
    const std::string summary = format_verify_summary(*report);
    EXPECT_NE(summary.find("VERIFY FAIL"), std::string::npos) << summary;
    std::printf("[ verify ] skewed combine at tp=4: %lld prefill logits with other bits\n",
                static_cast<long long>(bad));
}

// With draft-forcing ranks the SPECULATION gate also forces every acceptance count; a backend that feeds the
// trunk another token than the draft the engine verifies (so a wrong draft is "accepted") fails it.
TEST_F(VerifyTest, SpeculationForcesEveryAcceptanceAndCatchesAMisfedDraft) {
    VerifyOptions o = short_options({2});
    DraftForcing forcing;
    o.forcing = &forcing;
    o.make_rank_backend = [&forcing](int, int) -> Result<std::unique_ptr<Backend>> {
        return std::unique_ptr<Backend>(std::make_unique<cpu::ForcedDraftBackend>(1, Numerics::kDevice, &forcing));
    };
    auto report = verify("bf16", o);
    ASSERT_TRUE(report.has_value()) << report.error().message;
    EXPECT_EQ(gate(*report, "SPECULATION").status, GateStatus::kPass) << gate(*report, "SPECULATION").detail;
    int forced_lines = 0;
    for (const VerifyLine &line : report->lines) {
        if (line.stage.find(" accepted") == std::string::npos) continue;
        ++forced_lines;
        const auto it = std::find_if(line.comparisons.begin(), line.comparisons.end(),
                                     [](const Comparison &c) { return c.what == "acceptance"; });
        ASSERT_NE(it, line.comparisons.end()) << line.stage;
        EXPECT_GT(it->compared, 0) << line.stage;
    }
    EXPECT_EQ(forced_lines, 2 + 1);  // greedy 0 or 1 accepted, T 0.7 1 accepted (the tiny model has one MTP layer)

    o.make_rank_backend = [&forcing](int, int) -> Result<std::unique_ptr<Backend>> {
        return std::unique_ptr<Backend>(std::make_unique<MisfedDraftBackend>(1, Numerics::kDevice, &forcing));
    };
    auto bad = verify("bf16", o);
    ASSERT_TRUE(bad.has_value()) << bad.error().message;
    EXPECT_EQ(gate(*bad, "SPECULATION").status, GateStatus::kFail);
    EXPECT_GT(mismatches_of(*bad, 2, "SPECULATION"), 0);
    EXPECT_EQ(mismatches_of(*bad, 2, "LOGITS_DECODE"), 0);  // only speculation is broken
}

TEST_F(VerifyTest, AGroupedProductOffTheOracleFails) {
    VerifyOptions o = short_options({1});
    o.make_reference_backend = []() -> Result<std::unique_ptr<Backend>> {
        return std::unique_ptr<Backend>(std::make_unique<FlippedGroupedBackend>(1, Numerics::kDevice));
    };
    auto report = verify("bf16", o);
    ASSERT_TRUE(report.has_value()) << report.error().message;
    // The reference's grouped gate/up rows no longer equal one product per pair.
    EXPECT_GT(mismatches_of(*report, 1, "EXPERTS_GROUPED", true), 0);
    EXPECT_EQ(gate(*report, "EXPERTS_GROUPED").status, GateStatus::kFail);
    EXPECT_NE(gate(*report, "EXPERTS_GROUPED").detail.find("tp1 reference L2 prefill: tp1 expert_"), std::string::npos)
        << gate(*report, "EXPERTS_GROUPED").detail;
    EXPECT_TRUE(report->any_fail());
}

// The oracle's products on the reference backend (what `verify --device cuda` does for bf16 experts, whose tensor-core
// sums are not the host's): on the CPU the per-pair products equal the grouped rows, so every gate passes and the
// reference line says where the oracle ran; a grouped product that depends on the rows beside it still fails.
TEST_F(VerifyTest, TheOracleOnTheReferenceBackendHoldsTheGroupedRowsToPairsAlone) {
    VerifyOptions o = short_options({1, 2});
    o.oracle_products = OracleProducts::kBackend;
    auto report = verify("bf16", o);
    ASSERT_TRUE(report.has_value()) << report.error().message;
    EXPECT_FALSE(report->any_fail());
    EXPECT_EQ(gate(*report, "EXPERTS_GROUPED").status, GateStatus::kPass);
    const auto noted = std::find_if(report->lines.begin(), report->lines.end(), [](const VerifyLine &l) {
        return l.reference && l.note.find("one at a time on the reference backend") != std::string::npos;
    });
    EXPECT_NE(noted, report->lines.end());

    o.tp = {1};
    o.make_reference_backend = []() -> Result<std::unique_ptr<Backend>> {
        return std::unique_ptr<Backend>(std::make_unique<FlippedGroupedBackend>(1, Numerics::kDevice));
    };
    auto flipped = verify("bf16", o);
    ASSERT_TRUE(flipped.has_value()) << flipped.error().message;
    EXPECT_GT(mismatches_of(*flipped, 1, "EXPERTS_GROUPED", true), 0);
    EXPECT_EQ(gate(*flipped, "EXPERTS_GROUPED").status, GateStatus::kFail);
}

TEST_F(VerifyTest, ARankOpThatAllocatesFailsTheHotPathGate) {
    VerifyOptions o = short_options({2});
    o.make_rank_backend = [](int, int) -> Result<std::unique_ptr<Backend>> {
        return std::unique_ptr<Backend>(std::make_unique<AllocatingBackend>(1, Numerics::kDevice));
    };
    auto report = verify("bf16", o);
    ASSERT_TRUE(report.has_value()) << report.error().message;
    const GateResult &allocs = gate(*report, "HOT_PATH_ALLOCS");
    EXPECT_EQ(allocs.status, GateStatus::kFail);
    EXPECT_GT(allocs.mismatches, 0);
    EXPECT_NE(allocs.detail.find("tp=2 decode 1:"), std::string::npos) << allocs.detail;
    // The bits are right all the same.
    for (const GateResult &g : report->gates) {
        if (g.name != "HOT_PATH_ALLOCS") {
            EXPECT_NE(g.status, GateStatus::kFail) << g.name << ": " << g.detail;
        }
    }
    // Without a counter the gate is skipped, saying why (a degree the plan refuses keeps this cheap).
    o.count_allocations = {};
    o.tp = {3};
    report = verify("bf16", o);
    ASSERT_TRUE(report.has_value());
    EXPECT_EQ(gate(*report, "HOT_PATH_ALLOCS").status, GateStatus::kSkip);
    EXPECT_EQ(gate(*report, "HOT_PATH_ALLOCS").detail, "allocations are not counted here");
    EXPECT_FALSE(report->any_fail());
}

// ---- Skips and refusals ----

TEST_F(VerifyTest, ADenseLayerSkipsTheMoeGates) {
    VerifyOptions o = short_options({2});
    o.layer = 0;
    auto report = verify("bf16", o);
    ASSERT_TRUE(report.has_value()) << report.error().message;
    for (const char *name : {"ROUTER", "EXPERTS_GROUPED", "EXPERT_ROWS_ALL_RANKS", "COMBINE", "SHARED_EXPERT"}) {
        EXPECT_EQ(gate(*report, name).status, GateStatus::kSkip) << name;
        EXPECT_EQ(gate(*report, name).detail, "layer 0 is dense (--layer picks a MoE layer)") << name;
    }
    EXPECT_EQ(gate(*report, "ATTENTION_CACHELESS").status, GateStatus::kPass);
    EXPECT_EQ(gate(*report, "DECODER_LAYER").status, GateStatus::kPass);
    EXPECT_FALSE(report->any_fail());
}

TEST_F(VerifyTest, ADegreeThePlanRefusesIsSkippedAndSaysSo) {
    VerifyOptions o = small_options();
    o.tp = {3, 16};
    std::vector<std::string> streamed;
    o.on_line = [&streamed](const VerifyLine &line) { streamed.push_back(format_verify_line(line)); };
    auto report = verify("fp8", o);
    ASSERT_TRUE(report.has_value()) << report.error().message;
    EXPECT_EQ(report->runs, 0);
    EXPECT_FALSE(report->any_fail());
    ASSERT_EQ(streamed.size(), 2u);  // nothing ran, not even the reference
    EXPECT_NE(streamed[0].find("tp=3         SKIP             the plan refuses it: tp=3: query heads 8 on layer 0"),
              std::string::npos)
        << streamed[0];
    EXPECT_NE(streamed[1].find("the plan refuses it: tp=16"), std::string::npos) << streamed[1];
    for (const GateResult &g : report->gates) EXPECT_EQ(g.status, GateStatus::kSkip) << g.name;
    EXPECT_NE(format_verify_summary(*report).find("VERIFY NOTHING VERIFIED: 0 native runs, 2 skipped by the plan"),
              std::string::npos);
}

TEST_F(VerifyTest, BadOptionsAreRefused) {
    auto expect_error = [](VerifyOptions o, const std::string &fragment) {
        auto r = verify("bf16", o);
        ASSERT_FALSE(r.has_value()) << fragment;
        EXPECT_NE(r.error().message.find(fragment), std::string::npos) << r.error().message;
    };
    VerifyOptions o = small_options();
    o.prefill_tokens = 1;
    expect_error(o, "verify: prefill tokens 1, expected at least 2");
    o = small_options();
    o.decode_steps = 0;
    expect_error(o, "verify: decode steps 0, expected at least 1");
    o = small_options();
    o.batch = 0;
    expect_error(o, "verify: batch 0, expected at least 1");
    o = small_options();
    o.layer = 6;
    expect_error(o, "verify: layer 6 outside the model's trunk layers 0 .. 5");
    o = small_options();
    o.tp = {2, 0};
    expect_error(o, "verify: tp 0, expected at least 1");
    o = small_options();
    o.tp = {};
    expect_error(o, "verify: no tp degree to run");
    o = small_options();
    o.make_rank_backend = {};
    expect_error(o, "verify: no backend factory");
    o = small_options();
    o.prefill_tokens = 5000;
    expect_error(o, "past the model's context length 4096");
    o = small_options();
    o.tp = {1};
    o.make_reference_backend = []() -> Result<std::unique_ptr<Backend>> { return make_error("no device"); };
    expect_error(o, "rank 0 backend: no device");
}

TEST_F(VerifyTest, AFailingRankBackendStopsThatRunOnly) {
    VerifyOptions o = short_options({1, 2});
    o.make_rank_backend = [](int tp, int rank) -> Result<std::unique_ptr<Backend>> {
        if (tp == 2 && rank == 1) return make_error("rank {} has no device", rank);
        return cpu(1);
    };
    auto report = verify("bf16", o);
    ASSERT_TRUE(report.has_value()) << report.error().message;
    const GateResult &run = gate(*report, "NATIVE_RUN");
    EXPECT_EQ(run.status, GateStatus::kFail);
    EXPECT_NE(run.detail.find("tp=2: rank 1 backend: rank 1 has no device"), std::string::npos) << run.detail;
    EXPECT_EQ(mismatches_of(*report, 1, "LOGITS_PREFILL"), 0);
    EXPECT_EQ(gate(*report, "LOGITS_PREFILL").status, GateStatus::kPass);  // tp=1 ran
    EXPECT_TRUE(report->any_fail());
}

}  // namespace
}  // namespace memra::runtime
