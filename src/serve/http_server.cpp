#include "serve/http_server.h"

#include <chrono>
#include <ctime>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <httplib.h>
#include <sys/socket.h>

namespace memra::serve {
namespace {

using std::chrono::milliseconds;

constexpr milliseconds kPoll{20};                // how often a waiting response checks its socket
constexpr std::chrono::seconds kSsePing{15};      // a comment line keeps idle streams (long prefills) alive
constexpr size_t kMaxBody = size_t{64} << 20;     // request bodies
constexpr int kListenBacklog = 4096;              // pending connections the kernel queues for accept

void send_error(httplib::Response &res, const ApiError &e) {
    res.status = e.status;
    res.set_content(error_body(e), "application/json");
}

ApiError make_api_error(int status, const char *type, std::string message, std::string code = {}) {
    ApiError e;
    e.status = status;
    e.type = type;
    e.message = std::move(message);
    e.code = std::move(code);
    return e;
}

ApiError invalid(std::string message, std::string param = {}) {
    return bad_request(std::move(message), std::move(param)).value();
}

ApiError loading_error() {
    return make_api_error(503, "unavailable_error", "the model is loading", "model_loading");
}

ApiError refusal_error(const SubmitError &e) {
    switch (e.kind) {
    case Refusal::kQueueFull: return make_api_error(429, "rate_limit_error", e.message, "queue_full");
    case Refusal::kShuttingDown: return make_api_error(503, "unavailable_error", e.message, "shutting_down");
    case Refusal::kInvalid: break;
    }
    return make_api_error(400, "invalid_request_error", e.message);
}

// The error of a request that ended without output (before its response started).
ApiError finish_error(Finish finish, const std::string &message) {
    if (finish == Finish::kTimeout) return make_api_error(503, "unavailable_error", message, "queue_timeout");
    if (finish == Finish::kCancelled) return make_api_error(503, "unavailable_error", message, "cancelled");
    return make_api_error(500, "server_error", message);
}

std::string sse(const Json &value) { return "data: " + dump_json(value) + "\n\n"; }

// One request's choices in flight, shared by the handler and its content provider.
struct Generation {
    ParsedRequest request;
    std::vector<std::shared_ptr<RequestState>> states;
    std::vector<Cursor> cursors;
    std::vector<ChoiceOutput> outputs;
    std::vector<std::optional<Delta>> pending;  // read before the response started, not yet presented
    std::string id;
    int64_t created = 0;
    int64_t prompt_tokens = 0;

    void cancel_all() {
        for (const auto &s : states) s->cancel();
    }
    bool all_finished() const {
        for (const ChoiceOutput &o : outputs) {
            if (!o.finished()) return false;
        }
        return true;
    }
    int64_t completion_tokens() const {
        int64_t n = 0;
        for (const ChoiceOutput &o : outputs) n += o.completion_tokens();
        return n;
    }
    // The first choice that ended abnormally, or null.
    const ChoiceOutput *failed() const {
        for (const ChoiceOutput &o : outputs) {
            if (o.finish() == Finish::kError || o.finish() == Finish::kTimeout || o.finish() == Finish::kCancelled) {
                return &o;
            }
        }
        return nullptr;
    }
    // The next delta of choice i: a pending one, else what its state has (waiting up to `timeout`).
    bool next(size_t i, Delta &d, milliseconds timeout) {
        if (pending[i]) {
            d = std::move(*pending[i]);
            pending[i].reset();
            return true;
        }
        return states[i]->wait(cursors[i], d, timeout);
    }
    Json envelope(const char *object, const ModelInfo &model) const {
        Json j;
        j["id"] = id;
        j["object"] = object;
        j["created"] = created;
        j["model"] = model.name;
        j["seed"] = request.seed;  // memra: the seed to resubmit with for the same bytes
        return j;
    }
};

bool abnormal(Finish f) { return f == Finish::kError || f == Finish::kTimeout || f == Finish::kCancelled; }

// A non-streaming response: waits for every choice (cancelling them all if the client goes away), then writes
// the whole body.
bool whole_body(Generation &gen, httplib::DataSink &sink, const ModelInfo &model) {
    while (!gen.all_finished()) {
        bool any = false;
        for (size_t i = 0; i < gen.outputs.size(); ++i) {
            Delta d;
            if (!gen.outputs[i].finished() && gen.next(i, d, milliseconds(0))) {
                gen.outputs[i].add(d);
                any = true;
            }
        }
        if (!any) {
            for (size_t i = 0; i < gen.outputs.size(); ++i) {
                Delta d;
                if (gen.outputs[i].finished()) continue;
                if (gen.next(i, d, kPoll)) gen.outputs[i].add(d);
                break;
            }
        }
        if (!sink.is_writable()) {
            gen.cancel_all();
            return false;
        }
    }
    std::string body;
    if (const ChoiceOutput *f = gen.failed()) {  // the status is sent: the body says what went wrong
        gen.cancel_all();
        body = error_body(finish_error(f->finish(), f->error()));
    } else {
        const bool chat = gen.request.endpoint == Endpoint::kChat;
        Json j = gen.envelope(chat ? "chat.completion" : "text_completion", model);
        j["choices"] = Json::array();
        for (const ChoiceOutput &o : gen.outputs) j["choices"].push_back(o.whole());
        j["usage"] = usage_json(gen.prompt_tokens, gen.completion_tokens());
        body = dump_json(j);
    }
    if (!sink.write(body.data(), body.size())) return false;
    sink.done();
    return true;
}

// A streaming response (server-sent events, USERS.md section 2): for chat a first chunk per choice with the
// role, then a chunk per delta, exactly one chunk per choice with its finish_reason, the usage chunk when asked
// for, and "data: [DONE]". An abnormal end after the stream started is an error event before [DONE].
bool stream_body(Generation &gen, httplib::DataSink &sink, const ModelInfo &model) {
    const bool chat = gen.request.endpoint == Endpoint::kChat;
    const char *object = chat ? "chat.completion.chunk" : "text_completion";
    Clock::time_point last_write = Clock::now();
    bool ok = true;
    const auto write = [&](const std::string &bytes) {
        last_write = Clock::now();
        ok = ok && sink.write(bytes.data(), bytes.size());
    };
    const auto chunk = [&](Json choice) {
        Json j = gen.envelope(object, model);
        j["choices"] = Json::array({std::move(choice)});
        if (gen.request.include_usage) j["usage"] = nullptr;
        write(sse(j));
    };
    if (chat) {
        for (const ChoiceOutput &o : gen.outputs) {
            Json c;
            c["index"] = o.index();
            c["delta"] = {{"role", "assistant"}, {"content", ""}};
            c["logprobs"] = nullptr;
            c["finish_reason"] = nullptr;
            chunk(std::move(c));
        }
    }
    std::vector<bool> done(gen.outputs.size(), false);
    size_t n_done = 0;
    while (n_done < done.size() && ok) {
        bool any = false;
        for (size_t i = 0; i < done.size() && ok; ++i) {
            Delta d;
            if (done[i] || !gen.next(i, d, milliseconds(0))) continue;
            any = true;
            ChoiceOutput &o = gen.outputs[i];
            const Json delta = o.add(d);
            if (abnormal(o.finish())) {
                gen.cancel_all();
                write(sse(Json::parse(error_body(finish_error(o.finish(), o.error())))));
                write("data: [DONE]\n\n");
                if (ok) sink.done();
                return ok;
            }
            if (!delta.empty()) chunk(o.chunk_choice(delta, false));
            if (o.finished()) {
                chunk(o.chunk_choice(Json::object(), true));
                done[i] = true;
                ++n_done;
            }
        }
        if (!any) {
            for (size_t i = 0; i < done.size(); ++i) {
                if (done[i]) continue;
                Delta d;
                if (gen.next(i, d, kPoll)) gen.pending[i] = std::move(d);
                break;
            }
        }
        if (!sink.is_writable()) ok = false;
        if (ok && Clock::now() - last_write > kSsePing) write(": ping\n\n");
    }
    if (!ok) {  // the client is gone
        gen.cancel_all();
        return false;
    }
    if (gen.request.include_usage) {
        Json j = gen.envelope(object, model);
        j["choices"] = Json::array();
        j["usage"] = usage_json(gen.prompt_tokens, gen.completion_tokens());
        write(sse(j));
    }
    write("data: [DONE]\n\n");
    if (ok) sink.done();
    return ok;
}

}  // namespace

HttpServer::HttpServer(const ServerOptions &options)
    : options_(options), http_(std::make_unique<httplib::Server>()), seeds_(std::random_device{}()) {
    const int threads = options_.http_threads;
    http_->new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
    http_->set_payload_max_length(kMaxBody);
    http_->set_default_headers({{"Access-Control-Allow-Origin", "*"}});
    // SO_REUSEADDR (a restart binds while old connections linger) but not httplib's default SO_REUSEPORT, which
    // would let a second server bind the same port and split its traffic; the socket is kept to raise the backlog.
    http_->set_socket_options([this](socket_t sock) {
        const int yes = 1;
        setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
        listen_fd_ = sock;
    });
    routes();
}

HttpServer::~HttpServer() { stop(); }

Result<void> HttpServer::bind() {
    if (options_.port == 0) {
        port_ = http_->bind_to_any_port(options_.host);
        if (port_ <= 0) return make_error("serve: cannot listen on {} (any port)", options_.host);
    } else {
        if (!http_->bind_to_port(options_.host, options_.port)) {
            return make_error("serve: cannot listen on {}:{} (in use, or not an address of this machine)",
                              options_.host, options_.port);
        }
        port_ = options_.port;
    }
    // httplib listens with a backlog of 5: a burst of clients (hundreds of streams opened at once) overflows it,
    // and connections the kernel cannot queue are dropped or reset. listen() again sets the backlog (the kernel
    // caps it at net.core.somaxconn).
    if (::listen(listen_fd_, kListenBacklog) != 0) {
        return make_error("serve: cannot set the listen backlog of {}:{} to {}", options_.host, port_,
                          kListenBacklog);
    }
    return {};
}

void HttpServer::run() {
    run_started_ = true;  // before the check: stop() either sees this or run() sees stop_requested_
    if (!stop_requested_) http_->listen_after_bind();
    run_done_ = true;
}

void HttpServer::stop() {
    stop_requested_ = true;
    if (!http_) return;
    // httplib's stop() does nothing before its loop runs: a run() already past its check is waited for (a failure
    // right after start-up, e.g. a model that does not load, would otherwise leave the server listening).
    while (run_started_ && !run_done_ && !http_->is_running()) std::this_thread::yield();
    http_->stop();
}

void HttpServer::ready(Scheduler &scheduler, const ModelInfo &model, Metrics &metrics) {
    model_ = model;
    metrics_ = &metrics;
    scheduler_.store(&scheduler);
}

bool HttpServer::authorized(const void *request) const {
    if (options_.api_key.empty()) return true;
    const auto &req = *static_cast<const httplib::Request *>(request);
    return req.get_header_value("Authorization") == "Bearer " + options_.api_key;
}

void HttpServer::routes() {
    httplib::Server &s = *http_;
    // Every route but /health and /metrics checks the API key, and answers 503 until the model is loaded.
    const auto guarded = [this](auto handler) {
        return [this, handler](const httplib::Request &req, httplib::Response &res) {
            if (!authorized(&req)) {
                send_error(res, make_api_error(401, "authentication_error", "invalid or missing API key "
                                                                            "(Authorization: Bearer KEY)",
                                               "invalid_api_key"));
                return;
            }
            Scheduler *sched = scheduler_.load();
            if (!sched) {
                send_error(res, loading_error());
                return;
            }
            handler(*sched, req, res);
        };
    };

    const auto health = [this](const httplib::Request &, httplib::Response &res) {
        if (!scheduler_.load()) {
            send_error(res, loading_error());
            return;
        }
        res.set_content("{\"status\":\"ok\"}", "application/json");
    };
    s.Get("/health", health);
    s.Get("/v1/health", health);

    s.Get("/metrics", [this](const httplib::Request &, httplib::Response &res) {
        Scheduler *sched = scheduler_.load();
        if (!sched || !metrics_) {
            send_error(res, loading_error());
            return;
        }
        res.set_content(metrics_->render(sched->gauges()), "text/plain; version=0.0.4");
    });

    s.Get("/v1/models", guarded([this](Scheduler &, const httplib::Request &, httplib::Response &res) {
        Json m;
        m["id"] = model_.name;
        m["object"] = "model";
        m["created"] = model_.created;
        m["owned_by"] = "memra";
        m["max_model_len"] = model_.context;
        Json body;
        body["object"] = "list";
        body["data"] = Json::array({m});
        res.set_content(dump_json(body), "application/json");
    }));

    // llama-server's and vLLM's spellings: {"content" | "prompt", "add_special" | "add_special_tokens"}.
    s.Post("/tokenize", guarded([this](Scheduler &, const httplib::Request &req, httplib::Response &res) {
        Json body = Json::parse(req.body, nullptr, false);
        if (body.is_discarded() || !body.is_object()) {
            send_error(res, invalid("the request body: expected a JSON object"));
            return;
        }
        std::string text;
        if (body.contains("messages")) {
            auto rendered = render_chat(body, model_);
            if (!rendered) {
                send_error(res, rendered.error());
                return;
            }
            text = std::move(*rendered);
        } else {
            const Json &c = body.contains("prompt") ? body["prompt"] : body.value("content", Json());
            if (!c.is_string()) {
                send_error(res, invalid("prompt: expected a string (or \"content\", or \"messages\")", "prompt"));
                return;
            }
            text = c.get<std::string>();
        }
        const Json special = body.contains("add_special_tokens") ? body["add_special_tokens"]
                                                                  : body.value("add_special", Json(!body.contains("messages")));
        if (!special.is_boolean()) {
            send_error(res, invalid("add_special_tokens: expected a boolean", "add_special_tokens"));
            return;
        }
        auto ids = model_.tokenizer->encode(text, text::EncodeOptions{special.get<bool>(), true});
        if (!ids) {
            send_error(res, invalid(ids.error().message, "prompt"));
            return;
        }
        Json out;
        out["tokens"] = *ids;
        out["count"] = ids->size();
        out["max_model_len"] = model_.context;
        res.set_content(dump_json(out), "application/json");
    }));

    s.Post("/detokenize", guarded([this](Scheduler &, const httplib::Request &req, httplib::Response &res) {
        Json body = Json::parse(req.body, nullptr, false);
        const Json *tokens = body.is_object() && body.contains("tokens") ? &body["tokens"] : nullptr;
        if (!tokens || !tokens->is_array()) {
            send_error(res, invalid("tokens: expected an array of token ids", "tokens"));
            return;
        }
        std::vector<int32_t> ids;
        for (const Json &t : *tokens) {
            if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= model_.tokenizer->n_tokens()) {
                send_error(res, invalid(fmt::format("tokens: expected token ids in [0, {})", model_.tokenizer->n_tokens()),
                                        "tokens"));
                return;
            }
            ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
        }
        const std::string text = model_.tokenizer->decode(ids);
        Json out;
        out["prompt"] = text;   // vLLM
        out["content"] = text;  // llama-server
        res.set_content(dump_json(out), "application/json");
    }));

    s.Post("/apply-template", guarded([this](Scheduler &, const httplib::Request &req, httplib::Response &res) {
        Json body = Json::parse(req.body, nullptr, false);
        if (body.is_discarded() || !body.is_object()) {
            send_error(res, invalid("the request body: expected a JSON object"));
            return;
        }
        auto rendered = render_chat(body, model_);
        if (!rendered) {
            send_error(res, rendered.error());
            return;
        }
        res.set_content(dump_json(Json{{"prompt", *rendered}}), "application/json");
    }));

    const auto generate = [this](Endpoint endpoint) {
        return [this, endpoint](Scheduler &sched, const httplib::Request &req, httplib::Response &res) {
            uint64_t drawn = 0;
            auto gen = std::make_shared<Generation>();
            {
                std::lock_guard lock(seed_mu_);
                drawn = seeds_();
                gen->id = fmt::format("{}-{:016x}", endpoint == Endpoint::kChat ? "chatcmpl" : "cmpl", seeds_());
            }
            auto parsed = parse_request(endpoint, req.body, model_, drawn);
            if (!parsed) {
                send_error(res, parsed.error());
                return;
            }
            gen->request = std::move(*parsed);
            gen->created = static_cast<int64_t>(std::time(nullptr));
            const ParsedRequest &pr = gen->request;
            for (size_t p = 0; p < pr.prompts.size(); ++p) {
                gen->prompt_tokens += static_cast<int64_t>(pr.prompts[p].size());
                for (int j = 0; j < pr.n; ++j) {
                    GenerationRequest g = pr.generation;
                    g.prompt = pr.prompts[p];
                    g.choice = static_cast<uint64_t>(j);
                    auto state = sched.submit(std::move(g));
                    if (!state) {
                        gen->cancel_all();
                        send_error(res, refusal_error(state.error()));
                        return;
                    }
                    gen->states.push_back(std::move(*state));
                    gen->cursors.emplace_back();
                    gen->outputs.emplace_back(pr, model_, static_cast<int>(p) * pr.n + j);
                }
            }
            // Until every choice is admitted, the status can still tell a queue timeout (503) from success.
            for (const auto &state : gen->states) {
                while (!state->wait_started(std::chrono::seconds(1))) {
                }
            }
            gen->pending.resize(gen->states.size());
            for (size_t i = 0; i < gen->states.size(); ++i) {
                if (!gen->states[i]->finished()) continue;
                Delta d;
                gen->states[i]->wait(gen->cursors[i], d, milliseconds(0));
                if (d.tokens.empty() && abnormal(d.finish)) {
                    gen->cancel_all();
                    send_error(res, finish_error(d.finish, d.error));
                    return;
                }
                gen->pending[i] = std::move(d);
            }
            if (pr.stream) {
                res.set_header("Cache-Control", "no-cache");
                res.set_chunked_content_provider("text/event-stream", [this, gen](size_t, httplib::DataSink &sink) {
                    return stream_body(*gen, sink, model_);
                });
            } else {
                res.set_chunked_content_provider("application/json", [this, gen](size_t, httplib::DataSink &sink) {
                    return whole_body(*gen, sink, model_);
                });
            }
        };
    };
    s.Post("/v1/completions", guarded(generate(Endpoint::kCompletions)));
    s.Post("/completions", guarded(generate(Endpoint::kCompletions)));
    s.Post("/v1/chat/completions", guarded(generate(Endpoint::kChat)));
    s.Post("/chat/completions", guarded(generate(Endpoint::kChat)));

    s.Options(R"(.*)", [](const httplib::Request &, httplib::Response &res) {
        res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
        res.set_header("Access-Control-Allow-Headers", "Authorization, Content-Type");
        res.status = 204;
    });
    s.set_error_handler([](const httplib::Request &req, httplib::Response &res) {
        if (res.status == 404 && res.body.empty()) {
            send_error(res, make_api_error(404, "not_found_error", fmt::format("no route {} {}", req.method, req.path)));
        }
    });
    s.set_exception_handler([](const httplib::Request &, httplib::Response &res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
            std::rethrow_exception(ep);
        } catch (const std::exception &e) {
            what = e.what();
        } catch (...) {
        }
        send_error(res, make_api_error(500, "server_error", what));
    });
}

}  // namespace memra::serve
