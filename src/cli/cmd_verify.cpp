// `memra verify [MODEL_DIR]`: the determinism gates (runtime/verify.h) on CPU or CUDA backends (--device). Each stage line gives
// raw-bit mismatches and the native step's launches, copies each way, collectives and heap allocations
// (this executable's counting operator new, alloc_count.h); then one PASS / FAIL / SKIP line per gate and an
// overall line. Exit 0 when no gate fails, 3 when a gate fails, 1 on invalid input or when the plan refuses
// every requested degree (nothing verified), 2 on usage errors.
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include "cli/alloc_count.h"
#include "cli/commands.h"
#include "runtime/verify.h"
#ifdef MEMRA_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace memra::cli {
namespace {

struct VerifyCliOptions {
    std::string model_dir;
    SyntheticChoice synthetic;  // --synthetic: a model generated in memory instead of model_dir
    std::string tp = "1,2,4,8";
    int tokens = 40;
    int decode = 16;
    int batch = 8;
    int layer = -1;
    int threads = default_threads();
    Numerics numerics = Numerics::kDevice;
    DeviceChoice device = DeviceChoice::kAuto;
    std::string kv_k = "f32";
    std::string kv_v = "f32";
};

// "1,2,4,8" -> {1, 2, 4, 8}; the error is the validator's message.
Result<std::vector<int>> parse_tp_list(const std::string &text) {
    std::vector<int> out;
    size_t pos = 0;
    while (true) {
        const size_t comma = text.find(',', pos);
        const std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
        int value = 0;
        const char *end = item.data() + item.size();
        const auto [ptr, ec] = std::from_chars(item.data(), end, value);
        if (item.empty() || ec != std::errc() || ptr != end || value < 1) {
            return make_error("expected a comma-separated list of positive integers (e.g. 1,2,4,8), found {}", text);
        }
        for (const int seen : out) {
            if (seen == value) return make_error("tp {} is listed twice in {}", value, text);
        }
        out.push_back(value);
        if (comma == std::string::npos) break;
        pos = comma + 1;
    }
    return out;
}

int run_verify_command(const VerifyCliOptions &opt) {
    auto tp = parse_tp_list(opt.tp);
    if (!tp) {  // the validator already refused it; kept so the parse never silently fails
        std::fprintf(stderr, "error: --tp: %s\n", tp.error().message.c_str());
        return kExitUsage;
    }
    // The model: a checkpoint directory (its config first, the shards once --layer is checked) or a synthetic one.
    auto in = load_model_inputs(opt.model_dir, opt.synthetic, opt.threads, opt.kv_k, opt.kv_v);
    if (!in) return kExitInvalidInput;
    const std::string &name = in->name;
    const model::Step35Config *cfg = &in->cfg;
    if (opt.layer >= cfg->n_layers) {
        return report_error(fmt::format("--layer {}: the model has {} trunk layers (0 .. {})", opt.layer, cfg->n_layers,
                                        cfg->n_layers - 1));
    }
    auto store = open_store(*in);
    if (!store) return report_error(store.error().message);

    runtime::VerifyOptions vo;
    vo.tp = *tp;
    vo.prefill_tokens = opt.tokens;
    vo.decode_steps = opt.decode;
    vo.batch = opt.batch;
    vo.layer = opt.layer;
    vo.k_format = in->k_format;
    vo.v_format = in->v_format;
    auto device = resolve_device(opt.device, opt.numerics);
    if (!device) return report_error(device.error().message);
    const int threads = opt.threads;
    const Numerics numerics = opt.numerics;
    const BackendChoice reference{*device, threads, numerics};
    vo.make_reference_backend = [make = backend_factory(reference)]() { return make(0); };
    // The native ranks can force speculation's drafts (the SPECULATION gate's acceptance patterns).
    auto forcing = std::make_shared<DraftForcing>();
    vo.forcing = forcing.get();
    vo.make_rank_backend = [reference, forcing](int degree, int rank) -> Result<std::unique_ptr<Backend>> {
        BackendChoice ranks = reference;
        ranks.n_threads = std::max(1, reference.n_threads / degree);
        ranks.forcing = forcing.get();
        return backend_factory(ranks, degree)(rank);
    };
#ifdef MEMRA_HAVE_CUDA
    if (*device == Device::kCuda) {
        vo.rank_copy = cuda::cuda_rank_copy;  // degrees beyond the GPUs: ranks share GPU 0
        vo.make_comms = nccl_comm_factory();  // degrees the GPUs hold: a GPU per rank, NCCL
    }
#endif
    vo.count_allocations = heap_allocations;
    vo.on_line = [](const runtime::VerifyLine &line) {
        std::printf("%s\n", runtime::format_verify_line(line).c_str());
        std::fflush(stdout);
    };

    std::string tps;
    for (const int t : vo.tp) tps += (tps.empty() ? "" : ",") + std::to_string(t);
    std::printf("memra verify %s: tp %s (routed experts expert-parallel); prefill %d, decode %d, batch 1..%d; kv "
                "%s/%s; numerics %s; %s\n",
                name.c_str(), tps.c_str(), opt.tokens, opt.decode, opt.batch, opt.kv_k.c_str(),
                opt.kv_v.c_str(), numerics_name(opt.numerics),
                *device == Device::kCuda
                    ? "device cuda (a degree with as many GPUs: a GPU per rank over NCCL; else every rank on GPU 0)"
                    : fmt::format("{} thread{} (split over the ranks)", threads, threads == 1 ? "" : "s").c_str());
    std::printf("counts per native step (plan, run, finish), rank 0: backend op launches, host -> backend and backend "
                "-> host copies (syncs: those made before finish()), collectives; allocs: heap allocations on every "
                "thread from plan() to finish()\n");
    std::fflush(stdout);
    auto report = runtime::run_verify(**store, *cfg, vo);
    if (!report) return report_error(report.error().message);
    std::printf("model: %s\n%s", report->model.c_str(), runtime::format_verify_summary(*report).c_str());
    std::fflush(stdout);
    const int code = verify_exit_code(report->any_fail(), report->runs);
    if (code == kExitInvalidInput) {
        report_error(fmt::format("nothing verified: the plan refuses every requested tp on {}", name));
    }
    return code;
}

}  // namespace

Command add_verify_command(CLI::App &app) {
    auto opt = std::make_shared<VerifyCliOptions>();
    const int kMaxInt = std::numeric_limits<int>::max();

    CLI::App *sub = app.add_subcommand(
        "verify", "Check bit-for-bit determinism: the canonical TP=1 run vs the native tensor-parallel ranks "
                  "(routed experts expert-parallel), stage by stage, with per-step work counts. Exit 0: every gate "
                  "passed; 3: a gate failed; 1: invalid input or nothing verified; 2: usage");
    add_model_dir_option(*sub, opt->model_dir);
    add_synthetic_options(*sub, opt->synthetic);
    sub->add_option("--tp,--tensor-parallel-size", opt->tp,
                    "Tensor-parallel degrees to verify, comma-separated; a degree the plan refuses is skipped with "
                    "the plan's reason")
        ->envname("MEMRA_TP")
        ->check(CLI::Validator(
            [](std::string &text) -> std::string {
                auto tp = parse_tp_list(text);
                return tp ? std::string() : tp.error().message;
            },
            "LIST"))
        ->capture_default_str();
    sub->add_option("--tokens", opt->tokens,
                    "Prompt tokens of the prefill stage (at least 2; past the sliding window by default)")
        ->envname("MEMRA_VERIFY_TOKENS")
        ->check(CLI::Range(2, 65536))
        ->capture_default_str();
    sub->add_option("--decode", opt->decode, "Decode steps after the prompt, each compared")
        ->envname("MEMRA_VERIFY_DECODE")
        ->check(CLI::Range(1, 65536))
        ->capture_default_str();
    sub->add_option("--batch", opt->batch,
                    "Batch invariance: the probe sequence alone and in batches of 1 .. B sequences at every slot")
        ->envname("MEMRA_VERIFY_BATCH")
        ->check(CLI::Range(1, 64))
        ->capture_default_str();
    sub->add_option("--layer", opt->layer,
                    "Layer of the layer gates (attention, router, experts, combine, shared expert, layer output); "
                    "default: the first MoE layer")
        ->envname("MEMRA_VERIFY_LAYER")
        ->check(CLI::Range(0, kMaxInt));
    sub->add_option("-t,--threads", opt->threads,
                    "CPU threads of the TP=1 run, split over the ranks of a native run (at least one each; "
                    "default: the hardware threads)")
        ->envname("MEMRA_THREADS")
        ->check(positive_int_validator())
        ->capture_default_str();
    add_kv_format_options(*sub, opt->kv_k, opt->kv_v);
    add_numerics_option(*sub, opt->numerics);
    add_device_option(*sub, opt->device);
    return {sub, [opt]() { return run_verify_command(*opt); }};
}

}  // namespace memra::cli
