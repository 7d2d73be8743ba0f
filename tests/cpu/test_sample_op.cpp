// The CPU backend's sampling op: per row, exactly the token a core Sampler with the row's parameters draws
// from the same logits prefix [0, n_valid), penalty history and (choice, position); ids past n_valid are never
// drawn however large their logits; the log-probabilities are token_logprobs' (raw bits); and a row's result
// depends on no other row of the call (D2).
#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "core/sampling.h"
#include "cpu/ops_test_util.h"

namespace memra::cpu::test {
namespace {

constexpr int32_t kVocab = 50;  // logits row width: the model's vocabulary, padding rows included
constexpr int32_t kValid = 40;  // the tokenizer's ids; 40 .. 49 are padding

// Logits [4, kVocab] in [-3, 3] whose padding ids hold the largest values of their row; id 2 leads the valid
// ids of row 0 (so a penalty on it changes the greedy token).
std::vector<float> make_logits(uint32_t seed) {
    std::vector<float> l = random_floats(4 * kVocab, seed, -3.0f, 3.0f);
    for (int r = 0; r < 4; ++r) {
        for (int id = kValid; id < kVocab; ++id) {
            l[static_cast<size_t>(r * kVocab + id)] = 50.0f + static_cast<float>(id);
        }
    }
    l[2] = 3.5f;
    return l;
}

// The penalty contexts the rows index: tokens in [0, kVocab), some of them padding ids.
const std::vector<int32_t> kHistory{3, 17, 17, 5, 39, 45, 0, 12, 17, 3, 8, 29, 31, 2, 2, 2, 48, 11, 7, 19};

SamplingParams params(float temperature, int32_t top_k, float top_p, float min_p, uint64_t seed) {
    SamplingParams p;
    p.temperature = temperature;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.seed = seed;
    return p;
}

// A spread of rows: greedy, the default chain, no filters at a high temperature, penalties with their
// windows, several choices and positions over the same logits row, every log-probability request.
std::vector<SampleRow> make_rows() {
    std::vector<SampleRow> rows;
    auto add = [&](const SamplingParams &p, uint64_t choice, int64_t position, int32_t logit_row, int32_t h_begin,
                   int32_t h_len, int32_t top_logprobs) {
        SampleRow r;
        r.params = p;
        r.choice = choice;
        r.position = position;
        r.logit_row = logit_row;
        r.history_begin = h_begin;
        r.history_len = h_len;
        r.top_logprobs = top_logprobs;
        rows.push_back(r);
    };
    add(params(0.0f, 40, 0.95f, 0.05f, 1), 0, 7, 0, 0, 0, -1);    // greedy
    add(params(0.0f, 0, 1.0f, 0.0f, 1), 0, 7, 1, 0, 0, 5);        // greedy, 5 alternatives
    add(SamplingParams{}, 0, 12, 2, 0, 0, 0);                     // the default chain, the chosen logprob only
    add(params(1.5f, 0, 1.0f, 0.0f, 99), 0, 3, 3, 0, 0, kMaxTopLogprobs);
    SamplingParams pen = params(0.0f, 0, 1.0f, 0.0f, 5);
    pen.repetition_penalty = 4.0f;
    pen.frequency_penalty = 0.5f;
    pen.presence_penalty = 0.25f;
    pen.penalty_last_n = 6;
    add(pen, 0, 40, 0, 2, 14, 3);  // the last 6 of history[2, 16)
    pen.penalty_last_n = -1;
    pen.temperature = 0.7f;
    add(pen, 1, 41, 0, 0, 20, 2);  // the whole history
    for (int i = 0; i < 24; ++i) {
        add(params(1.2f, i % 3 == 0 ? 0 : 25, i % 2 == 0 ? 1.0f : 0.9f, i % 4 == 0 ? 0.0f : 0.02f, 1234), i % 3,
            100 + i, i % 4, 0, 0, i % 5 == 0 ? -1 : i % 21);
    }
    return rows;
}

struct OpResult {
    std::vector<SampledToken> tokens;
    int64_t launches = 0;
};

// The logit-bias lists rows index: [0, 1) bans id 2 (row 0's greedy token), [1, 3) forces id 5 (and biases
// the padding id 45, which has no logit to bias), [3, 7) small nudges, one of them to a padding id.
const std::vector<LogitBias> kBias{{2, -100.0f}, {5, 100.0f}, {45, 100.0f},
                                   {0, 1.25f},   {7, -0.5f},  {19, 2.0f}, {41, 3.0f}};

OpResult run_op(int threads, const std::vector<float> &logits, int32_t n_valid, const std::vector<SampleRow> &rows,
                const std::vector<LogitBias> &bias = {}) {
    CpuBackend be(threads, Numerics::kExact);
    EXPECT_TRUE(be.prepare_sampling(kVocab).has_value());
    auto lg = be.alloc(DType::kF32, {static_cast<int64_t>(logits.size()) / kVocab, kVocab});
    auto rv = be.alloc(DType::kU8, {static_cast<int64_t>(rows.size() * sizeof(SampleRow))});
    auto hv = be.alloc(DType::kI32, {static_cast<int64_t>(kHistory.size())});
    const auto bias_bytes = static_cast<int64_t>(bias.size() * sizeof(LogitBias));
    auto bv = be.alloc(DType::kU8, {std::max<int64_t>(bias_bytes, 1)});
    auto out = be.alloc(DType::kU8, {static_cast<int64_t>(rows.size() * sizeof(SampledToken))});
    be.copy_from_host(logits.data(), *lg);
    be.copy_from_host(rows.data(), *rv);
    be.copy_from_host(kHistory.data(), *hv);
    const TensorView bias_view = bv->row_slice(0, bias_bytes);
    if (bias_bytes > 0) be.copy_from_host(bias.data(), bias_view);
    be.reset_counters();
    be.sample(*lg, n_valid, *rv, *hv, bias_view, *out);
    OpResult r;
    r.launches = be.counters().launches;
    r.tokens.resize(rows.size());
    be.copy_to_host(*out, r.tokens.data());
    return r;
}

// What a core Sampler and token_logprobs give for one row.
SampledToken expected(const std::vector<float> &logits, int32_t n_valid, const SampleRow &r) {
    auto s = Sampler::create(kVocab, r.params);
    EXPECT_TRUE(s.has_value());
    const std::span<const float> row(logits.data() + r.logit_row * kVocab, static_cast<size_t>(n_valid));
    const std::span<const int32_t> context(kHistory.data() + r.history_begin, static_cast<size_t>(r.history_len));
    const std::span<const LogitBias> bias(kBias.data() + r.bias_begin, static_cast<size_t>(r.bias_len));
    SampledToken t;
    t.id = s->sample(row, context, r.choice, r.position, bias);
    t.has_logprobs = r.top_logprobs >= 0 ? 1 : 0;
    if (r.top_logprobs >= 0) token_logprobs(row, t.id, r.top_logprobs, t.logprobs);
    return t;
}

// Mismatches between two SampledTokens: the id, the flag and, when present, every log-probability field.
int64_t token_mismatches(const SampledToken &a, const SampledToken &b) {
    int64_t bad = (a.id != b.id) + (a.has_logprobs != b.has_logprobs);
    if (a.has_logprobs == 0 || b.has_logprobs == 0) return bad;
    bad += bits(a.logprobs.chosen) != bits(b.logprobs.chosen);
    bad += a.logprobs.n_top != b.logprobs.n_top;
    for (int32_t j = 0; j < a.logprobs.n_top && j < kMaxTopLogprobs; ++j) {
        bad += a.logprobs.top_ids[j] != b.logprobs.top_ids[j];
        bad += bits(a.logprobs.top_logprobs[j]) != bits(b.logprobs.top_logprobs[j]);
    }
    return bad;
}

TEST(CpuSampleOp, EachRowEqualsTheCoreSampler) {
    const std::vector<float> logits = make_logits(1);
    const std::vector<SampleRow> rows = make_rows();
    const OpResult got = run_op(2, logits, kValid, rows);
    EXPECT_EQ(got.launches, 1);
    std::vector<int32_t> distinct;
    for (size_t i = 0; i < rows.size(); ++i) {
        const SampledToken &t = got.tokens[i];
        EXPECT_EQ(token_mismatches(t, expected(logits, kValid, rows[i])), 0) << "row " << i;
        EXPECT_GE(t.id, 0) << "row " << i;
        EXPECT_LT(t.id, kValid) << "row " << i;  // the padding ids hold the largest logits, never drawn
        EXPECT_EQ(t.has_logprobs, rows[i].top_logprobs >= 0 ? 1 : 0) << "row " << i;
        if (rows[i].top_logprobs >= 0) {
            EXPECT_EQ(t.logprobs.n_top, rows[i].top_logprobs) << "row " << i;
            for (int32_t j = 0; j < t.logprobs.n_top; ++j) EXPECT_LT(t.logprobs.top_ids[j], kValid) << "row " << i;
        }
        if (std::find(distinct.begin(), distinct.end(), t.id) == distinct.end()) distinct.push_back(t.id);
    }
    EXPECT_GT(distinct.size(), 5u);  // the rows really draw: many different tokens
    // The penalties act: greedy takes id 2, the penalised greedy row (2 in its window) another one.
    EXPECT_EQ(got.tokens[0].id, 2);
    EXPECT_NE(got.tokens[4].id, 2);
}

TEST(CpuSampleOp, PaddingIdsAreDrawnOnlyWhenValid) {
    // With n_valid = the whole row, greedy takes the largest logit, a padding id: the bound above can fail.
    const std::vector<float> logits = make_logits(2);
    const std::vector<SampleRow> rows = make_rows();
    const OpResult all = run_op(1, logits, kVocab, rows);
    EXPECT_EQ(all.tokens[0].id, kVocab - 1);
    for (size_t i = 0; i < rows.size(); ++i) {
        EXPECT_EQ(token_mismatches(all.tokens[i], expected(logits, kVocab, rows[i])), 0) << "row " << i;
    }
}

TEST(CpuSampleOp, ARowDependsOnNoOtherRowOrThreadCount) {
    const std::vector<float> logits = make_logits(3);
    const std::vector<SampleRow> rows = make_rows();
    const OpResult batch = run_op(3, logits, kValid, rows);
    for (size_t i = 0; i < rows.size(); ++i) {
        const OpResult alone = run_op(1, logits, kValid, {rows[i]});
        EXPECT_EQ(token_mismatches(alone.tokens[0], batch.tokens[i]), 0) << "row " << i;
    }
    // Reversed order: every row still gets its own token.
    const std::vector<SampleRow> reversed(rows.rbegin(), rows.rend());
    const OpResult rev = run_op(2, logits, kValid, reversed);
    for (size_t i = 0; i < rows.size(); ++i) {
        EXPECT_EQ(token_mismatches(rev.tokens[rows.size() - 1 - i], batch.tokens[i]), 0) << "row " << i;
    }
}

TEST(CpuSampleOp, BiasedRowsBesideUnbiasedOnes) {
    // Every row twice in one call: as it is, then with one of the bias lists; the unbiased rows keep their bits,
    // the biased ones equal a core Sampler given the same bias, and the log-probabilities stay the raw logits'.
    const std::vector<float> logits = make_logits(4);
    const std::vector<SampleRow> plain = make_rows();
    const OpResult alone = run_op(2, logits, kValid, plain);
    const std::pair<int32_t, int32_t> lists[3] = {{0, 1}, {1, 2}, {3, 4}};
    std::vector<SampleRow> rows;
    for (size_t i = 0; i < plain.size(); ++i) {
        rows.push_back(plain[i]);
        SampleRow b = plain[i];
        b.bias_begin = lists[i % 3].first;
        b.bias_len = lists[i % 3].second;
        rows.push_back(b);
    }
    const OpResult got = run_op(2, logits, kValid, rows, kBias);
    EXPECT_EQ(got.launches, 1);
    int64_t changed = 0;
    for (size_t i = 0; i < plain.size(); ++i) {
        const SampledToken &u = got.tokens[2 * i];
        const SampledToken &b = got.tokens[2 * i + 1];
        const SampleRow &r = rows[2 * i + 1];
        EXPECT_EQ(token_mismatches(u, alone.tokens[i]), 0) << "unbiased row " << i;
        EXPECT_EQ(token_mismatches(b, expected(logits, kValid, r)), 0) << "biased row " << i;
        if (r.bias_begin == 0) {
            EXPECT_NE(b.id, 2) << "row " << i;  // banned
        } else if (r.bias_begin == 1) {
            EXPECT_EQ(b.id, 5) << "row " << i;  // forced, at any temperature and filter
        }
        if (b.has_logprobs != 0) {
            EXPECT_EQ(b.logprobs.n_top, u.logprobs.n_top) << "row " << i;
            for (int32_t j = 0; j < b.logprobs.n_top; ++j) {
                EXPECT_EQ(b.logprobs.top_ids[j], u.logprobs.top_ids[j]) << "row " << i;
                EXPECT_EQ(bits(b.logprobs.top_logprobs[j]), bits(u.logprobs.top_logprobs[j])) << "row " << i;
            }
        }
        changed += b.id != u.id;
    }
    EXPECT_GT(changed, 5);  // the bias acts
    // Row 0 (greedy) without its ban takes id 2 (make_logits), with it another one.
    EXPECT_EQ(got.tokens[0].id, 2);
    EXPECT_NE(got.tokens[1].id, 2);
}

}  // namespace
}  // namespace memra::cpu::test
