// `memra serve [MODEL_DIR]`: the OpenAI-compatible server (serve/http_server.h) over one engine and its
// scheduler. It listens first (so /health answers 503 while the model loads), loads the tokenizer, the chat
// template and the engine, prints the URL, what was loaded and the KV capacity, and serves until SIGINT or
// SIGTERM; then it refuses new requests, cancels the streams in flight (each gets an error event), checks that
// every KV page came back, and exits.
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <pthread.h>

#include "cli/commands.h"
#include "serve/http_server.h"
#include "serve/metrics.h"
#include "serve/scheduler.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace memra::cli {
namespace {

// Defaults per device [cpu, cuda]: running requests per step and the step's token budget. The CPU's budget is the
// engine's (kCpuStepRows); a GPU step amortizes its launches over more rows (vLLM's default budget is 2048).
constexpr int kServeSeqs[2] = {16, 64};
constexpr int64_t kServeStepRows[2] = {runtime::kCpuStepRows, 2048};

struct ServeOptions {
    std::string model_dir;
    serve::ServerOptions server;
    std::string served_name;
    std::string chat_template_file;
    int max_seqs = 0;        // 0: kServeSeqs of the device
    int64_t ctx_size = 16384;
    int64_t kv_budget = 0;   // bytes; 0: ctx_size decides
    int64_t step_rows = 0;   // 0: kServeStepRows of the device
    int64_t max_waiting = 1024;
    double queue_timeout_s = 600.0;
    std::string kv_k = "bf16";
    std::string kv_v = "bf16";
    int threads = 1;
    int tp = 1;
    bool prefix_cache = true;
    int spec_draft = 0;  // off by default: sequences with MTP streams do not use the prefix cache
    const CLI::Option *spec_option = nullptr;
    Numerics numerics = Numerics::kDevice;
    DeviceChoice device = DeviceChoice::kAuto;
};

int serve_main(const ServeOptions &opt) {
    // Signals go to the waiting thread below only: every thread started after this inherits the mask.
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGINT);
    sigaddset(&signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);

    auto in = load_engine_inputs(opt.model_dir, opt.kv_k, opt.kv_v);
    if (!in) return kExitInvalidInput;
    serve::HttpServer server(opt.server);
    if (auto bound = server.bind(); !bound) return report_error(bound.error().message);
    std::thread http([&] { server.run(); });
    const auto fail = [&](const std::string &message) {
        server.stop();
        http.join();
        return report_error(message);
    };

    const model::Step35Config &cfg = in->cfg;
    auto tok = text::Tokenizer::load(in->dir);
    if (!tok) return fail(tok.error().message);
    std::string template_origin;
    auto chat_template = load_chat_template(*tok, opt.chat_template_file, template_origin);
    if (!chat_template) return fail(chat_template.error().message);

    runtime::EngineOptions eo;
    eo.k_format = in->k_format;
    eo.v_format = in->v_format;
    eo.ctx_size = opt.ctx_size;
    eo.sample_vocab = std::min(cfg.vocab_size, tok->n_tokens());
    eo.tp = opt.tp;
    eo.prefix_cache = opt.prefix_cache;
    auto device = resolve_device(opt.device, opt.numerics);
    if (!device) return fail(device.error().message);
    const int on_gpu = *device == Device::kCuda ? 1 : 0;
    eo.max_seqs = opt.max_seqs > 0 ? opt.max_seqs : kServeSeqs[on_gpu];
    eo.step_rows = opt.step_rows > 0 ? opt.step_rows : kServeStepRows[on_gpu];
    auto spec = enable_speculation(eo, cfg, opt.spec_draft, opt.spec_option->count() > 0);
    if (!spec) return fail(spec.error().message);
    if (opt.kv_budget > 0) {
        auto tokens = runtime::kv_budget_tokens(cfg, eo, opt.kv_budget);
        if (!tokens) return fail(fmt::format("--kv-cache-memory: {}", tokens.error().message));
        eo.ctx_size = *tokens;
    }
    auto loaded = load_engine(in->dir, cfg, eo, BackendChoice{*device, opt.threads, opt.numerics});
    if (!loaded) return fail(loaded.error().message);
    runtime::Engine &engine = *loaded->engine;

    std::vector<int32_t> eos(cfg.eos_token_ids.begin(), cfg.eos_token_ids.end());
    if (eos.empty()) eos.assign(tok->eos_ids().begin(), tok->eos_ids().end());
    const std::string name =
        opt.served_name.empty() ? std::filesystem::path(in->dir).lexically_normal().filename().string() : opt.served_name;
    serve::Metrics metrics(name);
    serve::SchedulerOptions so;
    so.max_waiting = opt.max_waiting;
    so.queue_timeout = std::chrono::milliseconds(static_cast<int64_t>(opt.queue_timeout_s * 1000.0));
    serve::Scheduler scheduler(engine, *tok, eos, so, &metrics);
    scheduler.start();
    serve::ModelInfo info;
    info.name = name;
    info.context = engine.max_positions();
    info.tokenizer = &*tok;
    info.chat_template = *chat_template ? &**chat_template : nullptr;
    info.created = static_cast<int64_t>(std::time(nullptr));
    server.ready(scheduler, info, metrics);

    const int64_t kv_tokens = int64_t{engine.page_pool(kv::PoolKind::kFull).n_pages()} * kKvPageRows;
    const auto kv_mib = static_cast<double>(engine.kv_bytes()) / static_cast<double>(int64_t{1} << 20);
    const std::string kv_size = kv_mib >= 1024.0 ? fmt::format("{:.2f} GiB", kv_mib / 1024.0)
                                                 : fmt::format("{:.1f} MiB", kv_mib);
    std::fprintf(stderr, "serve: model %s (%s, %s, tp %d), served as \"%s\"\n", in->name.c_str(),
                 device_name(*device), opt.numerics == Numerics::kDevice ? "device numerics" : "exact numerics", opt.tp,
                 name.c_str());
    std::fprintf(stderr, "serve: prefix cache %s; speculation %s\n", eo.prefix_cache ? "on" : "off",
                 *spec > 0 ? fmt::format("{} MTP drafts per decode step (no prefix cache for its sequences)", *spec).c_str()
                           : "off");
    std::fprintf(stderr, "serve: chat template: %s\n",
                 *chat_template ? template_origin.c_str() : "none (chat completions refused)");
    std::fprintf(stderr,
                 "serve: KV cache: %lld tokens (%s K, %s V, %s); up to %d sequences per step, %lld rows per step; "
                 "maximum concurrency for %lld tokens per request: %.2fx\n",
                 static_cast<long long>(kv_tokens), opt.kv_k.c_str(), opt.kv_v.c_str(), kv_size.c_str(), eo.max_seqs,
                 static_cast<long long>(eo.step_rows), static_cast<long long>(info.context),
                 static_cast<double>(kv_tokens) / static_cast<double>(info.context));
    std::fprintf(stderr, "serve: listening on http://%s:%d (OpenAI API under /v1; Ctrl-C stops)\n",
                 opt.server.host.c_str(), server.port());

    int sig = 0;
    sigwait(&signals, &sig);
    std::fprintf(stderr, "serve: %s: cancelling the requests in flight and stopping\n",
                 sig == SIGINT ? "SIGINT" : "SIGTERM");
    scheduler.shutdown();
    server.stop();
    http.join();
    if (auto pages = scheduler.check_pages(); !pages) return report_error(pages.error().message);
    // Every page is free once the prefix cache lets go of its blocks.
    const int64_t cached = engine.prefix_cache().entries();
    engine.clear_prefix_cache();
    const kv::PagePool &full = engine.page_pool(kv::PoolKind::kFull);
    std::fprintf(stderr, "serve: stopped; %d of %d KV pages free (%lld cached blocks dropped)\n", full.n_free(),
                 full.n_pages(), static_cast<long long>(cached));
    return full.n_free() == full.n_pages() ? kExitOk : kExitInvalidInput;
}

}  // namespace

Command add_serve_command(CLI::App &app) {
    auto opt = std::make_shared<ServeOptions>();
    opt->threads = default_threads();
    CLI::App *sub = app.add_subcommand(
        "serve", "Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, ...)");
    add_model_dir_option(*sub, opt->model_dir);
    sub->add_option("--host", opt->server.host, "Address to listen on")->envname("MEMRA_HOST")->capture_default_str();
    sub->add_option("--port", opt->server.port, "Port to listen on (0 = any free port)")
        ->envname("MEMRA_PORT")
        ->check(CLI::Range(0, 65535))
        ->capture_default_str();
    sub->add_option("--api-key", opt->server.api_key,
                    "Require \"Authorization: Bearer KEY\" on the API routes (not /health, /metrics)")
        ->envname("MEMRA_API_KEY");
    sub->add_option("--served-model-name,--alias", opt->served_name,
                    "The model name clients send and /v1/models lists (default: the model directory's name)")
        ->envname("MEMRA_SERVED_MODEL_NAME");
    sub->add_option("--chat-template", opt->chat_template_file,
                    "A Jinja chat template file, instead of tokenizer_config.json's")
        ->envname("MEMRA_CHAT_TEMPLATE")
        ->check(CLI::ExistingFile);
    sub->add_option("--max-num-seqs,--parallel", opt->max_seqs,
                    "Sequences per engine step: requests running at once (also -np; 0 = 16 on the CPU, 64 on a GPU)")
        ->envname("MEMRA_MAX_NUM_SEQS")
        ->check(CLI::Range(0, 4096))
        ->capture_default_str();
    CLI::Option *ctx = sub->add_option("-c,--ctx-size", opt->ctx_size,
                    "KV cache size in tokens, all requests together, allocated once at start (one request reaches at "
                    "most this and the model's context length)")
        ->envname("MEMRA_CTX_SIZE")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
        ->capture_default_str();
    sub->add_option("--kv-cache-memory", opt->kv_budget,
                    "KV cache size in bytes instead of -c (e.g. 8GiB, 512MiB; both pools, every rank): the sliding "
                    "pool is sized first, the full-attention pool takes the rest")
        ->envname("MEMRA_KV_CACHE_MEMORY")
        ->transform(CLI::AsSizeValue(false))
        ->check(CLI::Range(int64_t{1}, std::numeric_limits<int64_t>::max()))
        ->excludes(ctx);
    sub->add_option("--max-num-batched-tokens,--ubatch-size", opt->step_rows,
                    "Token budget of one engine step (also -ub): decodes first, then prefill chunks (0 = 512 on the "
                    "CPU, 2048 on a GPU)")
        ->envname("MEMRA_MAX_NUM_BATCHED_TOKENS")
        ->check(CLI::Range(int64_t{0}, int64_t{1} << 20))
        ->capture_default_str();
    sub->add_option("--max-queue", opt->max_waiting, "Requests waiting beyond this are refused with 429")
        ->envname("MEMRA_MAX_QUEUE")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
        ->capture_default_str();
    sub->add_option("--queue-timeout", opt->queue_timeout_s,
                    "Seconds a request may wait for admission before it is refused with 503")
        ->envname("MEMRA_QUEUE_TIMEOUT")
        ->check(CLI::Range(0.001, 1e7))
        ->capture_default_str();
    sub->add_option("--http-threads", opt->server.http_threads,
                    "HTTP connections served at once (each open stream holds one)")
        ->envname("MEMRA_HTTP_THREADS")
        ->check(CLI::Range(4, 65536))
        ->capture_default_str();
    add_kv_format_options(*sub, opt->kv_k, opt->kv_v);
    add_threads_option(*sub, opt->threads);
    add_tp_option(*sub, opt->tp);
    add_prefix_cache_option(*sub, opt->prefix_cache);
    opt->spec_option = add_spec_draft_option(*sub, opt->spec_draft, 0);
    add_numerics_option(*sub, opt->numerics);
    add_device_option(*sub, opt->device);
    return {sub, [opt]() { return serve_main(*opt); }};
}

}  // namespace memra::cli
