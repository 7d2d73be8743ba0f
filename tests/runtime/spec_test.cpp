// MTP-3 speculative decoding (runtime::decode with drafts, ENGINE.md 1, SERVING.md 2.5) against decoding without
// drafts, D8 in raw bits: every emitted token, the logit row behind it and the final trunk KV bytes are equal —
// greedy and seeded sampling (top-p, penalties), drafts as the MTP layers make them and drafts forced so that
// exactly 0, 1, 2 or 3 are accepted (a backend that replaces them before they feed the trunk), across sliding
// window and page edges, up to the context limit, at TP 1, 2 and 4 (experts expert-parallel on CPU ranks), with
// abandoned draft steps in between. The MTP layers' rows after a run equal a fresh teacher-forced pass over the
// committed tokens. Refusals change nothing.
#include <unistd.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/forced_draft_backend.h"
#include "io/safetensors.h"
#include "model/step35_config.h"
#include "runtime/engine.h"

#include "model/model_test_util.h"
#include "runtime/kv_contents.h"
#include "make_tiny/make_tiny.h"

namespace memra::runtime {
namespace {

namespace fs = std::filesystem;


using cpu::ForcedDraftBackend;

struct Model {
    std::unique_ptr<io::Checkpoint> ckpt;
    model::Step35Config cfg;
};

Model open_model(const fs::path &dir) {
    Model m;
    auto cfg = model::load_step35_config(dir);
    EXPECT_TRUE(cfg.has_value()) << cfg.error().message;
    if (cfg) m.cfg = *cfg;
    auto ckpt = io::Checkpoint::open(dir);
    EXPECT_TRUE(ckpt.has_value()) << ckpt.error().message;
    if (ckpt) m.ckpt = std::make_unique<io::Checkpoint>(std::move(*ckpt));
    return m;
}

// An engine's options for these tests: one CPU thread per rank, each rank's drafts forced by `forcing`.
EngineOptions spec_options(int64_t ctx, int mtp_layers, int spec_draft, DraftForcing &forcing) {
    EngineOptions o;
    o.ctx_size = ctx;
    o.step_rows = 64;
    o.mtp_layers = mtp_layers;
    o.spec_draft = spec_draft;
    o.make_backend = [&forcing](int) -> Result<std::unique_ptr<Backend>> {
        return std::unique_ptr<Backend>(std::make_unique<ForcedDraftBackend>(1, Numerics::kDevice, &forcing));
    };
    return o;
}

struct RunSpec {
    int tp = 1;
    int draft = 0;  // 0: no MTP layers at all (the reference)
    KvFormat kv = KvFormat::kBf16;
    int64_t ctx = 0;
    int64_t step_rows = 64;
    SamplingParams sampling;
    std::vector<LogitBias> bias;  // the sequence's logit bias
    // The drafts to force at a step: the sequence's tokens so far (the last one pending) -> ids (-1: leave).
    std::function<std::array<int32_t, 3>(const std::vector<int32_t> &, uint64_t)> force;
    bool abandon_some = false;  // plan + run + abandon a drafting step before every 5th step
};

// What a run produced.
struct Trace {
    std::vector<int32_t> tokens;            // prompt + generated
    std::vector<std::vector<float>> logits;  // the logit row behind each token a decode step emitted
    std::vector<std::byte> trunk_kv;
    std::vector<int64_t> drafted, accepted;  // per decode step
    std::unique_ptr<Engine> engine;
    std::unique_ptr<Sequence> seq;
};

// Prefills `prompt`, then decodes until the context is full (every position used but the last token's).
Trace generate(const Model &m, const RunSpec &rs, const std::vector<int32_t> &prompt, DraftForcing &forcing) {
    Trace t;
    EngineOptions o = spec_options(rs.ctx, rs.draft > 0 ? m.cfg.n_mtp_layers : 0, rs.draft, forcing);
    o.tp = rs.tp;
    o.k_format = o.v_format = rs.kv;
    o.step_rows = rs.step_rows;
    auto engine = Engine::create(*m.ckpt, m.cfg, o);
    EXPECT_TRUE(engine.has_value()) << engine.error().message;
    if (!engine) return t;
    t.engine = std::move(*engine);
    Engine &e = *t.engine;
    SequenceOptions so;
    so.mtp_streams = o.mtp_layers;
    so.sampling = rs.sampling;
    so.logit_bias = rs.bias;
    auto seq = e.create_sequence(so);
    EXPECT_TRUE(seq.has_value()) << seq.error().message;
    if (!seq) return t;
    t.seq = std::move(*seq);
    Sequence &s = *t.seq;
    s.tokens = prompt;
    s.tokens.reserve(static_cast<size_t>(rs.ctx) + 4);
    auto first = feed(e, s);
    EXPECT_TRUE(first.has_value()) << first.error().message;
    if (!first) return t;
    s.tokens.push_back(*first);
    const auto vocab = static_cast<size_t>(m.cfg.vocab_size);
    for (uint64_t step = 0; s.length(0) + 1 < e.max_positions(); ++step) {
        forcing.step = 2 * step;
        forcing.ids = rs.force ? rs.force(s.tokens, step) : std::array<int32_t, 3>{-1, -1, -1};
        if (rs.abandon_some && step % 5 == 0 && rs.draft > 0) {
            // A drafting step that never finishes: its carried rows and KV writes must leave no trace.
            StepItem it;
            it.seq = &s;
            it.rows = 1;
            it.sample = true;
            it.draft = static_cast<int>(std::min<int64_t>(rs.draft, e.max_positions() - 1 - s.length(0)));
            if (it.draft > 0) {
                auto ok = e.plan(std::span(&it, 1));
                EXPECT_TRUE(ok.has_value()) << ok.error().message;
                if (ok) {
                    e.run();
                    e.abandon();
                }
            }
            forcing.step = 2 * step + 1;
        }
        DecodeOptions d;
        d.draft = rs.draft;
        d.max_new = e.max_positions() - static_cast<int64_t>(s.tokens.size());  // tokens to fill the context
        d.return_logits = true;
        auto r = decode(e, s, d);
        EXPECT_TRUE(r.has_value()) << r.error().message;
        if (!r) return t;
        const auto lg = e.logits(0);
        for (int64_t j = 0; j < r->emitted; ++j) {
            t.logits.emplace_back(lg.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(j) * vocab),
                                  lg.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(j + 1) * vocab));
        }
        t.drafted.push_back(r->drafted);
        t.accepted.push_back(r->accepted);
    }
    t.tokens = s.tokens;
    t.trunk_kv = kv_contents(e, s, 1);
    auto pages = e.check_pages();
    EXPECT_TRUE(pages.has_value()) << pages.error().message;
    return t;
}

// Every position's logit row, token and (with kv) the trunk's KV bytes equal; returns the accepted drafts in total.
int64_t expect_same(const Trace &ref, const Trace &spec, const std::string &what, bool kv = true) {
    EXPECT_EQ(ref.tokens, spec.tokens) << what;
    EXPECT_EQ(ref.logits.size(), spec.logits.size()) << what;
    int64_t rows_differing = 0;
    for (size_t i = 0; i < std::min(ref.logits.size(), spec.logits.size()); ++i) {
        rows_differing += model::bit_mismatches(ref.logits[i], spec.logits[i]) != 0 ? 1 : 0;
    }
    EXPECT_EQ(rows_differing, 0) << what << ": logit rows with differing bits";
    if (kv) {
        EXPECT_TRUE(ref.trunk_kv == spec.trunk_kv) << what << ": trunk KV bytes differ";
    }
    int64_t accepted = 0;
    for (const int64_t a : spec.accepted) accepted += a;
    return accepted;
}

// Forces exactly n_accept accepted drafts at every step (ref: the tokens the model samples).
std::function<std::array<int32_t, 3>(const std::vector<int32_t> &, uint64_t)> accept_exactly(
    const std::vector<int32_t> &ref, int n_accept, int32_t vocab) {
    return [&ref, n_accept, vocab](const std::vector<int32_t> &tokens, uint64_t) {
        return drafts_accepting(ref, tokens.size(), n_accept, vocab);
    };
}

// A different forced acceptance count at every step (0 .. 3, and the MTP layers' own drafts).
std::function<std::array<int32_t, 3>(const std::vector<int32_t> &, uint64_t)> mixed(const std::vector<int32_t> &ref,
                                                                                    int32_t vocab) {
    return [&ref, vocab](const std::vector<int32_t> &tokens, uint64_t step) {
        const int pattern = static_cast<int>((step * 7 + 3) % 5);
        if (pattern == 4) return std::array<int32_t, 3>{-1, -1, -1};
        return accept_exactly(ref, pattern, vocab)(tokens, step);
    };
}

SamplingParams sampling(float temperature, float top_p, float repeat = 1.0f) {
    SamplingParams p;
    p.temperature = temperature;
    p.top_k = 0;
    p.top_p = top_p;
    p.min_p = 0.0f;
    p.repetition_penalty = repeat;
    p.seed = 1234;
    return p;
}

fs::path default_model() { return fs::path(MEMRA_SOURCE_DIR) / "models" / "default"; }

// The sanitizer build (unoptimized, instrumented: tens of times slower) runs a subset of each matrix, shorter;
// the release build runs all of it.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

// The trained default model: its MTP layers draft real text, so acceptance is real.
TEST(Speculation, DefaultModelEqualsNoDraftsForEveryAcceptancePattern) {
    const Model m = open_model(default_model());
    ASSERT_TRUE(m.ckpt);
    ASSERT_EQ(m.cfg.n_mtp_layers, 3);
    // 30 prompt tokens; 212 positions: past the 192-row window and three 64-row pages.
    const std::vector<int32_t> prompt = model::make_tokens(5, 30, 1000);
    // Patterns: -2 the MTP layers' own drafts, -1 mixed (with abandoned steps), 0 .. 3 exactly that many accepted.
    struct Case {
        std::string name;
        SamplingParams sp;
        std::vector<int> patterns;
    };
    std::vector<Case> cases = {
        {"greedy", sampling(0.0f, 1.0f), {-2, -1, 0, 1, 2, 3}},
        {"T0.7 top-p 0.9", sampling(0.7f, 0.9f), {-2, -1, 1, 3}},
        {"T1.0 top-p 0.95 repeat 1.1", sampling(1.0f, 0.95f, 1.1f), {-2, -1, 2}},
    };
    if (kSanitized) cases = {{"T1.0 top-p 0.95 repeat 1.1", sampling(1.0f, 0.95f, 1.1f), {-1}}};
    DraftForcing forcing;
    for (const auto &[name, sp, patterns] : cases) {
        RunSpec base;
        base.ctx = kSanitized ? 90 : 212;
        base.sampling = sp;
        const Trace ref = generate(m, base, prompt, forcing);
        ASSERT_EQ(static_cast<int64_t>(ref.tokens.size()), base.ctx) << name;
        const int32_t vocab = m.cfg.vocab_size;
        for (const int pattern : patterns) {
            RunSpec rs = base;
            rs.draft = 3;
            std::string what = fmt::format("{}, drafts as drafted", name);
            if (pattern >= 0) {
                rs.force = accept_exactly(ref.tokens, pattern, vocab);
                what = fmt::format("{}, {} accepted", name, pattern);
            } else if (pattern == -1) {
                rs.force = mixed(ref.tokens, vocab);
                rs.abandon_some = true;
                what = fmt::format("{}, mixed with abandoned steps", name);
            }
            const Trace spec = generate(m, rs, prompt, forcing);
            const int64_t accepted = expect_same(ref, spec, what);
            for (size_t i = 0; i < spec.accepted.size() && pattern >= 0; ++i) {
                ASSERT_EQ(spec.accepted[i], std::min<int64_t>(pattern, spec.drafted[i])) << what << " step " << i;
            }
            if (pattern == -2 && sp.temperature == 0.0f) {
                // Real drafts on real text: most steps accept some.
                EXPECT_GT(accepted, static_cast<int64_t>(spec.accepted.size()) / 2) << what;
            }
        }
    }
}

// The MTP layers' committed rows are the teacher-forced rows of the committed tokens: a fresh engine feeding the
// run's tokens (chunked, the MTP layers following) holds the same bytes.
TEST(Speculation, MtpRowsEqualATeacherForcedPass) {
    const Model m = open_model(default_model());
    ASSERT_TRUE(m.ckpt);
    DraftForcing forcing;
    RunSpec rs;
    rs.ctx = kSanitized ? 100 : 300;
    rs.draft = 3;
    rs.kv = KvFormat::kQ8_0;
    rs.sampling = sampling(0.7f, 0.9f);
    const Trace spec = generate(m, rs, model::make_tokens(6, 20, 1000), forcing);
    ASSERT_TRUE(spec.seq);

    EngineOptions o = spec_options(rs.ctx, 3, 0, forcing);
    o.k_format = o.v_format = rs.kv;
    o.step_rows = 48;  // chunks that cut the window anywhere
    auto tf = Engine::create(*m.ckpt, m.cfg, o);
    ASSERT_TRUE(tf.has_value()) << tf.error().message;
    SequenceOptions so;
    so.mtp_streams = 3;
    auto s = (*tf)->create_sequence(so);
    ASSERT_TRUE(s.has_value());
    (*s)->tokens = spec.tokens;
    (*s)->tokens.pop_back();  // the pending token: the run's trunk never saw it
    ASSERT_TRUE(feed(**tf, **s).has_value());
    std::vector<std::byte> k0, v0, k1, v1;
    int64_t compared = 0;
    for (int layer = m.cfg.n_layers; layer < m.cfg.n_layers + 3; ++layer) {
        const int stream = 1 + layer - m.cfg.n_layers;
        const int64_t end = std::min(spec.seq->length(stream), (*s)->length(stream));
        EXPECT_GE(end, rs.ctx - 6) << "MTP layer " << stream - 1 << " lags";
        for (int64_t p = std::max(spec.seq->kv().first(stream), end - 150); p < end; ++p) {
            if (!spec.seq->kv().has_page(kv::PoolKind::kSwa, p) || !(*s)->kv().has_page(kv::PoolKind::kSwa, p)) continue;
            ASSERT_TRUE(spec.engine->kv_row(0, *spec.seq, layer, p, k0, v0).has_value());
            ASSERT_TRUE((*tf)->kv_row(0, **s, layer, p, k1, v1).has_value());
            ASSERT_TRUE(k0 == k1 && v0 == v1) << "MTP layer " << stream - 1 << " position " << p;
            ++compared;
        }
    }
    EXPECT_GT(compared, kSanitized ? 150 : 300);
}

// TP 2 and 4 with experts expert-parallel on CPU ranks: a random tiny checkpoint with three MTP layers and a
// window of three pages, drafts forced to every acceptance count.
TEST(Speculation, TensorParallelRanksEqualNoDrafts) {
    const fs::path dir = fs::temp_directory_path() / fmt::format("memra_spec_test_{}", ::getpid());
    tools::TinyOptions to;
    to.out_dir = dir;
    to.seed = 11;
    to.sliding_window = 192;
    to.mtp_layers = 3;
    to.force = true;
    ASSERT_TRUE(tools::make_tiny_checkpoint(to).has_value());
    {
        const Model m = open_model(dir);
        ASSERT_TRUE(m.ckpt);
        const std::vector<int32_t> prompt = model::make_tokens(8, 70, 1000);
        DraftForcing forcing;
        RunSpec base;
        base.ctx = kSanitized ? 100 : 210;
        base.kv = KvFormat::kQ8_0;
        base.sampling = sampling(0.7f, 0.9f);
        const Trace ref = generate(m, base, prompt, forcing);
        for (const int tp : kSanitized ? std::vector<int>{2} : std::vector<int>{2, 4}) {
            // A rank holds its KV heads: the KV bytes compare with the same ranks without drafts, the tokens
            // and logits with TP 1 too.
            RunSpec rs = base;
            rs.tp = tp;
            const Trace ref_tp = generate(m, rs, prompt, forcing);
            EXPECT_EQ(ref.tokens, ref_tp.tokens) << "TP " << tp;
            rs.draft = 3;
            rs.force = mixed(ref.tokens, m.cfg.vocab_size);
            rs.abandon_some = tp == 2;
            const Trace spec = generate(m, rs, prompt, forcing);
            expect_same(ref_tp, spec, fmt::format("TP {}", tp));
            expect_same(ref, spec, fmt::format("TP {} against TP 1", tp), false);
        }
    }
    std::error_code ec;
    fs::remove_all(dir, ec);
}

// Sequences drafting together in one step (and one of them not drafting) decode what each decodes alone.
TEST(Speculation, DraftingSequencesInOneStepEqualEachAlone) {
    const Model m = open_model(default_model());
    ASSERT_TRUE(m.ckpt);
    const std::vector<std::vector<int32_t>> prompts = {model::make_tokens(21, 12, 1000),
                                                       model::make_tokens(22, 30, 1000),
                                                       model::make_tokens(23, 5, 1000)};
    const std::vector<SamplingParams> samplings = {sampling(0.0f, 1.0f), sampling(0.7f, 0.9f, 1.1f),
                                                   sampling(1.0f, 1.0f)};
    const std::vector<int> drafts = {3, 2, 0};
    constexpr int64_t kNew = kSanitized ? 24 : 60;
    DraftForcing forcing;
    std::vector<std::vector<int32_t>> alone;
    for (size_t i = 0; i < prompts.size(); ++i) {
        RunSpec rs;
        rs.ctx = static_cast<int64_t>(prompts[i].size()) + kNew;
        rs.draft = drafts[i];
        rs.sampling = samplings[i];
        alone.push_back(generate(m, rs, prompts[i], forcing).tokens);
    }
    EngineOptions o = spec_options(512, 3, 3, forcing);  // nothing forced: the MTP layers' own drafts
    o.max_seqs = 4;
    auto e = Engine::create(*m.ckpt, m.cfg, o);
    ASSERT_TRUE(e.has_value()) << e.error().message;
    std::vector<std::unique_ptr<Sequence>> seqs;
    for (size_t i = 0; i < prompts.size(); ++i) {
        SequenceOptions so;
        so.mtp_streams = 3;
        so.sampling = samplings[i];
        auto s = (*e)->create_sequence(so);
        ASSERT_TRUE(s.has_value()) << s.error().message;
        (*s)->tokens = prompts[i];
        auto first = feed(**e, **s);
        ASSERT_TRUE(first.has_value()) << first.error().message;
        (*s)->tokens.push_back(*first);
        seqs.push_back(std::move(*s));
    }
    int64_t accepted = 0;
    while (true) {
        std::vector<StepItem> items;
        std::vector<size_t> which;
        for (size_t i = 0; i < seqs.size(); ++i) {
            Sequence &s = *seqs[i];
            const int64_t left = static_cast<int64_t>(prompts[i].size()) + kNew - static_cast<int64_t>(s.tokens.size());
            if (left <= 0) continue;
            StepItem it;
            it.seq = &s;
            it.rows = 1;
            it.sample = true;
            it.mtp_follow = true;
            it.draft = static_cast<int>(std::min<int64_t>(drafts[i], left - 1));
            items.push_back(it);
            which.push_back(i);
        }
        if (items.empty()) break;
        ASSERT_TRUE((*e)->plan(items).has_value());
        (*e)->run();
        ASSERT_TRUE((*e)->collect().has_value());
        std::vector<std::vector<int32_t>> emitted(items.size());
        for (size_t j = 0; j < items.size(); ++j) {
            accepted += (*e)->accepted(j);
            for (int64_t t = 0; t <= (*e)->accepted(j); ++t) emitted[j].push_back((*e)->sampled(j, t).id);
        }
        ASSERT_TRUE((*e)->finish().has_value());
        for (size_t j = 0; j < items.size(); ++j) {
            std::vector<int32_t> &tokens = seqs[which[j]]->tokens;
            tokens.insert(tokens.end(), emitted[j].begin(), emitted[j].end());
        }
    }
    for (size_t i = 0; i < seqs.size(); ++i) EXPECT_EQ(seqs[i]->tokens, alone[i]) << "sequence " << i;
    EXPECT_GT(accepted, kSanitized ? 3 : 10);
    EXPECT_TRUE((*e)->check_pages().has_value());
}

// The drafts are sampled with the sequence's logit bias: a forced token is drafted and accepted at every step
// (drafts without the bias would be the MTP layers' own guesses), and with any bias the emitted tokens and logit
// rows equal decoding without drafts.
TEST(Speculation, DraftsUseTheSequencesLogitBias) {
    const Model m = open_model(default_model());
    ASSERT_TRUE(m.ckpt);
    const std::vector<int32_t> prompt = model::make_tokens(31, 20, 1000);
    struct Case {
        std::string name;
        SamplingParams sp;
        std::vector<LogitBias> bias;
        bool forced;
    };
    const std::vector<Case> cases = {
        {"greedy, forced", sampling(0.0f, 1.0f), {{517, 100.0f}}, true},
        {"T0.7, forced", sampling(0.7f, 0.9f), {{3, -100.0f}, {517, 100.0f}}, true},
        {"T0.8, nudged", sampling(0.8f, 0.95f, 1.1f), {{10, 2.5f}, {32, -3.0f}, {101, 1.5f}, {640, 4.0f}}, false},
    };
    DraftForcing forcing;
    for (const Case &c : cases) {
        RunSpec base;
        base.ctx = kSanitized ? 44 : 64;
        base.sampling = c.sp;
        base.bias = c.bias;
        const Trace ref = generate(m, base, prompt, forcing);
        RunSpec rs = base;
        rs.draft = 3;
        const Trace spec = generate(m, rs, prompt, forcing);
        expect_same(ref, spec, c.name);
        if (!c.forced) continue;
        for (size_t k = prompt.size(); k < ref.tokens.size(); ++k) EXPECT_EQ(ref.tokens[k], 517) << c.name;
        for (size_t i = 0; i < spec.accepted.size(); ++i) {
            EXPECT_EQ(spec.accepted[i], spec.drafted[i]) << c.name << " step " << i;
        }
    }
}

// Refusals leave the sequence and the pools as they were; a drafting item keeps no unconfirmed row.
TEST(Speculation, RefusalsChangeNothing) {
    const Model m = open_model(default_model());
    ASSERT_TRUE(m.ckpt);
    DraftForcing forcing;
    EngineOptions o = spec_options(256, 3, 2, forcing);
    o.max_seqs = 2;
    // The drafting step's budget: MTP layer 1 runs up to 3 catch-up rows and 1 draft row.
    EngineOptions small = o;
    small.step_rows = 3;
    auto refused_engine = Engine::create(*m.ckpt, m.cfg, small);
    ASSERT_FALSE(refused_engine.has_value());
    EXPECT_NE(refused_engine.error().message.find("2 drafts per step need a step budget of at least 4 rows, found 3"),
              std::string::npos)
        << refused_engine.error().message;
    auto e = Engine::create(*m.ckpt, m.cfg, o);
    ASSERT_TRUE(e.has_value()) << e.error().message;
    Engine &eng = **e;
    SequenceOptions so;
    so.mtp_streams = 3;
    so.sampling = sampling(0.0f, 1.0f);
    auto s = eng.create_sequence(so);
    ASSERT_TRUE(s.has_value());
    Sequence &seq = **s;
    seq.tokens = model::make_tokens(9, 20, 1000);

    const auto refused = [&](std::vector<StepItem> items, const std::string &needle) {
        const int64_t len[4] = {seq.length(0), seq.length(1), seq.length(2), seq.length(3)};
        const auto carried = seq.carried(0);
        const int32_t free_swa = eng.page_pool(kv::PoolKind::kSwa).n_free();
        auto r = eng.plan(items);
        ASSERT_FALSE(r.has_value()) << needle;
        EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
        for (int st = 0; st < 4; ++st) EXPECT_EQ(seq.length(st), len[st]) << needle;
        EXPECT_EQ(seq.carried(0), carried) << needle;
        EXPECT_EQ(eng.page_pool(kv::PoolKind::kSwa).n_free(), free_swa);
    };
    StepItem it;
    it.seq = &seq;
    it.rows = 1;
    it.sample = true;
    it.draft = 1;
    refused({it}, "drafting needs one pending token");  // 20 pending
    ASSERT_TRUE(feed(eng, seq).has_value());
    seq.tokens.push_back(7);
    it.draft = 3;
    refused({it}, "3 drafts, expected 1 .. 2");
    it.draft = 1;
    it.mtp_logits = true;
    refused({it}, "computes no MTP logit rows");
    it.mtp_logits = false;
    StepItem explicit_rows = it;
    explicit_rows.draft = 0;
    explicit_rows.mtp_follow = true;
    explicit_rows.mtp_rows[0] = 1;
    refused({explicit_rows}, "mtp_follow sets the MTP rows itself");
    // A prefill chunk whose MTP layers follow cannot share a drafting step: they run before its trunk rows,
    // and would be left behind for good.
    SequenceOptions other = so;
    auto t = eng.create_sequence(other);
    ASSERT_TRUE(t.has_value());
    (*t)->tokens = model::make_tokens(10, 30, 1000);
    StepItem prefill;
    prefill.seq = t->get();
    prefill.rows = 30;
    prefill.mtp_follow = true;
    prefill.logits = LogitRows::kNone;
    refused({it, prefill}, "MTP layer 0 would be left behind for good");

    // Drafts forced wrong: none stands. Keeping a trunk row past them, or an MTP draft row, is refused and
    // rolls the step back.
    forcing.ids = {5, 5, 5};
    it.draft = 2;
    const auto run_step = [&] {
        ++forcing.step;
        ASSERT_TRUE(eng.plan(std::span(&it, 1)).has_value());
        eng.run();
        ASSERT_TRUE(eng.collect().has_value());
    };
    run_step();
    if (eng.accepted(0) > 0) {  // 5 is the model's token at that position: 6 is not
        eng.abandon();
        forcing.ids = {6, 6, 6};
        run_step();
    }
    EXPECT_EQ(eng.accepted(0), 0);
    Keep keep;
    keep.rows[0] = 2;
    auto r = eng.finish(std::span(&keep, 1));
    ASSERT_FALSE(r.has_value());
    EXPECT_NE(r.error().message.find("past the 1 whose tokens the drafts' acceptance confirms (1 + 0 accepted)"),
              std::string::npos)
        << r.error().message;
    EXPECT_EQ(seq.length(0), 20);
    run_step();
    Keep mtp_keep;
    mtp_keep.rows[2] = 2;  // MTP layer 1's catch-up row and its draft row
    r = eng.finish(std::span(&mtp_keep, 1));
    ASSERT_FALSE(r.has_value());
    EXPECT_NE(r.error().message.find("draft rows are never kept"), std::string::npos) << r.error().message;
    EXPECT_EQ(seq.length(0), 20);
    // Keeping no trunk row: MTP layer 0 has then drafted from its last row already; the next decode step
    // decodes without drafts, the one after drafts again.
    run_step();
    Keep none;
    none.rows[0] = 0;
    ASSERT_TRUE(eng.finish(std::span(&none, 1)).has_value());
    EXPECT_EQ(seq.length(0), 20);
    forcing.ids = {-1, -1, -1};
    DecodeOptions d;
    d.draft = 2;
    d.max_new = 10;
    auto first = decode(eng, seq, d);
    ASSERT_TRUE(first.has_value()) << first.error().message;
    EXPECT_EQ(first->drafted, 0);
    auto second = decode(eng, seq, d);
    ASSERT_TRUE(second.has_value()) << second.error().message;
    EXPECT_EQ(second->drafted, 2);
    EXPECT_TRUE(eng.check_pages().has_value());
}

// A stop id ends the step's tokens where a step without drafts would stop, and the cache holds what it holds.
TEST(Speculation, StopIdCutsTheDraftsWhereDecodingWithoutThemStops) {
    const Model m = open_model(default_model());
    ASSERT_TRUE(m.ckpt);
    DraftForcing forcing;
    const std::vector<int32_t> prompt = model::make_tokens(31, 16, 1000);
    RunSpec base;
    base.ctx = 80;
    base.sampling = sampling(0.0f, 1.0f);
    const Trace ref = generate(m, base, prompt, forcing);
    ASSERT_EQ(ref.tokens.size(), 80u);
    for (const size_t stop_at : {size_t{30}, size_t{47}, size_t{61}}) {
        const int64_t stop = ref.tokens[stop_at];
        // Where a decode loop without drafts stops: the first occurrence after the prompt's first sample.
        size_t first = prompt.size() + 1;
        while (ref.tokens[first] != stop) ++first;
        for (const int accept : {-1, 3}) {
            auto e = Engine::create(*m.ckpt, m.cfg, spec_options(base.ctx, 3, 3, forcing));
            ASSERT_TRUE(e.has_value());
            SequenceOptions so;
            so.mtp_streams = 3;
            so.sampling = base.sampling;
            auto s = (*e)->create_sequence(so);
            ASSERT_TRUE(s.has_value());
            Sequence &seq = **s;
            seq.tokens = prompt;
            auto f = feed(**e, seq);
            ASSERT_TRUE(f.has_value());
            seq.tokens.push_back(*f);
            const std::vector<int64_t> stops = {stop};
            while (seq.tokens.back() != stop || seq.tokens.size() == prompt.size() + 1) {
                ++forcing.step;
                forcing.ids = accept < 0 ? std::array<int32_t, 3>{-1, -1, -1}
                                         : drafts_accepting(ref.tokens, seq.tokens.size(), accept, m.cfg.vocab_size);
                DecodeOptions d;
                d.draft = 3;
                d.max_new = 64;
                d.stop_ids = stops;
                auto r = decode(**e, seq, d);
                ASSERT_TRUE(r.has_value()) << r.error().message;
            }
            ASSERT_EQ(seq.tokens.size(), first + 1) << "stop at " << stop_at;
            EXPECT_TRUE(std::equal(seq.tokens.begin(), seq.tokens.end(), ref.tokens.begin()));
            EXPECT_EQ(seq.length(0), static_cast<int64_t>(first));  // the stop token is not fed
            // The trunk rows equal the reference's rows at the same positions.
            std::vector<std::byte> k0, v0, k1, v1;
            for (int64_t p = 0; p < seq.length(0); ++p) {
                ASSERT_TRUE((*e)->kv_row(0, seq, 0, p, k0, v0).has_value());
                ASSERT_TRUE(ref.engine->kv_row(0, *ref.seq, 0, p, k1, v1).has_value());
                ASSERT_TRUE(k0 == k1 && v0 == v1) << "position " << p;
            }
        }
    }
}

}  // namespace
}  // namespace memra::runtime
