// Token sampling (DETERMINISM.md rule 8, ENGINE.md section 1): penalties, temperature and the top-k / top-p /
// min-p filters over one row of logits, then a Gumbel-max draw whose noise comes from a counter-based
// generator (Philox4x32-10) keyed by (seed, choice index, position) — never by a server-assigned id — so a
// request's tokens depend on nothing else in the batch and on no call order, and a request resubmitted with
// its seed reproduces its bytes. Shared by every backend's sampling op (core: host and device compile the
// same functions). Every buffer is sized for the vocabulary at create(); sample() allocates nothing.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "core/result.h"
#include "core/sampling_hd.h"

namespace memra {

// Refuses values outside SamplingParams' ranges (core/sampling_hd.h), naming the field, the range and the value found.
Result<void> validate_sampling_params(const SamplingParams &params);

// Refuses a logit bias list that is not sorted by id with unique ids in [0, vocab), at most kMaxLogitBias
// entries, values finite in [-kMaxLogitBiasValue, kMaxLogitBiasValue], naming the entry, the expectation and the
// value found. Allocates nothing when the list is valid.
Result<void> validate_logit_bias(std::span<const LogitBias> bias, int32_t vocab);

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC11): 10 rounds of the
// 4x32 multiply-xor bijection over a 128-bit counter under a 64-bit key.
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// The uniform in (0, 1) behind token `id` at (seed, choice, position): Philox counter
// (id / 4, position, choice low, choice high), key (seed low, seed high), output word id % 4, whose top 23
// bits k give (k + 0.5) / 2^23. position must be in [0, 2^32). `choice` is the index of the completion among
// those a request asks for (OpenAI's n), 0 for a single one.
float philox_uniform(uint64_t seed, uint64_t choice, int64_t position, int32_t id);
// The standard Gumbel noise -log(-log(u)) of that uniform.
float gumbel_noise(uint64_t seed, uint64_t choice, int64_t position, int32_t id);

// The log-probabilities of a chosen token and of the most likely ones (TokenLogprobs, core/sampling_hd.h).
// logits: the row over the ids that may be sampled (NaN counts as -Inf); 0 <= chosen < logits.size();
// 0 <= n_top <= kMaxTopLogprobs. The sum of exp(l - max) runs in increasing id order. Allocates nothing.
void token_logprobs(std::span<const float> logits, int32_t chosen, int32_t n_top, TokenLogprobs &out);

class Sampler {
public:
    // A workspace for rows of up to vocab_size logits. Refused: vocab_size < 1, invalid params
    // (validate_sampling_params).
    static Result<Sampler> create(int32_t vocab_size, const SamplingParams &params);
    // Replaces the parameters (a backend's sampling op, one request after another; no allocation).
    // MEMRA_CHECK: params that validate_sampling_params accepts (requests are validated at the boundary).
    void set_params(const SamplingParams &params);

    // The next token for a sequence. logits: [n] f32 over ids 0 .. n - 1, 1 <= n <= vocab_size (the ids that
    // may be sampled: a model's padding rows past the tokenizer's ids are left out; NaN counts as -Inf);
    // context: the sequence's tokens so far, prompt included (ids in [0, vocab_size)), for the penalties;
    // position: where the sampled token will sit, which with the choice index and the seed selects the
    // random stream; bias: the sequence's logit bias (step 0; MEMRA_CHECK: validate_logit_bias accepts it for
    // vocab_size; entries with ids >= n have no logit and are skipped). If every logit is -Inf the lowest id is
    // returned.
    int32_t sample(std::span<const float> logits, std::span<const int32_t> context, uint64_t choice,
                   int64_t position, std::span<const LogitBias> bias = {});

    // Steps 0-5 alone: the ids that survive the filters, in descending probability (ties: lower id first).
    // At temperature 0, just the greedy token. Valid until the next call.
    std::span<const int32_t> candidates(std::span<const float> logits, std::span<const int32_t> context,
                                        std::span<const LogitBias> bias = {});
    // After candidates() or sample(): every token's logit after the bias and the penalties (steps 0 and 1), [n]
    // of that call.
    std::span<const float> penalized_logits() const { return {work_.data(), static_cast<size_t>(n_)}; }

    const SamplingParams &params() const { return params_; }
    int32_t vocab_size() const { return vocab_size_; }

private:
    Sampler() = default;
    void apply_penalties(std::span<const float> logits, std::span<const int32_t> context,
                         std::span<const LogitBias> bias);
    int32_t greedy() const;
    bool before(int32_t a, int32_t b) const;  // descending score, ties to the lower id

    SamplingParams params_;
    int32_t vocab_size_ = 0;
    int32_t n_ = 0;               // logits of the current call
    std::vector<float> work_;     // [vocab] penalised logits
    std::vector<float> score_;    // [vocab] tempered logits (indexed by id)
    std::vector<float> weight_;   // [vocab] exp(score - max) of the candidates (indexed by id)
    std::vector<int32_t> order_;  // [vocab] candidate ids; the first n_candidates_ survive
    std::vector<int32_t> count_;  // [vocab] occurrences in the penalty window; all zero between calls
    int64_t n_candidates_ = 0;
};

}  // namespace memra
