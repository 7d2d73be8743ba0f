// Sampler tests: Philox known answers, log_f32 accuracy, greedy ties, each filter alone on hand-made logits
// (exact surviving sets), the penalties, the logit bias (against a Sampler given biased logits), seeded
// determinism independent of other calls, and the empirical distribution of 20000 seeded draws against the softmax
// (chi-square, deterministic for the fixed seed).
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/sampling.h"

namespace memra {
namespace {

using Ids = std::vector<int32_t>;

SamplingParams plain(float temperature = 1.0f) {
    SamplingParams p;
    p.temperature = temperature;
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    p.repetition_penalty = 1.0f;
    p.penalty_last_n = 64;
    p.seed = 42;
    return p;
}

Sampler make(int32_t vocab, const SamplingParams &p) {
    auto s = Sampler::create(vocab, p);
    EXPECT_TRUE(s.has_value()) << (s ? "" : s.error().message);
    return std::move(*s);
}

Ids survivors(Sampler s, const std::vector<float> &logits, const Ids &context = {}) {
    const auto kept = s.candidates(logits, context);
    return Ids(kept.begin(), kept.end());
}

// Logits whose softmax is proportional to `weights`.
std::vector<float> logits_of(const std::vector<double> &weights) {
    std::vector<float> out;
    for (double w : weights) out.push_back(static_cast<float>(std::log(w)));
    return out;
}

TEST(Philox, KnownAnswers) {
    // Random123's published philox4x32_10 test vectors.
    EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}),
              (std::array<uint32_t, 4>{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
    EXPECT_EQ(philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu}),
              (std::array<uint32_t, 4>{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
    EXPECT_EQ(philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u}),
              (std::array<uint32_t, 4>{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

TEST(Philox, UniformIsOpenIntervalAndKeyed) {
    double sum = 0.0;
    for (int32_t id = 0; id < 4000; ++id) {
        const float u = philox_uniform(1, 2, 3, id);
        ASSERT_GT(u, 0.0f);
        ASSERT_LT(u, 1.0f);
        sum += u;
    }
    EXPECT_NEAR(sum / 4000.0, 0.5, 0.02);
    // Lanes of one Philox block are distinct tokens; every key part changes the value.
    EXPECT_NE(philox_uniform(1, 2, 3, 0), philox_uniform(1, 2, 3, 1));
    EXPECT_NE(philox_uniform(1, 2, 3, 5), philox_uniform(2, 2, 3, 5));
    EXPECT_NE(philox_uniform(1, 2, 3, 5), philox_uniform(1, 3, 3, 5));
    EXPECT_NE(philox_uniform(1, 2, 3, 5), philox_uniform(1, 2, 4, 5));
    EXPECT_NE(philox_uniform(1, uint64_t{1} << 32, 3, 5), philox_uniform(1, 0, 3, 5));
    EXPECT_NE(philox_uniform(uint64_t{1} << 32, 2, 3, 5), philox_uniform(0, 2, 3, 5));
    // The exact word: counter (5 / 4, 3, 2, 0), key (1, 0), lane 1, top 23 bits.
    const uint32_t word = philox4x32_10({1, 3, 2, 0}, {1, 0})[1];
    EXPECT_EQ(philox_uniform(1, 2, 3, 5), (static_cast<float>(word >> 9) + 0.5f) / 8388608.0f);
}

TEST(Philox, QuadServesFourConsecutiveIds) {
    for (const uint32_t quad : {0u, 1u, 77u, 32223u}) {
        float u[4];
        philox_uniform_quad(9, uint64_t{5} << 33, 4096, quad, u);
        for (uint32_t k = 0; k < 4; ++k) {
            EXPECT_EQ(u[k], philox_uniform(9, uint64_t{5} << 33, 4096, static_cast<int32_t>(4 * quad + k)));
        }
    }
}

// The bound the device sampler prunes its draws with: every uniform the generator can return (all 2^23 words'
// values, an exhaustive check) gives a noise inside [kGumbelNoiseMin, kGumbelNoiseMax]; both ends are reached to
// within 0.01, so the bounds are tight.
TEST(Gumbel, NoiseOfEveryUniformLiesWithinTheBounds) {
    float lo = 0.0f;
    float hi = 0.0f;
    for (uint32_t top = 0; top < (1u << 23); ++top) {
        const float g = gumbel_from_uniform(uniform_from_word(top << 9));
        lo = std::min(lo, g);
        hi = std::max(hi, g);
    }
    EXPECT_GE(lo, kGumbelNoiseMin);
    EXPECT_LE(hi, kGumbelNoiseMax);
    EXPECT_LT(lo, kGumbelNoiseMin + 0.01f);
    EXPECT_GT(hi, kGumbelNoiseMax - 0.01f);
}

TEST(LogF32, MatchesLibmAndSpecialValues) {
    double worst = 0.0;
    for (float x = 1e-30f; x < 1e30f; x *= 1.0137f) {
        const double want = std::log(static_cast<double>(x));
        const double err = std::fabs(static_cast<double>(log_f32(x)) - want);
        worst = std::max(worst, err / std::max(std::fabs(want), 1e-30));
    }
    for (float x = 0.5f; x < 2.0f; x += 1.0f / 4096.0f) {  // near 1, where log is small: relative error
        const double want = std::log(static_cast<double>(x));
        if (want == 0.0) continue;
        worst = std::max(worst, std::fabs(static_cast<double>(log_f32(x)) - want) / std::fabs(want));
    }
    EXPECT_LT(worst, 4e-7);
    EXPECT_EQ(log_f32(1.0f), 0.0f);
    EXPECT_NEAR(log_f32(1e-40f), std::log(1e-40), 1e-5);  // subnormal
    EXPECT_EQ(log_f32(0.0f), -std::numeric_limits<float>::infinity());
    EXPECT_EQ(log_f32(std::numeric_limits<float>::infinity()), std::numeric_limits<float>::infinity());
    EXPECT_TRUE(std::isnan(log_f32(-1.0f)));
    EXPECT_TRUE(std::isnan(log_f32(std::numeric_limits<float>::quiet_NaN())));
}

TEST(Sampler, GreedyTakesArgmaxWithTiesToLowerId) {
    Sampler s = make(5, plain(0.0f));
    const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 3.0f, -1.0f};
    for (uint64_t seq = 0; seq < 5; ++seq) EXPECT_EQ(s.sample(logits, {}, seq, 7), 1);
    EXPECT_EQ(survivors(s, logits), (Ids{1}));
    const float nan = std::numeric_limits<float>::quiet_NaN();
    EXPECT_EQ(s.sample(std::vector<float>{nan, -5.0f, nan, -4.0f, -4.0f}, {}, 0, 0), 3);
    const float inf = std::numeric_limits<float>::infinity();
    EXPECT_EQ(s.sample(std::vector<float>{-inf, -inf, -inf, -inf, -inf}, {}, 0, 0), 0);
}

TEST(Sampler, NoFilterKeepsEverythingInProbabilityOrder) {
    Sampler s = make(5, plain());
    EXPECT_EQ(survivors(s, {0.5f, 2.0f, 1.0f, 2.0f, -1.0f}), (Ids{1, 3, 2, 0, 4}));
}

TEST(Sampler, TopKAlone) {
    const std::vector<float> logits = {0.5f, 2.0f, 1.0f, 2.0f, -1.0f};
    SamplingParams p = plain();
    p.top_k = 1;
    Sampler s1 = make(5, p);
    EXPECT_EQ(survivors(s1, logits), (Ids{1}));  // tie at the boundary: lower id
    p.top_k = 3;
    Sampler s3 = make(5, p);
    EXPECT_EQ(survivors(s3, logits), (Ids{1, 3, 2}));
    p.top_k = 5;
    Sampler s5 = make(5, p);
    EXPECT_EQ(survivors(s5, logits), (Ids{1, 3, 2, 0, 4}));
    p.top_k = 100;  // larger than the vocabulary: off
    Sampler s100 = make(5, p);
    EXPECT_EQ(survivors(s100, logits), (Ids{1, 3, 2, 0, 4}));
    // Only survivors are ever drawn.
    p.top_k = 2;
    Sampler s2 = make(5, p);
    for (int64_t pos = 0; pos < 200; ++pos) {
        const int32_t t = s2.sample(logits, {}, 0, pos);
        ASSERT_TRUE(t == 1 || t == 3) << t;
    }
}

TEST(Sampler, TopPAlone) {
    const std::vector<float> logits = logits_of({0.1, 0.5, 0.15, 0.25});  // sorted: 1 (.5), 3 (.25), 2, 0
    SamplingParams p = plain();
    p.top_p = 0.1f;
    EXPECT_EQ(survivors(make(4, p), logits), (Ids{1}));
    p.top_p = 0.7f;
    EXPECT_EQ(survivors(make(4, p), logits), (Ids{1, 3}));
    p.top_p = 0.8f;
    EXPECT_EQ(survivors(make(4, p), logits), (Ids{1, 3, 2}));
    p.top_p = 0.95f;
    EXPECT_EQ(survivors(make(4, p), logits), (Ids{1, 3, 2, 0}));
    // Temperature comes first: at 0.5 the probabilities are (1, 0.25, 0.09, 0.04) / 1.38, so 0.8 needs two.
    p.top_p = 0.8f;
    p.temperature = 0.5f;
    EXPECT_EQ(survivors(make(4, p), logits), (Ids{1, 3}));
}

TEST(Sampler, TopPRenormalisesAfterTopK) {
    const std::vector<float> logits = logits_of({0.1, 0.5, 0.15, 0.25});
    SamplingParams p = plain();
    p.top_k = 2;      // (0.5, 0.25) -> (2/3, 1/3)
    p.top_p = 0.65f;  // 2/3 alone reaches it; without renormalising, 0.5 would not
    EXPECT_EQ(survivors(make(4, p), logits), (Ids{1}));
}

TEST(Sampler, MinPAlone) {
    const std::vector<float> logits = logits_of({0.2, 1.0, 0.3, 0.5, 0.04});  // relative to the top token
    SamplingParams p = plain();
    p.min_p = 0.6f;
    EXPECT_EQ(survivors(make(5, p), logits), (Ids{1}));
    p.min_p = 0.4f;
    EXPECT_EQ(survivors(make(5, p), logits), (Ids{1, 3}));
    p.min_p = 0.25f;
    EXPECT_EQ(survivors(make(5, p), logits), (Ids{1, 3, 2}));
    p.min_p = 0.1f;
    EXPECT_EQ(survivors(make(5, p), logits), (Ids{1, 3, 2, 0}));
    p.min_p = 1.0f;
    EXPECT_EQ(survivors(make(5, p), logits), (Ids{1}));
    // After temperature 0.5 the ratios are squared: 0.25, 0.09, 0.04, ... so 0.2 keeps two.
    p.min_p = 0.2f;
    p.temperature = 0.5f;
    EXPECT_EQ(survivors(make(5, p), logits), (Ids{1, 3}));
}

TEST(Sampler, RepetitionPenaltyDividesPositiveAndMultipliesNegative) {
    SamplingParams p = plain(0.0f);
    p.repetition_penalty = 2.0f;
    Sampler s = make(5, p);
    const std::vector<float> logits = {2.0f, -1.0f, 0.5f, 3.0f, 0.0f};
    (void)s.candidates(logits, Ids{0, 1, 0, 4});
    const auto out = s.penalized_logits();
    EXPECT_EQ(std::vector<float>(out.begin(), out.end()), (std::vector<float>{1.0f, -2.0f, 0.5f, 3.0f, 0.0f}));
    // Greedy follows the penalised logits.
    EXPECT_EQ(s.sample(std::vector<float>{3.0f, 2.5f, 0.0f, 0.0f, 0.0f}, Ids{0}, 0, 1), 1);
    EXPECT_EQ(s.sample(std::vector<float>{3.0f, 2.5f, 0.0f, 0.0f, 0.0f}, Ids{}, 0, 1), 0);
}

TEST(Sampler, FrequencyAndPresencePenaltiesAndWindow) {
    SamplingParams p = plain(0.0f);
    p.frequency_penalty = 0.5f;
    p.presence_penalty = 0.25f;
    p.penalty_last_n = -1;
    const std::vector<float> logits = {2.0f, -1.0f, 0.5f, 3.0f, 0.0f};
    const Ids context = {0, 1, 0, 3};
    Sampler all = make(5, p);
    for (int call = 0; call < 2; ++call) {  // the counts are cleared between calls
        (void)all.candidates(logits, context);
        const auto out = all.penalized_logits();
        EXPECT_EQ(std::vector<float>(out.begin(), out.end()),
                  (std::vector<float>{2.0f - 1.0f - 0.25f, -1.0f - 0.5f - 0.25f, 0.5f, 3.0f - 0.75f, 0.0f}));
    }
    p.penalty_last_n = 2;  // only {0, 3}, once each
    Sampler last2 = make(5, p);
    (void)last2.candidates(logits, context);
    auto out = last2.penalized_logits();
    EXPECT_EQ(std::vector<float>(out.begin(), out.end()),
              (std::vector<float>{2.0f - 0.75f, -1.0f, 0.5f, 3.0f - 0.75f, 0.0f}));
    p.penalty_last_n = 0;  // none
    Sampler none = make(5, p);
    (void)none.candidates(logits, context);
    out = none.penalized_logits();
    EXPECT_EQ(std::vector<float>(out.begin(), out.end()), logits);
}

TEST(SamplingParams, PenaltyContextIsWhatThePenaltiesRead) {
    SamplingParams p = plain(0.8f);
    EXPECT_EQ(p.penalty_context(100), 0) << "every penalty off: no context is read";
    p.presence_penalty = 0.5f;
    EXPECT_EQ(p.penalty_context(100), 64);
    EXPECT_EQ(p.penalty_context(10), 10);
    p.penalty_last_n = -1;
    EXPECT_EQ(p.penalty_context(100), 100);
    p.penalty_last_n = 0;
    EXPECT_EQ(p.penalty_context(100), 0);
    p = plain(0.8f);
    p.repetition_penalty = 1.1f;
    EXPECT_EQ(p.penalty_context(3), 3);
    p = plain(0.8f);
    p.frequency_penalty = -0.5f;
    EXPECT_EQ(p.penalty_context(300), 64);
}

TEST(Sampler, SeededAndIndependentOfOtherCalls) {
    const std::vector<float> logits = {0.0f, 0.3f, -0.2f, 0.1f, 0.25f, -0.1f, 0.05f, 0.2f};
    const std::vector<float> other = {2.0f, -1.0f, 0.0f, 0.5f, 0.0f, 1.0f, 0.0f, -3.0f};
    const SamplingParams p = plain();
    Sampler alone = make(8, p);
    Ids reference;
    for (int64_t pos = 0; pos < 100; ++pos) reference.push_back(alone.sample(logits, {}, 7, pos));

    // The same (seed, seq, position) with other sequences sampled in between, in another order.
    Sampler busy = make(8, p);
    Ids interleaved(100);
    for (int64_t pos = 99; pos >= 0; --pos) {
        (void)busy.sample(other, Ids{1, 2}, 3, pos);
        interleaved[static_cast<size_t>(pos)] = busy.sample(logits, {}, 7, pos);
        (void)busy.sample(logits, {}, 8, pos + 1);
    }
    EXPECT_EQ(interleaved, reference);

    // Another sequence, or another seed, gives another stream.
    Ids seq8;
    Ids seed43;
    SamplingParams q = p;
    q.seed = 43;
    Sampler reseeded = make(8, q);
    for (int64_t pos = 0; pos < 100; ++pos) {
        seq8.push_back(alone.sample(logits, {}, 8, pos));
        seed43.push_back(reseeded.sample(logits, {}, 7, pos));
    }
    EXPECT_NE(seq8, reference);
    EXPECT_NE(seed43, reference);
    // A near-uniform distribution over 8 tokens visits all of them in 100 draws.
    std::vector<int> seen(8, 0);
    for (int32_t t : reference) seen[static_cast<size_t>(t)] = 1;
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), 8);
}

double chi_square(const std::vector<int> &counts, const std::vector<double> &expected_probs, int draws) {
    double chi2 = 0.0;
    for (size_t i = 0; i < counts.size(); ++i) {
        const double e = expected_probs[i] * draws;
        if (e == 0.0) {
            if (counts[i] != 0) return std::numeric_limits<double>::infinity();
            continue;
        }
        chi2 += (counts[i] - e) * (counts[i] - e) / e;
    }
    return chi2;
}

std::vector<double> softmax(const std::vector<float> &logits, double temperature, size_t keep) {
    std::vector<double> p(logits.size(), 0.0);
    std::vector<size_t> idx(logits.size());
    std::iota(idx.begin(), idx.end(), size_t{0});
    std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return logits[a] > logits[b]; });
    double sum = 0.0;
    for (size_t i = 0; i < keep; ++i) sum += std::exp(logits[idx[i]] / temperature);
    for (size_t i = 0; i < keep; ++i) p[idx[i]] = std::exp(logits[idx[i]] / temperature) / sum;
    return p;
}

TEST(Sampler, EmpiricalDistributionMatchesSoftmax) {
    const std::vector<float> logits = {0.0f, 0.5f, 1.0f, -1.0f, 2.0f, 0.25f, -0.5f, 1.5f};
    constexpr int kDraws = 20000;
    // Critical chi-square values at p = 0.001: 7 degrees of freedom 24.32, 2 degrees 13.82.
    struct Case {
        float temperature;
        int32_t top_k;
        double bound;
    };
    for (const Case c : {Case{1.0f, 0, 24.32}, Case{2.0f, 0, 24.32}, Case{1.0f, 3, 13.82}}) {
        SamplingParams p = plain(c.temperature);
        p.top_k = c.top_k;
        Sampler s = make(8, p);
        std::vector<int> counts(8, 0);
        for (int i = 0; i < kDraws; ++i) ++counts[static_cast<size_t>(s.sample(logits, {}, 0, i))];
        const auto want = softmax(logits, c.temperature, c.top_k > 0 ? size_t(c.top_k) : logits.size());
        const double chi2 = chi_square(counts, want, kDraws);
        EXPECT_LT(chi2, c.bound) << "temperature " << c.temperature << " top_k " << c.top_k;
        // The statistic has power: the same counts are far from a uniform distribution.
        EXPECT_GT(chi_square(counts, std::vector<double>(8, 1.0 / 8), kDraws), 1000.0);
    }
}

TEST(Sampler, RefusesBadParameters) {
    struct Case {
        SamplingParams p;
        std::string fragment;
    };
    std::vector<Case> cases;
    SamplingParams p = plain();
    p.temperature = -0.5f;
    cases.push_back({p, "sampling temperature: expected a finite value >= 0, found -0.5"});
    p = plain();
    p.temperature = std::numeric_limits<float>::infinity();
    cases.push_back({p, "sampling temperature"});
    p = plain();
    p.top_k = -1;
    cases.push_back({p, "sampling top_k: expected an integer >= 0 (0 = off), found -1"});
    p = plain();
    p.top_p = 0.0f;
    cases.push_back({p, "sampling top_p: expected a value in (0, 1] (1 = off), found 0"});
    p = plain();
    p.top_p = 1.5f;
    cases.push_back({p, "found 1.5"});
    p = plain();
    p.min_p = -0.1f;
    cases.push_back({p, "sampling min_p: expected a value in [0, 1] (0 = off), found -0.1"});
    p = plain();
    p.repetition_penalty = 0.0f;
    cases.push_back({p, "sampling repetition_penalty: expected a finite value > 0 (1 = off), found 0"});
    p = plain();
    p.presence_penalty = std::numeric_limits<float>::quiet_NaN();
    cases.push_back({p, "sampling presence_penalty: expected a finite value"});
    p = plain();
    p.frequency_penalty = -std::numeric_limits<float>::infinity();
    cases.push_back({p, "sampling frequency_penalty: expected a finite value"});
    p = plain();
    p.penalty_last_n = -2;
    cases.push_back({p, "sampling penalty_last_n: expected an integer >= -1 (-1 = whole context), found -2"});
    for (const Case &c : cases) {
        auto s = Sampler::create(4, c.p);
        ASSERT_FALSE(s.has_value()) << c.fragment;
        EXPECT_NE(s.error().message.find(c.fragment), std::string::npos) << s.error().message;
    }
    auto empty = Sampler::create(0, plain());
    ASSERT_FALSE(empty.has_value());
    EXPECT_NE(empty.error().message.find("sampler vocab_size: expected >= 1, found 0"), std::string::npos);
    EXPECT_TRUE(validate_sampling_params(SamplingParams{}).has_value());
}

// Logits in [-3, 3) from a fixed linear congruential sequence (no two equal for n <= 64).
std::vector<float> spread_logits(int32_t n, uint32_t seed) {
    std::vector<float> l;
    uint32_t x = seed;
    for (int32_t i = 0; i < n; ++i) {
        x = x * 1664525u + 1013904223u;
        l.push_back(static_cast<float>(x >> 8) / 16777216.0f * 6.0f - 3.0f);
    }
    return l;
}

// The logits with the bias added by hand (logit + value, the float add the Sampler is documented to do).
std::vector<float> biased(std::vector<float> logits, const std::vector<LogitBias> &bias) {
    for (const LogitBias &b : bias) {
        if (b.id < static_cast<int32_t>(logits.size())) logits[static_cast<size_t>(b.id)] += b.value;
    }
    return logits;
}

int32_t argmax(const std::vector<float> &l) {
    return static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
}

TEST(SamplerLogitBias, MinusHundredRemovesTheGreedyToken) {
    const std::vector<float> logits = spread_logits(48, 7);
    const int32_t greedy = argmax(logits);
    std::vector<float> rest = logits;
    rest[static_cast<size_t>(greedy)] = -std::numeric_limits<float>::infinity();
    const int32_t second = argmax(rest);
    const std::vector<LogitBias> ban{{greedy, -100.0f}};
    Sampler g = make(48, plain(0.0f));
    EXPECT_EQ(g.sample(logits, {}, 0, 3), greedy);
    EXPECT_EQ(g.sample(logits, {}, 0, 3, ban), second);
    Sampler t = make(48, plain(1.0f));
    int64_t drew_greedy_unbiased = 0;
    for (int64_t pos = 0; pos < 300; ++pos) {
        EXPECT_NE(t.sample(logits, {}, 0, pos, ban), greedy) << "position " << pos;
        drew_greedy_unbiased += t.sample(logits, {}, 0, pos) == greedy ? 1 : 0;
    }
    EXPECT_GT(drew_greedy_unbiased, 0);  // without the ban it is drawn
}

TEST(SamplerLogitBias, PlusHundredForcesAToken) {
    const std::vector<float> logits = spread_logits(48, 8);
    std::vector<float> sorted = logits;
    std::sort(sorted.begin(), sorted.end());
    const auto chosen = static_cast<int32_t>(std::find(logits.begin(), logits.end(), sorted[3]) - logits.begin());
    const std::vector<LogitBias> force{{chosen, 100.0f}};
    Sampler g = make(48, plain(0.0f));
    EXPECT_NE(g.sample(logits, {}, 0, 5), chosen);
    EXPECT_EQ(g.sample(logits, {}, 0, 5, force), chosen);
    SamplingParams p = SamplingParams{};  // the default chain: T 0.8, top-k 40, top-p 0.95, min-p 0.05
    p.temperature = 0.8f;
    Sampler t = make(48, p);
    for (int64_t pos = 0; pos < 200; ++pos) {
        EXPECT_EQ(t.sample(logits, {}, 1, pos, force), chosen) << "position " << pos;
        const auto kept = t.candidates(logits, {}, force);
        EXPECT_EQ(Ids(kept.begin(), kept.end()), (Ids{chosen}));
    }
}

TEST(SamplerLogitBias, AppliedBeforePenaltiesTemperatureAndFilters) {
    // Token 1 (logit -1, seen twice) gains 6: bias first, then the repetition penalty divides the positive 5
    // (penalty first would multiply the -1 instead), then frequency and presence subtract.
    SamplingParams p = plain(0.0f);
    p.repetition_penalty = 2.0f;
    p.frequency_penalty = 0.5f;
    p.presence_penalty = 0.25f;
    p.penalty_last_n = -1;
    const std::vector<float> logits = {2.0f, -1.0f, 0.5f, 1.9f, 0.0f};
    const Ids context = {1, 3, 1};
    const std::vector<LogitBias> bias{{1, 6.0f}, {2, -0.5f}, {4, 1.5f}};
    Sampler s = make(5, p);
    (void)s.candidates(logits, context, bias);
    const auto out = s.penalized_logits();
    EXPECT_EQ(std::vector<float>(out.begin(), out.end()),
              (std::vector<float>{2.0f, 5.0f / 2.0f - 1.0f - 0.25f, 0.0f, 1.9f / 2.0f - 0.5f - 0.25f, 1.5f}));
    // Greedy: token 0 (2.0) beats token 1 (1.25); penalties before the bias would make it token 1
    // (-1 * 2 - 1.25 + 6 = 2.75).
    EXPECT_EQ(s.sample(logits, context, 0, 9, bias), 0);

    // Everywhere else the bias is the same as biased logits given to an unbiased Sampler: every filter, the
    // penalties, the temperatures, many positions.
    const std::vector<float> wide = spread_logits(64, 21);
    const std::vector<LogitBias> nudges{{0, 1.25f}, {5, -2.0f}, {9, 3.5f}, {17, 0.75f}, {33, -100.0f}, {63, 2.0f}};
    const Ids history = {5, 9, 9, 17, 40, 5, 2};
    for (const float temperature : {0.0f, 0.5f, 1.0f, 1.7f}) {
        SamplingParams q = SamplingParams{};
        q.temperature = temperature;
        q.repetition_penalty = 1.3f;
        q.frequency_penalty = 0.2f;
        q.presence_penalty = 0.1f;
        q.penalty_last_n = 5;
        Sampler with_bias = make(64, q);
        Sampler by_hand = make(64, q);
        const std::vector<float> hand = biased(wide, nudges);
        for (int64_t pos = 0; pos < 100; ++pos) {
            EXPECT_EQ(with_bias.sample(wide, history, 2, pos, nudges), by_hand.sample(hand, history, 2, pos))
                << "T " << temperature << " position " << pos;
        }
        const auto a = with_bias.candidates(wide, history, nudges);
        const Ids ids_a(a.begin(), a.end());
        const auto b = by_hand.candidates(hand, history);
        EXPECT_EQ(ids_a, Ids(b.begin(), b.end()));
    }
}

TEST(SamplerLogitBias, IdsPastTheSampledOnesAndNaNLogits) {
    // The Sampler is sized for 10 ids, a row gives 8: a bias on id 9 has no logit to move. A NaN logit counts
    // as -Inf before the bias, so no bias revives it.
    const float nan = std::numeric_limits<float>::quiet_NaN();
    Sampler s = make(10, plain(0.0f));
    const std::vector<float> logits = {0.0f, 1.0f, nan, 0.5f, 0.0f, 0.0f, 0.0f, 0.0f};
    EXPECT_EQ(s.sample(logits, {}, 0, 0, std::vector<LogitBias>{{9, 100.0f}}), 1);
    EXPECT_EQ(s.sample(logits, {}, 0, 0, std::vector<LogitBias>{{2, 100.0f}}), 1);
    EXPECT_EQ(s.sample(logits, {}, 0, 0, std::vector<LogitBias>{{2, 100.0f}, {7, 100.0f}}), 7);
}

TEST(SamplerLogitBias, ValidateNamesTheEntryAndTheValue) {
    EXPECT_TRUE(validate_logit_bias({}, 10).has_value());
    EXPECT_TRUE(validate_logit_bias(std::vector<LogitBias>{{0, -100.0f}, {9, 100.0f}}, 10).has_value());
    std::vector<LogitBias> full;
    for (int32_t i = 0; i < kMaxLogitBias; ++i) full.push_back(LogitBias{i, 1.0f});
    EXPECT_TRUE(validate_logit_bias(full, kMaxLogitBias).has_value());
    full.push_back(LogitBias{kMaxLogitBias, 1.0f});
    struct Case {
        std::vector<LogitBias> bias;
        std::string fragment;
    };
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const std::vector<Case> cases = {
        {full, "logit_bias: expected at most 1024 entries, found 1025"},
        {{{-1, 1.0f}}, "logit_bias[0].id: expected a token id in [0, 2000), found -1"},
        {{{3, 1.0f}, {2000, 1.0f}}, "logit_bias[1].id: expected a token id in [0, 2000), found 2000"},
        {{{3, 1.0f}, {2, 1.0f}}, "logit_bias[1].id: expected ids sorted ascending and unique, found 2 after 3"},
        {{{3, 1.0f}, {3, 2.0f}}, "logit_bias[1].id: expected ids sorted ascending and unique, found 3 after 3"},
        {{{3, 100.5f}}, "logit_bias[0].value: expected a finite value in [-100, 100], found 100.5"},
        {{{3, 1.0f}, {4, nan}}, "logit_bias[1].value: expected a finite value in [-100, 100], found nan"},
    };
    for (const Case &c : cases) {
        auto ok = validate_logit_bias(c.bias, 2000);
        ASSERT_FALSE(ok.has_value()) << c.fragment;
        EXPECT_NE(ok.error().message.find(c.fragment), std::string::npos) << ok.error().message;
    }
}

}  // namespace
}  // namespace memra
