// The serving scheduler (SERVING.md 6.2): one engine thread runs continuous batching over an engine's steps.
// Each step gives its row budget (EngineOptions::step_rows) first to the decoding requests, then to the prefill
// chunks of admitted ones, then admits waiting requests first come, first served. When the full KV pool runs
// short, the newest running request is preempted by recompute: its pages go back, its tokens (prompt and those
// generated so far) stay, and it waits at the head of the queue to be prefilled again. Because every row's bits
// depend only on its own sequence's tokens (DETERMINISM.md: batch, chunk and slot invariance), and sampling
// noise is keyed by (seed, choice, position), a request's tokens, logits and text do not depend on what else
// the server runs, on chunk cuts or on preemptions (SERVING.md 6.3, test T1). An admitted request first takes the
// longest cached prefix of its tokens (Engine::reuse_prefix, when the engine has the prefix cache); a request that
// does not fit gives those pages back and waits.
//
// With an engine built for speculation (EngineOptions::spec_draft > 0), every sequence gets the engine's MTP
// streams; prefill chunks let the MTP layers catch up, and a step whose items are all decodes drafts: each
// decode verifies up to spec_draft drafted tokens and emits 1 + the accepted ones, each the token the model
// samples at its position anyway (SERVING.md 2.5), so drafts change speed, never the output. A request with
// presence or frequency penalties over its generated tokens does not draft (its penalty window is set per step).
// Sequences with MTP streams do not use the prefix cache (kv/prefix_cache.h).
//
// The scheduler also turns tokens into text: each request's tokens are decoded incrementally (complete UTF-8
// only) and cut at its stop strings across token boundaries, so a request ends at the token that completed a
// stop string and the text, the token count and the finish reason are the same however the request was
// scheduled. Consumers (the HTTP layer, tests) read a request's progress from its RequestState.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/result.h"
#include "core/sampling.h"
#include "runtime/engine.h"
#include "serve/metrics.h"
#include "serve/request.h"
#include "text/tokenizer.h"

namespace memra::serve {

// A request's progress, shared by the engine thread (which appends) and its consumer (which reads and may
// cancel). Thread-safe.
class RequestState {
public:
    RequestState(uint64_t id, int64_t prompt_tokens, Clock::time_point arrival)
        : id_(id), prompt_tokens_(prompt_tokens), arrival_(arrival) {}

    uint64_t id() const { return id_; }
    int64_t prompt_tokens() const { return prompt_tokens_; }
    Clock::time_point arrival() const { return arrival_; }

    // Waits until there is something the cursor has not read (tokens, text, the finish) or the timeout passes;
    // moves the cursor past what it copies into `out`. Returns whether anything was copied.
    bool wait(Cursor &cursor, Delta &out, std::chrono::milliseconds timeout);
    // Whether the request has finished (its last delta may still be unread).
    bool finished() const;
    // Waits until the request was admitted to the engine or finished (a refusal, a queue timeout, a
    // cancellation); returns false when the timeout passed first.
    bool wait_started(std::chrono::milliseconds timeout);
    // The client is gone or asked to stop: the scheduler ends the request (kCancelled) at its next step and
    // gives its pages back.
    void cancel() { cancel_requested_.store(true); }
    bool cancel_requested() const { return cancel_requested_.load(); }

private:
    friend class Scheduler;
    void mark_started();
    void append(const GeneratedToken &token, const std::string &text);
    void finish(Finish reason, std::string error);

    const uint64_t id_;
    const int64_t prompt_tokens_;
    const Clock::time_point arrival_;
    std::atomic<bool> cancel_requested_{false};
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::vector<GeneratedToken> tokens_;
    std::string text_;
    Finish finish_ = Finish::kNone;
    std::string error_;
    bool started_ = false;
};

struct SchedulerOptions {
    int64_t max_waiting = 1024;                          // queued requests beyond this are refused (HTTP 429)
    std::chrono::milliseconds queue_timeout{600000};     // a request not admitted by then ends kTimeout (503)
    double watermark = 0.01;                             // admissions leave this share of the full pool free
};

// Why submit refused a request.
enum class Refusal { kInvalid, kQueueFull, kShuttingDown };
struct SubmitError {
    Refusal kind = Refusal::kInvalid;
    std::string message;
};

class Scheduler {
public:
    // The engine (its max_seqs and step_rows bound each step; spec_draft > 0: speculation) and the tokenizer
    // must outlive the scheduler. `eos_ids`: the model's end-of-sequence ids.
    Scheduler(runtime::Engine &engine, const text::Tokenizer &tokenizer, std::vector<int32_t> eos_ids,
              const SchedulerOptions &options, Metrics *metrics = nullptr);
    Scheduler(const Scheduler &) = delete;
    Scheduler &operator=(const Scheduler &) = delete;
    // Stops the engine thread (if started) and cancels every request left.
    ~Scheduler();

    // The context a request may fill: its prompt plus at least one generated token must fit.
    int64_t max_context() const { return engine_.max_positions(); }

    // Queues a request. Refused: an empty prompt, ids outside the vocabulary, a prompt that leaves no room to
    // generate in the context (the message gives both counts), invalid sampling parameters or stop strings;
    // a full queue; a scheduler shutting down.
    tl::expected<std::shared_ptr<RequestState>, SubmitError> submit(GenerationRequest request);

    // Runs one scheduling iteration on the calling thread (tests drive the scheduler this way instead of
    // start()): intake, cancellations and timeouts, then one engine step if anything can run. Returns whether
    // a step ran.
    bool step_once();
    // Whether requests are queued or running.
    bool busy() const;

    // The engine thread: step_once() while busy, else waits for a submission.
    void start();
    // Refuses new requests, cancels every queued and running one, gives their pages back and joins the thread.
    void shutdown();

    // Requests running and waiting, the full-attention pool's pages (the sliding pool cannot run short: the
    // engine sizes it per sequence), preemptions so far; a consistent snapshot taken after the last step.
    Gauges gauges() const;
    // SERVING.md 5.2's accounting check (Engine::check_pages); call between steps.
    Result<void> check_pages() const;

private:
    struct Job;
    void intake();
    void expire(Clock::time_point now);
    void end_job(Job &job, Finish reason, std::string error);
    void preempt(Job &job);
    // Decodes a sampled token into text and applies the stop rules; returns whether the job finished.
    bool deliver(Job &job, const GeneratedToken &token);
    bool plan_step(std::vector<Job *> &planned);
    void run_step(std::vector<Job *> &planned);

    runtime::Engine &engine_;
    const text::Tokenizer &tokenizer_;
    std::vector<int32_t> eos_ids_;
    SchedulerOptions options_;
    Metrics *metrics_;

    mutable std::mutex mu_;  // guards incoming_, stopping_ and gauges_
    std::condition_variable cv_;
    std::vector<std::unique_ptr<Job>> incoming_;  // submitted, not yet seen by the engine thread
    bool stopping_ = false;
    Gauges gauges_;
    uint64_t next_id_ = 1;

    // Engine-thread state.
    std::deque<std::unique_ptr<Job>> waiting_;  // FCFS; preempted jobs go to the front
    std::vector<std::unique_ptr<Job>> running_;  // admitted, oldest first
    std::vector<runtime::StepItem> items_;
    std::thread thread_;
};

}  // namespace memra::serve
