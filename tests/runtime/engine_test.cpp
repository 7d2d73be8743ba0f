// The engine (runtime/engine.h) on the tiny checkpoint (bf16 and fp8) through the CPU backend: run-to-run
// determinism (D1), thread invariance (D5), batch invariance over batch size and slot (D2), chunked prefill ==
// one-shot prefill (rule 9), a teacher-forced prefill reproducing every decode step's logits and KV bytes,
// partial commits, an abandoned step leaving the cache byte-identical, the MTP chain, sampling (restricted
// ids, seeds, choices, log-probabilities), the per-step work (launches independent of the batch, one copy each
// way, no allocation) and refusals that change nothing. Every comparison is on raw bits.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "io/safetensors.h"
#include "model/step35_config.h"
#include "runtime/engine.h"

#include "model/model_test_util.h"
#include "model/tiny_dirs.h"
#include "runtime/alloc_count.h"
#include "runtime/kv_contents.h"

namespace memra::runtime {
namespace {

namespace fs = std::filesystem;
using model::bit_mismatches;
using model::make_tokens;
using model::TinyDirs;

// A checkpoint and an engine over it (the engine's weights are views of the checkpoint's mmap).
struct Loaded {
    std::unique_ptr<io::Checkpoint> ckpt;
    model::Step35Config cfg;
    std::unique_ptr<Engine> engine;
};

EngineOptions options(int threads = 1) {
    EngineOptions o;
    o.k_format = KvFormat::kF32;
    o.v_format = KvFormat::kF32;
    o.ctx_size = 1024;
    o.max_seqs = 8;
    o.step_rows = 128;
    o.max_logit_rows = 128;
    o.mtp_layers = 1;
    o.make_backend = [threads](int) -> Result<std::unique_ptr<Backend>> {
        return std::unique_ptr<Backend>(std::make_unique<cpu::CpuBackend>(threads, Numerics::kDevice));
    };
    return o;
}

// A sequence with greedy sampling.
std::unique_ptr<Sequence> new_seq(Engine &e, int mtp_streams = 0, float temperature = 0.0f, uint64_t seed = 0,
                                  uint64_t choice = 0) {
    SequenceOptions so;
    so.mtp_streams = mtp_streams;
    so.sampling.temperature = temperature;
    so.sampling.seed = seed;
    so.choice = choice;
    auto s = e.create_sequence(so);
    EXPECT_TRUE(s.has_value()) << s.error().message;
    return s ? std::move(*s) : nullptr;
}

// One step of `rows` pending tokens of one sequence, every row's logits returned; the logits.
std::vector<float> step_all(Engine &e, Sequence &s, int64_t rows, bool sample = true) {
    StepItem it;
    it.seq = &s;
    it.rows = rows;
    it.logits = LogitRows::kAll;
    it.sample = sample;
    it.return_logits = true;
    auto ok = e.step(std::span(&it, 1));
    EXPECT_TRUE(ok.has_value()) << ok.error().message;
    if (!ok) return {};
    const auto lg = e.logits(0);
    return std::vector<float>(lg.begin(), lg.end());
}

class EngineTest : public ::testing::TestWithParam<const char *> {
protected:
    static void SetUpTestSuite() { dirs_ = new TinyDirs("engine_test", 7, 7); }
    static void TearDownTestSuite() {
        delete dirs_;
        dirs_ = nullptr;
    }
    static fs::path dir() { return dirs_->at(GetParam()); }

    static Loaded load(const EngineOptions &o) {
        Loaded l;
        auto cfg = model::load_step35_config(dir());
        EXPECT_TRUE(cfg.has_value()) << cfg.error().message;
        l.cfg = *cfg;
        auto ckpt = io::Checkpoint::open(dir());
        EXPECT_TRUE(ckpt.has_value()) << ckpt.error().message;
        l.ckpt = std::make_unique<io::Checkpoint>(std::move(*ckpt));
        auto engine = Engine::create(*l.ckpt, l.cfg, o);
        EXPECT_TRUE(engine.has_value()) << engine.error().message;
        if (engine) l.engine = std::move(*engine);
        return l;
    }

    // Engine::create refuses o with a message that contains needle.
    static void expect_refused(const EngineOptions &o, const std::string &needle) {
        auto cfg = model::load_step35_config(dir());
        auto ckpt = io::Checkpoint::open(dir());
        ASSERT_TRUE(cfg && ckpt);
        auto engine = Engine::create(*ckpt, *cfg, o);
        ASSERT_FALSE(engine.has_value()) << needle;
        EXPECT_NE(engine.error().message.find(needle), std::string::npos) << engine.error().message;
    }

    static TinyDirs *dirs_;
};

TinyDirs *EngineTest::dirs_ = nullptr;

TEST_P(EngineTest, RunToRunThreadsAndEnginesGiveTheSameBits) {
    const std::vector<int32_t> prompt = make_tokens(1, 40, 1024);
    std::vector<std::vector<float>> runs;
    for (const int threads : {1, 3, 1}) {
        Loaded l = load(options(threads));
        auto s = new_seq(*l.engine);
        s->tokens = prompt;
        runs.push_back(step_all(*l.engine, *s, 40));
        // And one decode step after it.
        s->tokens.push_back(7);
        const std::vector<float> d = step_all(*l.engine, *s, 1);
        runs.back().insert(runs.back().end(), d.begin(), d.end());
    }
    ASSERT_EQ(runs[0].size(), 41u * 1024u);
    for (float v : runs[0]) ASSERT_TRUE(std::isfinite(v));
    EXPECT_EQ(bit_mismatches(runs[0], runs[1]), 0) << "1 vs 3 threads";
    EXPECT_EQ(bit_mismatches(runs[0], runs[2]), 0) << "run to run";
}

TEST_P(EngineTest, ChunkedPrefillEqualsOneShotInLogitsAndKvBytes) {
    const std::vector<int32_t> prompt = make_tokens(2, 100, 1024);
    std::vector<float> one_shot;
    std::vector<std::byte> one_shot_kv;
    for (const int64_t chunk : {int64_t{128}, int64_t{7}, int64_t{64}, int64_t{1}}) {
        EngineOptions o = options();
        o.step_rows = chunk;
        Loaded l = load(o);
        auto s = new_seq(*l.engine);
        s->tokens = prompt;
        std::vector<float> got;
        while (s->pending() > 0) {
            const std::vector<float> part = step_all(*l.engine, *s, std::min(s->pending(), chunk));
            got.insert(got.end(), part.begin(), part.end());
        }
        const std::vector<std::byte> kv = kv_contents(*l.engine, *s);
        if (chunk == 128) {
            one_shot = got;
            one_shot_kv = kv;
            continue;
        }
        EXPECT_EQ(bit_mismatches(one_shot, got), 0) << "chunks of " << chunk;
        EXPECT_EQ(kv, one_shot_kv) << "chunks of " << chunk;
    }
}

// DETERMINISM.md rule 9 / SERVING.md T4: a teacher-forced prefill of a generated sequence reproduces every
// decode step's logits and the KV bytes of every row.
TEST_P(EngineTest, TeacherForcedPrefillReproducesEveryDecodeStep) {
    for (const KvFormat fmt : {KvFormat::kF32, KvFormat::kQ8_0}) {
        EngineOptions o = options();
        o.k_format = fmt;
        o.v_format = fmt == KvFormat::kQ8_0 ? KvFormat::kQ5_1 : fmt;
        Loaded l = load(o);
        Engine &e = *l.engine;
        auto gen = new_seq(e, 0, 0.9f, 1234);
        gen->tokens = make_tokens(3, 20, 1024);
        std::vector<float> decode_logits = step_all(e, *gen, 20);
        for (int i = 0; i < 30; ++i) {
            gen->tokens.push_back(e.sampled(0).id);
            const std::vector<float> d = step_all(e, *gen, 1);
            decode_logits.insert(decode_logits.end(), d.begin(), d.end());
        }
        auto forced = new_seq(e);
        forced->tokens = gen->tokens;
        const std::vector<float> prefill = step_all(e, *forced, static_cast<int64_t>(forced->tokens.size()));
        EXPECT_EQ(bit_mismatches(decode_logits, prefill), 0) << kv_format_name(fmt);
        EXPECT_EQ(kv_contents(e, *gen), kv_contents(e, *forced)) << kv_format_name(fmt);
    }
}

TEST_P(EngineTest, BatchCompositionAndSlotDoNotChangeBitsOrLaunches) {
    Loaded l = load(options());
    Engine &e = *l.engine;
    const std::vector<int32_t> probe = make_tokens(4, 9, 1024);
    std::vector<float> alone_prefill, alone_decode;
    int64_t decode_launches = -1;
    for (const int b : {1, 3, 8}) {
        for (int slot = 0; slot < b; slot += (b > 1 ? b - 1 : 1)) {
            std::vector<std::unique_ptr<Sequence>> seqs;
            std::vector<StepItem> items;
            for (int i = 0; i < b; ++i) {
                seqs.push_back(new_seq(e));
                seqs.back()->tokens = i == slot ? probe : make_tokens(100 + static_cast<uint64_t>(i), 1 + 3 * i % 7, 1024);
                StepItem it;
                it.seq = seqs.back().get();
                it.rows = static_cast<int64_t>(seqs.back()->tokens.size());
                it.logits = i == slot ? LogitRows::kAll : LogitRows::kLast;
                it.sample = true;
                it.return_logits = true;
                items.push_back(it);
            }
            ASSERT_TRUE(e.step(items).has_value());
            const auto p = e.logits(static_cast<size_t>(slot));
            const std::vector<float> prefill(p.begin(), p.end());
            for (int i = 0; i < b; ++i) {
                seqs[static_cast<size_t>(i)]->tokens.push_back(e.sampled(static_cast<size_t>(i)).id);
                items[static_cast<size_t>(i)].rows = 1;
                items[static_cast<size_t>(i)].logits = LogitRows::kLast;
                items[static_cast<size_t>(i)].return_logits = i == slot;
            }
            e.reset_counters();
            ASSERT_TRUE(e.step(items).has_value());
            const StepCounters c = e.counters(0);
            const auto dl = e.logits(static_cast<size_t>(slot));
            const std::vector<float> decode(dl.begin(), dl.end());
            if (b == 1) {
                alone_prefill = prefill;
                alone_decode = decode;
                decode_launches = c.backend.launches;
            } else {
                EXPECT_EQ(bit_mismatches(alone_prefill, prefill), 0) << "batch " << b << " slot " << slot;
                EXPECT_EQ(bit_mismatches(alone_decode, decode), 0) << "batch " << b << " slot " << slot;
            }
            // The launches of a decode step do not depend on how many sequences it holds.
            EXPECT_EQ(c.backend.launches, decode_launches) << "batch " << b;
            EXPECT_EQ(c.backend.h2d_copies, 1) << "batch " << b;
            EXPECT_EQ(c.backend.d2h_copies, 2) << "batch " << b << ": the ids and the returned logits";
            EXPECT_EQ(c.d2h_before_finish, 0) << "batch " << b << ": both copies are finish()'s";
        }
    }
}

TEST_P(EngineTest, DecodeStepCopiesOnceEachWayAndAllocatesNothing) {
    Loaded l = load(options());
    Engine &e = *l.engine;
    e.set_allocation_counter(test::allocation_count);
    auto s = new_seq(e, 0, 0.8f, 99);
    s->tokens = make_tokens(5, 30, 1024);
    ASSERT_TRUE(feed(e, *s).has_value());
    for (int i = 0; i < 6; ++i) {
        s->tokens.push_back(e.sampled(0).id);
        e.reset_counters();
        auto next = feed(e, *s);
        ASSERT_TRUE(next.has_value()) << next.error().message;
        const StepCounters c = e.counters(0);
        EXPECT_EQ(c.backend.h2d_copies, 1) << "the packed step tables";
        EXPECT_EQ(c.backend.d2h_copies, 1) << "the sampled ids";
        EXPECT_EQ(c.d2h_before_finish, 0) << "plan and run never wait for the backend";
        if (i > 0) {
            EXPECT_EQ(e.step_allocations(), 0) << "decode step " << i;
        }
    }
    // The count sees a copy made inside run (here a tap reading one activation back).
    std::vector<float> host(static_cast<size_t>(e.config().d_model));
    e.forward(0).set_tap(0, [&](model::Tap t, TensorView v) {
        if (t == model::Tap::kAttnNorm) e.backend(0).copy_to_host(v.row_slice(0, 1), host.data());
    });
    s->tokens.push_back(e.sampled(0).id);
    e.reset_counters();
    ASSERT_TRUE(feed(e, *s).has_value());
    e.forward(0).set_tap(-1, {});
    EXPECT_EQ(e.counters(0).d2h_before_finish, 1);
    EXPECT_EQ(e.counters(0).backend.d2h_copies, 2);
}

// The prefix cache: blocks published while a sequence prefills and decodes (steps that allocate nothing), a later
// sequence sharing its first 150 tokens takes two blocks, and its logits equal a cold engine's bit for bit; a
// sequence with MTP streams neither takes nor publishes.
TEST_P(EngineTest, APrefixHitEqualsAColdPrefillAndPublishingAllocatesNothing) {
    EngineOptions o = options();
    o.prefix_cache = true;
    Loaded warm = load(o);
    Loaded cold = load(options());
    Engine &e = *warm.engine;
    e.set_allocation_counter(test::allocation_count);
    const std::vector<int32_t> prompt = make_tokens(31, 200, 1024);
    {
        auto a = new_seq(e, 0, 0.8f, 7);
        a->tokens = prompt;
        ASSERT_TRUE(feed(e, *a).has_value());
        EXPECT_EQ(e.prefix_cache().entries(), 3);
        for (int i = 0; i < 60; ++i) {  // past position 256: a block published inside a decode step
            a->tokens.push_back(e.sampled(0).id);
            ASSERT_TRUE(feed(e, *a).has_value());
            EXPECT_EQ(e.step_allocations(), 0) << "decode step " << i;
        }
        EXPECT_EQ(e.prefix_cache().entries(), 4);
        auto m = new_seq(e, 1);
        m->tokens = prompt;
        EXPECT_EQ(*e.reuse_prefix(*m), 0) << "MTP streams take no cached prefix";
    }
    EXPECT_TRUE(e.check_pages().has_value());
    std::vector<int32_t> tokens(prompt.begin(), prompt.begin() + 150);
    const std::vector<int32_t> tail = make_tokens(32, 40, 1024);
    tokens.insert(tokens.end(), tail.begin(), tail.end());
    auto b = new_seq(e);
    b->tokens = tokens;
    auto reused = e.reuse_prefix(*b);
    ASSERT_TRUE(reused.has_value()) << reused.error().message;
    EXPECT_EQ(*reused, 128);
    EXPECT_EQ(b->length(), 128);
    EXPECT_FALSE(e.reuse_prefix(*b).has_value()) << "a sequence with rows";
    const std::vector<float> hit = step_all(e, *b, b->pending());
    auto c = new_seq(*cold.engine);
    c->tokens = tokens;
    step_all(*cold.engine, *c, 128, false);  // the same cut: chunking changes no bit either (tested above)
    const std::vector<float> rest = step_all(*cold.engine, *c, c->pending());
    const auto vocab = static_cast<size_t>(e.config().vocab_size);
    ASSERT_EQ(hit.size(), (tokens.size() - 128) * vocab);
    ASSERT_EQ(rest.size(), hit.size());
    EXPECT_EQ(std::memcmp(hit.data(), rest.data(), hit.size() * sizeof(float)), 0);
    EXPECT_TRUE(e.check_pages().has_value());
}

TEST_P(EngineTest, PartialCommitEqualsTheShorterPrefill) {
    Loaded l = load(options());
    Engine &e = *l.engine;
    const std::vector<int32_t> tokens = make_tokens(6, 30, 1024);
    auto a = new_seq(e);
    a->tokens = tokens;
    StepItem it;
    it.seq = a.get();
    it.rows = 30;
    it.logits = LogitRows::kAll;
    ASSERT_TRUE(e.plan(std::span(&it, 1)).has_value());
    e.run();
    Keep keep;
    keep.rows[0] = 12;
    ASSERT_TRUE(e.finish(std::span(&keep, 1)).has_value());
    EXPECT_EQ(a->length(), 12);
    a->tokens.resize(12);
    auto b = new_seq(e);
    b->tokens.assign(tokens.begin(), tokens.begin() + 12);
    ASSERT_TRUE(feed(e, *b).has_value());
    EXPECT_EQ(kv_contents(e, *a), kv_contents(e, *b));
    // Both continue identically.
    a->tokens.push_back(5);
    b->tokens.push_back(5);
    EXPECT_EQ(bit_mismatches(step_all(e, *a, 1), step_all(e, *b, 1)), 0);
    EXPECT_TRUE(e.check_pages().has_value());
}

// ENGINE.md section 1: a step abandoned after sampling leaves the cache byte-identical to one that never ran:
// every row's bytes, the lengths, the block tables and the pools' free pages.
TEST_P(EngineTest, AnAbandonedStepLeavesTheCacheAsItWas) {
    Loaded l = load(options());
    Engine &e = *l.engine;
    auto s = new_seq(e, 1, 0.8f, 5);
    s->tokens = make_tokens(7, 60, 1024);
    StepItem first;
    first.seq = s.get();
    first.rows = 60;
    first.mtp_rows[0] = 59;
    ASSERT_TRUE(e.step(std::span(&first, 1)).has_value());
    const std::vector<std::byte> before = kv_contents(e, *s);
    const auto tables_full = std::vector<int32_t>(s->kv().block_table(kv::PoolKind::kFull).begin(),
                                                  s->kv().block_table(kv::PoolKind::kFull).end());
    const auto tables_swa = std::vector<int32_t>(s->kv().block_table(kv::PoolKind::kSwa).begin(),
                                                 s->kv().block_table(kv::PoolKind::kSwa).end());
    const int32_t free_full = e.page_pool(kv::PoolKind::kFull).n_free();
    const int32_t free_swa = e.page_pool(kv::PoolKind::kSwa).n_free();
    // Crosses a page boundary (positions 60 .. 65) so the step takes fresh pages, samples, then is abandoned.
    const std::vector<int32_t> more = {1, 2, 3, 4, 5, 6};
    s->tokens.insert(s->tokens.end(), more.begin(), more.end());
    StepItem it;
    it.seq = s.get();
    it.rows = 6;
    it.sample = true;
    ASSERT_TRUE(e.plan(std::span(&it, 1)).has_value());
    EXPECT_LT(e.page_pool(kv::PoolKind::kFull).n_free(), free_full);
    e.run();
    e.abandon();
    EXPECT_EQ(kv_contents(e, *s), before);
    EXPECT_EQ(s->length(0), 60);
    EXPECT_EQ(s->length(1), 59);
    EXPECT_EQ(std::vector<int32_t>(s->kv().block_table(kv::PoolKind::kFull).begin(),
                                   s->kv().block_table(kv::PoolKind::kFull).end()),
              tables_full);
    EXPECT_EQ(std::vector<int32_t>(s->kv().block_table(kv::PoolKind::kSwa).begin(),
                                   s->kv().block_table(kv::PoolKind::kSwa).end()),
              tables_swa);
    EXPECT_EQ(e.page_pool(kv::PoolKind::kFull).n_free(), free_full);
    EXPECT_EQ(e.page_pool(kv::PoolKind::kSwa).n_free(), free_swa);
    EXPECT_TRUE(e.check_pages().has_value());
    // It continues exactly like a sequence that never saw the abandoned step.
    s->tokens.resize(61);
    auto fresh = new_seq(e, 1, 0.8f, 5);
    fresh->tokens = s->tokens;
    StepItem f;
    f.seq = fresh.get();
    f.rows = 60;
    f.mtp_rows[0] = 59;
    ASSERT_TRUE(e.step(std::span(&f, 1)).has_value());
    EXPECT_EQ(bit_mismatches(step_all(e, *s, 1), step_all(e, *fresh, 1)), 0);
}

// All MTP layers chained in one step (MTP layer k rows k .. n - 2): deterministic, finite, each layer a
// different function, and a layer's rows do not depend on the trunk rows computed beside them.
TEST_P(EngineTest, MtpChainIsDeterministicAndRowsAreIndependent) {
    EngineOptions o = options();
    Loaded l = load(o);
    Engine &e = *l.engine;
    const int n_mtp = e.options().mtp_layers;
    ASSERT_GE(n_mtp, 1);
    const std::vector<int32_t> prompt = make_tokens(8, 24, 1024);
    std::vector<std::vector<float>> runs;
    for (int r = 0; r < 2; ++r) {
        auto s = new_seq(e, n_mtp);
        s->tokens = prompt;
        StepItem it;
        it.seq = s.get();
        it.rows = 24;
        it.logits = LogitRows::kNone;
        for (int k = 0; k < n_mtp; ++k) it.mtp_rows[k] = 23 - k;
        it.mtp_logits = true;
        it.return_logits = true;
        ASSERT_TRUE(e.step(std::span(&it, 1)).has_value());
        std::vector<float> all;
        for (int k = 0; k < n_mtp; ++k) {
            const auto lg = e.logits(0, 1 + k);
            ASSERT_EQ(lg.size(), static_cast<size_t>(23 - k) * 1024u);
            all.insert(all.end(), lg.begin(), lg.end());
        }
        for (float v : all) ASSERT_TRUE(std::isfinite(v));
        runs.push_back(all);
        EXPECT_EQ(s->length(1), 23);
    }
    EXPECT_EQ(bit_mismatches(runs[0], runs[1]), 0);
    // Two steps (chunks 16 + 8, MTP rows following the trunk chunk by chunk) give the same MTP bits for the
    // rows whose hidden sources are in their step.
    auto s = new_seq(e, n_mtp);
    s->tokens = prompt;
    StepItem a;
    a.seq = s.get();
    a.rows = 16;
    a.logits = LogitRows::kNone;
    a.mtp_rows[0] = 16;
    a.mtp_logits = true;
    a.return_logits = true;
    ASSERT_TRUE(e.step(std::span(&a, 1)).has_value());
    const auto first = e.logits(0, 1);
    EXPECT_EQ(bit_mismatches(std::vector<float>(first.begin(), first.end()),
                             std::vector<float>(runs[0].begin(), runs[0].begin() + 16 * 1024)),
              0);
}

TEST_P(EngineTest, SamplingRestrictedSeededAndWithLogprobs) {
    EngineOptions o = options();
    o.sample_vocab = 5;
    Loaded l = load(o);
    Engine &e = *l.engine;
    // Only ids [0, 5) are ever sampled, at any temperature.
    for (uint64_t seed = 0; seed < 20; ++seed) {
        auto s = new_seq(e, 0, 2.0f, seed);
        s->tokens = make_tokens(seed, 6, 1024);
        auto id = feed(e, *s);
        ASSERT_TRUE(id.has_value());
        EXPECT_LT(*id, 5);
    }
    // The same seed, choice and position give the same token; the sampled stream is a function of them only.
    Loaded m = load(options());
    Engine &f = *m.engine;
    const std::vector<int32_t> prompt = make_tokens(9, 12, 1024);
    std::vector<int32_t> by_choice[2];
    for (int rep = 0; rep < 2; ++rep) {
        for (const uint64_t choice : {uint64_t{0}, uint64_t{1}}) {
            auto s = new_seq(f, 0, 1.5f, 42, choice);
            s->tokens = prompt;
            std::vector<int32_t> out;
            for (int i = 0; i < 12; ++i) {
                auto id = feed(f, *s);
                ASSERT_TRUE(id.has_value());
                out.push_back(*id);
                s->tokens.push_back(*id);
            }
            if (rep == 0) {
                by_choice[choice] = out;
            } else {
                EXPECT_EQ(out, by_choice[choice]) << "choice " << choice;
            }
        }
    }
    EXPECT_NE(by_choice[0], by_choice[1]) << "two choices of one seed draw different streams";
    // Log-probabilities: the chosen token's and the top ones, from the raw logits.
    auto s = new_seq(f, 0, 1.0f, 3);
    s->tokens = prompt;
    StepItem it;
    it.seq = s.get();
    it.rows = 12;
    it.sample = true;
    it.return_logits = true;
    it.top_logprobs = 5;
    ASSERT_TRUE(f.step(std::span(&it, 1)).has_value());
    const SampledToken &t = f.sampled(0);
    ASSERT_EQ(t.has_logprobs, 1);
    TokenLogprobs want;
    token_logprobs(f.logits(0), t.id, 5, want);
    EXPECT_EQ(std::bit_cast<uint32_t>(t.logprobs.chosen), std::bit_cast<uint32_t>(want.chosen));
    ASSERT_EQ(t.logprobs.n_top, 5);
    for (int j = 0; j < 5; ++j) {
        EXPECT_EQ(t.logprobs.top_ids[j], want.top_ids[j]);
        EXPECT_EQ(std::bit_cast<uint32_t>(t.logprobs.top_logprobs[j]), std::bit_cast<uint32_t>(want.top_logprobs[j]));
    }
    EXPECT_LE(t.logprobs.chosen, 0.0f);
}

// A logit bias acts on its own sequence only: in a batch with unbiased sequences, those draw exactly the tokens
// they draw alone, the biased one the forced token at every step (sampled or greedy), never a banned one; the
// batched steps allocate nothing. Invalid lists are refused.
TEST_P(EngineTest, LogitBiasForcesATokenAndLeavesTheBatchAlone) {
    Loaded l = load(options());
    Engine &e = *l.engine;
    constexpr int kSteps = 8;
    constexpr int32_t kForced = 777;
    struct Spec {
        float temperature;
        uint64_t seed;
        std::vector<LogitBias> bias;
    };
    const std::vector<Spec> specs = {
        {0.8f, 11, {}},
        {0.8f, 12, {{3, -100.0f}, {kForced, 100.0f}, {900, -100.0f}}},
        {0.0f, 13, {}},
        {0.0f, 14, {{kForced, 100.0f}}},
        {1.2f, 15, {}},
    };
    const auto make = [&](size_t i) {
        SequenceOptions so;
        so.sampling.temperature = specs[i].temperature;
        so.sampling.seed = specs[i].seed;
        so.logit_bias = specs[i].bias;
        auto s = e.create_sequence(so);
        EXPECT_TRUE(s.has_value()) << s.error().message;
        (*s)->tokens = make_tokens(40 + i, 5 + 3 * i, 1024);
        return std::move(*s);
    };
    // Alone: prefill, then a decode step per token.
    std::vector<std::vector<int32_t>> alone;
    for (size_t i = 0; i < specs.size(); ++i) {
        auto s = make(i);
        for (int k = 0; k < kSteps; ++k) {
            auto id = feed(e, *s);
            ASSERT_TRUE(id.has_value()) << id.error().message;
            s->tokens.push_back(*id);
        }
        alone.push_back(s->tokens);
    }
    // Together: one step for every sequence's prefill, then batched decode steps.
    e.set_allocation_counter(test::allocation_count);
    std::vector<std::unique_ptr<Sequence>> seqs;
    std::vector<StepItem> items;
    for (size_t i = 0; i < specs.size(); ++i) {
        seqs.push_back(make(i));
        seqs.back()->tokens.reserve(64);
        StepItem it;
        it.seq = seqs.back().get();
        it.rows = seqs.back()->pending();
        it.sample = true;
        items.push_back(it);
    }
    for (int k = 0; k < kSteps; ++k) {
        auto ok = e.step(items);
        ASSERT_TRUE(ok.has_value()) << ok.error().message;
        if (k > 1) {
            EXPECT_EQ(e.step_allocations(), 0) << "step " << k;
        }
        for (size_t i = 0; i < items.size(); ++i) {
            seqs[i]->tokens.push_back(e.sampled(i).id);
            items[i].rows = 1;
        }
    }
    e.set_allocation_counter({});
    for (size_t i = 0; i < specs.size(); ++i) {
        EXPECT_EQ(seqs[i]->tokens, alone[i]) << "sequence " << i;
        const size_t prompt = alone[i].size() - kSteps;
        for (size_t k = prompt; k < alone[i].size(); ++k) {
            if (!specs[i].bias.empty()) {
                EXPECT_EQ(alone[i][k], kForced) << "sequence " << i << " token " << k;
            } else if (k == prompt) {
                EXPECT_NE(alone[i][k], kForced) << "sequence " << i << ": the unbiased model does not pick it";
            }
        }
    }

    // Refusals: an id outside the sampled ids, unsorted ids, a value past 100; set_logit_bias changes nothing then.
    SequenceOptions so;
    so.logit_bias = {{1024, 1.0f}};
    auto bad = e.create_sequence(so);
    ASSERT_FALSE(bad.has_value());
    EXPECT_NE(bad.error().message.find("logit_bias[0].id: expected a token id in [0, 1024), found 1024"),
              std::string::npos)
        << bad.error().message;
    so.logit_bias = {{5, 1.0f}, {4, 1.0f}};
    EXPECT_FALSE(e.create_sequence(so).has_value());
    so.logit_bias = {{5, 101.0f}};
    EXPECT_FALSE(e.create_sequence(so).has_value());
    Sequence &s = *seqs[1];
    EXPECT_FALSE(s.set_logit_bias(std::vector<LogitBias>{{2, 1.0f}, {2, 1.0f}}).has_value());
    EXPECT_EQ(s.logit_bias().size(), 3u);
    EXPECT_TRUE(s.set_logit_bias({}).has_value());
    EXPECT_TRUE(s.logit_bias().empty());
}

// Every refusal leaves the engine and the sequences as they were, and the engine usable.
TEST_P(EngineTest, BadStepsAreRefusedAndChangeNothing) {
    EngineOptions o = options();
    o.max_seqs = 2;
    o.step_rows = 16;
    o.max_logit_rows = 4;
    Loaded l = load(o);
    Engine &e = *l.engine;
    auto a = new_seq(e, 1);
    auto b = new_seq(e);
    a->tokens = make_tokens(10, 40, 1024);
    b->tokens = make_tokens(11, 8, 1024);
    const int32_t free_full = e.page_pool(kv::PoolKind::kFull).n_free();
    const int32_t free_swa = e.page_pool(kv::PoolKind::kSwa).n_free();
    const auto refused = [&](std::vector<StepItem> items, const std::string &needle) {
        auto r = e.plan(items);
        ASSERT_FALSE(r.has_value()) << needle;
        EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
        EXPECT_EQ(a->length(), 0);
        EXPECT_EQ(b->length(), 0);
        EXPECT_FALSE(a->kv().in_txn());
        EXPECT_EQ(e.page_pool(kv::PoolKind::kFull).n_free(), free_full);
        EXPECT_EQ(e.page_pool(kv::PoolKind::kSwa).n_free(), free_swa);
    };
    const auto item = [](Sequence *s, int64_t rows) {
        StepItem it;
        it.seq = s;
        it.rows = rows;
        return it;
    };
    refused({}, "0 sequences, expected 1 .. 2");
    refused({item(a.get(), 1), item(b.get(), 1), item(a.get(), 1)}, "3 sequences");
    refused({item(a.get(), 1), item(a.get(), 1)}, "the same sequence as item 0");
    refused({item(b.get(), 9)}, "9 trunk rows, the sequence has 8 tokens");
    refused({item(a.get(), 17)}, "17 rows of the trunk, the engine's step budget is 16 rows");
    StepItem all = item(b.get(), 8);
    all.logits = LogitRows::kAll;
    refused({all}, "8 logit rows, the engine was created for at most 4");
    StepItem mtp = item(a.get(), 4);
    mtp.mtp_rows[0] = 5;
    refused({mtp}, "MTP layer 0 row at position 4 reads trunk row 4, which this step does not compute");
    StepItem wrong = item(b.get(), 0);
    wrong.mtp_rows[0] = 1;
    refused({wrong}, "the sequence stages 0 MTP layers");
    StepItem none = item(b.get(), 4);
    none.logits = LogitRows::kNone;
    none.sample = true;
    refused({none}, "sampling needs the last trunk row's logits");
    b->tokens[3] = 5000;
    refused({item(b.get(), 4)}, "token id 5000 at position 3 outside the vocabulary [0, 1024)");
    b->tokens[3] = 3;
    Loaded other = load(o);
    auto foreign = new_seq(*other.engine);
    foreign->tokens = {1, 2};
    refused({item(foreign.get(), 1)}, "a sequence of another engine");
    // Phases: finish before run, plan twice, keep past the staged rows (rolled back).
    EXPECT_FALSE(e.finish().has_value());
    ASSERT_TRUE(e.plan(std::vector<StepItem>{item(b.get(), 4)}).has_value());
    EXPECT_FALSE(e.plan(std::vector<StepItem>{item(a.get(), 4)}).has_value());
    e.run();
    Keep too_many;
    too_many.rows[0] = 5;
    EXPECT_FALSE(e.finish(std::span(&too_many, 1)).has_value());
    EXPECT_EQ(b->length(), 0);
    EXPECT_EQ(e.page_pool(kv::PoolKind::kFull).n_free(), free_full);
    // Still usable.
    auto ok = e.step(std::vector<StepItem>{item(b.get(), 8)});
    EXPECT_TRUE(ok.has_value()) << ok.error().message;
    EXPECT_EQ(b->length(), 8);
    EXPECT_TRUE(e.check_pages().has_value());
}

TEST_P(EngineTest, BadKeepCountsRollTheWholeStepBack) {
    EngineOptions o = options();
    o.max_seqs = 2;
    Loaded l = load(o);
    Engine &e = *l.engine;
    auto a = new_seq(e, 1);
    auto b = new_seq(e);
    a->tokens = make_tokens(40, 12, 1024);
    b->tokens = make_tokens(41, 6, 1024);
    const int32_t free_full = e.page_pool(kv::PoolKind::kFull).n_free();
    const int32_t free_swa = e.page_pool(kv::PoolKind::kSwa).n_free();
    std::vector<StepItem> items(2);
    items[0].seq = a.get();
    items[0].rows = 12;
    items[0].mtp_rows[0] = 11;  // MTP layer 0 rows 0 .. 10 read trunk rows 0 .. 10 of this step
    items[1].seq = b.get();
    items[1].rows = 6;
    const auto refused = [&](std::vector<Keep> keep, const std::string &needle) {
        ASSERT_TRUE(e.plan(items).has_value());
        e.run();
        auto r = e.finish(keep);
        ASSERT_FALSE(r.has_value()) << needle;
        EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
        EXPECT_EQ(a->length(0), 0);
        EXPECT_EQ(a->length(1), 0);
        EXPECT_EQ(b->length(), 0) << "item 0 was fine; it is rolled back with the rest";
        EXPECT_FALSE(a->kv().in_txn() || b->kv().in_txn());
        EXPECT_EQ(e.page_pool(kv::PoolKind::kFull).n_free(), free_full);
        EXPECT_EQ(e.page_pool(kv::PoolKind::kSwa).n_free(), free_swa);
        EXPECT_TRUE(e.check_pages().has_value());
    };
    // A later item's count past what it staged (the first item's is fine).
    std::vector<Keep> keep(2);
    keep[1].rows[0] = 7;
    refused(keep, "step item 1 keep: stream 0 keeps 7 rows, 6 were staged");
    // MTP layer 0 keeping rows whose trunk rows are dropped.
    keep = std::vector<Keep>(2);
    keep[0].rows[0] = 3;
    keep[0].rows[1] = 5;
    refused(keep, "step item 0 keep: MTP layer 0 would keep rows up to position 4, past the trunk rows its source "
                  "keeps (reaching position 2)");
    // Speculation's shape is accepted: the trunk keeps 4, MTP layer 0 the 3 rows those reach.
    keep[0].rows[1] = 3;
    ASSERT_TRUE(e.plan(items).has_value());
    e.run();
    auto ok = e.finish(keep);
    ASSERT_TRUE(ok.has_value()) << ok.error().message;
    EXPECT_EQ(a->length(0), 3);
    EXPECT_EQ(a->length(1), 3);
    EXPECT_EQ(b->length(), 6);
    EXPECT_TRUE(e.check_pages().has_value());
}

TEST_P(EngineTest, DestroyingASequenceInsideAStepAbandonsTheStep) {
    Loaded l = load(options());
    Engine &e = *l.engine;
    auto a = new_seq(e);
    auto b = new_seq(e);
    a->tokens = make_tokens(50, 9, 1024);
    b->tokens = make_tokens(51, 70, 1024);
    const int32_t free_full = e.page_pool(kv::PoolKind::kFull).n_free();
    const int32_t free_swa = e.page_pool(kv::PoolKind::kSwa).n_free();
    for (const bool after_run : {false, true}) {
        std::vector<StepItem> items(2);
        items[0].seq = a.get();
        items[0].rows = 9;
        items[1].seq = b.get();
        items[1].rows = 70;
        ASSERT_TRUE(e.plan(items).has_value());
        if (after_run) e.run();
        b.reset();  // a client unwinding between plan and finish
        EXPECT_FALSE(e.finish().has_value()) << "nothing left to finish";
        EXPECT_EQ(a->length(), 0);
        EXPECT_FALSE(a->kv().in_txn());
        EXPECT_EQ(e.page_pool(kv::PoolKind::kFull).n_free(), free_full);
        EXPECT_EQ(e.page_pool(kv::PoolKind::kSwa).n_free(), free_swa);
        EXPECT_TRUE(e.check_pages().has_value());
        b = new_seq(e);
        b->tokens = make_tokens(51, 70, 1024);
    }
    // The engine goes on.
    StepItem it;
    it.seq = a.get();
    it.rows = 9;
    ASSERT_TRUE(e.step(std::span(&it, 1)).has_value());
    EXPECT_EQ(a->length(), 9);
}

TEST_P(EngineTest, PoolsRunOutWithAClearErrorAndSequencesGiveTheirPagesBack) {
    EngineOptions o = options();
    o.ctx_size = 128;  // 2 full pages + 1 per sequence of max_seqs; the sliding pool: 2 pages for max_seqs 1
    o.max_seqs = 1;
    o.step_rows = 64;
    Loaded l = load(o);
    Engine &e = *l.engine;
    EXPECT_EQ(e.page_pool(kv::PoolKind::kFull).n_pages(), 3);
    EXPECT_EQ(e.page_pool(kv::PoolKind::kSwa).n_pages(), 2);
    // Each short sequence holds one page of each pool: the third finds the sliding pool empty.
    std::vector<std::unique_ptr<Sequence>> seqs;
    for (int i = 0; i < 2; ++i) {
        seqs.push_back(new_seq(e));
        seqs.back()->tokens = make_tokens(20 + static_cast<uint64_t>(i), 10, 1024);
        ASSERT_TRUE(feed(e, *seqs.back()).has_value());
    }
    auto extra = new_seq(e);
    extra->tokens = make_tokens(30, 10, 1024);
    auto r = feed(e, *extra);
    ASSERT_FALSE(r.has_value());
    EXPECT_NE(r.error().message.find("sliding KV pool out of pages: the step needs 1 more, 0 of 2 are free"),
              std::string::npos)
        << r.error().message;
    EXPECT_EQ(e.page_pool(kv::PoolKind::kFull).n_free(), 1) << "the refused step gave its full page back";
    EXPECT_TRUE(e.check_pages().has_value());
    seqs.clear();
    EXPECT_EQ(e.page_pool(kv::PoolKind::kFull).n_free(), 3);
    EXPECT_EQ(e.page_pool(kv::PoolKind::kSwa).n_free(), 2);
    EXPECT_TRUE(feed(e, *extra).has_value());
    EXPECT_TRUE(e.check_pages().has_value());
}

// fill_context (the bench's --fill-depth): seeded rows in every stored layer without a forward. On an f32 cache
// the rows are the seeded values themselves, the same on two engines and on every TP degree (keyed by the
// model's KV head), another seed's elsewhere; the decode step after them reads them (its logits follow the
// seed); they never enter the prefix cache; pages stay accounted.
TEST_P(EngineTest, AFilledContextHoldsSeededRowsThatDecodeReads) {
    const std::vector<int32_t> context = make_tokens(40, 300, 1024);
    const auto filled = [&](Engine &e, uint64_t seed) {
        auto s = new_seq(e);
        s->tokens = context;
        auto ok = e.fill_context(*s, 300, seed);  // three chunks of the 128-row step budget, the last one partial
        EXPECT_TRUE(ok.has_value()) << ok.error().message;
        EXPECT_EQ(s->length(), 300);
        EXPECT_EQ(s->pending(), 0);
        EXPECT_TRUE(e.check_pages().has_value());
        return s;
    };
    EngineOptions o = options();
    o.prefix_cache = true;
    Loaded a = load(o), b = load(o);
    auto s1 = filled(*a.engine, 7), s2 = filled(*b.engine, 7), s3 = filled(*a.engine, 8);
    const std::vector<std::byte> c1 = kv_contents(*a.engine, *s1), c3 = kv_contents(*a.engine, *s3);
    ASSERT_FALSE(c1.empty());
    EXPECT_TRUE(c1 == kv_contents(*b.engine, *s2)) << "the same seed, another engine";
    EXPECT_FALSE(c1 == c3) << "another seed";
    std::vector<float> values(c1.size() / sizeof(float));
    std::memcpy(values.data(), c1.data(), values.size() * sizeof(float));
    const auto [lo, hi] = std::minmax_element(values.begin(), values.end());
    EXPECT_GE(*lo, -1.0f);
    EXPECT_LT(*hi, 1.0f);
    EXPECT_LT(*lo, -0.99f);
    EXPECT_GT(*hi, 0.99f);

    for (Sequence *s : {s1.get(), s2.get(), s3.get()}) s->tokens.push_back(5);
    const std::vector<float> want = step_all(*a.engine, *s1, 1);
    EXPECT_EQ(bit_mismatches(want, step_all(*b.engine, *s2, 1)), 0);
    EXPECT_GT(bit_mismatches(want, step_all(*a.engine, *s3, 1)), 0) << "the step attends over the filled rows";

    // Not the tokens' rows: a fresh sequence of the same tokens finds nothing cached and computes them.
    auto fresh = new_seq(*a.engine);
    fresh->tokens = context;
    EXPECT_EQ(*a.engine->reuse_prefix(*fresh), 0);

    // Every TP degree holds the same rows, so its step gives the single rank's bits.
    for (const int tp : {2, 4}) {
        EngineOptions ot = options(2);
        ot.tp = tp;
        Loaded l = load(ot);
        auto s = filled(*l.engine, 7);
        s->tokens.push_back(5);
        EXPECT_EQ(bit_mismatches(want, step_all(*l.engine, *s, 1)), 0) << "tp " << tp;
        for (int r = 1; r < tp; ++r) {
            EXPECT_EQ(bit_mismatches(want, l.engine->rank_logits(r)), 0) << "tp " << tp << " rank " << r;
        }
    }
}

TEST_P(EngineTest, FillingRefusesWhatItCannotFillAndChangesNothing) {
    EngineOptions o = options();
    Loaded l = load(o), other = load(o);
    Engine &e = *l.engine;
    const auto refused = [&](Engine &engine, Sequence &s, int64_t rows, const std::string &needle) {
        const int64_t length = s.length();
        auto ok = engine.fill_context(s, rows, 1);
        ASSERT_FALSE(ok.has_value()) << needle;
        EXPECT_NE(ok.error().message.find(needle), std::string::npos) << ok.error().message;
        EXPECT_EQ(s.length(), length);
        EXPECT_TRUE(e.check_pages().has_value());
    };
    auto s = new_seq(e);
    s->tokens = make_tokens(41, 100, 1024);
    refused(e, *s, 0, "0 rows, expected 1 .. the sequence's 100 tokens");
    refused(e, *s, 101, "101 rows, expected 1 .. the sequence's 100 tokens");
    refused(*other.engine, *s, 10, "another engine");
    auto mtp = new_seq(e, 1);
    mtp->tokens = s->tokens;
    refused(e, *mtp, 10, "1 MTP streams");
    auto longer = new_seq(e);
    longer->tokens = make_tokens(42, 1100, 1024);
    refused(e, *longer, 1100, "1100 rows, past the 1024 positions");
    // A planned step: no fill until it finishes.
    auto fed = new_seq(e);
    fed->tokens = make_tokens(43, 10, 1024);
    StepItem it;
    it.seq = fed.get();
    it.rows = 10;
    ASSERT_TRUE(e.plan(std::span(&it, 1)).has_value());
    refused(e, *s, 10, "a step is planned");
    e.abandon();
    ASSERT_TRUE(feed(e, *fed).has_value());
    refused(e, *fed, 10, "already holds 10 rows");
    ASSERT_TRUE(e.fill_context(*s, 100, 1).has_value());

    // Pools that run out refuse at the chunk that finds them empty; the chunks before it stay.
    EngineOptions small = options();
    small.ctx_size = 128;  // 3 full pages
    small.max_seqs = 1;
    small.step_rows = 64;
    Loaded tight = load(small);
    auto first = new_seq(*tight.engine), second = new_seq(*tight.engine);
    first->tokens = second->tokens = make_tokens(44, 128, 1024);
    ASSERT_TRUE(tight.engine->fill_context(*first, 128, 1).has_value());
    auto ok = tight.engine->fill_context(*second, 128, 1);
    ASSERT_FALSE(ok.has_value());
    EXPECT_NE(ok.error().message.find("fill: positions 64 .. 127"), std::string::npos) << ok.error().message;
    EXPECT_NE(ok.error().message.find("out of pages"), std::string::npos) << ok.error().message;
    EXPECT_EQ(second->length(), 64);
    EXPECT_TRUE(tight.engine->check_pages().has_value());
}

TEST_P(EngineTest, AKvBudgetSizesThePoolsWithinIt) {
    for (const int tp : {1, 2}) {
        for (const int64_t budget : {int64_t{8} << 20, int64_t{12} << 20}) {
            EngineOptions o = options();
            o.tp = tp;
            o.max_seqs = 3;
            auto cfg = model::load_step35_config(dir());
            ASSERT_TRUE(cfg.has_value());
            auto tokens = kv_budget_tokens(*cfg, o, budget);
            ASSERT_TRUE(tokens.has_value()) << budget << ": " << tokens.error().message;
            EXPECT_EQ(*tokens % kKvPageRows, 0);
            o.ctx_size = *tokens;
            Loaded l = load(o);
            ASSERT_TRUE(l.engine);
            // Within the budget, and one more full page per rank would not fit beside what the budget left.
            EXPECT_LE(l.engine->kv_bytes(), budget) << "tp " << tp;
            o.ctx_size = *tokens + kKvPageRows;
            auto more = kv_budget_tokens(*cfg, o, budget);
            ASSERT_TRUE(more.has_value());
            EXPECT_EQ(*more, *tokens);  // ctx_size does not enter
            Loaded bigger = load(o);
            ASSERT_TRUE(bigger.engine);
            EXPECT_GT(bigger.engine->kv_bytes(), l.engine->kv_bytes());
        }
        EngineOptions o = options();
        o.tp = tp;
        auto cfg = model::load_step35_config(dir());
        auto small = kv_budget_tokens(*cfg, o, 1000);
        ASSERT_FALSE(small.has_value());
        EXPECT_NE(small.error().message.find("KV budget of 1000 bytes: the sliding pool takes"), std::string::npos)
            << small.error().message;
    }
}

TEST_P(EngineTest, CreateRefusesBadOptions) {
    EngineOptions o = options();
    o.max_seqs = 0;
    expect_refused(o, "expected max_seqs, step_rows, ctx_size >= 1");
    o = options();
    o.mtp_layers = 2;
    expect_refused(o, "2 MTP layers requested, the model has 1");
    o = options();
    o.sample_vocab = 2000;
    expect_refused(o, "sample_vocab 2000 outside [0, 1024]");
    o = options();
    o.tp = 3;
    expect_refused(o, "tp=3");
    o = options();
    o.make_backend = nullptr;
    expect_refused(o, "no backend factory");
    o = options();
    o.max_seqs = 1 << 21;  // 2^21 sequences of 1024 positions: sampling history offsets past int32
    expect_refused(o, "the sampling history of 2097152 sequences of 1024 positions exceeds 2^29 tokens");
    Loaded l = load(options());
    SequenceOptions so;
    so.mtp_streams = 2;
    EXPECT_FALSE(l.engine->create_sequence(so).has_value());
    so.mtp_streams = 0;
    so.sampling.top_p = 0.0f;
    EXPECT_FALSE(l.engine->create_sequence(so).has_value());
}

// A short scenario on 2 and 4 ranks gives the single rank's logits bit for bit on every rank.
TEST_P(EngineTest, TensorParallelRanksGiveTheSingleRankBits) {
    const std::vector<int32_t> prompt = make_tokens(12, 30, 1024);
    std::vector<float> want;
    for (const int tp : {1, 2, 4}) {
        EngineOptions o = options(2);
        o.tp = tp;
        Loaded l = load(o);
        Engine &e = *l.engine;
        auto s = new_seq(e, 1, 0.7f, 8);
        s->tokens = prompt;
        StepItem it;
        it.seq = s.get();
        it.rows = 30;
        it.logits = LogitRows::kAll;
        it.mtp_rows[0] = 29;
        it.mtp_logits = true;
        it.sample = true;
        ASSERT_TRUE(e.step(std::span(&it, 1)).has_value());
        for (int r = 0; r < tp; ++r) {
            const std::vector<float> got = e.rank_logits(r);
            if (want.empty()) want = got;
            EXPECT_EQ(bit_mismatches(want, got), 0) << "tp " << tp << " rank " << r;
        }
    }
}

// A communicator that forwards to one rank of a group the test owns and counts the calls that reach it: what
// EngineOptions::make_comms hands the engine in place of its in-process group (NCCL's place on GPUs).
class CountingComm final : public parallel::Communicator {
public:
    CountingComm(parallel::Communicator &inner, int *calls) : inner_(inner), calls_(calls) {}
    int rank() const override { return inner_.rank(); }
    int size() const override { return inner_.size(); }
    Result<void> all_gather(std::span<const std::byte> s, std::span<std::byte> r) override {
        return counted(inner_.all_gather(s, r));
    }
    Result<void> broadcast(std::span<std::byte> b, int root) override { return counted(inner_.broadcast(b, root)); }
    Result<void> barrier() override { return counted(inner_.barrier()); }
    Result<void> send(std::span<const std::byte> b, int peer) override { return counted(inner_.send(b, peer)); }
    Result<void> recv(std::span<std::byte> b, int peer) override { return counted(inner_.recv(b, peer)); }
    Result<void> group_start() override { return counted(inner_.group_start()); }
    Result<void> group_end() override { return counted(inner_.group_end()); }

private:
    Result<void> counted(Result<void> r) {
        ++*calls_;
        return r;
    }
    parallel::Communicator &inner_;
    int *calls_;
};

// Communicators from make_comms carry the ranks' traffic (every call goes through them) and give the bits of
// the engine's own group; a factory that makes the wrong number of communicators, or one of the wrong rank or
// size, is refused; a factory that makes none leaves the in-process group in place.
TEST_P(EngineTest, CommunicatorsFromTheFactoryCarryTheRanksTraffic) {
    const std::vector<int32_t> prompt = make_tokens(12, 30, 1024);
    const auto prefill_logits = [&](const EngineOptions &o) {
        Loaded l = load(o);
        std::vector<float> logits;
        if (!l.engine) return logits;
        auto s = new_seq(*l.engine);
        s->tokens = prompt;
        StepItem it;
        it.seq = s.get();
        it.rows = 30;
        it.logits = LogitRows::kAll;
        if (!l.engine->step(std::span(&it, 1))) return logits;
        return l.engine->rank_logits(1);
    };
    EngineOptions o = options();
    o.tp = 2;
    const std::vector<float> want = prefill_logits(o);
    ASSERT_FALSE(want.empty());
    auto outer = parallel::InProcessGroup::create(2);
    ASSERT_TRUE(outer.has_value());
    int calls[2] = {0, 0};
    o.make_comms = [&](std::span<Backend *const> backends) -> Result<std::vector<std::unique_ptr<parallel::Communicator>>> {
        std::vector<std::unique_ptr<parallel::Communicator>> comms;
        for (size_t r = 0; r < backends.size(); ++r) {
            comms.push_back(std::make_unique<CountingComm>(outer->communicator(static_cast<int>(r)), &calls[r]));
        }
        return comms;
    };
    EXPECT_EQ(bit_mismatches(prefill_logits(o), want), 0);
    EXPECT_GT(calls[0], 0);
    EXPECT_EQ(calls[0], calls[1]);

    const auto refused = [](const CommFactory &make, const std::string &needle) {
        EngineOptions bad = options();
        bad.tp = 2;
        bad.make_comms = make;
        expect_refused(bad, needle);
    };
    refused(
        [&](std::span<Backend *const>) -> Result<std::vector<std::unique_ptr<parallel::Communicator>>> {
            std::vector<std::unique_ptr<parallel::Communicator>> one;
            one.push_back(std::make_unique<CountingComm>(outer->communicator(0), &calls[0]));
            return one;
        },
        "the communicator factory made 1 communicators for 2 ranks");
    refused(
        [&](std::span<Backend *const>) -> Result<std::vector<std::unique_ptr<parallel::Communicator>>> {
            std::vector<std::unique_ptr<parallel::Communicator>> swapped;
            swapped.push_back(std::make_unique<CountingComm>(outer->communicator(1), &calls[1]));
            swapped.push_back(std::make_unique<CountingComm>(outer->communicator(0), &calls[0]));
            return swapped;
        },
        "communicator 0 is rank 1 of 2, expected rank 0 of 2");
    refused([](std::span<Backend *const>) -> Result<std::vector<std::unique_ptr<parallel::Communicator>>> {
        return make_error("no GPUs for these ranks");
    }, "the ranks' communicators: no GPUs for these ranks");
    o.make_comms = [](std::span<Backend *const>) -> Result<std::vector<std::unique_ptr<parallel::Communicator>>> {
        return std::vector<std::unique_ptr<parallel::Communicator>>{};
    };
    EXPECT_EQ(bit_mismatches(prefill_logits(o), want), 0);
}

// A multi-process launch in one test process: an engine per rank, each running only its process_rank with a
// communicator of a group the test owns, each driven by its own thread as a process would drive it. Every engine
// plans the same steps; rank r's logits and sampled tokens equal those of the engine that runs every rank.
TEST_P(EngineTest, ProcessRankEnginesEqualTheInProcessRanks) {
    constexpr int kTp = 2;
    const std::vector<int32_t> prompt = make_tokens(14, 30, 1024);
    // Prefill with every row's logits, then 6 greedy decode steps: the logits of rank `rank` and the tokens.
    struct Trace {
        std::vector<float> logits;
        std::vector<int32_t> tokens;
    };
    const auto drive = [&](Engine &e, int rank, Trace &out) {
        auto s = new_seq(e);
        if (!s) return;
        s->tokens = prompt;
        StepItem it;
        it.seq = s.get();
        it.rows = static_cast<int64_t>(prompt.size());
        it.logits = LogitRows::kAll;
        it.sample = true;
        auto ok = e.step(std::span(&it, 1));
        ASSERT_TRUE(ok.has_value()) << ok.error().message;
        out.logits = e.rank_logits(rank);
        for (int i = 0; i < 6; ++i) {
            s->tokens.push_back(e.sampled(0).id);
            out.tokens.push_back(e.sampled(0).id);
            it.rows = 1;
            it.logits = LogitRows::kLast;
            ok = e.step(std::span(&it, 1));
            ASSERT_TRUE(ok.has_value()) << ok.error().message;
        }
    };
    EngineOptions o = options();
    o.tp = kTp;
    Trace want[kTp];
    {
        Loaded l = load(o);
        ASSERT_TRUE(l.engine);
        EXPECT_EQ(l.engine->local_ranks(), std::make_pair(0, kTp));
        for (int r = 0; r < kTp; ++r) drive(*l.engine, r, want[r]);
    }
    auto outer = parallel::InProcessGroup::create(kTp);
    ASSERT_TRUE(outer.has_value());
    int calls[kTp] = {};
    Loaded engines[kTp];
    for (int r = 0; r < kTp; ++r) {
        EngineOptions pr = o;
        pr.process_rank = r;
        pr.make_comms = [&, r](std::span<Backend *const> backends)
            -> Result<std::vector<std::unique_ptr<parallel::Communicator>>> {
            EXPECT_EQ(backends.size(), 1u);
            std::vector<std::unique_ptr<parallel::Communicator>> comms;
            comms.push_back(std::make_unique<CountingComm>(outer->communicator(r), &calls[r]));
            return comms;
        };
        engines[r] = load(pr);
        ASSERT_TRUE(engines[r].engine);
        EXPECT_EQ(engines[r].engine->local_ranks(), std::make_pair(r, 1));
    }
    Trace got[kTp];
    {
        std::vector<std::thread> processes;
        for (int r = 0; r < kTp; ++r) processes.emplace_back([&, r] { drive(*engines[r].engine, r, got[r]); });
        for (std::thread &t : processes) t.join();
    }
    for (int r = 0; r < kTp; ++r) {
        EXPECT_EQ(bit_mismatches(got[r].logits, want[r].logits), 0) << "rank " << r;
        EXPECT_EQ(got[r].tokens, want[0].tokens) << "rank " << r;
        EXPECT_GT(calls[r], 0) << "rank " << r;
    }
    EXPECT_EQ(calls[0], calls[1]);

    // Refused: a rank outside tp, a process rank at tp = 1, no factory, a factory that makes no communicator.
    EngineOptions bad = o;
    bad.process_rank = kTp;
    expect_refused(bad, "process rank 2 of tp=2");
    bad = options();
    bad.process_rank = 0;
    expect_refused(bad, "process rank 0 of tp=1");
    bad = o;
    bad.process_rank = 1;
    expect_refused(bad, "a communicator factory that reaches the other processes");
    bad.make_comms = [](std::span<Backend *const>) -> Result<std::vector<std::unique_ptr<parallel::Communicator>>> {
        return std::vector<std::unique_ptr<parallel::Communicator>>{};
    };
    expect_refused(bad, "the communicator factory made 0 communicators for 1 ranks");
}

INSTANTIATE_TEST_SUITE_P(Dtypes, EngineTest, ::testing::Values("bf16", "fp8"));

}  // namespace
}  // namespace memra::runtime
