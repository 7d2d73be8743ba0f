// Sampler: the penalty / temperature / top-k / top-p / min-p chain over a prepared workspace, the
// Gumbel-max draw from Philox4x32-10 noise keyed by (seed, choice index, position, token id), and the
// log-probabilities of the chosen and the most likely tokens.
#include "core/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/check.h"
#include "core/float_formats.h"
#include "core/math.h"

namespace memra {

Result<void> validate_sampling_params(const SamplingParams &p) {
    if (!std::isfinite(p.temperature) || p.temperature < 0.0f) {
        return make_error("sampling temperature: expected a finite value >= 0, found {}", p.temperature);
    }
    if (p.top_k < 0) return make_error("sampling top_k: expected an integer >= 0 (0 = off), found {}", p.top_k);
    if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
        return make_error("sampling top_p: expected a value in (0, 1] (1 = off), found {}", p.top_p);
    }
    if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) {
        return make_error("sampling min_p: expected a value in [0, 1] (0 = off), found {}", p.min_p);
    }
    if (!std::isfinite(p.repetition_penalty) || p.repetition_penalty <= 0.0f) {
        return make_error("sampling repetition_penalty: expected a finite value > 0 (1 = off), found {}",
                          p.repetition_penalty);
    }
    if (!std::isfinite(p.presence_penalty)) {
        return make_error("sampling presence_penalty: expected a finite value, found {}", p.presence_penalty);
    }
    if (!std::isfinite(p.frequency_penalty)) {
        return make_error("sampling frequency_penalty: expected a finite value, found {}", p.frequency_penalty);
    }
    if (p.penalty_last_n < -1) {
        return make_error("sampling penalty_last_n: expected an integer >= -1 (-1 = whole context), found {}",
                          p.penalty_last_n);
    }
    return {};
}

Result<void> validate_logit_bias(std::span<const LogitBias> bias, int32_t vocab) {
    if (bias.size() > static_cast<size_t>(kMaxLogitBias)) {
        return make_error("logit_bias: expected at most {} entries, found {}", kMaxLogitBias, bias.size());
    }
    for (size_t i = 0; i < bias.size(); ++i) {
        const LogitBias &b = bias[i];
        if (b.id < 0 || b.id >= vocab) {
            return make_error("logit_bias[{}].id: expected a token id in [0, {}), found {}", i, vocab, b.id);
        }
        if (i > 0 && b.id <= bias[i - 1].id) {
            return make_error("logit_bias[{}].id: expected ids sorted ascending and unique, found {} after {}", i, b.id,
                              bias[i - 1].id);
        }
        if (!std::isfinite(b.value) || b.value < -kMaxLogitBiasValue || b.value > kMaxLogitBiasValue) {
            return make_error("logit_bias[{}].value: expected a finite value in [{}, {}], found {}", i,
                              -kMaxLogitBiasValue, kMaxLogitBiasValue, b.value);
        }
    }
    return {};
}

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
    philox4x32_10_words(c.data(), k[0], k[1]);
    return c;
}

float philox_uniform(uint64_t seed, uint64_t choice, int64_t position, int32_t id) {
    MEMRA_CHECK(position >= 0 && position <= int64_t{0xffffffff}, "position {} outside [0, 2^32)", position);
    MEMRA_CHECK(id >= 0, "token id {} < 0", id);
    return philox_uniform_unchecked(seed, choice, position, id);
}

float gumbel_noise(uint64_t seed, uint64_t choice, int64_t position, int32_t id) {
    return gumbel_from_uniform(philox_uniform(seed, choice, position, id));
}

Result<Sampler> Sampler::create(int32_t vocab_size, const SamplingParams &params) {
    if (vocab_size < 1) return make_error("sampler vocab_size: expected >= 1, found {}", vocab_size);
    if (auto ok = validate_sampling_params(params); !ok) return tl::unexpected(ok.error());
    Sampler s;
    s.params_ = params;
    s.vocab_size_ = vocab_size;
    const auto n = static_cast<size_t>(vocab_size);
    s.work_.assign(n, 0.0f);
    s.score_.assign(n, 0.0f);
    s.weight_.assign(n, 0.0f);
    s.order_.assign(n, 0);
    s.count_.assign(n, 0);
    return s;
}

void Sampler::set_params(const SamplingParams &params) {
    auto ok = validate_sampling_params(params);
    MEMRA_CHECK(ok.has_value(), "sampler: {}", ok ? "" : ok.error().message);
    params_ = params;
}

void Sampler::apply_penalties(std::span<const float> logits, std::span<const int32_t> context,
                              std::span<const LogitBias> bias) {
    MEMRA_CHECK(!logits.empty() && static_cast<int64_t>(logits.size()) <= vocab_size_,
                "logits: expected 1 .. {} values, found {}", vocab_size_, logits.size());
    n_ = static_cast<int32_t>(logits.size());
    const float kNegInf = -std::numeric_limits<float>::infinity();
    for (size_t i = 0; i < logits.size(); ++i) work_[i] = logits[i] != logits[i] ? kNegInf : logits[i];
    // The bias first (one float add per entry; a token outside the sampled ids has no logit to bias).
    if (!bias.empty()) {
        auto ok = validate_logit_bias(bias, vocab_size_);
        MEMRA_CHECK(ok.has_value(), "sampler: {}", ok ? "" : ok.error().message);
        for (const LogitBias &b : bias) {
            if (b.id < n_) work_[static_cast<size_t>(b.id)] = work_[static_cast<size_t>(b.id)] + b.value;
        }
    }

    const SamplingParams &p = params_;
    const auto window = static_cast<size_t>(p.penalty_context(static_cast<int64_t>(context.size())));
    if (window == 0) return;
    const std::span<const int32_t> recent = context.last(window);
    for (const int32_t t : recent) {
        MEMRA_CHECK(t >= 0 && t < vocab_size_, "context token {} outside [0, {})", t, vocab_size_);
        ++count_[static_cast<size_t>(t)];
    }
    // Each distinct token once; clearing its count on the way leaves count_ all zero for the next call.
    // A token outside the sampled ids (>= n_) has no logit to penalise.
    for (const int32_t t : recent) {
        int32_t &c = count_[static_cast<size_t>(t)];
        if (t >= n_) {
            c = 0;
            continue;
        }
        if (c == 0) continue;
        float &l = work_[static_cast<size_t>(t)];
        l = l > 0.0f ? l / p.repetition_penalty : l * p.repetition_penalty;
        l = l - static_cast<float>(c) * p.frequency_penalty - p.presence_penalty;
        c = 0;
    }
}

int32_t Sampler::greedy() const {
    int32_t best = 0;
    for (int32_t i = 1; i < n_; ++i) {
        if (work_[static_cast<size_t>(i)] > work_[static_cast<size_t>(best)]) best = i;
    }
    return best;
}

bool Sampler::before(int32_t a, int32_t b) const {
    const float sa = score_[static_cast<size_t>(a)];
    const float sb = score_[static_cast<size_t>(b)];
    return sa > sb || (sa == sb && a < b);
}

std::span<const int32_t> Sampler::candidates(std::span<const float> logits, std::span<const int32_t> context,
                                             std::span<const LogitBias> bias) {
    apply_penalties(logits, context, bias);
    const SamplingParams &p = params_;
    if (p.temperature == 0.0f) {
        order_[0] = greedy();
        n_candidates_ = 1;
        return std::span<const int32_t>(order_.data(), 1);
    }
    const auto all = static_cast<size_t>(n_);
    for (size_t i = 0; i < all; ++i) score_[i] = work_[i] / p.temperature;
    std::iota(order_.begin(), order_.begin() + n_, 0);
    const auto cmp = [this](int32_t a, int32_t b) { return before(a, b); };
    int64_t n = n_;
    if (p.top_k > 0 && p.top_k < n) {
        n = p.top_k;
        std::nth_element(order_.begin(), order_.begin() + n, order_.begin() + n_, cmp);
    }
    std::sort(order_.begin(), order_.begin() + n, cmp);

    // A largest score of +-Inf (all -Inf, or an overflowing logit / temperature): the lowest id holding it.
    const float top = score_[static_cast<size_t>(order_[0])];
    if (!std::isfinite(top)) {
        n_candidates_ = 1;
        return std::span<const int32_t>(order_.data(), 1);
    }
    // Unnormalised probabilities exp(score - top), summed in descending order; the top one is exactly 1.
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        const auto id = static_cast<size_t>(order_[static_cast<size_t>(i)]);
        weight_[id] = exp_f32(score_[id] - top);
        sum += weight_[id];
    }
    if (p.top_p < 1.0f) {
        float cumulative = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
            cumulative += weight_[static_cast<size_t>(order_[static_cast<size_t>(i)])] / sum;
            if (cumulative >= p.top_p) {
                n = i + 1;
                break;
            }
        }
    }
    if (p.min_p > 0.0f) {
        int64_t kept = 0;
        for (int64_t i = 0; i < n; ++i) {
            const int32_t id = order_[static_cast<size_t>(i)];
            if (weight_[static_cast<size_t>(id)] >= p.min_p) order_[static_cast<size_t>(kept++)] = id;
        }
        n = kept;  // >= 1: the top token's weight is 1
    }
    n_candidates_ = n;
    return std::span<const int32_t>(order_.data(), static_cast<size_t>(n));
}

int32_t Sampler::sample(std::span<const float> logits, std::span<const int32_t> context, uint64_t choice,
                        int64_t position, std::span<const LogitBias> bias) {
    MEMRA_CHECK(position >= 0 && position <= int64_t{0xffffffff}, "position {} outside [0, 2^32)", position);
    const std::span<const int32_t> kept = candidates(logits, context, bias);
    if (kept.size() == 1) return kept[0];
    // Gumbel-max over the survivors: argmax(score + G) is a draw from softmax(score) restricted to them.
    const float top = score_[static_cast<size_t>(kept[0])];
    int32_t best = -1;
    float best_key = 0.0f;
    for (const int32_t id : kept) {
        const float key = (score_[static_cast<size_t>(id)] - top) + gumbel_noise(params_.seed, choice, position, id);
        if (best < 0 || key > best_key || (key == best_key && id < best)) {
            best = id;
            best_key = key;
        }
    }
    return best;
}

void token_logprobs(std::span<const float> logits, int32_t chosen, int32_t n_top, TokenLogprobs &out) {
    const auto n = static_cast<int64_t>(logits.size());
    MEMRA_CHECK(n >= 1 && chosen >= 0 && chosen < n && n_top >= 0 && n_top <= kMaxTopLogprobs,
                "token_logprobs: {} logits, chosen {}, top {}", n, chosen, n_top);
    const float kNegInf = -std::numeric_limits<float>::infinity();
    const auto value = [&](int64_t i) { return logits[static_cast<size_t>(i)] != logits[static_cast<size_t>(i)]
                                                   ? kNegInf
                                                   : logits[static_cast<size_t>(i)]; };
    float top = kNegInf;
    for (int64_t i = 0; i < n; ++i) top = value(i) > top ? value(i) : top;
    // log softmax: l - top - log(sum exp(l - top)), the sum in increasing id order.
    float sum = 0.0f;
    if (std::isfinite(top)) {
        for (int64_t i = 0; i < n; ++i) sum = sum + exp_f32(value(i) - top);
    }
    const float log_sum = std::isfinite(top) ? log_f32(sum) : 0.0f;
    const auto logprob = [&](int64_t i) { return std::isfinite(top) ? (value(i) - top) - log_sum : kNegInf; };
    out.chosen = logprob(chosen);
    // The n_top largest logits, ties to the lower id, by insertion into a short sorted list.
    out.n_top = 0;
    for (int64_t i = 0; i < n && n_top > 0; ++i) {
        const float v = value(i);
        int32_t at = out.n_top;
        while (at > 0 && v > value(out.top_ids[at - 1])) --at;
        if (at >= n_top) continue;
        const int32_t last = std::min(out.n_top, n_top - 1);
        for (int32_t j = last; j > at; --j) out.top_ids[j] = out.top_ids[j - 1];
        out.top_ids[at] = static_cast<int32_t>(i);
        out.n_top = std::min(out.n_top + 1, n_top);
    }
    for (int32_t j = 0; j < out.n_top; ++j) out.top_logprobs[j] = logprob(out.top_ids[j]);
}

}  // namespace memra
