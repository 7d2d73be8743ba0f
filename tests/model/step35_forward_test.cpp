// The Step-3.5 forward on the tiny checkpoint (bf16 and fp8) through the CPU backend: run-to-run
// determinism (D1), thread invariance (D5), batch invariance over batch size and slot (D2), chunked prefill
// == one-shot prefill == token-by-token decode (rule 9), partial commits, MTP, refusals, and the per-step
// launch / host-copy counts. Every comparison is on raw logit bits.

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "io/safetensors.h"
#include "kv/kv_cache.h"
#include "model/step35_config.h"
#include "model/step35_forward.h"
#include "model/step35_model.h"

#include "model/model_test_util.h"
#include "model/tiny_dirs.h"

namespace memra::model {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kContext = 128;

// One loaded model on one CPU backend with a forward. Not movable: the forward points into it.
struct Engine {
    std::unique_ptr<cpu::CpuBackend> backend;
    std::optional<io::Checkpoint> ckpt;
    Step35Config cfg;
    Step35Model model;
    std::optional<Step35Forward> fwd;
};

class ForwardTest : public ::testing::TestWithParam<const char *> {
protected:
    static void SetUpTestSuite() { dirs_ = new TinyDirs("forward_test", 7, 7); }
    static void TearDownTestSuite() {
        delete dirs_;
        dirs_ = nullptr;
    }

    static fs::path dir() { return dirs_->at(GetParam()); }

    static std::unique_ptr<Engine> make_engine(int threads, ForwardCapacity cap = {64, 4, kContext, 0}) {
        auto e = std::make_unique<Engine>();
        e->backend = std::make_unique<cpu::CpuBackend>(threads);
        auto cfg = load_step35_config(dir());
        EXPECT_TRUE(cfg.has_value()) << cfg.error().message;
        e->cfg = *cfg;
        auto ckpt = io::Checkpoint::open(dir());
        EXPECT_TRUE(ckpt.has_value()) << ckpt.error().message;
        e->ckpt.emplace(std::move(*ckpt));
        auto model = bind_step35_model(*e->backend, *e->ckpt, e->cfg);
        EXPECT_TRUE(model.has_value()) << model.error().message;
        e->model = std::move(*model);
        auto fwd = Step35Forward::create(*e->backend, e->model, cap);
        EXPECT_TRUE(fwd.has_value()) << fwd.error().message;
        e->fwd.emplace(std::move(*fwd));
        return e;
    }

    static kv::KvCache make_cache(const Engine &e, kv::KvFormat fmt = kv::KvFormat::kF32, int max_stage = 64) {
        auto c = kv::KvCache::create(trunk_kv_spec(e.cfg, fmt, fmt, kContext, max_stage));
        EXPECT_TRUE(c.has_value()) << c.error().message;
        return std::move(*c);
    }

    // Runs one sequence through the given chunk sizes with every position's logits; returns them all.
    static std::vector<float> run_chunked(Engine &e, const std::vector<int32_t> &tokens,
                                          const std::vector<size_t> &chunks, kv::KvFormat fmt = kv::KvFormat::kF32) {
        kv::KvCache cache = make_cache(e, fmt);
        std::vector<float> out;
        size_t at = 0;
        size_t i = 0;
        while (at < tokens.size()) {
            const size_t n = std::min(chunks[i % chunks.size()], tokens.size() - at);
            ++i;
            const SeqChunk chunk{&cache, std::span(tokens).subspan(at, n), true, -1};
            auto r = e.fwd->step(std::span(&chunk, 1));
            EXPECT_TRUE(r.has_value()) << r.error().message;
            if (!r) return {};
            out.insert(out.end(), e.fwd->logits().begin(), e.fwd->logits().end());
            at += n;
        }
        EXPECT_EQ(cache.length(), static_cast<int64_t>(tokens.size()));
        return out;
    }

    static TinyDirs *dirs_;
};

TinyDirs *ForwardTest::dirs_ = nullptr;

TEST_P(ForwardTest, LogitsAreFiniteWithSpread) {
    auto e = make_engine(2);
    const auto tokens = make_tokens(1, 40, e->cfg.vocab_size);  // longer than the sliding window (16)
    const std::vector<float> logits = run_chunked(*e, tokens, {40});
    ASSERT_EQ(logits.size(), tokens.size() * static_cast<size_t>(e->cfg.vocab_size));
    double sum = 0.0, sum2 = 0.0;
    float lo = logits[0], hi = logits[0];
    for (float v : logits) {
        ASSERT_TRUE(std::isfinite(v));
        sum += v;
        sum2 += double(v) * v;
        lo = std::min(lo, v);
        hi = std::max(hi, v);
    }
    const double mean = sum / double(logits.size());
    const double stddev = std::sqrt(sum2 / double(logits.size()) - mean * mean);
    EXPECT_GT(stddev, 0.05) << "mean " << mean;
    EXPECT_LT(stddev, 100.0);
    EXPECT_GT(hi - lo, 0.5f);
    // Different positions give different distributions.
    const size_t V = static_cast<size_t>(e->cfg.vocab_size);
    EXPECT_NE(0, std::memcmp(logits.data(), logits.data() + V, V * sizeof(float)));
}

TEST_P(ForwardTest, RunToRunAndAcrossEngines) {
    auto e1 = make_engine(2);
    auto e2 = make_engine(2);
    const auto tokens = make_tokens(2, 30, e1->cfg.vocab_size);
    const auto a = run_chunked(*e1, tokens, {30});
    const auto b = run_chunked(*e1, tokens, {30});
    const auto c = run_chunked(*e2, tokens, {30});
    ASSERT_FALSE(a.empty());
    EXPECT_EQ(0, bit_mismatches(a, b));
    EXPECT_EQ(0, bit_mismatches(a, c));
    // The comparison can fail: another prompt gives other bits.
    auto other = tokens;
    other[5] = (other[5] + 1) % e1->cfg.vocab_size;
    EXPECT_GT(bit_mismatches(a, run_chunked(*e1, other, {30})), 0);
}

TEST_P(ForwardTest, ThreadCountDoesNotChangeBits) {
    auto e1 = make_engine(1);
    auto e3 = make_engine(3);
    const auto tokens = make_tokens(3, 37, e1->cfg.vocab_size);
    const auto a = run_chunked(*e1, tokens, {37});
    const auto b = run_chunked(*e3, tokens, {37});
    ASSERT_FALSE(a.empty());
    EXPECT_EQ(0, bit_mismatches(a, b));
    // Decode steps too.
    EXPECT_EQ(0, bit_mismatches(run_chunked(*e1, tokens, {1}), run_chunked(*e3, tokens, {1})));
}

TEST_P(ForwardTest, ChunkedPrefillEqualsOneShotEqualsDecode) {
    auto e = make_engine(2);
    const auto tokens = make_tokens(4, 45, e->cfg.vocab_size);
    const auto one_shot = run_chunked(*e, tokens, {45});
    ASSERT_FALSE(one_shot.empty());
    EXPECT_EQ(0, bit_mismatches(one_shot, run_chunked(*e, tokens, {1})));
    EXPECT_EQ(0, bit_mismatches(one_shot, run_chunked(*e, tokens, {5, 7, 1, 13})));
    EXPECT_EQ(0, bit_mismatches(one_shot, run_chunked(*e, tokens, {16, 17})));
    // Quantized KV rows are read back in their stored format by every chunking alike.
    const auto q_one = run_chunked(*e, tokens, {45}, kv::KvFormat::kQ8_0);
    EXPECT_EQ(0, bit_mismatches(q_one, run_chunked(*e, tokens, {3, 11}, kv::KvFormat::kQ8_0)));
    EXPECT_GT(bit_mismatches(q_one, one_shot), 0);  // q8_0 keys really differ from f32 ones
}

TEST_P(ForwardTest, BatchCompositionAndSlotDoNotChangeBits) {
    auto e = make_engine(2);
    const int32_t V = e->cfg.vocab_size;
    const auto probe = make_tokens(5, 20, V);
    constexpr int kDecode = 4;
    // The probe alone: prefill, then kDecode decode steps; the last-token logits of every step.
    auto run = [&](int batch, int slot) {
        std::vector<kv::KvCache> caches;
        std::vector<std::vector<int32_t>> prompts;
        for (int s = 0; s < batch; ++s) {
            caches.push_back(make_cache(*e));
            prompts.push_back(s == slot ? probe : make_tokens(100 + s * 7 + batch, 3 + 5 * s, V));
        }
        std::vector<float> out;
        for (int stepi = 0; stepi <= kDecode; ++stepi) {
            std::vector<SeqChunk> chunks;
            std::vector<int32_t> next(static_cast<size_t>(batch));
            for (int s = 0; s < batch; ++s) {
                if (stepi == 0) {
                    chunks.push_back(SeqChunk{&caches[s], prompts[s], false, -1});
                } else {
                    next[s] = make_tokens(1000 + stepi * 31 + (s == slot ? 0 : s + 50 * batch), 1, V)[0];
                    chunks.push_back(SeqChunk{&caches[s], std::span(&next[s], 1), false, -1});
                }
            }
            auto r = e->fwd->step(chunks);
            EXPECT_TRUE(r.has_value()) << r.error().message;
            const auto rows = e->fwd->logit_row_begin();
            const auto lg = e->fwd->logits();
            out.insert(out.end(), lg.begin() + rows[slot] * V, lg.begin() + rows[slot + 1] * V);
        }
        return out;
    };
    const auto alone = run(1, 0);
    ASSERT_EQ(alone.size(), static_cast<size_t>((kDecode + 1) * V));
    for (int batch = 2; batch <= 4; ++batch) {
        for (int slot : {0, batch - 1}) {
            EXPECT_EQ(0, bit_mismatches(alone, run(batch, slot))) << "batch " << batch << " slot " << slot;
        }
    }
}

TEST_P(ForwardTest, PartialCommitEqualsShorterPrefill) {
    auto e = make_engine(2);
    const auto tokens = make_tokens(6, 12, e->cfg.vocab_size);
    const auto tail = make_tokens(7, 3, e->cfg.vocab_size);
    // A: stage 12 tokens but keep 8 (a rejected speculation), then run the tail.
    kv::KvCache a = make_cache(*e);
    SeqChunk c{&a, tokens, false, 8};
    ASSERT_TRUE(e->fwd->step(std::span(&c, 1)).has_value());
    EXPECT_EQ(a.length(), 8);
    c = SeqChunk{&a, tail, true, -1};
    ASSERT_TRUE(e->fwd->step(std::span(&c, 1)).has_value());
    const std::vector<float> la(e->fwd->logits().begin(), e->fwd->logits().end());
    // B: the 8 kept tokens, then the tail.
    kv::KvCache b = make_cache(*e);
    c = SeqChunk{&b, std::span(tokens).first(8), false, -1};
    ASSERT_TRUE(e->fwd->step(std::span(&c, 1)).has_value());
    c = SeqChunk{&b, tail, true, -1};
    ASSERT_TRUE(e->fwd->step(std::span(&c, 1)).has_value());
    const std::vector<float> lb(e->fwd->logits().begin(), e->fwd->logits().end());
    EXPECT_EQ(0, bit_mismatches(la, lb));
    EXPECT_EQ(kv::kv_cache_digest(a), kv::kv_cache_digest(b));
}

TEST_P(ForwardTest, MtpLayerShapesFiniteDeterministic) {
    auto e = make_engine(2);
    ASSERT_EQ(e->cfg.n_mtp_layers, 1);
    const int32_t V = e->cfg.vocab_size;
    const auto tokens = make_tokens(8, 10, V);
    auto run = [&](int threads) {
        auto eng = threads == 2 ? nullptr : make_engine(threads);
        Engine &en = eng ? *eng : *e;
        kv::KvCache trunk = make_cache(en);
        auto mtp_cache =
            kv::KvCache::create(mtp_kv_spec(en.cfg, 0, kv::KvFormat::kF32, kv::KvFormat::kF32, kContext, 64));
        EXPECT_TRUE(mtp_cache.has_value());
        SeqChunk c{&trunk, std::span(tokens).first(9), true, -1};
        EXPECT_TRUE(en.fwd->step(std::span(&c, 1)).has_value());
        // Draft inputs: token p + 1 with the hidden state at p, for p = 0 .. 8.
        const MtpChunk m{&*mtp_cache, std::span(tokens).subspan(1, 9), true, -1};
        auto r = en.fwd->mtp_step(0, std::span(&m, 1), en.fwd->hidden());
        EXPECT_TRUE(r.has_value()) << r.error().message;
        EXPECT_EQ(mtp_cache->length(), 9);
        EXPECT_EQ(en.fwd->mtp_hidden().rows(), 9);
        std::vector<float> out(en.fwd->logits().begin(), en.fwd->logits().end());
        // A second draft step chained on the MTP layer's own hidden state (as the chain 45 -> 46 -> 47 does).
        const int32_t nxt = tokens[9];
        const MtpChunk m2{&*mtp_cache, std::span(&nxt, 1), false, -1};
        TensorView h = en.fwd->mtp_hidden().row_slice(8, 9);
        r = en.fwd->mtp_step(0, std::span(&m2, 1), h);
        EXPECT_TRUE(r.has_value()) << r.error().message;
        out.insert(out.end(), en.fwd->logits().begin(), en.fwd->logits().end());
        return out;
    };
    const auto a = run(2);
    ASSERT_EQ(a.size(), static_cast<size_t>(10 * V));
    for (float v : a) ASSERT_TRUE(std::isfinite(v));
    EXPECT_EQ(0, bit_mismatches(a, run(2)));
    EXPECT_EQ(0, bit_mismatches(a, run(1)));
    // The MTP head differs from the trunk head.
    kv::KvCache trunk = make_cache(*e);
    SeqChunk c{&trunk, std::span(tokens).first(9), true, -1};
    ASSERT_TRUE(e->fwd->step(std::span(&c, 1)).has_value());
    EXPECT_NE(0, std::memcmp(a.data(), e->fwd->logits().data(), static_cast<size_t>(V) * sizeof(float)));
}

TEST_P(ForwardTest, DecodeStepCounts) {
    auto e = make_engine(1);
    kv::KvCache cache = make_cache(*e);
    const auto tokens = make_tokens(9, 6, e->cfg.vocab_size);
    SeqChunk c{&cache, std::span(tokens).first(5), false, -1};
    ASSERT_TRUE(e->fwd->step(std::span(&c, 1)).has_value());
    e->backend->reset_counters();
    c = SeqChunk{&cache, std::span(tokens).subspan(5, 1), false, -1};
    ASSERT_TRUE(e->fwd->step(std::span(&c, 1)).has_value());
    const BackendCounters n = e->backend->counters();
    // Per layer: norm, q/k/v/g, 2 head norms, 2 ropes, attention, o_proj, add+norm (12); dense FFN 5 ops,
    // MoE FFN 13; plus embedding and the head (gather, norm, lm_head). Host copies: ids, positions, logit
    // rows, logits, and per layer K/V out to the cache and back (4).
    int64_t want = 1 + 3;
    for (int l = 0; l < e->cfg.n_layers; ++l) {
        want += 12 + (e->cfg.layers[static_cast<size_t>(l)].ffn == FfnKind::kDense ? 5 : 13);
    }
    EXPECT_EQ(n.launches, want);
    EXPECT_EQ(n.host_copies, 4 + 4 * e->cfg.n_layers);
    std::printf("[ counts ] %s decode step: %lld launches, %lld host copies (%lld bytes)\n", GetParam(),
                static_cast<long long>(n.launches), static_cast<long long>(n.host_copies),
                static_cast<long long>(n.host_copy_bytes));
}

TEST_P(ForwardTest, BadStepsAreRefusedAndChangeNothing) {
    auto e = make_engine(1, ForwardCapacity{16, 2, kContext, 0});
    kv::KvCache cache = make_cache(*e);
    const auto tokens = make_tokens(10, 20, e->cfg.vocab_size);
    auto expect_error = [&](std::span<const SeqChunk> chunks, const std::string &fragment) {
        const uint64_t before = kv::kv_cache_digest(cache);
        auto r = e->fwd->step(chunks);
        ASSERT_FALSE(r.has_value()) << "expected: " << fragment;
        EXPECT_NE(r.error().message.find(fragment), std::string::npos) << r.error().message;
        EXPECT_EQ(before, kv::kv_cache_digest(cache));
        EXPECT_FALSE(cache.in_txn());
    };
    expect_error({}, "0 chunks, expected 1 .. 2");
    SeqChunk c{&cache, {}, false, -1};
    expect_error(std::span(&c, 1), "chunk 0: no tokens");
    c = SeqChunk{nullptr, tokens, false, -1};
    expect_error(std::span(&c, 1), "chunk 0: no KV cache");
    c = SeqChunk{&cache, tokens, false, -1};
    expect_error(std::span(&c, 1), "20 tokens, the forward was prepared for at most 16");
    const std::vector<int32_t> bad_id{1, e->cfg.vocab_size};
    c = SeqChunk{&cache, bad_id, false, -1};
    expect_error(std::span(&c, 1), "token id 1024 at row 1 outside the vocabulary [0, 1024)");
    c = SeqChunk{&cache, std::span(tokens).first(3), false, 4};
    expect_error(std::span(&c, 1), "chunk 0: commit 4 outside [-1, 3]");
    const SeqChunk twice[] = {{&cache, std::span(tokens).first(2), false, -1},
                              {&cache, std::span(tokens).first(2), false, -1}};
    expect_error(twice, "chunk 1: same KV cache as chunk 0");
    auto small = kv::KvCache::create(trunk_kv_spec(e->cfg, kv::KvFormat::kF32, kv::KvFormat::kF32, 4, 2));
    ASSERT_TRUE(small.has_value());
    c = SeqChunk{&*small, std::span(tokens).first(3), false, -1};
    expect_error(std::span(&c, 1), "chunk 0: 3 tokens, the KV cache stages at most 2 per step");
    auto mtp = kv::KvCache::create(mtp_kv_spec(e->cfg, 0, kv::KvFormat::kF32, kv::KvFormat::kF32, kContext, 8));
    ASSERT_TRUE(mtp.has_value());
    c = SeqChunk{&*mtp, std::span(tokens).first(3), false, -1};
    expect_error(std::span(&c, 1), "chunk 0: KV cache has 1 layers, expected 6");
    auto txn = cache.begin();
    ASSERT_TRUE(txn.has_value());
    c = SeqChunk{&cache, std::span(tokens).first(3), false, -1};
    {
        auto r = e->fwd->step(std::span(&c, 1));
        ASSERT_FALSE(r.has_value());
        EXPECT_NE(r.error().message.find("chunk 0: KV cache has an open transaction"), std::string::npos);
    }
    ASSERT_TRUE(cache.rollback(*txn).has_value());
    // MTP refusals.
    const MtpChunk m{&*mtp, std::span(tokens).first(3), false, -1};
    auto r = e->fwd->mtp_step(1, std::span(&m, 1), e->fwd->hidden());
    ASSERT_FALSE(r.has_value());
    EXPECT_NE(r.error().message.find("MTP layer 1 outside [0, 1)"), std::string::npos) << r.error().message;
    r = e->fwd->mtp_step(0, std::span(&m, 1), e->fwd->hidden());
    ASSERT_FALSE(r.has_value());
    EXPECT_NE(r.error().message.find("h_prev is [0, 256] F32, expected [3, 256] F32"), std::string::npos)
        << r.error().message;
    // A valid step still works afterwards.
    c = SeqChunk{&cache, std::span(tokens).first(3), false, -1};
    EXPECT_TRUE(e->fwd->step(std::span(&c, 1)).has_value());
    EXPECT_EQ(cache.length(), 3);
}

TEST_P(ForwardTest, BindRefusesMismatchedConfigAndCapacity) {
    auto cfg = load_step35_config(dir());
    ASSERT_TRUE(cfg.has_value());
    auto ckpt = io::Checkpoint::open(dir());
    ASSERT_TRUE(ckpt.has_value());
    cpu::CpuBackend backend(1);
    Step35Config wrong = *cfg;
    wrong.layers[1].d_ff += 8;
    auto m = bind_step35_model(backend, *ckpt, wrong);
    ASSERT_FALSE(m.has_value());
    EXPECT_NE(m.error().message.find("checkpoint does not match the config: model.layers.1.mlp.gate_proj.weight: "
                                     "expected shape [520, 256], found [512, 256]"),
              std::string::npos)
        << m.error().message;
    auto ok = bind_step35_model(backend, *ckpt, *cfg);
    ASSERT_TRUE(ok.has_value()) << ok.error().message;
    auto f = Step35Forward::create(backend, *ok, ForwardCapacity{0, 1, 8, 0});
    ASSERT_FALSE(f.has_value());
    EXPECT_NE(f.error().message.find("expected max_tokens, max_seqs, max_context >= 1"), std::string::npos);
}

std::string dtype_name_of(const ::testing::TestParamInfo<const char *> &p) { return std::string(p.param); }

INSTANTIATE_TEST_SUITE_P(Tiny, ForwardTest, ::testing::Values("bf16", "fp8"), dtype_name_of);

}  // namespace
}  // namespace memra::model
