// `memra chat [MODEL_DIR]`: an interactive chat in the terminal. Each turn renders the conversation through the
// model's chat template (as the server does), generates through the same scheduler on this thread, and splits the
// answer with the same parser: the reasoning is shown apart (dim on a terminal; between <think> and </think> when
// stdout is not one), then the answer. Earlier turns keep their answers (the template decides whether their
// reasoning is shown to the model again). Lines typed: a message, /reset (a new conversation), /exit (or EOF).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "serve/openai.h"
#include "serve/scheduler.h"
#include "text/chat_output.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace memra::cli {
namespace {

using Json = nlohmann::ordered_json;

struct ChatOptions {
    std::string model_dir;
    std::string system;
    std::string chat_template_file;
    int n_predict = -1;
    SamplingParams sampling;
    std::string kv_k = "bf16";
    std::string kv_v = "bf16";
    int64_t ctx_size = 4096;
    int64_t step_rows = runtime::kCpuStepRows;
    int threads = 1;
    Numerics numerics = Numerics::kDevice;
    DeviceChoice device = DeviceChoice::kAuto;
    bool prefix_cache = true;  // each turn reuses the conversation so far
};

// How a turn is shown: a terminal gets the reasoning dim, a pipe gets it between tags.
struct Printer {
    bool tty = false;
    bool in_reasoning = false;

    void reasoning(const std::string &text) {
        if (text.empty()) return;
        if (!in_reasoning) {
            std::fputs(tty ? "\x1b[2m" : "<think>\n", stdout);
            in_reasoning = true;
        }
        std::fputs(text.c_str(), stdout);
        std::fflush(stdout);
    }
    void end_reasoning() {
        if (!in_reasoning) return;
        std::fputs(tty ? "\x1b[0m\n" : "\n</think>\n", stdout);
        in_reasoning = false;
    }
    void content(const std::string &text) {
        if (text.empty()) return;
        end_reasoning();
        std::fputs(text.c_str(), stdout);
        std::fflush(stdout);
    }
};

int chat_main(const ChatOptions &opt) {
    if (auto ok = validate_sampling_params(opt.sampling); !ok) return report_error(ok.error().message);
    auto in = load_engine_inputs(opt.model_dir, opt.kv_k, opt.kv_v);
    if (!in) return kExitInvalidInput;
    const model::Step35Config &cfg = in->cfg;
    auto tok = text::Tokenizer::load(in->dir);
    if (!tok) return report_error(tok.error().message);
    std::string origin;
    auto loaded_template = load_chat_template(*tok, opt.chat_template_file, origin);
    if (!loaded_template) return report_error(loaded_template.error().message);
    if (!*loaded_template) {
        return report_error("this model has no chat template (tokenizer_config.json chat_template): pass "
                            "--chat-template FILE, or use `memra run`");
    }
    const text::ChatTemplate &tmpl = **loaded_template;

    runtime::EngineOptions eo;
    eo.k_format = in->k_format;
    eo.v_format = in->v_format;
    eo.ctx_size = opt.ctx_size;
    eo.step_rows = opt.step_rows;
    eo.prefix_cache = opt.prefix_cache;
    eo.sample_vocab = std::min(cfg.vocab_size, tok->n_tokens());
    auto device = resolve_device(opt.device, opt.numerics);
    if (!device) return report_error(device.error().message);
    auto loaded = load_engine(in->dir, cfg, eo, BackendChoice{*device, opt.threads, opt.numerics});
    if (!loaded) return report_error(loaded.error().message);
    std::vector<int32_t> eos(cfg.eos_token_ids.begin(), cfg.eos_token_ids.end());
    if (eos.empty()) eos.assign(tok->eos_ids().begin(), tok->eos_ids().end());
    serve::Scheduler sched(*loaded->engine, *tok, eos, serve::SchedulerOptions{});

    Printer out;
    out.tty = isatty(STDOUT_FILENO) != 0;
    const bool prompt_user = isatty(STDIN_FILENO) != 0;
    if (prompt_user) {
        std::fprintf(stderr, "chat: %s on %s; /reset starts over, /exit (or Ctrl-D) ends\n", in->name.c_str(),
                     device_name(*device));
    }
    Json messages = Json::array();
    if (!opt.system.empty()) messages.push_back({{"role", "system"}, {"content", opt.system}});
    const size_t base = messages.size();
    std::string line;
    while (true) {
        if (prompt_user) std::fputs("> ", stdout);
        std::fflush(stdout);
        if (!std::getline(std::cin, line) || line == "/exit") break;
        if (line == "/reset") {
            messages.erase(messages.begin() + static_cast<std::ptrdiff_t>(base), messages.end());
            continue;
        }
        if (line.empty()) continue;
        messages.push_back({{"role", "user"}, {"content", line}});
        auto rendered = tmpl.apply(messages, nullptr, true, Json::object());
        if (!rendered) return report_error(fmt::format("chat template: {}", rendered.error().message));
        auto ids = tok->encode(*rendered, text::EncodeOptions{false, true});
        if (!ids) return report_error(ids.error().message);
        serve::GenerationRequest req;
        req.prompt = std::move(*ids);
        req.sampling = opt.sampling;
        req.max_tokens = opt.n_predict;
        req.skip_special = false;  // the parser reads the <think> and tool-call markup (special tokens)
        auto state = sched.submit(std::move(req));
        if (!state) {  // the conversation outgrew the context: say so and forget this message
            std::fprintf(stderr, "chat: %s (/reset starts over)\n", state.error().message.c_str());
            messages.erase(messages.end() - 1);
            continue;
        }
        text::ChatOutputOptions po;
        po.starts_in_reasoning = serve::prompt_opens_reasoning(*rendered);
        text::ChatOutputParser parser(po);
        std::string answer, reasoning;
        const auto show = [&](text::ChatOutputDelta d) {
            out.reasoning(d.reasoning);
            reasoning += d.reasoning;
            out.content(d.content);
            answer += d.content;
        };
        const auto t0 = std::chrono::steady_clock::now();
        serve::Cursor cursor;
        serve::Delta delta;
        int64_t tokens = 0;
        serve::Finish finish = serve::Finish::kNone;
        while (finish == serve::Finish::kNone) {
            sched.step_once();
            while ((*state)->wait(cursor, delta, std::chrono::milliseconds(0))) {
                tokens += static_cast<int64_t>(delta.tokens.size());
                show(parser.feed(delta.text));
                if (delta.finish != serve::Finish::kNone) {
                    finish = delta.finish;
                    show(parser.finish());
                }
            }
        }
        out.end_reasoning();
        std::fputs("\n", stdout);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (prompt_user) {
            std::fprintf(stderr, "[%lld tokens, %.1f tokens/s, %s]\n", static_cast<long long>(tokens),
                         s > 0 ? static_cast<double>(tokens) / s : 0.0, serve::finish_name(finish));
        }
        Json reply = {{"role", "assistant"}, {"content", answer}};
        if (!reasoning.empty()) reply["reasoning_content"] = reasoning;
        messages.push_back(std::move(reply));
    }
    return kExitOk;
}

}  // namespace

Command add_chat_command(CLI::App &app) {
    auto opt = std::make_shared<ChatOptions>();
    opt->threads = default_threads();
    CLI::App *sub = app.add_subcommand("chat", "Chat with the model in the terminal (its chat template; reasoning shown apart)");
    add_model_dir_option(*sub, opt->model_dir);
    sub->add_option("--system", opt->system, "A system message opening the conversation")->envname("MEMRA_SYSTEM");
    sub->add_option("--chat-template", opt->chat_template_file, "A Jinja chat template file, instead of the model's")
        ->envname("MEMRA_CHAT_TEMPLATE")
        ->check(CLI::ExistingFile);
    sub->add_option("-n,--n-predict,--predict", opt->n_predict,
                    "Tokens per answer at most (-1 = until the end of the turn or the context (-c) is full)")
        ->envname("MEMRA_N_PREDICT")
        ->check(CLI::Range(-1, std::numeric_limits<int>::max()))
        ->capture_default_str();
    add_sampling_options(*sub, opt->sampling);
    add_kv_format_options(*sub, opt->kv_k, opt->kv_v);
    add_prefix_cache_option(*sub, opt->prefix_cache);
    add_engine_size_options(*sub, opt->ctx_size, opt->step_rows);
    add_threads_option(*sub, opt->threads);
    add_numerics_option(*sub, opt->numerics);
    add_device_option(*sub, opt->device);
    return {sub, [opt]() { return chat_main(*opt); }};
}

}  // namespace memra::cli
