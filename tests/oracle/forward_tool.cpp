// memra_forward_tool: runs the Step-3.5 forward through the engine (CPU backend) for the Python oracles.
//   memra_forward_tool MODEL_DIR IDS_FILE OUT_FILE [--all-positions] [--decode N] [--mtp] [--threads T]
//                      [--kv-k FMT] [--kv-v FMT] [--ubatch N] [--tp T] [--numerics device|exact]
//                      [--taps DIR]
// IDS_FILE holds the prompt as raw little-endian int32 ids. OUT_FILE gets raw float32 logits, [rows, vocab]:
// the prompt's last position (every position with --all-positions), then one row per greedy decode step
// (--decode N: each step feeds the token the engine sampled at temperature 0, the argmax with ties to the
// lowest id). --mtp instead appends every MTP layer's logits, chained in one step with the prompt: MTP layer
// k over positions k .. T-2 (row p takes the token at p + 1 and the hidden row of layer k - 1 at p - 1, the
// trunk's at p for k = 0), layer after layer. --ubatch N prefills the prompt in steps of N rows (not with
// --mtp, whose rows need their hidden sources in the same step). --numerics (exact default) picks the CPU
// backend's numerics (ENGINE.md section 4). --taps DIR also writes, for every trunk layer L, the per-token
// intermediates of the prompt's prefill (model::Tap: layer_in, attn_norm, q, k, v, attn_gate, attn_out, o_proj,
// residual, ffn_norm, router_logits, expert_ids, expert_weights, shared_out, layer_out) as DIR/L<L>_<tap>.bin,
// raw [T, row] f32 (expert_ids: i32), each layer tapped in its own prefill of a fresh sequence: the inputs of
// op-by-op teacher-forced comparisons. KV cache formats (f32 default, bf16, q8_0,
// q5_1) apply to every layer. Prints the row count, the vocabulary size, the decoded ids and the work of the
// last decode step (launches, host -> backend and backend -> host copies).
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "backend/cpu/cpu_backend.h"
#include "core/kv_format.h"
#include "io/safetensors.h"
#include "model/step35_config.h"
#include "runtime/engine.h"

namespace {

int fail(const std::string &msg) {
    fmt::print(stderr, "memra_forward_tool: {}\n", msg);
    return 1;
}

bool parse_int(const char *s, int64_t lo, int64_t &out) {
    try {
        size_t used = 0;
        const long long v = std::stoll(s, &used);
        if (used != std::string(s).size() || v < lo) return false;
        out = v;
        return true;
    } catch (const std::exception &) {
        return false;
    }
}

}  // namespace

int main(int argc, char **argv) {
    using namespace memra;
    std::vector<std::string> positional;
    bool all_positions = false;
    bool mtp = false;
    KvFormat kv_k = KvFormat::kF32;
    KvFormat kv_v = KvFormat::kF32;
    int64_t n_decode = 0;
    int64_t threads = 1;
    int64_t ubatch = 0;  // 0: the whole prompt in one step
    int64_t tp = 1;
    Numerics numerics = Numerics::kExact;  // the oracles' f32 reference; --numerics device for the device forward
    std::string taps_dir;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--all-positions") {
            all_positions = true;
        } else if (arg == "--mtp") {
            mtp = true;
        } else if (arg == "--taps") {
            if (i + 1 >= argc) return fail("--taps expects a directory");
            taps_dir = argv[++i];
        } else if (arg == "--numerics") {
            if (i + 1 >= argc) return fail("--numerics expects device or exact");
            const std::string v = argv[++i];
            if (v != "device" && v != "exact") return fail(fmt::format("--numerics expects device or exact, found '{}'", v));
            numerics = v == "device" ? Numerics::kDevice : Numerics::kExact;
        } else if (arg == "--kv-k" || arg == "--kv-v") {
            if (i + 1 >= argc) return fail(arg + " needs a value");
            auto format = parse_kv_format(argv[++i]);
            if (!format) return fail(fmt::format("{}: {}", arg, format.error().message));
            (arg == "--kv-k" ? kv_k : kv_v) = *format;
        } else if (arg == "--decode" || arg == "--threads" || arg == "--ubatch" || arg == "--tp") {
            if (i + 1 >= argc) return fail(arg + " needs a value");
            int64_t &dst = arg == "--decode" ? n_decode : arg == "--threads" ? threads : arg == "--ubatch" ? ubatch : tp;
            const int64_t lo = arg == "--decode" ? 0 : 1;
            if (!parse_int(argv[++i], lo, dst)) {
                return fail(fmt::format("{} expects an integer >= {}, found '{}'", arg, lo, argv[i]));
            }
        } else if (arg.rfind("--", 0) == 0) {
            return fail(fmt::format("unknown option '{}'", arg));
        } else {
            positional.push_back(arg);
        }
    }
    if (positional.size() != 3) {
        return fail("usage: memra_forward_tool MODEL_DIR IDS_FILE OUT_FILE [--all-positions] [--decode N] "
                    "[--mtp] [--threads T] [--kv-k FMT] [--kv-v FMT] [--ubatch N] [--tp T] [--numerics device|exact] "
                    "[--taps DIR]");
    }
    if (mtp && n_decode > 0) return fail("--mtp and --decode cannot be combined");
    if (mtp && ubatch > 0) return fail("--mtp and --ubatch cannot be combined");
    if (!taps_dir.empty() && (ubatch > 0 || tp > 1 || mtp)) return fail("--taps runs alone: no --ubatch, --tp or --mtp");

    std::ifstream in(positional[1], std::ios::binary);
    if (!in) return fail(fmt::format("{}: cannot open", positional[1]));
    std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (raw.empty() || raw.size() % 4 != 0) {
        return fail(fmt::format("{}: expected a non-empty multiple of 4 bytes (int32 ids), found {} bytes",
                                positional[1], raw.size()));
    }
    std::vector<int32_t> prompt(raw.size() / 4);
    std::copy(raw.begin(), raw.end(), reinterpret_cast<char *>(prompt.data()));

    auto cfg = model::load_step35_config(positional[0]);
    if (!cfg) return fail(cfg.error().message);
    auto ckpt = io::Checkpoint::open(positional[0]);
    if (!ckpt) return fail(ckpt.error().message);
    if (mtp && cfg->n_mtp_layers < 1) return fail(fmt::format("{}: the config has no MTP layer", positional[0]));
    const auto n_prompt = static_cast<int64_t>(prompt.size());
    if (mtp && n_prompt < 2) return fail("--mtp needs a prompt of at least 2 tokens");
    const int n_mtp = mtp ? std::min(cfg->n_mtp_layers, model::kMaxMtp) : 0;

    runtime::EngineOptions eo;
    eo.tp = static_cast<int>(tp);
    eo.k_format = kv_k;
    eo.v_format = kv_v;
    eo.ctx_size = n_prompt + n_decode;
    eo.step_rows = ubatch > 0 ? ubatch : n_prompt;
    eo.max_logit_rows = n_prompt * (1 + n_mtp);
    eo.mtp_layers = n_mtp;
    const int per_rank = static_cast<int>(std::max<int64_t>(1, threads / tp));
    eo.make_backend = [per_rank, numerics](int) -> Result<std::unique_ptr<Backend>> {
        return std::unique_ptr<Backend>(std::make_unique<cpu::CpuBackend>(per_rank, numerics));
    };
    auto engine = runtime::Engine::create(*ckpt, *cfg, eo);
    if (!engine) return fail(engine.error().message);
    runtime::Engine &e = **engine;
    runtime::SequenceOptions so;
    so.sampling.temperature = 0.0f;
    so.mtp_streams = n_mtp;
    auto seq = e.create_sequence(so);
    if (!seq) return fail(seq.error().message);
    runtime::Sequence &s = **seq;
    s.tokens = prompt;

    std::vector<float> out;
    const auto append = [&](size_t item, int stream) {
        const auto lg = e.logits(item, stream);
        out.insert(out.end(), lg.begin(), lg.end());
    };
    // The prompt in steps of at most step_rows rows; logits of the rows asked for, in order.
    while (s.pending() > 0) {
        runtime::StepItem it;
        it.seq = &s;
        it.rows = std::min(s.pending(), eo.step_rows);
        const bool last = it.rows == s.pending();
        it.logits = all_positions ? runtime::LogitRows::kAll : last ? runtime::LogitRows::kLast : runtime::LogitRows::kNone;
        it.sample = last;
        it.return_logits = it.logits != runtime::LogitRows::kNone;
        for (int k = 0; k < n_mtp; ++k) it.mtp_rows[k] = std::max<int64_t>(0, n_prompt - 1 - k);
        it.mtp_logits = n_mtp > 0;
        it.return_logits = it.return_logits || n_mtp > 0;
        if (auto r = e.step(std::span(&it, 1)); !r) return fail(r.error().message);
        if (it.logits != runtime::LogitRows::kNone) append(0, 0);
        for (int k = 0; k < n_mtp; ++k) append(0, 1 + k);
    }
    std::vector<int32_t> generated;
    runtime::StepCounters counts;
    for (int64_t i = 0; i < n_decode; ++i) {
        generated.push_back(e.sampled(0).id);
        s.tokens.push_back(generated.back());
        runtime::StepItem it;
        it.seq = &s;
        it.rows = 1;
        it.sample = true;
        it.return_logits = true;
        e.reset_counters();
        if (auto r = e.step(std::span(&it, 1)); !r) return fail(r.error().message);
        counts = e.counters(0);
        append(0, 0);
    }

    const auto write = [&](const std::string &path, const std::vector<float> &v) {
        std::ofstream o(path, std::ios::binary | std::ios::trunc);
        o.write(reinterpret_cast<const char *>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
        return static_cast<bool>(o);
    };
    if (!write(positional[2], out)) return fail(fmt::format("{}: cannot write", positional[2]));
    if (!taps_dir.empty()) {
        seq->reset();  // one sequence at a time: each layer's tapped prefill takes a fresh one
        const model::Tap row_taps[] = {model::Tap::kLayerIn,      model::Tap::kAttnNorm,      model::Tap::kQ,
                                       model::Tap::kK,            model::Tap::kV,             model::Tap::kAttnGate,
                                       model::Tap::kAttnOut,      model::Tap::kOProj,         model::Tap::kResidual,
                                       model::Tap::kFfnNorm,      model::Tap::kRouterLogits,  model::Tap::kExpertIds,
                                       model::Tap::kExpertWeights, model::Tap::kSharedOut,    model::Tap::kLayerOut};
        bool written = true;
        for (int layer = 0; layer < cfg->n_layers; ++layer) {
            auto fresh = e.create_sequence(so);
            if (!fresh) return fail(fresh.error().message);
            (*fresh)->tokens = prompt;
            e.forward(0).set_tap(layer, [&](model::Tap tap, TensorView v) {
                if (std::find(std::begin(row_taps), std::end(row_taps), tap) == std::end(row_taps)) return;
                std::ofstream o(fmt::format("{}/L{}_{}.bin", taps_dir, layer, model::tap_name(tap)),
                                std::ios::binary | std::ios::trunc);
                o.write(static_cast<const char *>(v.data), static_cast<std::streamsize>(n_prompt * v.row_elems() * 4));
                written = written && static_cast<bool>(o);
            });
            runtime::StepItem it;
            it.seq = fresh->get();
            it.rows = n_prompt;
            if (auto r = e.step(std::span(&it, 1)); !r) return fail(r.error().message);
            e.forward(0).set_tap(-1, {});
        }
        if (!written) return fail(fmt::format("{}: cannot write the taps", taps_dir));
    }
    const int64_t vocab = cfg->vocab_size;
    fmt::print("rows {} vocab {} decoded [{}] decode_launches {} decode_h2d {} decode_d2h {}\n",
               static_cast<int64_t>(out.size()) / vocab, vocab, fmt::join(generated, ", "), counts.backend.launches,
               counts.backend.h2d_copies, counts.backend.d2h_copies);
    return 0;
}
