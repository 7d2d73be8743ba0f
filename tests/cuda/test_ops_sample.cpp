// backend/cuda/ops_sample: every SampledToken byte (id, flag, chosen and top log-probabilities) equal to
// CpuBackend(1, device).sample over the same logits, rows and history: greedy, temperature, top-k / top-p /
// min-p alone and together, penalties over history windows, 0..20 alternatives, exact ties (equal logits, +-0),
// rows reading different logit rows, n_valid below the row width, adversarial logits (NaN, +-Inf, huge,
// subnormal), logit biases (bans, forced ids, long lists, padding ids) beside unbiased rows, vocabularies of 1000
// and 128k ids, more rows than workspace slots, and the error flag.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/ops_sample.h"
#include "core/float_formats.h"
#include "core/math.h"
#include "core/sampling.h"
#include "cuda/cuda_test_util.h"

namespace memra {
namespace {

// One sampling call: logits [n_logit_rows, vocab], the rows and the history their penalty windows index.
struct Call {
    int32_t vocab = 0;    // row width (the model's vocabulary, padding ids included)
    int32_t n_valid = 0;  // ids that may be drawn
    std::vector<float> logits;
    std::vector<SampleRow> rows;
    std::vector<int32_t> history;
    std::vector<LogitBias> bias;  // the entries the rows' bias ranges index

    int64_t n_logit_rows() const { return static_cast<int64_t>(logits.size()) / vocab; }
};

SamplingParams params(float temperature, int32_t top_k, float top_p, float min_p, uint64_t seed) {
    SamplingParams p;
    p.temperature = temperature;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.seed = seed;
    return p;
}

SamplingParams with_penalties(SamplingParams p, float repetition, float frequency, float presence, int32_t last_n) {
    p.repetition_penalty = repetition;
    p.frequency_penalty = frequency;
    p.presence_penalty = presence;
    p.penalty_last_n = last_n;
    return p;
}

SampleRow row(const SamplingParams &p, uint64_t choice, int64_t position, int32_t logit_row, int32_t history_begin,
              int32_t history_len, int32_t top_logprobs) {
    SampleRow r;
    r.params = p;
    r.choice = choice;
    r.position = position;
    r.logit_row = logit_row;
    r.history_begin = history_begin;
    r.history_len = history_len;
    r.top_logprobs = top_logprobs;
    return r;
}

std::string describe(const SampleRow &r) {
    std::ostringstream s;
    const SamplingParams &p = r.params;
    s << "T " << p.temperature << " top_k " << p.top_k << " top_p " << p.top_p << " min_p " << p.min_p << " rep "
      << p.repetition_penalty << " freq " << p.frequency_penalty << " pres " << p.presence_penalty << " last_n "
      << p.penalty_last_n << " seed " << p.seed << " choice " << r.choice << " pos " << r.position << " logit row "
      << r.logit_row << " history [" << r.history_begin << ", +" << r.history_len << ") top " << r.top_logprobs;
    return s.str();
}

// The reference: CpuBackend's sampling op in device numerics. The out buffer starts zeroed (alloc), so the
// bytes the op leaves alone are zero.
std::vector<SampledToken> cpu_sample(const Call &c) {
    cpu::CpuBackend be(1, Numerics::kDevice);
    EXPECT_TRUE(be.prepare_sampling(c.vocab).has_value());
    const std::vector<int32_t> history = c.history.empty() ? std::vector<int32_t>{0} : c.history;
    auto lg = be.alloc(DType::kF32, {c.n_logit_rows(), c.vocab});
    auto rv = be.alloc(DType::kU8, {static_cast<int64_t>(c.rows.size() * sizeof(SampleRow))});
    auto hv = be.alloc(DType::kI32, {static_cast<int64_t>(history.size())});
    const auto bias_bytes = static_cast<int64_t>(c.bias.size() * sizeof(LogitBias));
    auto bv = be.alloc(DType::kU8, {std::max<int64_t>(bias_bytes, 1)});
    auto out = be.alloc(DType::kU8, {static_cast<int64_t>(c.rows.size() * sizeof(SampledToken))});
    be.copy_from_host(c.logits.data(), *lg);
    be.copy_from_host(c.rows.data(), *rv);
    be.copy_from_host(history.data(), *hv);
    const TensorView bias_view = bv->row_slice(0, bias_bytes);
    if (bias_bytes > 0) be.copy_from_host(c.bias.data(), bias_view);
    be.sample(*lg, c.n_valid, *rv, *hv, bias_view, *out);
    std::vector<SampledToken> tokens(c.rows.size());
    be.copy_to_host(*out, tokens.data());
    return tokens;
}

// The kernel, over a zeroed out buffer and a workspace of `slots` row slots (0: one per row).
std::vector<SampledToken> gpu_sample(const Call &c, int64_t slots = 0, int32_t *flag_out = nullptr) {
    const auto n_rows = static_cast<int64_t>(c.rows.size());
    if (slots == 0) slots = n_rows;
    const std::vector<int32_t> history = c.history.empty() ? std::vector<int32_t>{0} : c.history;
    DeviceBuffer d_logits = to_device(c.logits);
    DeviceBuffer d_rows(c.rows.size() * sizeof(SampleRow));
    d_rows.upload(c.rows.data());
    DeviceBuffer d_history = to_device(history);
    const std::vector<LogitBias> bias = c.bias.empty() ? std::vector<LogitBias>{LogitBias{}} : c.bias;
    DeviceBuffer d_bias(bias.size() * sizeof(LogitBias));
    d_bias.upload(bias.data());
    DeviceBuffer d_out(c.rows.size() * sizeof(SampledToken));
    EXPECT_EQ(cudaMemset(d_out.as<void>(), 0, c.rows.size() * sizeof(SampledToken)), cudaSuccess);
    const int64_t ws_bytes = cuda::sample_workspace_bytes(c.vocab, slots);
    DeviceBuffer d_ws(static_cast<size_t>(ws_bytes));
    DeviceBuffer d_flag = to_device(std::vector<int32_t>{0});
    EXPECT_EQ(cuda::sample(d_logits.as<float>(), c.n_logit_rows(), c.vocab, c.n_valid, d_rows.as<SampleRow>(), n_rows,
                           d_history.as<int32_t>(), static_cast<int64_t>(c.history.size()),
                           c.bias.empty() ? nullptr : d_bias.as<LogitBias>(), static_cast<int64_t>(c.bias.size()),
                           d_out.as<SampledToken>(),
                           d_ws.as<void>(), ws_bytes, c.vocab, d_flag.as<int32_t>(), nullptr),
              cudaSuccess);
    std::vector<SampledToken> tokens(c.rows.size());
    d_out.download(tokens.data());
    const int32_t flag = from_device<int32_t>(d_flag, 1)[0];
    if (flag_out != nullptr) {
        *flag_out = flag;
    } else {
        EXPECT_EQ(flag, 0);
    }
    return tokens;
}

// Every byte of every token equal; the first mismatches are reported with their rows.
void expect_same_tokens(const std::vector<SampledToken> &got, const std::vector<SampledToken> &want,
                        const std::vector<SampleRow> &rows) {
    ASSERT_EQ(got.size(), want.size());
    int64_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::memcmp(&got[i], &want[i], sizeof(SampledToken)) == 0) continue;
        if (++bad > 8) continue;
        std::ostringstream s;
        s << "row " << i << " (" << describe(rows[i]) << "): id " << got[i].id << " vs cpu " << want[i].id
          << ", has_logprobs " << got[i].has_logprobs << " vs " << want[i].has_logprobs << ", chosen bits "
          << f32_as_u32(got[i].logprobs.chosen) << " vs " << f32_as_u32(want[i].logprobs.chosen) << ", n_top "
          << got[i].logprobs.n_top << " vs " << want[i].logprobs.n_top;
        for (int j = 0; j < kMaxTopLogprobs; ++j) {
            if (got[i].logprobs.top_ids[j] != want[i].logprobs.top_ids[j] ||
                f32_as_u32(got[i].logprobs.top_logprobs[j]) != f32_as_u32(want[i].logprobs.top_logprobs[j])) {
                s << ", first top difference at " << j << ": id " << got[i].logprobs.top_ids[j] << " vs "
                  << want[i].logprobs.top_ids[j];
                break;
            }
        }
        ADD_FAILURE() << s.str();
    }
    EXPECT_EQ(bad, 0) << "rows differing from the CPU";
}

size_t distinct_ids(const std::vector<SampledToken> &tokens) {
    std::set<int32_t> ids;
    for (const SampledToken &t : tokens) ids.insert(t.id);
    return ids.size();
}

// Logit rows of several shapes: wide uniform, normal, peaked (a few large, the rest far below), narrow (every id
// within 1e-3: all relevant), and one whose ids past n_valid hold the largest values.
std::vector<float> shaped_logits(int32_t vocab, int32_t n_valid, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<float> l(static_cast<size_t>(5) * static_cast<size_t>(vocab));
    std::uniform_real_distribution<float> wide(-8.0f, 8.0f);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::normal_distribution<float> low(-6.0f, 2.0f);
    std::uniform_real_distribution<float> narrow(0.0f, 1e-3f);
    for (int32_t i = 0; i < vocab; ++i) {
        const auto u = static_cast<size_t>(i);
        const auto v = static_cast<size_t>(vocab);
        l[u] = wide(rng);
        l[v + u] = normal(rng);
        l[2 * v + u] = low(rng);
        l[3 * v + u] = narrow(rng);
        l[4 * v + u] = i >= n_valid ? 40.0f + static_cast<float>(i % 7) : normal(rng);
    }
    for (int k = 0; k < 6; ++k) {
        const size_t at = 2 * static_cast<size_t>(vocab) + rng() % static_cast<uint32_t>(n_valid);
        l[at] = 9.0f + 0.5f * static_cast<float>(k);
    }
    return l;
}

// History tokens in [0, vocab), repeated ones and padding ids among them.
std::vector<int32_t> random_history(int32_t vocab, size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<int32_t> h(n);
    for (size_t i = 0; i < n; ++i) {
        const uint32_t bound = rng() % 4 == 0 ? 16u : static_cast<uint32_t>(vocab);  // a quarter among 16 ids
        h[i] = static_cast<int32_t>(rng() % bound);
    }
    return h;
}

// Rows over every filter and penalty setting, picked at random from small sets.
std::vector<SampleRow> random_rows(size_t n, int32_t n_logit_rows, int32_t history_size, uint32_t seed) {
    std::mt19937 rng(seed);
    const float temps[] = {0.0f, 0.3f, 0.7f, 1.0f, 1.5f};
    const int32_t top_ks[] = {0, 1, 5, 40, 999, 2000};
    const float top_ps[] = {1.0f, 0.95f, 0.5f, 0.1f};
    const float min_ps[] = {0.0f, 0.05f, 0.3f, 1e-7f};
    std::vector<SampleRow> rows;
    for (size_t i = 0; i < n; ++i) {
        SamplingParams p = params(temps[rng() % 5], top_ks[rng() % 6], top_ps[rng() % 4], min_ps[rng() % 4], rng());
        switch (rng() % 4) {
        case 0: p = with_penalties(p, 1.3f, 0.5f, 0.25f, 64); break;
        case 1: p = with_penalties(p, 0.8f, -0.2f, 0.0f, -1); break;  // a penalty below 1 rewards repetition
        case 2: p = with_penalties(p, 1.0f, 0.0f, 1.5f, 7); break;
        default: break;  // no penalties
        }
        const auto h_begin = static_cast<int32_t>(rng() % static_cast<uint32_t>(history_size));
        const auto h_len = static_cast<int32_t>(rng() % static_cast<uint32_t>(history_size - h_begin + 1));
        const auto top = static_cast<int32_t>(rng() % 23) - 1;  // -1 .. 21, clamped below
        const auto logit_row = static_cast<int32_t>(i % static_cast<size_t>(n_logit_rows));
        rows.push_back(row(p, rng() % 3, static_cast<int64_t>(rng() % 100000), logit_row, h_begin, h_len,
                           std::min(top, kMaxTopLogprobs)));
    }
    return rows;
}

TEST(CudaSample, Vocab1000EveryFilterAndPenalty) {
    MEMRA_SKIP_WITHOUT_GPU();
    for (int32_t n_valid : {1000, 937}) {
        Call c;
        c.vocab = 1000;
        c.n_valid = n_valid;
        c.logits = shaped_logits(c.vocab, n_valid, 11);
        c.history = random_history(c.vocab, 300, 12);
        c.rows = random_rows(240, 5, 300, static_cast<uint32_t>(n_valid));
        const std::vector<SampledToken> want = cpu_sample(c);
        const std::vector<SampledToken> got = gpu_sample(c);
        expect_same_tokens(got, want, c.rows);
        EXPECT_GT(distinct_ids(want), 40u);  // the rows really draw
        for (const SampledToken &t : got) EXPECT_LT(t.id, n_valid);
    }
}

TEST(CudaSample, EveryLogprobCountAndSignedZeros) {
    MEMRA_SKIP_WITHOUT_GPU();
    Call c;
    c.vocab = 333;
    c.n_valid = 300;
    c.logits = shaped_logits(c.vocab, c.n_valid, 5);
    // Row 3: only +0 and -0 (the log-softmax top takes the sign of the first one).
    for (int32_t i = 0; i < c.vocab; ++i) c.logits[static_cast<size_t>(3 * c.vocab + i)] = i % 3 == 1 ? 0.0f : -0.0f;
    c.history = random_history(c.vocab, 50, 6);
    for (int32_t top = -1; top <= kMaxTopLogprobs; ++top) {
        for (int32_t lr = 0; lr < 5; ++lr) {
            c.rows.push_back(row(params(lr == 0 ? 0.0f : 0.9f, 0, 0.9f, 0.02f, 77), 0, 1000 + top, lr, 3, 40, top));
        }
    }
    expect_same_tokens(gpu_sample(c), cpu_sample(c), c.rows);
}

TEST(CudaSample, EqualLogitsTieToTheLowerId) {
    MEMRA_SKIP_WITHOUT_GPU();
    Call c;
    c.vocab = 1000;
    c.n_valid = 1000;
    c.logits.assign(3 * 1000, 0.25f);  // row 0: every id equal
    std::mt19937 rng(3);
    for (size_t i = 1000; i < 2000; ++i) c.logits[i] = static_cast<float>(rng() % 3);  // row 1: three tie classes
    for (size_t i = 2000; i < 3000; ++i) c.logits[i] = -1.0f;                          // row 2: ties but 2 peaks
    c.logits[2500] = 4.0f;
    c.logits[2100] = 4.0f;
    for (int32_t lr = 0; lr < 3; ++lr) {
        c.rows.push_back(row(params(0.0f, 0, 1.0f, 0.0f, 1), 0, 5, lr, 0, 0, kMaxTopLogprobs));
        for (uint64_t seed = 0; seed < 12; ++seed) {
            c.rows.push_back(row(params(1.0f, 10, 1.0f, 0.0f, seed), 0, 5, lr, 0, 0, -1));         // top-k among ties
            c.rows.push_back(row(params(0.7f, 0, 0.3f, 0.0f, seed), seed % 2, 9, lr, 0, 0, 3));    // top-p among ties
            c.rows.push_back(row(params(1.3f, 0, 1.0f, 0.5f, seed), 0, 17, lr, 0, 0, -1));         // min-p among ties
            c.rows.push_back(row(params(1.0f, 0, 1.0f, 0.0f, seed), 1, 100 + seed, lr, 0, 0, 0));  // everything
        }
    }
    const std::vector<SampledToken> want = cpu_sample(c);
    const std::vector<SampledToken> got = gpu_sample(c);
    expect_same_tokens(got, want, c.rows);
    EXPECT_EQ(got[0].id, 0);  // greedy over equal logits: the lowest id
    for (int j = 0; j < kMaxTopLogprobs; ++j) EXPECT_EQ(got[0].logprobs.top_ids[j], j);
    // Top-k 10 over equal logits keeps ids 0..9 only.
    for (size_t i = 1; i < 49; i += 4) EXPECT_LT(got[i].id, 10) << describe(c.rows[i]);
    EXPECT_GT(distinct_ids(std::vector<SampledToken>(got.begin() + 1, got.begin() + 49)), 4u);
}

TEST(CudaSample, TopPCutAtTheExactCumulativeSum) {
    MEMRA_SKIP_WITHOUT_GPU();
    // Three near-equal leaders over 997 lower logits, and top_p set to the CPU's own cumulative sum after two
    // candidates (kept: 2) or one ulp above it (kept: 3). The cut, and so whether the third leader can be drawn,
    // hinges on the last bit of the softmax sum over all 1000 weights in descending order: a kernel that sums
    // in another order or drops terms that matter moves it, and the draws over 64 seeds show it.
    Call c;
    c.vocab = 1000;
    c.n_valid = 1000;
    std::mt19937 rng(51);
    std::uniform_real_distribution<float> dist(-3.0f, 1.0f);
    c.logits.resize(1000);
    for (float &x : c.logits) x = dist(rng);
    c.logits[10] = 2.0f;
    c.logits[500] = 1.99f;
    c.logits[990] = 1.98f;
    const float temperature = 0.9f;
    std::vector<float> score(1000);
    for (size_t i = 0; i < 1000; ++i) score[i] = c.logits[i] / temperature;
    std::vector<int32_t> order(1000);
    for (int32_t i = 0; i < 1000; ++i) order[static_cast<size_t>(i)] = i;
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        const float sa = score[static_cast<size_t>(a)];
        const float sb = score[static_cast<size_t>(b)];
        return sa > sb || (sa == sb && a < b);
    });
    const float top = score[static_cast<size_t>(order[0])];
    float sum = 0.0f;
    for (int32_t id : order) sum += exp_f32(score[static_cast<size_t>(id)] - top);
    float cumulative = 0.0f;
    cumulative += exp_f32(score[static_cast<size_t>(order[0])] - top) / sum;
    cumulative += exp_f32(score[static_cast<size_t>(order[1])] - top) / sum;
    const float above = std::nextafter(cumulative, 1.0f);
    for (uint64_t seed = 0; seed < 64; ++seed) {
        c.rows.push_back(row(params(temperature, 0, cumulative, 0.0f, seed), 0, 7, 0, 0, 0, -1));
        c.rows.push_back(row(params(temperature, 0, above, 0.0f, seed), 0, 7, 0, 0, 0, -1));
    }
    const std::vector<SampledToken> want = cpu_sample(c);
    expect_same_tokens(gpu_sample(c), want, c.rows);
    int third = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        if (i % 2 == 0) {
            EXPECT_TRUE(want[i].id == 10 || want[i].id == 500) << want[i].id;
        }
        third += i % 2 == 1 && want[i].id == 990 ? 1 : 0;
    }
    EXPECT_GT(third, 0);  // one ulp of top_p really changes the draws
}

TEST(CudaSample, AdversarialLogits) {
    MEMRA_SKIP_WITHOUT_GPU();
    const float inf = std::numeric_limits<float>::infinity();
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const int32_t vocab = 257;
    std::vector<std::vector<float>> lrows;
    std::mt19937 rng(9);
    std::uniform_real_distribution<float> dist(-5.0f, 5.0f);
    auto random_row = [&] {
        std::vector<float> r(vocab);
        for (float &x : r) x = dist(rng);
        return r;
    };
    lrows.push_back(random_row());
    for (int i = 0; i < vocab; i += 5) lrows.back()[static_cast<size_t>(i)] = nan;  // NaN counts as -Inf
    lrows.push_back(random_row());
    for (int i = 0; i < vocab; i += 3) lrows.back()[static_cast<size_t>(i)] = -inf;
    lrows.push_back(random_row());
    lrows.back()[200] = inf;  // a +Inf logit: the top score is not finite
    lrows.back()[17] = inf;
    lrows.push_back(std::vector<float>(vocab, -inf));  // every logit -Inf: the lowest id
    lrows.push_back(std::vector<float>(vocab, nan));   // every logit NaN: as -Inf
    lrows.push_back(random_row());
    for (float &x : lrows.back()) x = x * 1e-39f;  // subnormal logits
    lrows.push_back(random_row());
    for (float &x : lrows.back()) x = x * 6e37f;  // huge: a temperature below 1 overflows the scores
    lrows.push_back(random_row());
    lrows.back()[0] = nan;  // a NaN at id 0 counts as -Inf: greedy does not keep id 0
    Call c;
    c.vocab = vocab;
    c.n_valid = vocab;
    for (const auto &r : lrows) c.logits.insert(c.logits.end(), r.begin(), r.end());
    c.history = random_history(vocab, 64, 10);
    const auto n_lrows = static_cast<int32_t>(lrows.size());
    const SamplingParams settings[] = {
        params(0.0f, 0, 1.0f, 0.0f, 1),
        params(1.0f, 0, 1.0f, 0.0f, 2),
        params(0.5f, 20, 0.9f, 0.05f, 3),
        params(1e-30f, 0, 1.0f, 0.0f, 4),  // scores overflow to +-Inf
        params(3.0f, 3, 1.0f, 0.0f, 5),
        with_penalties(params(0.8f, 0, 0.95f, 0.0f, 6), 1.5f, 0.75f, 0.5f, -1),
        with_penalties(params(0.0f, 0, 1.0f, 0.0f, 7), 2.0f, 1.0f, 3.0f, 10),
    };
    for (int32_t lr = 0; lr < n_lrows; ++lr) {
        int32_t k = 0;
        for (const SamplingParams &p : settings) {
            c.rows.push_back(row(p, 0, 300 + k, lr, 0, 64, k % 2 == 0 ? kMaxTopLogprobs : 4));
            ++k;
        }
    }
    expect_same_tokens(gpu_sample(c), cpu_sample(c), c.rows);
}

TEST(CudaSample, Vocab128k) {
    MEMRA_SKIP_WITHOUT_GPU();
    Call c;
    c.vocab = 128896;
    c.n_valid = 128815;
    const auto v = static_cast<size_t>(c.vocab);
    c.logits.resize(5 * v);
    std::mt19937 rng(21);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::normal_distribution<float> lm(-4.0f, 2.5f);
    for (size_t i = 0; i < v; ++i) {
        c.logits[i] = normal(rng);  // every id within 20 of the top: the whole row is sorted
        c.logits[v + i] = lm(rng);  // a real model's shape: a few peaks far above the rest
        c.logits[2 * v + i] = 1.5f;  // all equal: one score bucket of every id
        c.logits[3 * v + i] = normal(rng);
        c.logits[4 * v + i] = normal(rng);
    }
    for (int k = 0; k < 40; ++k) c.logits[v + rng() % v] = 12.0f + 0.25f * static_cast<float>(k % 9);
    // Row 3: a leader, then 6000 equal scores: one bucket of more than a shared-memory chunk (the network over all).
    c.logits[3 * v + 77] = 9.0f;
    for (int k = 0; k < 6000; ++k) c.logits[3 * v + (rng() % v)] = 5.0f;
    // Row 4: the same with 1000 equal scores, a bucket sorted by the whole block in shared memory.
    c.logits[4 * v + 77] = 9.0f;
    for (int k = 0; k < 1000; ++k) c.logits[4 * v + (rng() % v)] = 5.0f;
    c.history = random_history(c.vocab, 5000, 22);
    for (int32_t lr = 0; lr < 5; ++lr) {
        c.rows.push_back(row(params(0.0f, 0, 1.0f, 0.0f, 1), 0, 10, lr, 0, 0, kMaxTopLogprobs));
        c.rows.push_back(row(params(1.0f, 0, 1.0f, 0.0f, 2), 0, 11, lr, 0, 0, 5));  // the full sorted sum
        c.rows.push_back(row(params(0.8f, 50, 0.9f, 0.05f, 3), 0, 12, lr, 0, 0, -1));
        c.rows.push_back(row(params(1.2f, 0, 0.5f, 0.0f, 4), 1, 13, lr, 0, 0, 1));
        c.rows.push_back(row(params(1.0f, 0, 1.0f, 1e-7f, 5), 0, 14, lr, 0, 0, 0));
        c.rows.push_back(
            row(with_penalties(params(0.7f, 0, 0.95f, 0.0f, 6), 1.2f, 0.3f, 0.1f, -1), 0, 15, lr, 0, 5000, 20));
        c.rows.push_back(row(params(0.8f, 40, 1.0f, 0.0f, 7), 0, 16, lr, 0, 0, -1));  // top-k alone: a sorted prefix
        c.rows.push_back(row(params(1.0f, 10000, 0.95f, 0.0f, 8), 0, 17, lr, 0, 0, -1));  // a prefix of many runs
        c.rows.push_back(row(params(0.8f, 40, 0.95f, 0.05f, 9), 0, 18, lr, 0, 0, -1));    // the CLI's defaults
    }
    const std::vector<SampledToken> want = cpu_sample(c);
    const std::vector<SampledToken> got = gpu_sample(c);
    expect_same_tokens(got, want, c.rows);
    for (const SampledToken &t : got) EXPECT_LT(t.id, c.n_valid);
}

TEST(CudaSample, MoreRowsThanWorkspaceSlots) {
    MEMRA_SKIP_WITHOUT_GPU();
    Call c;
    c.vocab = 1000;
    c.n_valid = 990;
    c.logits = shaped_logits(c.vocab, c.n_valid, 31);
    c.history = random_history(c.vocab, 100, 32);
    c.rows = random_rows(23, 5, 100, 33);
    const std::vector<SampledToken> want = cpu_sample(c);
    expect_same_tokens(gpu_sample(c, 3), want, c.rows);
    expect_same_tokens(gpu_sample(c, 1), want, c.rows);
}

// Runs `call` with a corrupted copy (corrupt(row, i)) before each of its first n rows, which must sample `want`:
// every corrupted row gets id -1 without log-probabilities and raises the flag, every good row is unchanged.
void expect_bad_rows_flagged(Call call, size_t n, const std::vector<SampledToken> &want,
                             const std::function<void(SampleRow &, size_t)> &corrupt) {
    const std::vector<SampleRow> good = call.rows;
    call.rows.clear();
    std::vector<size_t> good_at;
    for (size_t i = 0; i < n; ++i) {
        SampleRow b = good[i];
        corrupt(b, i);
        call.rows.push_back(b);
        good_at.push_back(call.rows.size());
        call.rows.push_back(good[i]);
    }
    int32_t flag = 0;
    const std::vector<SampledToken> got = gpu_sample(call, 0, &flag);
    EXPECT_EQ(flag, 1);
    for (size_t i = 0; i < n; ++i) {
        EXPECT_EQ(got[2 * i].id, -1);
        EXPECT_EQ(got[2 * i].has_logprobs, 0);
        EXPECT_EQ(std::memcmp(&got[good_at[i]], &want[i], sizeof(SampledToken)), 0) << describe(good[i]);
    }
}

TEST(CudaSample, BadRowsAreFlaggedAndLeaveTheOthersAlone) {
    MEMRA_SKIP_WITHOUT_GPU();
    Call good;
    good.vocab = 500;
    good.n_valid = 480;
    good.logits = shaped_logits(good.vocab, good.n_valid, 41);
    good.history = random_history(good.vocab, 40, 42);
    good.rows = random_rows(6, 5, 40, 43);
    const std::vector<SampledToken> want = cpu_sample(good);

    // The same rows with bad ones between them: a logit row past the buffer, a history range past it, too many
    // alternatives, a negative position.
    expect_bad_rows_flagged(good, good.rows.size(), want, [](SampleRow &b, size_t i) {
        switch (i % 4) {
        case 0: b.logit_row = 5; break;
        case 1: b.history_len = 41; b.history_begin = 0; break;
        case 2: b.top_logprobs = kMaxTopLogprobs + 1; break;
        default: b.position = -1; break;
        }
    });

    // A history token past the workspace vocabulary is skipped (and flagged) like a padding id.
    Call hist = good;
    hist.history[5] = 100000;
    Call padded = good;
    padded.history[5] = good.vocab - 1;  // a padding id: skipped without a flag
    int32_t flag = 0;
    const std::vector<SampledToken> got_hist = gpu_sample(hist, 0, &flag);
    bool reads_5 = false;
    for (const SampleRow &r : good.rows) {
        const int64_t window = r.params.penalty_context(r.history_len);
        reads_5 = reads_5 || (r.history_begin + r.history_len - window <= 5 && 5 < r.history_begin + r.history_len);
    }
    EXPECT_EQ(flag, reads_5 ? 1 : 0);
    expect_same_tokens(got_hist, cpu_sample(padded), good.rows);
}

// A sorted unique bias list of n <= vocab entries over [0, vocab) (padding ids among them), values in
// [-100, 100] with the ends and small nudges among them.
std::vector<LogitBias> random_bias(int32_t vocab, size_t n, uint32_t seed) {
    EXPECT_LE(n, static_cast<size_t>(vocab));
    if (n > static_cast<size_t>(vocab)) return {};
    std::mt19937 rng(seed);
    std::set<int32_t> ids;
    while (ids.size() < n) ids.insert(static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab)));
    const float values[] = {-100.0f, 100.0f, -3.5f, 2.25f, 0.0f, -0.001f, 7.0f, 0.37f};
    std::vector<LogitBias> bias;
    for (const int32_t id : ids) bias.push_back(LogitBias{id, values[rng() % 8]});
    return bias;
}

TEST(CudaSample, LogitBiasRowsBesideUnbiasedOnes) {
    MEMRA_SKIP_WITHOUT_GPU();
    Call c;
    c.vocab = 1500;  // room for a list of kMaxLogitBias distinct ids
    c.n_valid = 1401;
    c.logits = shaped_logits(c.vocab, c.n_valid, 61);
    c.history = random_history(c.vocab, 200, 62);
    // The lists: a ban of each logit row's greedy token, a forced id (and a forced padding id, which has no
    // logit), random lists of 1 .. 300 entries, and one of kMaxLogitBias entries (more than a block's threads).
    std::vector<std::pair<int32_t, int32_t>> lists;
    const auto add_list = [&](const std::vector<LogitBias> &l) {
        lists.emplace_back(static_cast<int32_t>(c.bias.size()), static_cast<int32_t>(l.size()));
        c.bias.insert(c.bias.end(), l.begin(), l.end());
    };
    for (int32_t lr = 0; lr < 5; ++lr) {
        const float *row0 = c.logits.data() + static_cast<size_t>(lr) * static_cast<size_t>(c.vocab);
        const auto greedy = static_cast<int32_t>(std::max_element(row0, row0 + c.n_valid) - row0);
        add_list({LogitBias{greedy, -100.0f}});
    }
    add_list({LogitBias{123, 100.0f}, LogitBias{1450, 100.0f}});
    for (uint32_t k = 0; k < 6; ++k) add_list(random_bias(c.vocab, 1 + (k * 59) % 300, 70 + k));
    add_list(random_bias(c.vocab, kMaxLogitBias, 80));
    const std::vector<SampleRow> plain = random_rows(120, 5, 200, 63);
    for (size_t i = 0; i < plain.size(); ++i) {
        c.rows.push_back(plain[i]);
        SampleRow b = plain[i];
        const auto &[begin, len] = lists[i % lists.size()];
        b.bias_begin = begin;
        b.bias_len = len;
        c.rows.push_back(b);
    }
    const std::vector<SampledToken> want = cpu_sample(c);
    const std::vector<SampledToken> got = gpu_sample(c);
    expect_same_tokens(got, want, c.rows);
    size_t changed = 0;
    for (size_t i = 0; i < plain.size(); ++i) {
        changed += want[2 * i].id != want[2 * i + 1].id ? 1 : 0;
        if (i % lists.size() == 5) {
            EXPECT_EQ(got[2 * i + 1].id, 123) << describe(c.rows[2 * i + 1]);
        }
    }
    EXPECT_GT(changed, 30u);  // the bias acts

    // Bad bias ranges are flagged and leave the other rows alone: past the buffer, unsorted, an id past the
    // workspace vocabulary.
    Call bad = c;
    bad.bias.push_back(LogitBias{10, 1.0f});
    bad.bias.push_back(LogitBias{5, 1.0f});
    bad.bias.push_back(LogitBias{c.vocab, 1.0f});
    const auto at = static_cast<int32_t>(c.bias.size());
    const std::pair<int32_t, int32_t> bad_ranges[] = {{at, 4}, {at, 2}, {at + 2, 1}};
    expect_bad_rows_flagged(bad, 6, want, [&](SampleRow &b, size_t i) {
        b.bias_begin = bad_ranges[i % 3].first;
        b.bias_len = bad_ranges[i % 3].second;
    });
}

TEST(CudaSample, RejectsBadArguments) {
    MEMRA_SKIP_WITHOUT_GPU();
    const int64_t ws_bytes = cuda::sample_workspace_bytes(100, 1);
    EXPECT_EQ(ws_bytes, cuda::sample_workspace_slot_bytes(100));
    EXPECT_EQ(ws_bytes % 256, 0);
    EXPECT_EQ(cuda::sample_workspace_bytes(0, 1), 0);
    DeviceBuffer d_ws(static_cast<size_t>(ws_bytes)), d(1 << 16);
    auto *rows = d.as<SampleRow>();
    auto *out = reinterpret_cast<SampledToken *>(d.as<unsigned char>() + 8192);
    const float *lg = d.as<float>();
    void *ws = d_ws.as<void>();
    // n_valid past the workspace's vocabulary or the row width; a workspace too small; null or misaligned buffers.
    EXPECT_EQ(cuda::sample(lg, 1, 200, 101, rows, 1, nullptr, 0, nullptr, 0, out, ws, ws_bytes, 100, nullptr, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::sample(lg, 1, 50, 60, rows, 1, nullptr, 0, nullptr, 0, out, ws, ws_bytes, 100, nullptr, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::sample(lg, 1, 100, 100, rows, 1, nullptr, 0, nullptr, 0, out, ws, ws_bytes - 1, 100, nullptr,
                           nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::sample(nullptr, 1, 100, 100, rows, 1, nullptr, 0, nullptr, 0, out, ws, ws_bytes, 100, nullptr,
                           nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::sample(lg, 1, 100, 100, reinterpret_cast<const SampleRow *>(d.as<unsigned char>() + 4), 1,
                           nullptr, 0, nullptr, 0, out, ws, ws_bytes, 100, nullptr, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::sample(lg, 1, 100, 100, rows, 1, nullptr, 5, nullptr, 0, out, ws, ws_bytes, 100, nullptr, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::sample(lg, 1, 100, 0, rows, 1, nullptr, 0, nullptr, 0, out, ws, ws_bytes, 100, nullptr, nullptr),
              cudaErrorInvalidValue);
    // A bias size without a bias buffer, a negative one, a misaligned bias buffer.
    EXPECT_EQ(cuda::sample(lg, 1, 100, 100, rows, 1, nullptr, 0, nullptr, 3, out, ws, ws_bytes, 100, nullptr, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::sample(lg, 1, 100, 100, rows, 1, nullptr, 0, reinterpret_cast<const LogitBias *>(lg), -1, out, ws,
                           ws_bytes, 100, nullptr, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::sample(lg, 1, 100, 100, rows, 1, nullptr, 0,
                           reinterpret_cast<const LogitBias *>(d.as<unsigned char>() + 2), 1, out, ws, ws_bytes, 100,
                           nullptr, nullptr),
              cudaErrorInvalidValue);
    // No rows: nothing to launch.
    EXPECT_EQ(cuda::sample(lg, 1, 100, 100, nullptr, 0, nullptr, 0, nullptr, 0, nullptr, nullptr, 0, 100, nullptr,
                           nullptr),
              cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace memra
