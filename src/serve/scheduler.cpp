#include "serve/scheduler.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <optional>
#include <utility>

#include <fmt/format.h>

#include "core/check.h"
#include "text/chat_output.h"

namespace memra::serve {
namespace {

double seconds_between(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
}

uint64_t fnv1a(std::span<const float> row) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const float v : row) {
        uint32_t bits;
        std::memcpy(&bits, &v, sizeof bits);
        for (int i = 0; i < 4; ++i) {
            h ^= (bits >> (8 * i)) & 0xffu;
            h *= 0x100000001b3ull;
        }
    }
    return h;
}

bool contains(const std::vector<int32_t> &ids, int32_t id) { return std::find(ids.begin(), ids.end(), id) != ids.end(); }

}  // namespace

// ---- RequestState ----

bool RequestState::wait(Cursor &cursor, Delta &out, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    const auto fresh = [&] {
        return tokens_.size() > cursor.tokens || text_.size() > cursor.text ||
               (finish_ != Finish::kNone && !cursor.finished);
    };
    if (!cv_.wait_for(lock, timeout, fresh)) return false;
    out.tokens.assign(tokens_.begin() + static_cast<std::ptrdiff_t>(cursor.tokens), tokens_.end());
    out.text = text_.substr(cursor.text);
    out.finish = finish_;
    out.error = error_;
    cursor.tokens = tokens_.size();
    cursor.text = text_.size();
    cursor.finished = finish_ != Finish::kNone;
    return true;
}

bool RequestState::finished() const {
    std::lock_guard lock(mu_);
    return finish_ != Finish::kNone;
}

bool RequestState::wait_started(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return started_ || finish_ != Finish::kNone; });
}

void RequestState::mark_started() {
    {
        std::lock_guard lock(mu_);
        started_ = true;
    }
    cv_.notify_all();
}

void RequestState::append(const GeneratedToken &token, const std::string &text) {
    {
        std::lock_guard lock(mu_);
        tokens_.push_back(token);
        text_ += text;
    }
    cv_.notify_all();
}

void RequestState::finish(Finish reason, std::string error) {
    {
        std::lock_guard lock(mu_);
        if (finish_ != Finish::kNone) return;
        finish_ = reason;
        error_ = std::move(error);
    }
    cv_.notify_all();
}

// ---- Scheduler ----

struct Scheduler::Job {
    std::shared_ptr<RequestState> state;
    GenerationRequest req;
    int64_t max_new = 0;                      // generated tokens at most (max_tokens clamped to the context)
    std::vector<int32_t> tokens;              // prompt + generated while not admitted; the sequence holds them after
    std::unique_ptr<runtime::Sequence> seq;   // while admitted
    int64_t generated = 0;
    bool admitted_once = false;
    std::optional<text::StreamDecoder> decoder;
    std::optional<text::StopMatcher> stops;
    Clock::time_point last_token;
    // This step's plan.
    int64_t rows = 0;
    int64_t draft = 0;  // drafts a decode verifies (its step takes 1 + draft trunk rows)
    std::array<int64_t, 2> pages = {0, 0};
};

Scheduler::Scheduler(runtime::Engine &engine, const text::Tokenizer &tokenizer, std::vector<int32_t> eos_ids,
                     const SchedulerOptions &options, Metrics *metrics)
    : engine_(engine), tokenizer_(tokenizer), eos_ids_(std::move(eos_ids)), options_(options), metrics_(metrics) {
    items_.reserve(static_cast<size_t>(engine_.options().max_seqs));
    gauges_.kv_pages_total = engine_.page_pool(kv::PoolKind::kFull).n_pages();
}

Scheduler::~Scheduler() { shutdown(); }

tl::expected<std::shared_ptr<RequestState>, SubmitError> Scheduler::submit(GenerationRequest request) {
    const auto refuse = [](Refusal kind, std::string message) {
        return tl::unexpected(SubmitError{kind, std::move(message)});
    };
    const int64_t n_prompt = static_cast<int64_t>(request.prompt.size());
    if (n_prompt == 0) return refuse(Refusal::kInvalid, "prompt: no tokens");
    const int32_t vocab = engine_.config().vocab_size;
    for (const int32_t id : request.prompt) {
        if (id < 0 || id >= vocab) {
            return refuse(Refusal::kInvalid,
                          fmt::format("prompt: token id {} is outside the model's vocabulary of {}", id, vocab));
        }
    }
    for (const int32_t id : request.stop_ids) {
        if (id < 0 || id >= vocab) {
            return refuse(Refusal::kInvalid,
                          fmt::format("stop_token_ids: token id {} is outside the model's vocabulary of {}", id, vocab));
        }
    }
    const int64_t context = max_context();
    if (n_prompt >= context) {
        return refuse(Refusal::kInvalid,
                      fmt::format("prompt: {} tokens, but the context holds {} positions: at most {} prompt tokens "
                                  "leave room to generate",
                                  n_prompt, context, context - 1));
    }
    if (request.max_tokens == 0 || request.max_tokens < -1) {
        return refuse(Refusal::kInvalid, fmt::format("max_tokens: expected at least 1, found {}", request.max_tokens));
    }
    if (auto ok = validate_sampling_params(request.sampling); !ok) return refuse(Refusal::kInvalid, ok.error().message);
    if (auto ok = validate_logit_bias(request.logit_bias, engine_.options().sample_vocab); !ok) {
        return refuse(Refusal::kInvalid, ok.error().message);
    }
    if (request.top_logprobs < -1 || request.top_logprobs > kMaxTopLogprobs) {
        return refuse(Refusal::kInvalid, fmt::format("top_logprobs: expected 0 .. {}, found {}", kMaxTopLogprobs,
                                                     request.top_logprobs));
    }
    auto stops = text::StopMatcher::create(request.stop);
    if (!stops) return refuse(Refusal::kInvalid, stops.error().message);

    auto job = std::make_unique<Job>();
    job->max_new = request.max_tokens < 0 ? context - n_prompt : std::min(request.max_tokens, context - n_prompt);
    job->tokens = request.prompt;
    job->decoder.emplace(tokenizer_.stream_decoder(request.skip_special));
    job->stops.emplace(std::move(*stops));
    job->req = std::move(request);
    std::shared_ptr<RequestState> state;
    {
        std::lock_guard lock(mu_);
        if (stopping_) return refuse(Refusal::kShuttingDown, "the server is shutting down");
        if (gauges_.waiting + static_cast<int64_t>(incoming_.size()) >= options_.max_waiting) {
            return refuse(Refusal::kQueueFull,
                          fmt::format("the queue is full ({} requests waiting); retry later", options_.max_waiting));
        }
        state = std::make_shared<RequestState>(next_id_++, n_prompt, Clock::now());
        job->state = state;
        incoming_.push_back(std::move(job));
    }
    cv_.notify_all();
    return state;
}

void Scheduler::intake() {
    std::lock_guard lock(mu_);
    for (std::unique_ptr<Job> &job : incoming_) waiting_.push_back(std::move(job));
    incoming_.clear();
}

void Scheduler::end_job(Job &job, Finish reason, std::string error) {
    job.seq.reset();  // its pages go back
    const Clock::time_point now = Clock::now();
    if (metrics_) metrics_->on_finished(finish_name(reason), seconds_between(job.state->arrival(), now));
    job.state->finish(reason, std::move(error));
}

void Scheduler::preempt(Job &job) {
    job.tokens = std::move(job.seq->tokens);
    job.seq.reset();
    auto it = std::find_if(running_.begin(), running_.end(), [&](const auto &j) { return j.get() == &job; });
    std::unique_ptr<Job> owned = std::move(*it);
    running_.erase(it);
    waiting_.push_front(std::move(owned));
    std::lock_guard lock(mu_);
    ++gauges_.preemptions;
}

void Scheduler::expire(Clock::time_point now) {
    const auto remove_ended = [&](auto &jobs) {
        jobs.erase(std::remove_if(jobs.begin(), jobs.end(), [](const auto &j) { return j->state->finished(); }),
                   jobs.end());
    };
    for (const std::unique_ptr<Job> &job : running_) {
        if (job->state->cancel_requested()) end_job(*job, Finish::kCancelled, "cancelled");
    }
    for (const std::unique_ptr<Job> &job : waiting_) {
        if (job->state->cancel_requested()) {
            end_job(*job, Finish::kCancelled, "cancelled");
        } else if (!job->admitted_once && now - job->state->arrival() > options_.queue_timeout) {
            end_job(*job, Finish::kTimeout,
                    fmt::format("queue timeout: not admitted within {} ms", options_.queue_timeout.count()));
        }
    }
    remove_ended(running_);
    remove_ended(waiting_);
}

bool Scheduler::plan_step(std::vector<Job *> &planned) {
    const runtime::EngineOptions &eo = engine_.options();
    int64_t rows_left = eo.step_rows;
    int seats = eo.max_seqs;
    std::array<int64_t, 2> reserved = {0, 0};
    const kv::PagePool *pools[2] = {&engine_.page_pool(kv::PoolKind::kFull), &engine_.page_pool(kv::PoolKind::kSwa)};
    const auto fits = [&](const std::array<int64_t, 2> &need, int64_t spare) {
        // Cached pages no sequence holds count as available: the engine evicts them when a step needs them.
        return need[0] + spare <= pools[0]->n_available() - reserved[0] &&
               need[1] <= pools[1]->n_available() - reserved[1];
    };
    const auto plan = [&](Job &job, int64_t rows, int64_t draft, const std::array<int64_t, 2> &need) {
        job.rows = rows;
        job.draft = draft;
        job.pages = need;
        reserved[0] += need[0];
        reserved[1] += need[1];
        rows_left -= rows + draft;
        --seats;
        planned.push_back(&job);
    };
    const auto unplan = [&](Job &job) {
        auto it = std::find(planned.begin(), planned.end(), &job);
        if (it == planned.end()) return;
        reserved[0] -= job.pages[0];
        reserved[1] -= job.pages[1];
        rows_left += job.rows + job.draft;
        ++seats;
        planned.erase(it);
    };
    planned.clear();
    // A step drafts when it has only decodes: MTP layers run before the trunk in a drafting step, so a prefill
    // chunk there could not let them catch up (runtime::StepItem::draft).
    const bool drafting = eo.spec_draft > 0 && waiting_.empty() &&
                          std::all_of(running_.begin(), running_.end(), [](const auto &j) { return j->seq->pending() == 1; });

    // Running requests, oldest first: decodes, then prefill chunks. Short of pages, the newest running request
    // is preempted (it may be the one being planned).
    for (const bool decodes : {true, false}) {
        for (size_t i = 0; i < running_.size() && seats > 0 && rows_left > 0; ++i) {
            Job &job = *running_[i];
            const int64_t pending = job.seq->pending();
            if ((pending == 1) != decodes) continue;
            const int64_t rows[1] = {std::min(pending, rows_left)};
            const int64_t draft =
                drafting && !job.req.penalize_generated
                    ? runtime::draft_limit(engine_, *job.seq, std::min<int64_t>(eo.spec_draft, rows_left - 1),
                                           job.max_new - job.generated)
                    : 0;
            const int64_t trunk_rows[1] = {rows[0] + draft};
            while (true) {
                const std::array<int64_t, 2> need = job.seq->kv().pages_needed(trunk_rows);
                if (fits(need, 0)) {
                    plan(job, rows[0], draft, need);
                    break;
                }
                Job &victim = *running_.back();
                unplan(victim);
                const bool self = &victim == &job;
                preempt(victim);
                if (self) break;
            }
        }
    }

    // Admissions, first come first served, leaving the watermark free unless nothing else runs.
    const auto watermark =
        static_cast<int64_t>(std::ceil(options_.watermark * static_cast<double>(pools[0]->n_pages())));
    while (!waiting_.empty() && seats > 0 && rows_left > 0) {
        Job &job = *waiting_.front();
        runtime::SequenceOptions so;
        so.mtp_streams = eo.spec_draft > 0 ? eo.mtp_layers : 0;
        so.sampling = job.req.sampling;
        so.choice = job.req.choice;
        so.logit_bias = job.req.logit_bias;
        auto seq = engine_.create_sequence(so);
        if (!seq) {
            end_job(job, Finish::kError, seq.error().message);
            waiting_.pop_front();
            continue;
        }
        job.seq = std::move(*seq);
        job.seq->tokens = std::move(job.tokens);
        auto reused = engine_.reuse_prefix(*job.seq);
        MEMRA_CHECK(reused.has_value(), "scheduler: a fresh sequence's prefix lookup was refused: {}",
                    reused ? "" : reused.error().message);
        const int64_t rows[1] = {std::min(job.seq->pending(), rows_left)};
        const std::array<int64_t, 2> need = job.seq->kv().pages_needed(rows);
        if (!fits(need, running_.empty() ? 0 : watermark)) {
            // Not admitted: the sequence goes, so the cached pages it took are evictable again for the steps
            // planned above, which counted on them.
            job.tokens = std::move(job.seq->tokens);
            job.seq.reset();
            break;
        }
        if (metrics_) metrics_->on_prefix_lookup(static_cast<int64_t>(job.seq->tokens.size()), *reused);
        if (!job.admitted_once) {
            job.admitted_once = true;
            job.state->mark_started();
            if (metrics_) {
                metrics_->on_queued(seconds_between(job.state->arrival(), Clock::now()));
                metrics_->on_prompt_tokens(job.state->prompt_tokens());
            }
        }
        running_.push_back(std::move(waiting_.front()));
        waiting_.pop_front();
        plan(job, rows[0], 0, need);
    }
    return !planned.empty();
}

bool Scheduler::deliver(Job &job, const GeneratedToken &token) {
    ++job.generated;
    const Clock::time_point now = Clock::now();
    if (metrics_) {
        if (job.generated == 1) {
            metrics_->on_first_token(seconds_between(job.state->arrival(), now));
        } else {
            metrics_->on_token_gap(seconds_between(job.last_token, now));
        }
        metrics_->on_generated_tokens(1);
    }
    job.last_token = now;
    const bool stop_id = (!job.req.ignore_eos && contains(eos_ids_, token.id)) || contains(job.req.stop_ids, token.id);
    std::string text;
    bool stopped = stop_id;
    if (!stop_id) {
        text::StopStep out = job.stops->feed(job.decoder->feed(token.id));
        text = std::move(out.text);
        stopped = out.stopped;
    }
    const bool length = !stopped && job.generated >= job.max_new;
    if (length || stop_id) {  // the end of the text: what the decoder and the matcher held back
        text::StopStep out = job.stops->feed(job.decoder->flush());
        text += out.text;
        if (!out.stopped) text += job.stops->finish().text;
    }
    job.state->append(token, text);
    if (stopped || length) {
        end_job(job, stopped ? Finish::kStop : Finish::kLength, {});
        return true;
    }
    return false;
}

void Scheduler::run_step(std::vector<Job *> &planned) {
    items_.clear();
    for (Job *job : planned) {
        if (job->req.penalize_generated) {
            SamplingParams params = job->req.sampling;
            params.penalty_last_n = static_cast<int32_t>(job->generated);
            (void)job->seq->set_sampling(params);  // validated at submit; only the window changes
        }
        runtime::StepItem it;
        it.seq = job->seq.get();
        it.rows = job->rows;
        const bool last = job->rows == job->seq->pending();
        it.logits = last ? runtime::LogitRows::kLast : runtime::LogitRows::kNone;
        it.sample = last;
        it.top_logprobs = last ? job->req.top_logprobs : -1;
        it.return_logits = last && job->req.hash_logits;
        it.mtp_follow = job->seq->n_streams() > 1;
        it.draft = static_cast<int>(job->draft);
        items_.push_back(it);
    }
    Result<void> done = engine_.plan(items_);
    if (!done && std::any_of(items_.begin(), items_.end(), [](const runtime::StepItem &it) { return it.draft > 0; })) {
        // Drafts change speed, never what can be decoded: a step they make impossible runs without them.
        for (runtime::StepItem &it : items_) it.draft = 0;
        done = engine_.plan(items_);
    }
    if (done) {
        engine_.run();
        done = engine_.finish();
    }
    if (!done) {  // pages were counted before planning: an internal error, which ends the step's requests only
        for (Job *job : planned) end_job(*job, Finish::kError, fmt::format("engine step: {}", done.error().message));
    } else {
        for (size_t i = 0; i < planned.size(); ++i) {
            Job &job = *planned[i];
            if (!items_[i].sample) continue;
            // A drafting decode emits its sample and one more per accepted draft (trunk row j: the token after
            // draft j - 1), each with its own logit row; the engine kept the rows behind them.
            const int64_t accepted = items_[i].draft > 0 ? engine_.accepted(i) : 0;
            if (items_[i].draft > 0 && metrics_) metrics_->on_drafts(items_[i].draft, accepted);
            const auto vocab = static_cast<size_t>(engine_.config().vocab_size);
            for (int64_t j = 0; j <= accepted; ++j) {
                const SampledToken &s = engine_.sampled(i, j);
                GeneratedToken token;
                token.id = s.id;
                if (s.has_logprobs) token.logprobs = s.logprobs;
                if (items_[i].return_logits) {
                    token.logits_hash = fnv1a(engine_.logits(i).subspan(static_cast<size_t>(j) * vocab, vocab));
                }
                job.seq->tokens.push_back(s.id);
                if (deliver(job, token)) break;  // finished: the request's sequence goes, and the rest with it
            }
        }
    }
    running_.erase(std::remove_if(running_.begin(), running_.end(), [](const auto &j) { return j->state->finished(); }),
                   running_.end());
}

bool Scheduler::step_once() {
    intake();
    expire(Clock::now());
    std::vector<Job *> planned;
    planned.reserve(static_cast<size_t>(engine_.options().max_seqs));
    const bool ran = plan_step(planned);
    if (ran) run_step(planned);
    std::lock_guard lock(mu_);
    gauges_.running = static_cast<int64_t>(running_.size());
    gauges_.waiting = static_cast<int64_t>(waiting_.size());
    const kv::PagePool &full = engine_.page_pool(kv::PoolKind::kFull);
    gauges_.kv_pages_used = full.n_pages() - full.n_available();
    return ran;
}

bool Scheduler::busy() const {
    std::lock_guard lock(mu_);
    return !incoming_.empty() || gauges_.running > 0 || gauges_.waiting > 0;
}

void Scheduler::start() {
    thread_ = std::thread([this] {
        while (true) {
            {
                std::lock_guard lock(mu_);
                if (stopping_) return;
            }
            if (step_once()) continue;
            // Idle, or every waiting request blocked: wake for a submission, and every 20 ms for cancellations
            // and queue timeouts.
            std::unique_lock lock(mu_);
            cv_.wait_for(lock, std::chrono::milliseconds(20), [&] { return stopping_ || !incoming_.empty(); });
        }
    });
}

void Scheduler::shutdown() {
    {
        std::lock_guard lock(mu_);
        stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    intake();
    for (const std::unique_ptr<Job> &job : running_) end_job(*job, Finish::kCancelled, "the server is shutting down");
    for (const std::unique_ptr<Job> &job : waiting_) end_job(*job, Finish::kCancelled, "the server is shutting down");
    running_.clear();
    waiting_.clear();
    std::lock_guard lock(mu_);
    gauges_.running = gauges_.waiting = 0;
    gauges_.kv_pages_used = 0;
}

Gauges Scheduler::gauges() const {
    std::lock_guard lock(mu_);
    return gauges_;
}

Result<void> Scheduler::check_pages() const { return engine_.check_pages(); }

}  // namespace memra::serve
