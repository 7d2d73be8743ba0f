// memra verify's gates through the library (model/step35_verify.h), on tiny bf16 and fp8 checkpoints: every
// (tp, ep) the plan allows reports zero mismatches and zero hot-path allocations, refused ones are skipped
// with the plan's reason, and the gates can fail: a reduction finished in another order, a grouped expert
// product that differs from the per-expert oracle and a rank op that allocates are each caught.

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
#include "io/safetensors.h"
#include "kv/kv_cache.h"
#include "model/step35_config.h"
#include "model/step35_ranks.h"
#include "model/step35_verify.h"

#include "model/alloc_count.h"
#include "model/skewed_combine_backend.h"
#include "model/tiny_dirs.h"

namespace memra::model {
namespace {

namespace fs = std::filesystem;

// ---- Backends ----

Result<std::unique_ptr<Backend>> cpu(int threads) {
    return std::unique_ptr<Backend>(std::make_unique<cpu::CpuBackend>(threads));
}

// A grouped product whose first output value has its lowest mantissa bit flipped.
class FlippedGroupedBackend : public cpu::CpuBackend {
public:
    using cpu::CpuBackend::CpuBackend;
    void matmul_grouped(TensorView x_sorted, BankId b, TensorView offsets, TensorView y) override {
        cpu::CpuBackend::matmul_grouped(x_sorted, b, offsets, y);
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
        o.ep = {false, true};
        o.ep_both = true;
        o.prefill_tokens = 17;
        o.decode_steps = 1;
        o.batch = 2;
        o.make_reference_backend = [] { return cpu(2); };
        o.make_rank_backend = [](int tp, int rank) { return cpu(tp <= 2 ? 1 + rank % 2 : 1); };
        o.count_allocations = test::allocation_count;
        return o;
    }

    // One EP setting, batch 1 and an 8-token prompt: enough to show a gate failing or skipping (the
    // window-crossing prompt runs in the tests above).
    static VerifyOptions short_options(std::vector<int> tp, bool ep) {
        VerifyOptions o = small_options();
        o.tp = std::move(tp);
        o.ep = {ep};
        o.ep_both = false;
        o.batch = 1;
        o.prefill_tokens = 8;
        return o;
    }

    static Result<VerifyReport> verify(const std::string &dtype, const VerifyOptions &o) {
        const fs::path &dir = g_dirs->at(dtype);
        auto cfg = load_step35_config(dir);
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
int64_t mismatches_of(const VerifyReport &r, int tp, bool ep, const std::string &gate_name, bool reference = false) {
    int64_t n = 0;
    for (const VerifyLine &line : r.lines) {
        if (line.reference != reference || (!reference && (line.tp != tp || line.ep != ep))) continue;
        for (const Comparison &c : line.comparisons) n += c.gate == gate_name ? c.mismatches : 0;
    }
    return n;
}

std::vector<std::string> stages_of(const VerifyReport &r, int tp, bool ep) {
    std::vector<std::string> out;
    for (const VerifyLine &line : r.lines) {
        if (!line.reference && line.tp == tp && line.ep == ep) out.push_back(line.stage);
    }
    return out;
}

// ---- Everything passes ----

TEST_F(VerifyTest, DegreesWithAndWithoutEpHaveZeroMismatches) {
    // The whole tp 1, 2, 4, 8 matrix on both dtypes runs in the CLI test (VerifyTinyCheckpointsAtEveryDegree...);
    // here fewer runs (the sanitizer build runs this too) check the report itself: fp8 at tp 1 and 8, where the
    // plan refuses tp 8 without EP (96 / 8 d_expert columns are no whole 128-wide scale block).
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
    EXPECT_EQ(report->runs, 3) << summary;
    ASSERT_EQ(report->combos.size(), 4u);
    for (const VerifyCombo &c : report->combos) {
        const bool refused = !c.ep && c.tp == 8;
        EXPECT_EQ(c.skipped, refused) << "tp " << c.tp << " ep " << c.ep;
        if (refused) {
            EXPECT_NE(c.reason.find("not a multiple of the fp8 scale block 128; use ep"), std::string::npos)
                << c.reason;
            EXPECT_FALSE(c.requested);  // implied by ep_both, not asked for one by one
        } else {
            EXPECT_TRUE(c.reason.empty()) << c.reason;
        }
    }
    EXPECT_NE(text.find("tp=8 ep=off  SKIP             the plan refuses it: tp=8 without ep"), std::string::npos)
        << text;
    // Every native step was counted, allocated nothing (the warm-up step included) and ranks agree on work.
    int64_t counted = 0;
    for (const VerifyLine &line : report->lines) {
        if (!line.has_counts) continue;
        ++counted;
        EXPECT_EQ(line.counts.allocations, 0) << format_verify_line(line);
        EXPECT_FALSE(line.counts.ranks_differ) << format_verify_line(line);
        EXPECT_GT(line.counts.launches, 0);
        if (!line.ep) {
            EXPECT_EQ(line.counts.broadcasts, 0) << format_verify_line(line);
        }
    }
    // Per run: prefill, 2 MTP steps, 1 decode step, 3 transaction steps, the grown decode, 12 ring steps and
    // 2 batch lines.
    EXPECT_EQ(counted, 22 * report->runs);

    // The stages of one run. Prompt 17: the cache holds 17 + 1 + 4 = 22 positions before the grow (to
    // 33 + 16 + 2 = 51); the sliding ring (window 16, stage rows 17: 33 slots) has wrapped by two positions
    // at 35: 23 after the grown decode, then 12 ring steps.
    std::vector<std::string> want = {"prefill",      "L2 prefill",     "mtp prompt",   "mtp chained",
                                     "decode 1",     "L2 decode 1",    "txn partial",  "L2 txn partial",
                                     "txn rollback", "L2 txn rollback", "txn recommit", "L2 txn recommit",
                                     "grow",         "grown decode"};
    for (int i = 1; i <= 12; ++i) want.push_back(fmt::format("ring {}", i));
    for (int b = 1; b <= 2; ++b) want.push_back(fmt::format("batch {}", b));
    EXPECT_EQ(stages_of(*report, 8, true), want);
    for (const VerifyLine &line : report->lines) {
        if (line.reference || line.tp != 8) continue;
        if (line.stage == "grow") {
            EXPECT_EQ(line.note, "capacity 22 -> 51");
        }
        if (line.stage == "txn rollback") {
            // The rollback leaves the caches as they were: the digest check ran on all 8 ranks.
            const auto it = std::find_if(line.comparisons.begin(), line.comparisons.end(),
                                         [](const Comparison &c) { return c.what == "unchanged"; });
            ASSERT_NE(it, line.comparisons.end());
            EXPECT_EQ(it->compared, 8);
            EXPECT_EQ(it->mismatches, 0);
        }
        if (line.stage == "L2 decode 1") {
            // One token: 8 routed pairs, the grouped rows of each rank's own experts against the oracle, and the
            // routes changed since the prefill.
            EXPECT_EQ(line.note, "8 pairs");
            const auto it = std::find_if(line.comparisons.begin(), line.comparisons.end(),
                                         [](const Comparison &c) { return c.gate == "ROUTES_DYNAMIC"; });
            ASSERT_NE(it, line.comparisons.end());
            EXPECT_GT(it->compared, 0);
        }
    }
    std::printf("[ verify ] fp8: %d runs, %zu lines, %lld counted steps\n", report->runs, report->lines.size(),
                static_cast<long long>(counted));
}

// ---- The gates can fail ----

TEST_F(VerifyTest, AReductionInAnotherOrderFails) {
    VerifyOptions o = short_options({2, 4}, false);
    o.make_rank_backend = [](int, int) -> Result<std::unique_ptr<Backend>> {
        return std::unique_ptr<Backend>(std::make_unique<SkewedCombineBackend>(1));
    };
    auto report = verify("bf16", o);
    ASSERT_TRUE(report.has_value()) << report.error().message;
    EXPECT_TRUE(report->any_fail());
    // Two subtree sums have one order: tp=2 still equals TP=1. At tp=4 the o_proj and down_proj sums differ.
    EXPECT_EQ(mismatches_of(*report, 2, false, "LOGITS_PREFILL"), 0);
    EXPECT_EQ(mismatches_of(*report, 2, false, "ATTENTION_CACHELESS"), 0);
    const int64_t bad = mismatches_of(*report, 4, false, "LOGITS_PREFILL");
    EXPECT_GT(bad, 0);
    EXPECT_GT(mismatches_of(*report, 4, false, "ATTENTION_CACHELESS"), 0);
    EXPECT_GT(mismatches_of(*report, 4, false, "KV_BYTES"), 0);  // later layers' K/V follow the drift
    for (const char *name : {"LOGITS_PREFILL", "LOGITS_DECODE", "ATTENTION_CACHELESS", "DECODER_LAYER"}) {
        const GateResult &g = gate(*report, name);
        EXPECT_EQ(g.status, GateStatus::kFail) << name;
        EXPECT_NE(g.detail.find("tp=4 ep=off"), std::string::npos) << name << ": " << g.detail;
    }
    const std::string summary = format_verify_summary(*report);
    EXPECT_NE(summary.find("VERIFY FAIL"), std::string::npos) << summary;
    std::printf("[ verify ] skewed combine at tp=4: %lld prefill logits with other bits\n",
                static_cast<long long>(bad));
}

TEST_F(VerifyTest, AGroupedProductOffTheOracleFails) {
    VerifyOptions o = short_options({1}, false);
    o.make_reference_backend = []() -> Result<std::unique_ptr<Backend>> {
        return std::unique_ptr<Backend>(std::make_unique<FlippedGroupedBackend>(1));
    };
    auto report = verify("bf16", o);
    ASSERT_TRUE(report.has_value()) << report.error().message;
    // The reference's grouped gate/up rows no longer equal one product per pair.
    EXPECT_GT(mismatches_of(*report, 1, false, "EXPERTS_GROUPED", true), 0);
    EXPECT_EQ(gate(*report, "EXPERTS_GROUPED").status, GateStatus::kFail);
    EXPECT_NE(gate(*report, "EXPERTS_GROUPED").detail.find("tp1 reference L2 prefill: tp1 expert_"), std::string::npos)
        << gate(*report, "EXPERTS_GROUPED").detail;
    EXPECT_TRUE(report->any_fail());
}

TEST_F(VerifyTest, ARankOpThatAllocatesFailsTheHotPathGate) {
    VerifyOptions o = short_options({2}, true);
    o.make_rank_backend = [](int, int) -> Result<std::unique_ptr<Backend>> {
        return std::unique_ptr<Backend>(std::make_unique<AllocatingBackend>(1));
    };
    auto report = verify("bf16", o);
    ASSERT_TRUE(report.has_value()) << report.error().message;
    const GateResult &allocs = gate(*report, "HOT_PATH_ALLOCS");
    EXPECT_EQ(allocs.status, GateStatus::kFail);
    EXPECT_GT(allocs.mismatches, 0);
    EXPECT_NE(allocs.detail.find("tp=2 ep=on mtp prompt:"), std::string::npos) << allocs.detail;
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
    VerifyOptions o = short_options({2}, false);
    o.layer = 0;
    auto report = verify("bf16", o);
    ASSERT_TRUE(report.has_value()) << report.error().message;
    for (const char *name : {"ROUTER", "EXPERTS_GROUPED", "ROUTES_DYNAMIC", "EXPERT_ROWS_ALL_RANKS", "COMBINE",
                             "SHARED_EXPERT"}) {
        EXPECT_EQ(gate(*report, name).status, GateStatus::kSkip) << name;
        EXPECT_EQ(gate(*report, name).detail, "layer 0 is dense (--layer picks a MoE layer)") << name;
    }
    EXPECT_EQ(gate(*report, "ATTENTION_CACHELESS").status, GateStatus::kPass);
    EXPECT_EQ(gate(*report, "DECODER_LAYER").status, GateStatus::kPass);
    EXPECT_FALSE(report->any_fail());
}

TEST_F(VerifyTest, ARequestedCombinationThePlanRefusesIsSkippedAndSaysSo) {
    VerifyOptions o = small_options();
    o.tp = {2, 3};
    o.ep = {false};
    o.ep_both = false;
    std::vector<std::string> streamed;
    o.on_line = [&streamed](const VerifyLine &line) { streamed.push_back(format_verify_line(line)); };
    auto report = verify("fp8", o);
    ASSERT_TRUE(report.has_value()) << report.error().message;
    EXPECT_EQ(report->runs, 0);
    EXPECT_FALSE(report->any_fail());
    ASSERT_EQ(streamed.size(), 2u);  // nothing ran, not even the reference
    EXPECT_NE(streamed[0].find("tp=2 ep=off  SKIP             requested, but the plan refuses it: tp=2 without ep"),
              std::string::npos)
        << streamed[0];
    EXPECT_NE(streamed[1].find("requested, but the plan refuses it: tp=3"), std::string::npos) << streamed[1];
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
    expect_error(o, "verify: no (tp, ep) to run");
    o = small_options();
    o.make_rank_backend = {};
    expect_error(o, "verify: no backend factory");
    o = small_options();
    o.prefill_tokens = 5000;
    expect_error(o, "past the model's context length 4096");
    o = small_options();
    o.tp = {1};
    o.ep = {false};
    o.make_reference_backend = []() -> Result<std::unique_ptr<Backend>> { return make_error("no device"); };
    expect_error(o, "reference backend: no device");
}

TEST_F(VerifyTest, AFailingRankBackendStopsThatRunOnly) {
    VerifyOptions o = short_options({1, 2}, false);
    o.make_rank_backend = [](int tp, int rank) -> Result<std::unique_ptr<Backend>> {
        if (tp == 2 && rank == 1) return make_error("rank {} has no device", rank);
        return cpu(1);
    };
    auto report = verify("bf16", o);
    ASSERT_TRUE(report.has_value()) << report.error().message;
    const GateResult &run = gate(*report, "NATIVE_RUN");
    EXPECT_EQ(run.status, GateStatus::kFail);
    EXPECT_NE(run.detail.find("tp=2 ep=off: rank 1 backend: rank 1 has no device"), std::string::npos) << run.detail;
    EXPECT_EQ(mismatches_of(*report, 1, false, "LOGITS_PREFILL"), 0);
    EXPECT_EQ(gate(*report, "LOGITS_PREFILL").status, GateStatus::kPass);  // tp=1 ran
    EXPECT_TRUE(report->any_fail());
}

// ---- What verify added to the rank group: grow and the step allocation count ----

TEST_F(VerifyTest, RankGroupGrowsEveryCacheAndCountsStepAllocations) {
    const fs::path &dir = g_dirs->at("bf16");
    auto cfg = load_step35_config(dir);
    ASSERT_TRUE(cfg.has_value());
    auto ckpt = io::Checkpoint::open(dir);
    ASSERT_TRUE(ckpt.has_value());
    const ForwardCapacity cap{8, 2, 32, 0};
    const BackendFactory factory = [](int) { return cpu(1); };
    auto g = Step35RankGroup::create(*ckpt, *cfg, RankGroupOptions{2, false, cap, factory});
    ASSERT_TRUE(g.has_value()) << g.error().message;
    auto other = Step35RankGroup::create(*ckpt, *cfg, RankGroupOptions{2, false, cap, factory});
    ASSERT_TRUE(other.has_value());
    const kv::KvFormat q8 = kv::KvFormat::kQ8_0;
    auto seq = (*g)->create_sequence(q8, q8, 12, 8);
    auto foreign = (*other)->create_sequence(q8, q8, 12, 8);
    ASSERT_TRUE(seq.has_value() && foreign.has_value());
    const std::vector<int32_t> tokens = {3, 1, 4, 1, 5, 9, 2, 6};
    RankSeqChunk c{&*seq, tokens, false, -1};
    ASSERT_TRUE((*g)->step(std::span(&c, 1)).has_value());
    EXPECT_EQ((*g)->step_allocations(), -1);  // no counter set

    std::vector<uint64_t> digests;
    for (int r = 0; r < 2; ++r) digests.push_back(kv::kv_cache_digest(seq->trunk(r)));
    auto refused = (*g)->grow(*seq, 11);
    ASSERT_FALSE(refused.has_value());
    EXPECT_EQ(refused.error().message, "grow: new capacity 11 is below the capacity 12");
    refused = (*g)->grow(*foreign, 20);
    ASSERT_FALSE(refused.has_value());
    EXPECT_EQ(refused.error().message, "grow: the sequence belongs to another rank group");
    ASSERT_TRUE((*g)->grow(*seq, 20).has_value());
    EXPECT_EQ(seq->capacity(), 20);
    for (int r = 0; r < 2; ++r) {
        EXPECT_EQ(seq->trunk(r).capacity(), 20);
        EXPECT_EQ(seq->mtp(0, r).capacity(), 20);
        EXPECT_EQ(seq->trunk(r).last_generation(), 1u);
        EXPECT_EQ(kv::kv_cache_digest(seq->trunk(r)), digests[static_cast<size_t>(r)]);
    }
    // Past the old capacity now, with the allocations of the ranks' step counted: none.
    (*g)->set_allocation_counter(test::allocation_count);
    c = RankSeqChunk{&*seq, tokens, false, -1};
    ASSERT_TRUE((*g)->step(std::span(&c, 1)).has_value());
    EXPECT_EQ(seq->length(), 16);
    EXPECT_EQ((*g)->step_allocations(), 0);
}

}  // namespace
}  // namespace memra::model
