// `memra serve`'s HTTP layer (cpp-httplib, as llama-server uses it): the OpenAI-compatible endpoints over a
// Scheduler, plus /health, /metrics, /v1/models, /tokenize, /detokenize and /apply-template. Each connection is
// served by a thread of a pool sized for the concurrent streams the server must hold; responses with a body to
// wait for (streaming or not) are written by chunked content providers, which poll the socket so a client that
// disconnects cancels its request (and frees its pages) within a poll interval.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>

#include "core/result.h"
#include "serve/metrics.h"
#include "serve/openai.h"
#include "serve/scheduler.h"

namespace httplib {
class Server;
}

namespace memra::serve {

struct ServerOptions {
    std::string host = "127.0.0.1";
    int port = 8080;                // 0: any free port (port() says which)
    std::string api_key;            // empty: no authentication
    int http_threads = 512;         // connections served at once (each stream holds one)
};

class HttpServer {
public:
    explicit HttpServer(const ServerOptions &options);
    ~HttpServer();
    HttpServer(const HttpServer &) = delete;
    HttpServer &operator=(const HttpServer &) = delete;

    // Binds the listening socket. Refused: the address cannot be bound (the message names it).
    Result<void> bind();
    int port() const { return port_; }
    // Serves until stop(); /health answers 503 until ready() is called.
    void run();
    void stop();

    // The model is loaded: requests go to the scheduler (both must outlive the server's run()).
    void ready(Scheduler &scheduler, const ModelInfo &model, Metrics &metrics);

private:
    void routes();
    bool authorized(const void *request) const;

    ServerOptions options_;
    std::unique_ptr<httplib::Server> http_;
    int port_ = 0;
    int listen_fd_ = -1;  // the socket bind() listens on (httplib's own backlog of 5 is raised on it)
    std::atomic<Scheduler *> scheduler_{nullptr};
    std::atomic<bool> run_started_{false}, run_done_{false}, stop_requested_{false};
    ModelInfo model_;
    Metrics *metrics_ = nullptr;
    std::mutex seed_mu_;
    std::mt19937_64 seeds_;  // draws the seeds of requests that give none (returned in the response)
};

}  // namespace memra::serve
