// `memra perplexity [MODEL_DIR] -f FILE`: llama.cpp's llama-perplexity on the engine (runtime/engine.h; GPU or CPU, --device).
// The whole file is tokenized (no chat template; BOS first when the tokenizer adds one) and split into
// non-overlapping chunks of -c tokens, each evaluated as a fresh sequence (prefilled in steps of -ub rows, the
// KV cache sized by -c). Only the second half of a chunk is scored, so every scored token sees at least
// c/2 tokens of context: row i (c/2 <= i <= c-2) scores token i+1 by log-softmax in double. The first token of
// every chunk is replaced by BOS, as llama.cpp does, when the tokenizer adds one. With --mtp the model's MTP
// layers run chained over each chunk in the same steps (teacher-forced: layer k's row p takes token p+1 and
// the hidden row of layer k-1 at p-1, the trunk's at p for k = 0) and each layer reports its top-1 accuracy
// and perplexity on the token at p+2 over the rows whose target is in the scored half.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/kv_format.h"
#include "model/step35_config.h"
#include "model/step35_forward.h"
#include "runtime/engine.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

namespace memra::cli {
namespace {

using Json = nlohmann::ordered_json;  // keys in the order written

// The smallest chunk: its second half must hold a scored token and the token it predicts.
constexpr int64_t kMinChunk = 4;

struct PerplexityOptions {
    std::string model_dir;
    std::string file;
    int64_t ctx_size = 512;  // tokens per chunk
    int64_t step_rows = runtime::kCpuStepRows;
    int chunks = -1;  // -1: every full chunk of the file
    std::string kv_k = "bf16";
    std::string kv_v = "bf16";
    int tp = 1;
    int threads = 1;
    Numerics numerics = Numerics::kDevice;
    DeviceChoice device = DeviceChoice::kAuto;
    bool mtp = false;
    std::string output = "text";
};

// The file as text: readable, not empty, valid UTF-8 (else the byte offset of the first bad sequence).
Result<std::string> read_utf8_file(const std::string &path) {
    std::FILE *f = std::fopen(path.c_str(), "rb");
    if (f == nullptr) return make_error("{}: cannot open: {}", path, std::strerror(errno));
    std::string text;
    char buf[1 << 16];
    size_t got = 0;
    while ((got = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, got);
    const int read_errno = std::ferror(f) != 0 ? errno : 0;
    std::fclose(f);
    if (read_errno != 0) return make_error("{}: cannot read: {}", path, std::strerror(read_errno));
    if (text.empty()) return make_error("{}: the file is empty", path);
    for (size_t pos = 0; pos < text.size();) {
        const text::Utf8Step step = text::utf8_step(std::string_view(text).substr(pos));
        if (step.kind != text::Utf8Kind::kValid) {
            return make_error("{}: not valid UTF-8 at byte offset {} (byte 0x{:02x})", path, pos,
                              static_cast<unsigned char>(text[pos]));
        }
        pos += step.len;
    }
    return text;
}

// Negative log-likelihoods (natural log) of scored tokens, and how many were the row's top-1.
struct NllSum {
    double nll = 0.0;
    double nll2 = 0.0;
    int64_t count = 0;
    int64_t top1 = 0;

    double ppl() const { return std::exp(nll / static_cast<double>(count)); }
    double top1_rate() const { return static_cast<double>(top1) / static_cast<double>(count); }
    // llama.cpp's error of the perplexity: PPL times the standard error of the mean NLL; NaN for one token.
    double ppl_stderr() const {
        const auto n = static_cast<double>(count);
        const double m = nll / n;
        const double var = nll2 / n - m * m;
        return count > 1 ? ppl() * std::sqrt(std::max(var, 0.0) / (n - 1.0)) : std::nan("");
    }
};

// Scores logit rows of consecutive positions p0, p0 + 1, ...: the row of position p predicts
// tokens[p + ahead] and counts when lo <= p <= hi. -log softmax in double; top-1 is the first maximum.
void score_rows(std::span<const float> logits, int64_t vocab, int64_t p0, std::span<const int32_t> tokens,
                int64_t ahead, int64_t lo, int64_t hi, NllSum &sum) {
    const int64_t n = static_cast<int64_t>(logits.size()) / vocab;
    for (int64_t p = std::max(p0, lo); p <= std::min(p0 + n - 1, hi); ++p) {
        const std::span<const float> row =
            logits.subspan(static_cast<size_t>((p - p0) * vocab), static_cast<size_t>(vocab));
        const auto best = std::max_element(row.begin(), row.end());
        const double max = *best;
        double sum_exp = 0.0;
        for (const float x : row) sum_exp += std::exp(static_cast<double>(x) - max);
        const int32_t target = tokens[static_cast<size_t>(p + ahead)];
        const double nll = max + std::log(sum_exp) - static_cast<double>(row[static_cast<size_t>(target)]);
        sum.nll += nll;
        sum.nll2 += nll * nll;
        sum.count += 1;
        sum.top1 += best - row.begin() == target ? 1 : 0;
    }
}

struct Scores {
    NllSum trunk;
    std::vector<NllSum> mtp;  // [MTP layer]
};

// Evaluates one chunk as a fresh sequence in steps of the row budget. Trunk row i scores token i+1 for
// first <= i <= c-2 (first = c/2); MTP layer k has rows k .. c-2, each step reaching k rows past the trunk's
// last (its hidden sources are rows of the same step), and its row p scores token p+2 for
// first-1 <= p <= c-3. Logits are computed and copied only in steps that hold scored rows.
Result<void> evaluate_chunk(runtime::Engine &engine, std::vector<int32_t> chunk, Scores &scores) {
    const auto ctx = static_cast<int64_t>(chunk.size());
    const int64_t first = ctx / 2;
    const int n_mtp = static_cast<int>(scores.mtp.size());
    const int64_t vocab = engine.config().vocab_size;
    runtime::SequenceOptions so;
    so.mtp_streams = n_mtp;
    auto seq = engine.create_sequence(so);
    if (!seq) return tl::unexpected(seq.error());
    runtime::Sequence &s = **seq;
    s.tokens = std::move(chunk);
    while (s.pending() > 0) {
        int64_t p0[kv::kMaxStreams] = {};
        for (int st = 0; st <= n_mtp; ++st) p0[st] = s.length(st);
        runtime::StepItem it;
        it.seq = &s;
        it.rows = std::min(s.pending(), engine.options().step_rows);
        const int64_t end = p0[0] + it.rows;
        it.logits = end > first && p0[0] <= ctx - 2 ? runtime::LogitRows::kAll : runtime::LogitRows::kNone;
        for (int k = 0; k < n_mtp; ++k) {
            it.mtp_rows[k] = std::min(end + k, ctx - 1) - p0[1 + k];
            const bool scored = it.mtp_rows[k] > 0 && p0[1 + k] + it.mtp_rows[k] > first - 1 && p0[1 + k] <= ctx - 3;
            it.mtp_logits = it.mtp_logits || scored;
        }
        it.return_logits = it.logits == runtime::LogitRows::kAll || it.mtp_logits;
        if (auto ok = engine.step(std::span(&it, 1)); !ok) return ok;
        if (it.logits == runtime::LogitRows::kAll) {
            score_rows(engine.logits(0, 0), vocab, p0[0], s.tokens, 1, first, ctx - 2, scores.trunk);
        }
        for (int k = 0; k < n_mtp && it.mtp_logits; ++k) {
            score_rows(engine.logits(0, 1 + k), vocab, p0[1 + k], s.tokens, 2, first - 1, ctx - 3,
                       scores.mtp[static_cast<size_t>(k)]);
        }
    }
    return {};
}

int run_perplexity(const PerplexityOptions &opt) {
    if (opt.ctx_size < kMinChunk) {
        std::fprintf(stderr, "error: -c %lld: perplexity needs chunks of at least %lld tokens (it scores the second "
                             "half of each)\n",
                     static_cast<long long>(opt.ctx_size), static_cast<long long>(kMinChunk));
        return kExitUsage;
    }
    if (opt.chunks == 0) {
        std::fputs("error: --chunks 0: nothing to evaluate (-1 = every chunk of the file)\n", stderr);
        return kExitUsage;
    }
    auto in = load_engine_inputs(opt.model_dir, opt.kv_k, opt.kv_v);
    if (!in) return kExitInvalidInput;
    const std::filesystem::path &dir = in->dir;
    const model::Step35Config &cfg = in->cfg;
    if (opt.mtp && cfg.n_mtp_layers == 0) {
        return report_error(fmt::format("--mtp: {} has no MTP layers (num_nextn_predict_layers is 0)", dir.string()));
    }
    if (opt.ctx_size > cfg.context_length) {
        return report_error(fmt::format("-c {}: more positions than the model's context length {}", opt.ctx_size,
                                        cfg.context_length));
    }
    auto text = read_utf8_file(opt.file);
    if (!text) return report_error(text.error().message);
    auto tok = text::Tokenizer::load(dir);
    if (!tok) return report_error(tok.error().message);

    // As llama.cpp: BOS first when the tokenizer adds one; the text is data, so special tokens in it are text.
    auto encoded = tok->encode(*text, text::EncodeOptions{false, false});
    if (!encoded) return report_error(fmt::format("{}: {}", opt.file, encoded.error().message));
    const bool add_bos = tok->add_bos_token() && tok->bos_id().has_value();
    const int32_t bos = add_bos ? *tok->bos_id() : 0;
    std::vector<int32_t> tokens;
    if (add_bos) tokens.push_back(bos);
    tokens.insert(tokens.end(), encoded->begin(), encoded->end());
    const auto n_tokens = static_cast<int64_t>(tokens.size());
    if (n_tokens < opt.ctx_size) {
        return report_error(fmt::format("{}: {} tokens, need at least {} (-c) for one chunk", opt.file, n_tokens,
                                        opt.ctx_size));
    }
    const int64_t n_chunks = opt.chunks > 0 ? std::min<int64_t>(opt.chunks, n_tokens / opt.ctx_size)
                                            : n_tokens / opt.ctx_size;
    const int n_mtp = opt.mtp ? std::min(cfg.n_mtp_layers, model::kMaxMtp) : 0;

    runtime::EngineOptions eo;
    eo.tp = opt.tp;
    eo.k_format = in->k_format;
    eo.v_format = in->v_format;
    eo.ctx_size = opt.ctx_size;
    eo.step_rows = std::min(opt.step_rows, opt.ctx_size);
    eo.max_logit_rows = eo.step_rows * (1 + n_mtp);
    eo.mtp_layers = n_mtp;
    auto device = resolve_device(opt.device, opt.numerics);
    if (!device) return report_error(device.error().message);
    const std::string where = *device == Device::kCuda ? std::string("device cuda")
                                                       : fmt::format("threads {} per rank", std::max(1, opt.threads / opt.tp));
    const std::string mtp_note = n_mtp > 0 ? fmt::format(", {} MTP layer(s)", n_mtp) : "";
    std::fputs(fmt::format("memra perplexity: {}: {} tokens, {} chunks of {} (scoring the tokens at positions {} .. "
                           "{} of each), KV {}/{}, tp {}, {}{}\n",
                           dir.string(), n_tokens, n_chunks, opt.ctx_size, opt.ctx_size / 2 + 1, opt.ctx_size - 1,
                           kv_format_name(in->k_format), kv_format_name(in->v_format), opt.tp, where, mtp_note)
                   .c_str(),
               stderr);
    auto loaded = load_engine(dir, cfg, eo, BackendChoice{*device, opt.threads, opt.numerics});
    if (!loaded) return report_error(fmt::format("--tp {}: {}", opt.tp, loaded.error().message));
    runtime::Engine &engine = *loaded->engine;

    const bool text_out = opt.output == "text";
    Scores scores;
    scores.mtp.resize(static_cast<size_t>(n_mtp));
    std::vector<double> running;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t c = 0; c < n_chunks; ++c) {
        const auto from = tokens.begin() + c * opt.ctx_size;
        std::vector<int32_t> chunk(from, from + opt.ctx_size);
        if (add_bos) chunk.front() = bos;
        if (auto ok = evaluate_chunk(engine, std::move(chunk), scores); !ok) {
            if (text_out) std::fputc('\n', stdout);
            return report_error(fmt::format("chunk {}: {}", c + 1, ok.error().message));
        }
        running.push_back(scores.trunk.ppl());
        if (text_out) {
            std::printf("[%lld]%.4f,", static_cast<long long>(c + 1), running.back());
            std::fflush(stdout);
        }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    const NllSum &t = scores.trunk;
    if (text_out) {
        std::printf("\nFinal estimate: PPL = %.4f +/- %.5f\n", t.ppl(), t.ppl_stderr());
        for (int k = 0; k < n_mtp; ++k) {
            const NllSum &m = scores.mtp[static_cast<size_t>(k)];
            std::printf("MTP layer %d: top-1 = %.4f (%lld of %lld), PPL = %.4f +/- %.5f\n", k, m.top1_rate(),
                        static_cast<long long>(m.top1), static_cast<long long>(m.count), m.ppl(), m.ppl_stderr());
        }
    } else {
        Json out{{"model", dir.string()},
                 {"file", opt.file},
                 {"ctx", opt.ctx_size},
                 {"n_chunks", n_chunks},
                 {"file_tokens", n_tokens},
                 {"n_tokens", t.count},
                 {"type_k", kv_format_name(in->k_format)},
                 {"type_v", kv_format_name(in->v_format)},
                 {"tp", opt.tp},
                 {"ppl", t.ppl()},
                 {"ppl_stderr", t.ppl_stderr()},
                 {"top1", t.top1_rate()},
                 {"chunk_ppl", running},
                 {"seconds", seconds}};
        if (n_mtp > 0) {
            Json layers = Json::array();
            for (int k = 0; k < n_mtp; ++k) {
                const NllSum &m = scores.mtp[static_cast<size_t>(k)];
                layers.push_back(Json{{"layer", k}, {"top1", m.top1_rate()}, {"ppl", m.ppl()}, {"n", m.count}});
            }
            out["mtp"] = std::move(layers);
        }
        std::printf("%s\n", out.dump(2).c_str());
    }
    std::fflush(stdout);
    std::fprintf(stderr, "memra perplexity: %lld chunks in %.2f s (%.1f tokens/s)\n", static_cast<long long>(n_chunks),
                 seconds, seconds > 0.0 ? static_cast<double>(n_chunks * opt.ctx_size) / seconds : 0.0);
    return kExitOk;
}

}  // namespace

Command add_perplexity_command(CLI::App &app) {
    auto opt = std::make_shared<PerplexityOptions>();
    opt->threads = default_threads();

    CLI::App *sub = app.add_subcommand(
        "perplexity", "Perplexity of a text file on the engine (GPU or CPU), like llama-perplexity: non-overlapping chunks "
                      "of -c tokens, each scored on its second half");
    add_model_dir_option(*sub, opt->model_dir);
    sub->add_option("-f,--file", opt->file, "UTF-8 text to evaluate (tokenized whole, no chat template)")
        ->envname("MEMRA_FILE")
        ->required();
    add_engine_size_options(*sub, opt->ctx_size, opt->step_rows);
    sub->get_option("--ctx-size")
        ->description("Tokens per chunk (at least 4; each chunk is a fresh sequence, the KV cache holds one chunk)");
    sub->add_option("--chunks", opt->chunks, "Chunks to evaluate at most (-1 = every full chunk of the file)")
        ->envname("MEMRA_CHUNKS")
        ->check(CLI::Range(-1, std::numeric_limits<int>::max()))
        ->capture_default_str();
    add_kv_format_options(*sub, opt->kv_k, opt->kv_v);
    add_tp_option(*sub, opt->tp);
    add_threads_option(*sub, opt->threads);
    add_numerics_option(*sub, opt->numerics);
    add_device_option(*sub, opt->device);
    sub->add_flag("--mtp", opt->mtp,
                  "Also run the model's MTP layers chained over each chunk (teacher-forced) and report each layer's "
                  "top-1 accuracy and perplexity on the token two ahead, over the scored half")
        ->envname("MEMRA_MTP");
    sub->add_option("-o,--output", opt->output,
                    "text (llama.cpp's running [chunk]PPL line and the final estimate) or json (one object at the end)")
        ->envname("MEMRA_OUTPUT")
        ->check(CLI::IsMember({"text", "json"}))
        ->capture_default_str();
    return {sub, [opt]() { return run_perplexity(*opt); }};
}

}  // namespace memra::cli
