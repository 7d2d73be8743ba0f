#include "serve/metrics.h"

#include <cstring>
#include <utility>

#include <fmt/format.h>

namespace memra::serve {
namespace {

// Prometheus label values escape backslash, double quote and line feed.
std::string label_value(const std::string &s) {
    std::string out;
    for (const char c : s) {
        if (c == '\\' || c == '"') out += '\\';
        if (c == '\n') {
            out += "\\n";
            continue;
        }
        out += c;
    }
    return out;
}

void counter(std::string &out, const std::string &name, const std::string &help, const std::string &labels,
             int64_t value) {
    out += fmt::format("# HELP {0} {1}\n# TYPE {0} counter\n{0}{{{2}}} {3}\n", name, help, labels, value);
}

void gauge(std::string &out, const std::string &name, const std::string &help, const std::string &labels,
           double value) {
    out += fmt::format("# HELP {0} {1}\n# TYPE {0} gauge\n{0}{{{2}}} {3}\n", name, help, labels, value);
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size(), 0) {}

void Histogram::observe(double value) {
    for (size_t i = 0; i < bounds_.size(); ++i) {
        if (value <= bounds_[i]) ++counts_[i];
    }
    sum_ += value;
    ++count_;
}

void Histogram::render(std::string &out, const std::string &name, const std::string &help,
                       const std::string &labels) const {
    out += fmt::format("# HELP {0} {1}\n# TYPE {0} histogram\n", name, help);
    for (size_t i = 0; i < bounds_.size(); ++i) {
        out += fmt::format("{}_bucket{{{},le=\"{}\"}} {}\n", name, labels, bounds_[i], counts_[i]);
    }
    out += fmt::format("{}_bucket{{{},le=\"+Inf\"}} {}\n", name, labels, count_);
    out += fmt::format("{}_sum{{{}}} {}\n{}_count{{{}}} {}\n", name, labels, sum_, name, labels, count_);
}

// Bucket bounds as vLLM's for the same histograms (seconds).
Metrics::Metrics(std::string model_name)
    : labels_(fmt::format("model_name=\"{}\"", label_value(model_name))),
      ttft_({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0}),
      itl_({0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}),
      e2e_({0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
            960.0, 1920.0, 7680.0}),
      queue_({0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
              960.0, 1920.0, 7680.0}) {}

void Metrics::on_queued(double seconds) {
    std::lock_guard lock(mu_);
    queue_.observe(seconds);
}

void Metrics::on_first_token(double seconds) {
    std::lock_guard lock(mu_);
    ttft_.observe(seconds);
}

void Metrics::on_token_gap(double seconds) {
    std::lock_guard lock(mu_);
    itl_.observe(seconds);
}

void Metrics::on_prompt_tokens(int64_t n) {
    std::lock_guard lock(mu_);
    prompt_tokens_ += n;
}

void Metrics::on_generated_tokens(int64_t n) {
    std::lock_guard lock(mu_);
    generation_tokens_ += n;
}

void Metrics::on_prefix_lookup(int64_t queried, int64_t hit) {
    std::lock_guard lock(mu_);
    prefix_queries_ += queried;
    prefix_hits_ += hit;
}

void Metrics::on_drafts(int64_t drafted, int64_t accepted) {
    std::lock_guard lock(mu_);
    ++drafts_;
    draft_tokens_ += drafted;
    accepted_tokens_ += accepted;
}

void Metrics::on_finished(const char *reason, double e2e_seconds) {
    std::lock_guard lock(mu_);
    e2e_.observe(e2e_seconds);
    for (size_t i = 0; i < kReasons.size(); ++i) {
        if (std::strcmp(kReasons[i], reason) == 0) ++finished_[i];
    }
}

std::string Metrics::render(const Gauges &g) const {
    std::lock_guard lock(mu_);
    std::string out;
    gauge(out, "memra:num_requests_running", "Requests in the engine's steps.", labels_, static_cast<double>(g.running));
    gauge(out, "memra:num_requests_waiting", "Requests waiting to be admitted.", labels_,
          static_cast<double>(g.waiting));
    gauge(out, "memra:kv_cache_usage_perc", "Share of the full-attention KV pages in use (1 = full).", labels_,
          g.kv_pages_total > 0 ? static_cast<double>(g.kv_pages_used) / static_cast<double>(g.kv_pages_total) : 0.0);
    counter(out, "memra:num_preemptions_total", "Requests preempted (recomputed later) for lack of KV pages.",
            labels_, g.preemptions);
    counter(out, "memra:prompt_tokens_total", "Prompt tokens admitted.", labels_, prompt_tokens_);
    counter(out, "memra:generation_tokens_total", "Tokens generated.", labels_, generation_tokens_);
    counter(out, "memra:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", labels_,
            prefix_queries_);
    counter(out, "memra:prefix_cache_hits_total", "Prompt tokens whose KV rows the prefix cache held.", labels_,
            prefix_hits_);
    counter(out, "memra:spec_decode_num_drafts_total", "Decode steps that verified MTP drafts.", labels_, drafts_);
    counter(out, "memra:spec_decode_num_draft_tokens_total", "MTP draft tokens verified.", labels_, draft_tokens_);
    counter(out, "memra:spec_decode_num_accepted_tokens_total", "MTP draft tokens accepted (each the token sampled "
            "there anyway).", labels_, accepted_tokens_);
    out += "# HELP memra:request_success_total Finished requests by finish reason.\n"
           "# TYPE memra:request_success_total counter\n";
    for (size_t i = 0; i < kReasons.size(); ++i) {
        out += fmt::format("memra:request_success_total{{{},finished_reason=\"{}\"}} {}\n", labels_, kReasons[i],
                           finished_[i]);
    }
    ttft_.render(out, "memra:time_to_first_token_seconds", "Time to the first generated token.", labels_);
    itl_.render(out, "memra:inter_token_latency_seconds", "Time between two generated tokens of a request.",
                labels_);
    e2e_.render(out, "memra:e2e_request_latency_seconds", "Arrival to finish.", labels_);
    queue_.render(out, "memra:request_queue_time_seconds", "Arrival to admission.", labels_);
    return out;
}

}  // namespace memra::serve
