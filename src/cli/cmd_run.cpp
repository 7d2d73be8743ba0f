// `memra run [MODEL_DIR] -p TEXT`: one-shot generation on the engine (runtime/engine.h; GPU or CPU, --device). Tokenizes the
// prompt, prefills it in chunks of the step budget (-ub), then samples and decodes (with --spec-draft K, the
// MTP layers drafting up to K tokens per step that the trunk verifies: the same text, faster), streaming
// complete UTF-8 text to stdout as it comes, and ends with llama.cpp-style timing lines on stderr. The KV
// cache is sized by -c once, at start; buffers by the step budget, never by the prompt.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "core/sampling.h"
#include "model/step35_config.h"
#include "runtime/engine.h"
#include "text/tokenizer.h"

namespace memra::cli {
namespace {

struct RunOptions {
    std::string model_dir;
    std::string prompt;
    int n_predict = 64;  // -1: until EOS or the context is full
    SamplingParams sampling;
    std::string kv_k = "bf16";
    std::string kv_v = "bf16";
    int64_t ctx_size = 4096;
    int64_t step_rows = runtime::kCpuStepRows;
    int threads = 1;
    int tp = 1;
    Numerics numerics = Numerics::kDevice;
    DeviceChoice device = DeviceChoice::kAuto;
    bool ignore_eos = false;
    int spec_draft = 0;
    const CLI::Option *spec_option = nullptr;  // whether --spec-draft was given
};

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// "prompt eval time =    12.34 ms /     5 tokens (    2.47 ms per token,   405.19 tokens per second)"
std::string timing_line(const char *label, double ms, int64_t tokens) {
    if (tokens == 0) return fmt::format("{} = {:8.2f} ms / {:5} tokens\n", label, ms, tokens);
    const double per_token = ms / static_cast<double>(tokens);
    const double per_second = ms > 0.0 ? 1000.0 * static_cast<double>(tokens) / ms : 0.0;
    return fmt::format("{} = {:8.2f} ms / {:5} tokens ({:8.2f} ms per token, {:8.2f} tokens per second)\n", label,
                       ms, tokens, per_token, per_second);
}

void write_out(const std::string &text) {
    if (text.empty()) return;
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
}

int run_generate(const RunOptions &opt) {
    auto sampler_check = validate_sampling_params(opt.sampling);
    if (!sampler_check) return report_error(sampler_check.error().message);
    auto in = load_engine_inputs(opt.model_dir, opt.kv_k, opt.kv_v);
    if (!in) return kExitInvalidInput;
    const std::filesystem::path &dir = in->dir;
    const model::Step35Config &cfg = in->cfg;
    auto tok = text::Tokenizer::load(dir);
    if (!tok) return report_error(tok.error().message);

    // BOS as tokenizer_config.json's add_bos_token says; special tokens written in the prompt are parsed.
    auto encoded = tok->encode(opt.prompt, text::EncodeOptions{false, true});
    if (!encoded) return report_error(fmt::format("prompt: {}", encoded.error().message));
    std::vector<int32_t> prompt;
    if (tok->add_bos_token() && tok->bos_id()) prompt.push_back(*tok->bos_id());
    prompt.insert(prompt.end(), encoded->begin(), encoded->end());
    const auto n_prompt = static_cast<int64_t>(prompt.size());
    if (n_prompt == 0) return report_error("prompt: no tokens to evaluate (empty prompt and no BOS token)");
    for (const int32_t id : prompt) {
        if (id >= cfg.vocab_size) {
            return report_error(fmt::format("prompt: token id {} is outside the model's vocabulary of {}", id,
                                            cfg.vocab_size));
        }
    }
    // Positions: the context (-c, at most the model's), which the prompt and the tokens to feed must fit.
    const int64_t context = std::min<int64_t>(opt.ctx_size, cfg.context_length);
    if (n_prompt + std::max(opt.n_predict, 0) > context) {
        return report_error(fmt::format("prompt too long: {} prompt tokens + {} to generate exceed the context of {} "
                                        "positions (-c {}, model context length {}); raise -c or lower -n",
                                        n_prompt, opt.n_predict, context, opt.ctx_size, cfg.context_length));
    }
    const int64_t n_predict = opt.n_predict >= 0 ? opt.n_predict : context - n_prompt;

    std::vector<int64_t> eos(cfg.eos_token_ids.begin(), cfg.eos_token_ids.end());
    if (eos.empty()) eos.assign(tok->eos_ids().begin(), tok->eos_ids().end());
    const auto is_eos = [&](int32_t id) {
        return !opt.ignore_eos && std::find(eos.begin(), eos.end(), id) != eos.end();
    };

    runtime::EngineOptions eo;
    eo.tp = opt.tp;
    eo.k_format = in->k_format;
    eo.v_format = in->v_format;
    eo.ctx_size = context;
    eo.step_rows = opt.step_rows;
    // Only the tokenizer's ids are sampled: the embedding's padding rows past them have no text.
    eo.sample_vocab = std::min(cfg.vocab_size, tok->n_tokens());
    auto spec = enable_speculation(eo, cfg, opt.spec_draft, opt.spec_option->count() > 0);
    if (!spec) return report_error(spec.error().message);
    const int spec_draft = *spec;
    auto device = resolve_device(opt.device, opt.numerics);
    if (!device) return report_error(device.error().message);
    auto loaded = load_engine(dir, cfg, eo, BackendChoice{*device, opt.threads, opt.numerics});
    if (!loaded) return report_error(loaded.error().message);
    runtime::Engine &engine = *loaded->engine;
    runtime::SequenceOptions so;
    so.sampling = opt.sampling;
    so.mtp_streams = eo.mtp_layers;
    auto seq = engine.create_sequence(so);
    if (!seq) return report_error(seq.error().message);
    (*seq)->tokens = prompt;
    (*seq)->tokens.reserve(static_cast<size_t>(n_prompt + n_predict));

    const auto t_prompt = std::chrono::steady_clock::now();
    auto next = runtime::feed(engine, **seq);
    if (!next) return report_error(next.error().message);
    const double prompt_ms = ms_since(t_prompt);

    // Each sampled token is counted; an EOS ends the loop unprinted and unfed, and the last token is not fed.
    const auto t_gen = std::chrono::steady_clock::now();
    text::StreamDecoder decoder = tok->stream_decoder();
    int64_t generated = 0;
    runtime::SpecStats stats;
    const std::span<const int64_t> stops = opt.ignore_eos ? std::span<const int64_t>() : std::span(eos);
    if (n_predict > 0) {
        runtime::Sequence &s = **seq;
        s.tokens.push_back(*next);
        int64_t emitted = 1;  // the tokens at the end of s.tokens not yet counted
        while (true) {
            bool stop = false;
            for (size_t i = s.tokens.size() - static_cast<size_t>(emitted); i < s.tokens.size(); ++i) {
                ++generated;
                if (is_eos(s.tokens[i])) {
                    stop = true;
                    break;
                }
                write_out(decoder.feed(s.tokens[i]));
            }
            if (stop || generated == n_predict) break;
            runtime::DecodeOptions d;
            d.draft = spec_draft;
            d.max_new = n_predict - generated;
            d.stop_ids = stops;
            auto r = runtime::decode(engine, s, d);
            if (!r) return report_error(r.error().message);
            stats.add(*r);
            emitted = r->emitted;
        }
    }
    write_out(decoder.flush() + "\n");
    const double gen_ms = ms_since(t_gen);

    std::fputs(timing_line("prompt eval time", prompt_ms, n_prompt).c_str(), stderr);
    std::fputs(timing_line("       eval time", gen_ms, generated).c_str(), stderr);
    if (spec_draft > 0) {
        std::fputs(fmt::format("     speculation = {} drafts: {}\n", spec_draft, spec_summary(stats, spec_draft))
                       .c_str(),
                   stderr);
    }
    return kExitOk;
}

}  // namespace

Command add_run_command(CLI::App &app) {
    auto opt = std::make_shared<RunOptions>();
    opt->threads = default_threads();

    CLI::App *sub = app.add_subcommand("run", "Generate text from a prompt (on the GPU when one is visible, else the CPU), streaming it to stdout");
    add_model_dir_option(*sub, opt->model_dir);
    sub->add_option("-p,--prompt", opt->prompt, "Prompt text")->envname("MEMRA_PROMPT")->required();
    sub->add_option("-n,--n-predict,--predict", opt->n_predict,
                    "Tokens to generate (-1 = until EOS or the context (-c) is full)")
        ->envname("MEMRA_N_PREDICT")
        ->check(CLI::Range(-1, std::numeric_limits<int>::max()))
        ->capture_default_str();
    add_sampling_options(*sub, opt->sampling);
    add_kv_format_options(*sub, opt->kv_k, opt->kv_v);
    add_engine_size_options(*sub, opt->ctx_size, opt->step_rows);
    add_threads_option(*sub, opt->threads);
    add_tp_option(*sub, opt->tp);
    add_numerics_option(*sub, opt->numerics);
    add_device_option(*sub, opt->device);
    sub->add_flag("--ignore-eos", opt->ignore_eos, "Keep generating past end-of-sequence tokens")
        ->envname("MEMRA_IGNORE_EOS");
    opt->spec_option = add_spec_draft_option(*sub, opt->spec_draft, kDefaultSpecDraft);
    sub->get_option("--spec-draft")
        ->description("Speculative decoding: tokens the chained MTP layers draft per decode step, verified by the "
                      "trunk in the same step (0 = off; the default is lowered to the model's MTP layers). Drafts "
                      "change speed, never the output: a draft stands only if it equals the token the model samples "
                      "there");
    return {sub, [opt]() { return run_generate(*opt); }};
}

}  // namespace memra::cli
