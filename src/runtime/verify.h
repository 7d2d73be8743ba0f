// The determinism gates of `memra verify` (DETERMINISM.md "The gates"): one scenario runs through the engine
// (runtime/engine.h) on the canonical path (one rank, the whole model) and again on a native engine per
// requested TP degree (routed experts expert-parallel); every stage compares raw bits (logits, each rank's
// KV bytes against its heads' slice of the reference rows, the page tables, one layer's intermediates
// against the reference and an independent per-expert oracle) and counts each native step's work
// (launches, copies each way, collectives, heap allocations). The CLI formats the report; tests call
// run_verify directly.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/draft_forcing.h"
#include "core/kv_format.h"
#include "core/result.h"
#include "io/safetensors.h"
#include "parallel/comm.h"
#include "model/step35_config.h"
#include "runtime/engine.h"

namespace memra::runtime {

// Makes the backend of the canonical TP=1 run, and rank `rank` of a native run of `tp` ranks. The runtime
// does not depend on a backend implementation, so the caller names it (CPU in the CLI; a test may hand the
// ranks a deliberately perturbed backend to show that a gate fails).
using ReferenceBackendFactory = std::function<Result<std::unique_ptr<Backend>>()>;
using RankBackendFactory = std::function<Result<std::unique_ptr<Backend>>(int tp, int rank)>;

struct VerifyLine;

// Where the per-expert oracle computes its products: on the host (scalar products in the reference's numerics,
// code the backends do not share) or on the reference backend, one pair per call (the bits a backend must match
// when its products are not the host's). kAuto: the backend for bf16 experts, and FP8 ones with e4m3 activations,
// on the GPU (tensor cores), else the host.
enum class OracleProducts { kAuto, kBackend };

struct VerifyOptions {
    std::vector<int> tp = {1, 2, 4, 8};  // native degrees, in this order (routed experts expert-parallel)
    int prefill_tokens = 40;             // prompt length (>= 2); longer than the sliding window by default
    int decode_steps = 16;               // decode steps after the prompt (>= 1); more follow until a sliding
                                         // page has been released
    int batch = 8;                       // batch invariance: batches of 1 .. batch sequences (>= 1)
    int layer = -1;                      // the layer of the layer gates: -1 = the first MoE layer (else 0)
    KvFormat k_format = KvFormat::kF32;
    KvFormat v_format = KvFormat::kF32;
    uint64_t seed = 0x5eed;  // of the token ids (uniform over the vocabulary)
    ReferenceBackendFactory make_reference_backend;
    RankBackendFactory make_rank_backend;
    // How tp > 1 ranks exchange backend buffers (EngineOptions::rank_copy); nullptr: host memory.
    parallel::InProcessGroup::ByteCopy rank_copy = nullptr;
    // The communicators of tp > 1 ranks (EngineOptions::make_comms); empty: the in-process group's.
    CommFactory make_comms;
    // The process's heap allocations so far (a counting operator new), or empty: then allocations are not
    // counted and HOT_PATH_ALLOCS is skipped.
    std::function<int64_t()> count_allocations;
    // Called with every stage line as soon as it is complete (the report holds them all too); optional.
    std::function<void(const VerifyLine &)> on_line;
    // The drafts the native ranks' backends impose (draft-forcing backends over it, e.g. cpu::ForcedDraftBackend):
    // the SPECULATION gate then also forces exactly 0 .. K accepted drafts per step. Null: the MTP layers' own
    // drafts only.
    DraftForcing *forcing = nullptr;
    OracleProducts oracle_products = OracleProducts::kAuto;
};

enum class GateStatus { kPass, kFail, kSkip };
const char *gate_status_name(GateStatus s);  // "PASS", "FAIL", "SKIP"

// One comparison of a stage: `mismatches` of `compared` items differ. Items are 4-byte values compared as
// raw bits (unit "values"), KV row bytes ("bytes"), state fields ("fields": lengths, generation, pages held,
// block-table entries, page accounting, work counts) or whole caches by digest ("caches"). It counts toward
// gate `gate`.
struct Comparison {
    std::string gate;  // e.g. "LOGITS_DECODE"
    std::string what;  // short label: "logits", "kv_bytes", "attention", ...
    int64_t mismatches = 0;
    int64_t compared = 0;
    const char *unit = "values";
    std::string first;  // where the first mismatch is, when there is one
};

// Work of one native step (plan + run + finish) on rank 0 (every rank runs the same op sequence;
// ranks_differ says otherwise).
struct StepCounts {
    int64_t launches = 0;     // backend op calls
    int64_t h2d = 0;          // host -> backend copies (the step tables)
    int64_t d2h = 0;          // backend -> host copies (the sampled ids; the logits when returned)
    int64_t syncs = 0;        // of those, made before finish() (each a wait for the backend): want 0
    int64_t all_gathers = 0;
    int64_t exchanges = 0;      // grouped send/recv exchanges (the MoE combine's exact counts)
    int64_t comm_bytes = 0;     // bytes received by the collectives and exchanges
    int64_t allocations = -1;  // heap allocations from plan() to finish()'s return, every thread; -1: not counted
    bool ranks_differ = false;  // some rank's launches / copies / collectives differ from rank 0's
};

// One line of the report: one stage of the TP=1 reference (tp = 1, reference = true) or of one native run.
struct VerifyLine {
    int tp = 1;
    bool reference = false;
    std::string stage;  // "prefill", "decode 3", "txn partial", "L2 prefill", "batch 4", ...
    std::vector<Comparison> comparisons;
    bool has_counts = false;  // a native step ran for this line
    StepCounts counts;
    std::string note;   // extra facts (pair counts, pages) or, for a failed run, the error
    bool failed = false;  // the native run stopped here with an error (note)
};

// A TP degree: run, or refused by the plan (skipped, with the plan's reason).
struct VerifyCombo {
    int tp = 1;
    bool skipped = false;
    std::string reason;      // the plan's refusal, or the error that stopped the run
};

struct GateResult {
    std::string name;
    GateStatus status = GateStatus::kSkip;
    int64_t mismatches = 0;  // over every comparison of the gate, whatever its unit
    std::string totals;      // mismatches / compared per unit, e.g. "0/40960 bits, 0/7680 bytes"
    int runs = 0;            // runs that checked it (native runs, and the TP=1 reference for its oracles)
    std::string detail;      // why it was skipped or failed
};

struct VerifyReport {
    std::string model;  // one line: dtype, layers, experts, the chosen layer
    std::vector<VerifyLine> lines;
    std::vector<VerifyCombo> combos;
    std::vector<GateResult> gates;  // in a fixed order (verify_gate_names)
    int runs = 0;                   // native runs that were not skipped

    bool any_fail() const;
};

// Every gate, in report order.
const std::vector<std::string> &verify_gate_names();

// Runs the gates on the model in store (a checkpoint or a generated model; cfg parsed from its config). Errors
// (not FAILs): options out of range
// (tokens < 2, decode < 1, batch < 1, a layer outside the trunk, a tp < 1, no backend factory), a
// reference run that cannot run, a context the model does not have. A native run that fails ends that
// run with a failed line and FAILs the NATIVE_RUN gate; a degree the plan refuses is skipped.
Result<VerifyReport> run_verify(const io::TensorStore &store, const model::Step35Config &cfg,
                                const VerifyOptions &options);

// The report as the CLI prints it: a header, one line per stage, then one line per gate and an overall
// line. format_verify_line is one stage line (what on_line callers print).
std::string format_verify_line(const VerifyLine &line);
std::string format_verify_summary(const VerifyReport &report);

}  // namespace memra::runtime
