// memra_forward_tool: runs the Step-3.5 forward (CPU backend) for the Python oracles.
//   memra_forward_tool MODEL_DIR IDS_FILE OUT_FILE [--all-positions] [--decode N] [--mtp] [--threads T]
//                      [--kv-k FMT] [--kv-v FMT]
// IDS_FILE holds the prompt as raw little-endian int32 ids. OUT_FILE gets raw float32 logits, [rows, vocab]:
// the prompt's last position (every position with --all-positions), then one row per greedy decode step
// (--decode N: each step feeds the argmax of the previous row, lowest id on ties). --mtp instead appends the
// first MTP layer's logits over prompt positions 0 .. T-2 (token p+1 with the trunk's hidden state at p).
// KV cache formats (f32 default, bf16, q8_0, q5_1) apply to the trunk and MTP caches. Prints the row count,
// the vocabulary size, the decoded ids and the launches / host copies of the last decode step.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "backend/cpu/cpu_backend.h"
#include "io/safetensors.h"
#include "kv/kv_cache.h"
#include "kv/kv_format.h"
#include "model/step35_config.h"
#include "model/step35_forward.h"
#include "model/step35_model.h"

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
    kv::KvFormat kv_k = kv::KvFormat::kF32;
    kv::KvFormat kv_v = kv::KvFormat::kF32;
    int64_t n_decode = 0;
    int64_t threads = 1;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--all-positions") {
            all_positions = true;
        } else if (arg == "--mtp") {
            mtp = true;
        } else if (arg == "--kv-k" || arg == "--kv-v") {
            if (i + 1 >= argc) return fail(arg + " needs a value");
            auto format = kv::parse_kv_format(argv[++i]);
            if (!format) return fail(fmt::format("{}: {}", arg, format.error().message));
            (arg == "--kv-k" ? kv_k : kv_v) = *format;
        } else if (arg == "--decode" || arg == "--threads") {
            if (i + 1 >= argc) return fail(arg + " needs a value");
            int64_t &dst = arg == "--decode" ? n_decode : threads;
            if (!parse_int(argv[++i], arg == "--decode" ? 0 : 1, dst)) {
                return fail(fmt::format("{} expects an integer >= {}, found '{}'", arg, arg == "--decode" ? 0 : 1,
                                        argv[i]));
            }
        } else if (arg.rfind("--", 0) == 0) {
            return fail(fmt::format("unknown option '{}'", arg));
        } else {
            positional.push_back(arg);
        }
    }
    if (positional.size() != 3) {
        return fail("usage: memra_forward_tool MODEL_DIR IDS_FILE OUT_FILE [--all-positions] [--decode N] "
                    "[--mtp] [--threads T] [--kv-k FMT] [--kv-v FMT]");
    }
    if (mtp && n_decode > 0) return fail("--mtp and --decode cannot be combined");

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
    cpu::CpuBackend backend(static_cast<int>(threads));
    auto mdl = model::bind_step35_model(backend, *ckpt, *cfg);
    if (!mdl) return fail(mdl.error().message);
    const auto n_prompt = static_cast<int64_t>(prompt.size());
    const int64_t context = n_prompt + n_decode;
    auto fwd = model::Step35Forward::create(backend, *mdl, model::ForwardCapacity{n_prompt, 1, context, 0});
    if (!fwd) return fail(fwd.error().message);
    auto cache = kv::KvCache::create(model::trunk_kv_spec(*cfg, kv_k, kv_v, context, static_cast<int>(n_prompt)));
    if (!cache) return fail(cache.error().message);

    std::vector<float> out;
    std::vector<int32_t> generated;
    model::SeqChunk chunk{&*cache, prompt, all_positions, -1};
    auto r = fwd->step(std::span(&chunk, 1));
    if (!r) return fail(r.error().message);
    out.insert(out.end(), fwd->logits().begin(), fwd->logits().end());
    const int64_t vocab = cfg->vocab_size;
    if (mtp) {
        if (cfg->n_mtp_layers < 1) return fail(fmt::format("{}: the config has no MTP layer", positional[0]));
        if (n_prompt < 2) return fail("--mtp needs a prompt of at least 2 tokens");
        auto mtp_cache =
            kv::KvCache::create(model::mtp_kv_spec(*cfg, 0, kv_k, kv_v, context, static_cast<int>(n_prompt)));
        if (!mtp_cache) return fail(mtp_cache.error().message);
        const model::MtpChunk draft{&*mtp_cache, std::span(prompt).subspan(1), true, -1};
        r = fwd->mtp_step(0, std::span(&draft, 1), fwd->hidden().row_slice(0, n_prompt - 1));
        if (!r) return fail(r.error().message);
        out.insert(out.end(), fwd->logits().begin(), fwd->logits().end());
    }
    BackendCounters counts;
    for (int64_t s = 0; s < n_decode; ++s) {
        const float *last = out.data() + out.size() - static_cast<size_t>(vocab);
        const int32_t next = static_cast<int32_t>(std::max_element(last, last + vocab) - last);
        generated.push_back(next);
        backend.reset_counters();
        chunk = model::SeqChunk{&*cache, std::span(&generated.back(), 1), false, -1};
        r = fwd->step(std::span(&chunk, 1));
        if (!r) return fail(r.error().message);
        counts = backend.counters();
        out.insert(out.end(), fwd->logits().begin(), fwd->logits().end());
    }

    std::ofstream o(positional[2], std::ios::binary | std::ios::trunc);
    if (!o) return fail(fmt::format("{}: cannot create", positional[2]));
    o.write(reinterpret_cast<const char *>(out.data()), static_cast<std::streamsize>(out.size() * sizeof(float)));
    if (!o) return fail(fmt::format("{}: write failed", positional[2]));
    fmt::print("rows {} vocab {} decoded [{}] decode_launches {} decode_host_copies {}\n",
               static_cast<int64_t>(out.size()) / vocab, vocab, fmt::join(generated, ", "), counts.launches,
               counts.host_copies);
    return 0;
}
