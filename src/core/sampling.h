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

namespace memra {

// The filter chain, in this order (each step sees the previous step's output):
//   1. penalties over the last penalty_last_n context tokens (llama.cpp semantics): a logit l of a token seen
//      c > 0 times becomes (l > 0 ? l / repetition_penalty : l * repetition_penalty)
//      - c * frequency_penalty - presence_penalty;
//   2. temperature: l / temperature (0 = greedy: the argmax of the penalised logits, ties to the lower id;
//      the filters and the seed then play no part);
//   3. top-k: the k largest (ties to the lower id);
//   4. top-p: the shortest prefix, in descending probability (softmax over the top-k survivors), whose
//      cumulative probability reaches top_p;
//   5. min-p: tokens whose probability is at least min_p times the largest one.
// This is the order of Hugging Face and vLLM (temperature first). llama.cpp's default chain applies the
// temperature last, after top-k / top-p / min-p; the two agree at temperature 1 and for top-k alone.
struct SamplingParams {
    float temperature = 0.8f;        // >= 0; 0 = greedy
    int32_t top_k = 40;              // >= 0; 0 = off
    float top_p = 0.95f;             // (0, 1]; 1 = off
    float min_p = 0.05f;             // [0, 1]; 0 = off
    float repetition_penalty = 1.0f; // > 0; 1 = off
    float presence_penalty = 0.0f;   // finite; 0 = off
    float frequency_penalty = 0.0f;  // finite; 0 = off
    int32_t penalty_last_n = 64;     // context tokens the penalties look at; 0 = none, -1 = the whole context
    uint64_t seed = 0;

    // The context tokens the penalties read: 0 when every penalty is off, else penalty_last_n of them (-1:
    // the whole context) and never more than the context holds.
    int64_t penalty_context(int64_t context) const {
        const bool active = repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f;
        if (!active) return 0;
        return penalty_last_n < 0 ? context : std::min<int64_t>(context, penalty_last_n);
    }
};

// Refuses values outside the ranges above, naming the field, the range and the value found.
Result<void> validate_sampling_params(const SamplingParams &params);

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC11): 10 rounds of the
// 4x32 multiply-xor bijection over a 128-bit counter under a 64-bit key.
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// Natural log for x > 0 (x = 0 -> -Inf, x < 0 or NaN -> NaN, +Inf -> +Inf) from IEEE float operations
// only (no libm, no FMA), so the Gumbel noise has the same bits wherever it is computed. Error about 1 ulp.
float log_f32(float x);

// The uniform in (0, 1) behind token `id` at (seed, choice, position): Philox counter
// (id / 4, position, choice low, choice high), key (seed low, seed high), output word id % 4, whose top 23
// bits k give (k + 0.5) / 2^23. position must be in [0, 2^32). `choice` is the index of the completion among
// those a request asks for (OpenAI's n), 0 for a single one.
float philox_uniform(uint64_t seed, uint64_t choice, int64_t position, int32_t id);
// The standard Gumbel noise -log(-log(u)) of that uniform.
float gumbel_noise(uint64_t seed, uint64_t choice, int64_t position, int32_t id);

// Most top alternatives a sampled token reports (OpenAI's top_logprobs limit).
inline constexpr int32_t kMaxTopLogprobs = 20;

// Log-probabilities under the model's raw distribution (log softmax of the logits, before penalties and
// temperature, as vLLM reports by default): of the chosen token and of the n_top most likely ones.
struct TokenLogprobs {
    float chosen = 0.0f;
    int32_t n_top = 0;
    int32_t top_ids[kMaxTopLogprobs] = {};  // descending logit, ties to the lower id
    float top_logprobs[kMaxTopLogprobs] = {};
};
// logits: the row over the ids that may be sampled (NaN counts as -Inf); 0 <= chosen < logits.size();
// 0 <= n_top <= kMaxTopLogprobs. The sum of exp(l - max) runs in increasing id order. Allocates nothing.
void token_logprobs(std::span<const float> logits, int32_t chosen, int32_t n_top, TokenLogprobs &out);

// One row a sampling op draws from, as the engine writes it into a step's tables (plain bytes, the same on
// host and device).
struct SampleRow {
    SamplingParams params;     // validated at the boundary
    uint64_t choice = 0;       // the random stream: (params.seed, choice, position)
    int64_t position = 0;      // where the sampled token will sit, in [0, 2^32)
    int32_t logit_row = 0;     // the row of the logits buffer
    int32_t history_begin = 0;  // the penalty context: history[history_begin, + history_len)
    int32_t history_len = 0;
    int32_t top_logprobs = -1;  // -1: no log-probabilities; 0 .. kMaxTopLogprobs alternatives
};

// What a sampling op writes for one row; read back by the step's one device -> host copy.
struct SampledToken {
    int32_t id = 0;
    int32_t has_logprobs = 0;
    TokenLogprobs logprobs;
};

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
    // random stream. If every logit is -Inf the lowest id is returned.
    int32_t sample(std::span<const float> logits, std::span<const int32_t> context, uint64_t choice,
                   int64_t position);

    // Steps 1-5 alone: the ids that survive the filters, in descending probability (ties: lower id first).
    // At temperature 0, just the greedy token. Valid until the next call.
    std::span<const int32_t> candidates(std::span<const float> logits, std::span<const int32_t> context);
    // After candidates() or sample(): every token's logit after the penalties (step 1), [n] of that call.
    std::span<const float> penalized_logits() const { return {work_.data(), static_cast<size_t>(n_)}; }

    const SamplingParams &params() const { return params_; }
    int32_t vocab_size() const { return vocab_size_; }

private:
    Sampler() = default;
    void apply_penalties(std::span<const float> logits, std::span<const int32_t> context);
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
