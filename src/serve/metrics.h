// Server metrics in the Prometheus text format (GET /metrics), named as vLLM names them where the meaning is
// the same, with the prefix "memra:" instead of "vllm:", so dashboards built for vLLM need only the prefix
// changed. Thread-safe: the engine thread observes, the HTTP threads render.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace memra::serve {

// Cumulative buckets with fixed upper bounds (seconds), plus the sum and count of the observations.
class Histogram {
public:
    explicit Histogram(std::vector<double> bounds);
    void observe(double value);
    // "# TYPE name histogram" and its _bucket{le=...}, _sum and _count lines, each with `labels` (`k="v"`).
    void render(std::string &out, const std::string &name, const std::string &help, const std::string &labels) const;

private:
    std::vector<double> bounds_;
    std::vector<int64_t> counts_;  // [bound]; observations above the last bound count only in count_
    double sum_ = 0.0;
    int64_t count_ = 0;
};

// The gauges /metrics reads from the scheduler when it renders.
struct Gauges {
    int64_t running = 0, waiting = 0;
    int64_t kv_pages_used = 0, kv_pages_total = 0;
    int64_t preemptions = 0;
};

class Metrics {
public:
    explicit Metrics(std::string model_name);

    void on_queued(double seconds);             // arrival -> first admission
    void on_first_token(double seconds);        // arrival -> the first generated token
    void on_token_gap(double seconds);          // between two tokens of one request
    void on_prompt_tokens(int64_t n);           // prompt tokens of a request, counted once at admission
    void on_generated_tokens(int64_t n);
    // A prefix-cache lookup at admission: the prompt's tokens, and those whose KV rows came from the cache.
    void on_prefix_lookup(int64_t queried, int64_t hit);
    // A decode step that verified `drafted` MTP drafts, `accepted` of them taken (a prefix).
    void on_drafts(int64_t drafted, int64_t accepted);
    // A finished request: its reason ("stop", "length", "cancelled", "timeout", "error") and its latency.
    void on_finished(const char *reason, double e2e_seconds);

    std::string render(const Gauges &gauges) const;

private:
    mutable std::mutex mu_;
    std::string labels_;  // model_name="..."
    Histogram ttft_, itl_, e2e_, queue_;
    int64_t prompt_tokens_ = 0, generation_tokens_ = 0;
    int64_t prefix_queries_ = 0, prefix_hits_ = 0;
    int64_t drafts_ = 0, draft_tokens_ = 0, accepted_tokens_ = 0;
    static constexpr std::array<const char *, 5> kReasons = {"stop", "length", "cancelled", "timeout", "error"};
    std::array<int64_t, kReasons.size()> finished_{};
};

}  // namespace memra::serve
