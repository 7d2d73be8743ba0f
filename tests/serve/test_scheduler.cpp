// The serving scheduler (serve/scheduler.h) on the embedded default model through the CPU backend. T1 (SERVING.md
// 6.4): every request served in a crowd — random arrivals, step budgets of 1 to 333 rows, a pool so small that
// running requests are preempted and recomputed, the prefix cache cold, warm and evicting, MTP drafts,
// cancellations of other requests, seeded sampling and penalties —
// produces the tokens, the hash of every sampled position's logits, the text and the finish of the same request
// served alone; zero mismatches. T6: the limits (context, queue, timeout) and every refusal. Stop strings across
// token boundaries, max_tokens and the context edge, cancellation and shutdown giving every page back, and the
// threaded loop.
#include <chrono>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "io/safetensors.h"
#include "model/step35_config.h"
#include "runtime/engine.h"
#include "serve/metrics.h"
#include "serve/scheduler.h"
#include "text/tokenizer.h"

namespace memra::serve {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

fs::path model_dir() { return fs::path(MEMRA_SOURCE_DIR) / "models" / "default"; }

// The default model's checkpoint and tokenizer, loaded once for the suite.
struct Model {
    model::Step35Config cfg;
    std::unique_ptr<io::Checkpoint> ckpt;
    std::unique_ptr<text::Tokenizer> tok;
    std::vector<int32_t> eos;
};

const Model &the_model() {
    static const Model *m = [] {
        auto *out = new Model;
        auto cfg = model::load_step35_config(model_dir());
        EXPECT_TRUE(cfg.has_value()) << cfg.error().message;
        out->cfg = *cfg;
        auto ckpt = io::Checkpoint::open(model_dir());
        EXPECT_TRUE(ckpt.has_value()) << ckpt.error().message;
        out->ckpt = std::make_unique<io::Checkpoint>(std::move(*ckpt));
        auto tok = text::Tokenizer::load(model_dir());
        EXPECT_TRUE(tok.has_value()) << tok.error().message;
        out->tok = std::make_unique<text::Tokenizer>(std::move(*tok));
        out->eos.assign(out->cfg.eos_token_ids.begin(), out->cfg.eos_token_ids.end());
        return out;
    }();
    return *m;
}

std::unique_ptr<runtime::Engine> make_engine(int max_seqs, int64_t step_rows, int64_t ctx_size,
                                             bool prefix_cache = false, int spec_draft = 0) {
    const Model &m = the_model();
    runtime::EngineOptions o;
    o.k_format = KvFormat::kQ8_0;
    o.v_format = KvFormat::kQ5_1;
    o.ctx_size = ctx_size;
    o.max_seqs = max_seqs;
    o.step_rows = step_rows;
    o.prefix_cache = prefix_cache;
    o.mtp_layers = spec_draft;
    o.spec_draft = spec_draft;
    o.sample_vocab = std::min(m.cfg.vocab_size, m.tok->n_tokens());
    o.make_backend = [](int) -> Result<std::unique_ptr<Backend>> {
        return std::unique_ptr<Backend>(std::make_unique<cpu::CpuBackend>(1, Numerics::kDevice));
    };
    auto e = runtime::Engine::create(*m.ckpt, m.cfg, o);
    EXPECT_TRUE(e.has_value()) << e.error().message;
    return e ? std::move(*e) : nullptr;
}

std::vector<int32_t> encode(const std::string &text) {
    auto ids = the_model().tok->encode(text);
    EXPECT_TRUE(ids.has_value());
    return ids ? *ids : std::vector<int32_t>{};
}

// Everything a request produced, read once it finished.
struct Outcome {
    std::vector<int32_t> ids;
    std::vector<uint64_t> hashes;
    std::string text;
    Finish finish = Finish::kNone;
    bool operator==(const Outcome &) const = default;
};

Outcome collect(RequestState &state) {
    Outcome out;
    Cursor cursor;
    Delta d;
    while (state.wait(cursor, d, milliseconds(0))) {
        for (const GeneratedToken &t : d.tokens) {
            out.ids.push_back(t.id);
            out.hashes.push_back(t.logits_hash);
        }
        out.text += d.text;
        out.finish = d.finish;
    }
    return out;
}

std::string describe(const Outcome &o) {
    return fmt::format("{} tokens, finish {}, text \"{}\"", o.ids.size(), finish_name(o.finish), o.text);
}

// A mix of requests: prompts of 3 to ~420 tokens (some sharing a long prefix), greedy and seeded sampling, a
// penalty over the generated tokens, stop strings.
std::vector<GenerationRequest> request_mix() {
    const std::string doc =
        "The list data type has some more methods. Here are all of the methods of list objects: list.append(x) "
        "adds an item to the end of the list. list.extend(iterable) extends the list by appending all the items "
        "from the iterable. list.insert(i, x) inserts an item at a given position. The first argument is the "
        "index of the element before which to insert, so a.insert(0, x) inserts at the front of the list.";
    const std::vector<std::string> prompts = {
        "A list is a mutable sequence",
        doc,
        doc + " Dictionaries are",
        "import os",
        doc + doc,
        "def f(x):\n    return",
        doc + " " + doc + " " + doc,
        "The for statement in Python differs a bit from what you may be used to in C or Pascal.",
    };
    std::vector<GenerationRequest> reqs;
    for (size_t i = 0; i < 50; ++i) {
        GenerationRequest r;
        r.prompt = encode(prompts[i % prompts.size()]);
        r.max_tokens = 6 + static_cast<int64_t>((i * 7) % 29);
        r.hash_logits = true;
        r.sampling.temperature = i % 3 == 0 ? 0.0f : 0.7f;
        r.sampling.top_k = 0;
        r.sampling.top_p = i % 4 == 1 ? 0.9f : 1.0f;
        r.sampling.min_p = 0.0f;
        r.sampling.seed = 1000 + i;
        r.choice = i % 2;
        if (i % 5 == 2) {
            r.sampling.presence_penalty = 0.5f;
            r.sampling.frequency_penalty = 0.25f;
            r.penalize_generated = true;
            r.sampling.penalty_last_n = 0;
        }
        if (i % 6 == 4) r.stop = {"\n\n", "the "};
        r.top_logprobs = i % 4 == 3 ? 3 : -1;
        reqs.push_back(std::move(r));
    }
    return reqs;
}

// Each request alone on a roomy engine, one step at a time.
std::vector<Outcome> solo_run(const std::vector<GenerationRequest> &reqs) {
    auto engine = make_engine(1, 512, 2048);
    Scheduler sched(*engine, *the_model().tok, the_model().eos, SchedulerOptions{});
    std::vector<Outcome> out;
    for (const GenerationRequest &r : reqs) {
        auto state = sched.submit(r);
        EXPECT_TRUE(state.has_value()) << state.error().message;
        while (sched.busy()) sched.step_once();
        out.push_back(collect(**state));
        EXPECT_NE(out.back().finish, Finish::kNone);
    }
    return out;
}

// request_mix() served alone, computed once for the suite.
const std::vector<Outcome> &mix_alone() {
    static const std::vector<Outcome> out = solo_run(request_mix());
    return out;
}

struct Crowd {
    int max_seqs;
    int64_t step_rows;
    int64_t ctx_size;
    uint64_t seed;
    bool prefix_cache;
    int rounds;      // the mix served this many times on one engine (a warm prefix cache after the first)
    int spec_draft;  // MTP drafts per decode step (0: none)
};

// A counter of the scheduler's metrics.
double metric(const Metrics &metrics, const std::string &name) {
    const std::string text = metrics.render(Gauges{});
    const std::string line = name + "{model_name=\"t\"} ";
    const size_t at = text.find(line);
    EXPECT_NE(at, std::string::npos) << text;
    return at == std::string::npos ? -1.0 : std::stod(text.substr(at + line.size()));
}

// Prompt tokens the prefix cache supplied.
double prefix_hits(const Metrics &metrics) { return metric(metrics, "memra:prefix_cache_hits_total"); }

TEST(SchedulerT1, EveryRequestInACrowdEqualsItselfAlone) {
    const std::vector<GenerationRequest> reqs = request_mix();
    const std::vector<Outcome> &alone = mix_alone();
    // Budgets around the chunking edges, a one-row budget, and pools of 16 pages for 8 sequences of up to 8 pages
    // each: with 64-row chunks admissions outrun the pool and running requests are preempted. With the prefix
    // cache the mix's shared prefixes hit (and a second round on the same engine starts warm), in the small pool
    // cached pages are evicted, and preempted requests take their own published blocks back.
    // With MTP drafts (3, and 1 in a pool short of pages) pure-decode steps speculate and the rest catch up.
    for (const Crowd &c : {Crowd{8, 7, 512, 1, false, 1, 0}, Crowd{8, 333, 4096, 2, true, 2, 0},
                           Crowd{3, 1, 1024, 3, false, 1, 0}, Crowd{8, 64, 512, 4, false, 1, 0},
                           Crowd{8, 64, 512, 6, true, 1, 0}, Crowd{5, 48, 1024, 5, true, 2, 0},
                           Crowd{6, 40, 2048, 7, false, 1, 3}, Crowd{8, 64, 512, 8, false, 1, 1}}) {
        SCOPED_TRACE(fmt::format("max_seqs {} step_rows {} ctx {} prefix cache {} drafts {}", c.max_seqs,
                                 c.step_rows, c.ctx_size, c.prefix_cache, c.spec_draft));
        auto engine = make_engine(c.max_seqs, c.step_rows, c.ctx_size, c.prefix_cache, c.spec_draft);
        Metrics metrics("t");
        Scheduler sched(*engine, *the_model().tok, the_model().eos, SchedulerOptions{}, &metrics);
        std::mt19937_64 rng(c.seed);
        for (int round = 0; round < c.rounds; ++round) {
            SCOPED_TRACE(fmt::format("round {}", round));
            std::vector<std::shared_ptr<RequestState>> states(reqs.size());
            std::vector<std::shared_ptr<RequestState>> others;  // cancelled at random: not compared
            size_t next = 0;
            while (next < reqs.size() || sched.busy()) {
                while (next < reqs.size() && rng() % 3 != 0) {
                    auto s = sched.submit(reqs[next]);
                    ASSERT_TRUE(s.has_value()) << s.error().message;
                    states[next++] = *s;
                    if (rng() % 4 == 0) {  // another request, which a client abandons later
                        GenerationRequest other = reqs[rng() % reqs.size()];
                        other.max_tokens = 40;
                        auto o = sched.submit(other);
                        ASSERT_TRUE(o.has_value());
                        others.push_back(*o);
                    }
                }
                for (const auto &o : others) {
                    if (rng() % 16 == 0) o->cancel();
                }
                sched.step_once();
                auto pages = sched.check_pages();
                ASSERT_TRUE(pages.has_value()) << pages.error().message;
            }
            int mismatches = 0;
            for (size_t i = 0; i < reqs.size(); ++i) {
                const Outcome got = collect(*states[i]);
                if (!(got == alone[i])) {
                    ++mismatches;
                    ADD_FAILURE() << "request " << i << ": alone " << describe(alone[i]) << "; in the crowd "
                                  << describe(got);
                }
            }
            EXPECT_EQ(mismatches, 0);
        }
        if (c.step_rows == 64 && !c.prefix_cache) {  // the scenario built to run short of pages (shared pages last)
            EXPECT_GT(sched.gauges().preemptions, 0);
        }
        EXPECT_EQ(prefix_hits(metrics) > 0, c.prefix_cache);
        EXPECT_EQ(metric(metrics, "memra:spec_decode_num_accepted_tokens_total") > 0, c.spec_draft > 0);
        const kv::PagePool &full = engine->page_pool(kv::PoolKind::kFull);
        EXPECT_EQ(full.n_available(), full.n_pages());
        engine->clear_prefix_cache();
        EXPECT_EQ(full.n_free(), full.n_pages());
        EXPECT_TRUE(engine->check_pages().has_value());
    }
}

TEST(SchedulerT1, DecodingRequestsPreemptedAndRecomputedEqualThemselvesAlone) {
    // Short prompts admitted at once, then long generations that outgrow a 16-page pool together (8 x 4 pages):
    // requests are preempted while decoding, and their prompt and generated tokens prefilled again.
    std::vector<GenerationRequest> reqs;
    for (int i = 0; i < 8; ++i) {
        GenerationRequest r;
        r.prompt = encode(fmt::format("Item {} of the list is", i));
        r.max_tokens = 180 + 7 * i;
        r.ignore_eos = true;
        r.hash_logits = true;
        r.sampling.temperature = 0.7f;
        r.sampling.top_k = 0;
        r.sampling.top_p = 1.0f;
        r.sampling.min_p = 0.0f;
        r.sampling.seed = 77 + static_cast<uint64_t>(i);
        reqs.push_back(std::move(r));
    }
    const std::vector<Outcome> alone = solo_run(reqs);
    for (const bool prefix_cache : {false, true}) {  // with it, a recomputed request takes back its own blocks
        SCOPED_TRACE(fmt::format("prefix cache {}", prefix_cache));
        auto engine = make_engine(8, 32, 512, prefix_cache);
        Metrics metrics("t");
        Scheduler sched(*engine, *the_model().tok, the_model().eos, SchedulerOptions{}, &metrics);
        std::vector<std::shared_ptr<RequestState>> states;
        for (const GenerationRequest &r : reqs) states.push_back(*sched.submit(r));
        while (sched.busy()) {
            sched.step_once();
            ASSERT_TRUE(sched.check_pages().has_value());
        }
        for (size_t i = 0; i < reqs.size(); ++i) {
            const Outcome got = collect(*states[i]);
            EXPECT_EQ(got, alone[i]) << "request " << i << ": alone " << describe(alone[i]) << "; in the crowd "
                                     << describe(got);
        }
        EXPECT_GE(sched.gauges().preemptions, 4);
        EXPECT_EQ(prefix_hits(metrics) > 0, prefix_cache);
    }
}

TEST(SchedulerT1, ThreadedLoopEqualsTheSteppedOne) {
    const std::vector<GenerationRequest> reqs = request_mix();
    const std::vector<Outcome> &alone = mix_alone();
    auto engine = make_engine(6, 48, 4096);
    Scheduler sched(*engine, *the_model().tok, the_model().eos, SchedulerOptions{});
    sched.start();
    std::vector<std::thread> clients;
    std::vector<Outcome> got(reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) {
        clients.emplace_back([&, i] {
            auto state = sched.submit(reqs[i]);
            ASSERT_TRUE(state.has_value());
            Cursor cursor;
            Delta d;
            Outcome &o = got[i];
            while (o.finish == Finish::kNone) {
                if (!(*state)->wait(cursor, d, milliseconds(1000))) continue;
                for (const GeneratedToken &t : d.tokens) {
                    o.ids.push_back(t.id);
                    o.hashes.push_back(t.logits_hash);
                }
                o.text += d.text;
                o.finish = d.finish;
            }
        });
    }
    for (std::thread &t : clients) t.join();
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i], alone[i]) << "request " << i;
    sched.shutdown();
    const kv::PagePool &full = engine->page_pool(kv::PoolKind::kFull);
    EXPECT_EQ(full.n_free(), full.n_pages());
}

GenerationRequest greedy(const std::string &prompt, int64_t max_tokens) {
    GenerationRequest r;
    r.prompt = encode(prompt);
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0.0f;
    return r;
}

Outcome run_alone(Scheduler &sched, const GenerationRequest &r) {
    auto state = sched.submit(r);
    EXPECT_TRUE(state.has_value()) << state.error().message;
    if (!state) return {};
    while (sched.busy()) sched.step_once();
    return collect(**state);
}

TEST(Scheduler, StopStringsCutTheTextAcrossTokensAndEndTheRequestThere) {
    auto engine = make_engine(2, 64, 2048);
    Scheduler sched(*engine, *the_model().tok, the_model().eos, SchedulerOptions{});
    const GenerationRequest base = greedy("A list is a mutable sequence", 40);
    const Outcome full = run_alone(sched, base);
    ASSERT_EQ(full.finish, Finish::kLength);
    ASSERT_EQ(full.ids.size(), 40u);
    // Token boundaries in the text (each token's text end); a stop string that starts inside one token and
    // ends inside a later one.
    std::vector<size_t> ends;
    std::string so_far;
    for (const int32_t id : full.ids) {
        so_far += the_model().tok->token_text(id);
        ends.push_back(so_far.size());
    }
    ASSERT_EQ(so_far, full.text);  // byte-level tokens of plain ASCII text
    size_t at = 0;
    for (size_t k = 1; k + 2 < ends.size(); ++k) {
        if (ends[k] - ends[k - 1] >= 2 && ends[k + 1] > ends[k] && ends[k] >= 1) {
            at = ends[k] - 1;  // the last byte of token k
            break;
        }
    }
    ASSERT_GT(at, 0u);
    const std::string stop = full.text.substr(at, 3);
    const size_t first = full.text.find(stop);
    GenerationRequest r = base;
    r.stop = {"never appears", stop};
    const Outcome cut = run_alone(sched, r);
    EXPECT_EQ(cut.finish, Finish::kStop);
    EXPECT_EQ(cut.text, full.text.substr(0, first));
    // The request ended with the token that completed the stop string.
    size_t k_end = 0;
    while (ends[k_end] < first + stop.size()) ++k_end;
    EXPECT_EQ(cut.ids.size(), k_end + 1);
    EXPECT_EQ(std::vector<int32_t>(full.ids.begin(), full.ids.begin() + static_cast<std::ptrdiff_t>(k_end + 1)),
              cut.ids);
}

TEST(Scheduler, MaxTokensAndTheContextEdgeFinishWithLength) {
    auto engine = make_engine(2, 64, 96);
    Scheduler sched(*engine, *the_model().tok, the_model().eos, SchedulerOptions{});
    EXPECT_EQ(sched.max_context(), 96);
    const Outcome three = run_alone(sched, greedy("import os", 3));
    EXPECT_EQ(three.finish, Finish::kLength);
    EXPECT_EQ(three.ids.size(), 3u);
    // No max_tokens: the request fills the context and ends there.
    GenerationRequest edge = greedy("import os", -1);
    edge.ignore_eos = true;
    const Outcome filled = run_alone(sched, edge);
    EXPECT_EQ(filled.finish, Finish::kLength);
    EXPECT_EQ(static_cast<int64_t>(edge.prompt.size() + filled.ids.size()), 96);
    // A max_tokens past the edge is cut there too.
    edge.max_tokens = 1000;
    EXPECT_EQ(run_alone(sched, edge).ids.size(), filled.ids.size());
}

TEST(Scheduler, RefusalsNameTheFieldAndTheCounts) {
    auto engine = make_engine(2, 64, 64);
    SchedulerOptions so;
    so.max_waiting = 2;
    Scheduler sched(*engine, *the_model().tok, the_model().eos, so);
    const auto refused = [&](GenerationRequest r, Refusal kind, const std::string &part) {
        auto s = sched.submit(std::move(r));
        ASSERT_FALSE(s.has_value());
        EXPECT_EQ(s.error().kind, kind);
        EXPECT_NE(s.error().message.find(part), std::string::npos) << s.error().message;
    };
    GenerationRequest empty = greedy("x", 4);
    empty.prompt.clear();
    refused(empty, Refusal::kInvalid, "prompt: no tokens");
    GenerationRequest big = greedy("x", 4);
    big.prompt.assign(64, big.prompt[0]);
    refused(big, Refusal::kInvalid, "prompt: 64 tokens, but the context holds 64 positions: at most 63");
    GenerationRequest bad_id = greedy("x", 4);
    bad_id.prompt.push_back(1 << 20);
    refused(bad_id, Refusal::kInvalid, "outside the model's vocabulary");
    GenerationRequest bad_stop_id = greedy("x", 4);
    bad_stop_id.stop_ids = {2, -1};
    refused(bad_stop_id, Refusal::kInvalid, "stop_token_ids: token id -1 is outside the model's vocabulary");
    GenerationRequest bad_temp = greedy("x", 4);
    bad_temp.sampling.temperature = -1.0f;
    refused(bad_temp, Refusal::kInvalid, "temperature");
    GenerationRequest bad_stop = greedy("x", 4);
    bad_stop.stop = {""};
    refused(bad_stop, Refusal::kInvalid, "");
    GenerationRequest bad_top = greedy("x", 4);
    bad_top.top_logprobs = 21;
    refused(bad_top, Refusal::kInvalid, "top_logprobs: expected 0 .. 20, found 21");
    refused(greedy("x", 0), Refusal::kInvalid, "max_tokens: expected at least 1, found 0");
    // The queue holds two.
    ASSERT_TRUE(sched.submit(greedy("x", 2)).has_value());
    ASSERT_TRUE(sched.submit(greedy("x", 2)).has_value());
    refused(greedy("x", 2), Refusal::kQueueFull, "the queue is full (2 requests waiting)");
    while (sched.busy()) sched.step_once();
    ASSERT_TRUE(sched.submit(greedy("x", 2)).has_value());
    sched.shutdown();
    refused(greedy("x", 2), Refusal::kShuttingDown, "shutting down");
}

TEST(Scheduler, QueueTimeoutEndsARequestNeverAdmitted) {
    auto engine = make_engine(1, 64, 1024);
    SchedulerOptions so;
    so.queue_timeout = milliseconds(50);
    Scheduler sched(*engine, *the_model().tok, the_model().eos, so);
    auto running = sched.submit(greedy("import os", 30));
    ASSERT_TRUE(running.has_value());
    sched.step_once();  // admitted: the only seat is taken
    auto queued = sched.submit(greedy("import sys", 4));
    ASSERT_TRUE(queued.has_value());
    std::this_thread::sleep_for(milliseconds(60));
    sched.step_once();
    const Outcome timed_out = collect(**queued);
    EXPECT_EQ(timed_out.finish, Finish::kTimeout);
    EXPECT_TRUE(timed_out.ids.empty());
    // The admitted request is not subject to the timeout.
    while (sched.busy()) sched.step_once();
    EXPECT_EQ(collect(**running).finish, Finish::kLength);
}

TEST(Scheduler, CancellationAndShutdownGiveEveryPageBack) {
    auto engine = make_engine(4, 16, 2048);
    Scheduler sched(*engine, *the_model().tok, the_model().eos, SchedulerOptions{});
    const kv::PagePool &full = engine->page_pool(kv::PoolKind::kFull);
    std::vector<std::shared_ptr<RequestState>> states;
    for (int i = 0; i < 6; ++i) states.push_back(*sched.submit(greedy("The list data type has some more methods", 50)));
    for (int i = 0; i < 5; ++i) sched.step_once();
    EXPECT_LT(full.n_free(), full.n_pages());
    states[0]->cancel();  // running
    states[5]->cancel();  // waiting
    sched.step_once();
    EXPECT_EQ(collect(*states[0]).finish, Finish::kCancelled);
    EXPECT_EQ(collect(*states[5]).finish, Finish::kCancelled);
    ASSERT_TRUE(sched.check_pages().has_value());
    sched.shutdown();
    for (const auto &s : states) EXPECT_TRUE(s->finished());
    EXPECT_EQ(full.n_free(), full.n_pages());
}

TEST(SchedulerT5, SoakWithCancellationsAtEveryPhaseReturnsEveryPage) {
    // 1,000 requests (SERVING.md T5, bounded for CI); a fifth are cancelled at a random step: while queued,
    // while their prompt is prefilled in 5-row chunks, or while decoding. The accounting holds after every step
    // and every page is free at the end.
    auto engine = make_engine(8, 5, 1024);
    Scheduler sched(*engine, *the_model().tok, the_model().eos, SchedulerOptions{});
    std::mt19937_64 rng(5);
    const std::vector<std::string> words = {"list", "import os", "The for statement", "x = [1, 2, 3]", "def"};
    std::vector<std::pair<std::shared_ptr<RequestState>, int64_t>> cancel_at;  // (request, step)
    std::vector<std::shared_ptr<RequestState>> all;
    int64_t step = 0;
    size_t submitted = 0;
    while (submitted < 1000 || sched.busy()) {
        for (int k = 0; k < 3 && submitted < 1000; ++k, ++submitted) {
            GenerationRequest r = greedy(words[rng() % words.size()] + std::string(rng() % 24, ' ') + "a", 1 + rng() % 12);
            r.sampling.temperature = 0.5f;
            r.sampling.seed = rng();
            auto s = sched.submit(std::move(r));
            ASSERT_TRUE(s.has_value()) << s.error().message;
            all.push_back(*s);
            if (rng() % 5 == 0) cancel_at.emplace_back(*s, step + static_cast<int64_t>(rng() % 40));
        }
        for (auto &[state, at] : cancel_at) {
            if (at == step) state->cancel();
        }
        sched.step_once();
        ++step;
        auto pages = sched.check_pages();
        ASSERT_TRUE(pages.has_value()) << pages.error().message;
    }
    int64_t cancelled = 0, normal = 0;
    for (const auto &s : all) {
        const Outcome o = collect(*s);
        cancelled += o.finish == Finish::kCancelled;
        normal += o.finish == Finish::kStop || o.finish == Finish::kLength;
    }
    EXPECT_EQ(cancelled + normal, 1000);
    EXPECT_GT(cancelled, 100);
    const kv::PagePool &full = engine->page_pool(kv::PoolKind::kFull);
    const kv::PagePool &swa = engine->page_pool(kv::PoolKind::kSwa);
    EXPECT_EQ(full.n_free(), full.n_pages());
    EXPECT_EQ(swa.n_free(), swa.n_pages());
}

}  // namespace
}  // namespace memra::serve
