// The host + device part of token sampling (core/sampling.h): the parameters and per-row records a sampling op
// reads and writes (plain bytes, the same on host and device), Philox4x32-10, log_f32 and the Gumbel noise as
// MEMRA_HD functions. Kept free of host-only headers so that CUDA sources can include it: the device sampling
// op (backend/cuda/ops_sample) runs the very code the CPU's Sampler runs.
#pragma once

#include <cstdint>

#include "core/float_formats.h"
#include "core/hd.h"

namespace memra {

// The filter chain, in this order (each step sees the previous step's output):
//   0. the logit bias (LogitBias below, OpenAI's logit_bias): logit[id] + value for each entry of the
//      sequence's list (-100 all but bans a token, +100 all but forces it);
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
    // (MEMRA_HD: the device sampling op reads the same window.)
    MEMRA_HD int64_t penalty_context(int64_t context) const {
        const bool active = repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f;
        if (!active) return 0;
        return penalty_last_n < 0 || context < penalty_last_n ? context : penalty_last_n;
    }
};

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC11) on plain words: the 128-bit
// counter c[4] is replaced by its image under the 64-bit key (key0, key1) after 10 multiply-xor rounds. The body
// of core/sampling.h's philox4x32_10; MEMRA_HD (std::array is not usable in device code).
MEMRA_HD void philox4x32_10_words(uint32_t *c, uint32_t key0, uint32_t key1) {
    const uint64_t kM0 = 0xD2511F53u;
    const uint64_t kM1 = 0xCD9E8D57u;
    const uint32_t kW0 = 0x9E3779B9u;  // golden ratio
    const uint32_t kW1 = 0xBB67AE85u;  // sqrt(3) - 1
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            key0 += kW0;
            key1 += kW1;
        }
        const uint64_t p0 = kM0 * c[0];
        const uint64_t p1 = kM1 * c[2];
        const auto hi0 = static_cast<uint32_t>(p0 >> 32);
        const auto lo0 = static_cast<uint32_t>(p0);
        const auto hi1 = static_cast<uint32_t>(p1 >> 32);
        const auto lo1 = static_cast<uint32_t>(p1);
        const uint32_t c1 = c[1];
        const uint32_t c3 = c[3];
        c[0] = hi1 ^ c1 ^ key0;
        c[1] = lo1;
        c[2] = hi0 ^ c3 ^ key1;
        c[3] = lo0;
    }
}

// Natural log for x > 0 (x = 0 -> -Inf, x < 0 or NaN -> NaN, +Inf -> +Inf) from IEEE float operations
// only (no libm, no FMA), so the Gumbel noise has the same bits wherever it is computed. Error about 1 ulp.
MEMRA_HD float log_f32(float x) {
    if (x != x) return x + x;
    if (x < 0.0f) return u32_as_f32(0x7fc00000u);
    if (x == 0.0f) return u32_as_f32(0xff800000u);
    if (x == u32_as_f32(0x7f800000u)) return x;
    int e = 0;
    if (x < u32_as_f32(0x00800000u)) {  // subnormal: scale into the normal range (exact)
        x = x * 8388608.0f;
        e = -23;
    }
    const uint32_t bits = f32_as_u32(x);
    e += static_cast<int>(bits >> 23) - 127;
    float m = u32_as_f32((bits & 0x007fffffu) | 0x3f800000u);  // [1, 2)
    if (m > 1.41421356f) {  // centre the mantissa on 1: m in [sqrt(1/2), sqrt(2)]
        m = m * 0.5f;
        e += 1;
    }
    // log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.1716: the odd series to s^11 leaves < 1e-10.
    const float s = (m - 1.0f) / (m + 1.0f);
    const float z = s * s;
    float q = 1.0f / 11.0f;
    q = q * z + 1.0f / 9.0f;
    q = q * z + 1.0f / 7.0f;
    q = q * z + 1.0f / 5.0f;
    q = q * z + 1.0f / 3.0f;
    const float log_m = 2.0f * (s + (s * z) * q);
    const float kLn2Hi = u32_as_f32(0x3f317200u);  // 15 significant bits: e * kLn2Hi is exact
    const float kLn2Lo = u32_as_f32(0x35bfbe8eu);
    const auto ef = static_cast<float>(e);
    return ef * kLn2Hi + (log_m + ef * kLn2Lo);
}

// The uniform in (0, 1) of one Philox output word: 23 bits + 0.5 fit a float exactly, so u lies in
// [2^-24, 1 - 2^-24], never 0 or 1.
MEMRA_HD float uniform_from_word(uint32_t word) { return (static_cast<float>(word >> 9) + 0.5f) * (1.0f / 8388608.0f); }

// The four uniforms behind ids 4 quad .. 4 quad + 3 at (seed, choice, position): one Philox block serves four
// consecutive ids (the caller guarantees 0 <= position < 2^32).
MEMRA_HD void philox_uniform_quad(uint64_t seed, uint64_t choice, int64_t position, uint32_t quad, float *u) {
    uint32_t c[4] = {quad, static_cast<uint32_t>(position), static_cast<uint32_t>(choice),
                     static_cast<uint32_t>(choice >> 32)};
    philox4x32_10_words(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
    for (int k = 0; k < 4; ++k) u[k] = uniform_from_word(c[k]);
}

// core/sampling.h's philox_uniform (the uniform in (0, 1) behind token `id` at (seed, choice, position))
// without its argument checks: the caller guarantees 0 <= position < 2^32 and id >= 0.
MEMRA_HD float philox_uniform_unchecked(uint64_t seed, uint64_t choice, int64_t position, int32_t id) {
    float u[4];
    philox_uniform_quad(seed, choice, position, static_cast<uint32_t>(id) / 4u, u);
    return u[static_cast<uint32_t>(id) % 4u];
}

// Gumbel noise -log(-log(u)) of a uniform. Over every uniform_from_word value it lies in
// [kGumbelNoiseMin, kGumbelNoiseMax] (tests/core/test_sampling.cpp checks all 2^23 of them), so a candidate whose
// (score - top) + kGumbelNoiseMax rounds below a key already drawn can never be drawn.
MEMRA_HD float gumbel_from_uniform(float u) { return -log_f32(-log_f32(u)); }
inline constexpr float kGumbelNoiseMin = -2.82f;
inline constexpr float kGumbelNoiseMax = 16.64f;

// core/sampling.h's gumbel_noise without the argument checks.
MEMRA_HD float gumbel_noise_unchecked(uint64_t seed, uint64_t choice, int64_t position, int32_t id) {
    return gumbel_from_uniform(philox_uniform_unchecked(seed, choice, position, id));
}

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

// Most entries of a sequence's logit bias, and the largest magnitude of a value (OpenAI's range).
inline constexpr int32_t kMaxLogitBias = 1024;
inline constexpr float kMaxLogitBiasValue = 100.0f;

// One entry of a logit bias: logit[id] + value before the penalties (step 0 above). A list is sorted by id,
// ids unique, in [0, vocab), values finite in [-kMaxLogitBiasValue, kMaxLogitBiasValue]
// (validate_logit_bias, core/sampling.h). The log-probabilities stay those of the raw logits.
struct LogitBias {
    int32_t id = 0;
    float value = 0.0f;
};

// One row a sampling op draws from, as the engine writes it into a step's tables (plain bytes, the same on
// host and device).
struct SampleRow {
    SamplingParams params;     // validated at the boundary
    uint64_t choice = 0;       // the random stream: (params.seed, choice, position)
    int64_t position = 0;      // where the sampled token will sit, in [0, 2^32)
    int32_t logit_row = 0;     // the row of the logits buffer
    int32_t history_begin = 0;  // the penalty context: history[history_begin, + history_len)
    int32_t history_len = 0;
    int32_t bias_begin = 0;     // the logit bias: bias[bias_begin, + bias_len) (LogitBias, sorted unique ids)
    int32_t bias_len = 0;
    int32_t top_logprobs = -1;  // -1: no log-probabilities; 0 .. kMaxTopLogprobs alternatives
};

// What a sampling op writes for one row; read back by the step's one device -> host copy.
struct SampledToken {
    int32_t id = 0;
    int32_t has_logprobs = 0;
    TokenLogprobs logprobs;
};

}  // namespace memra
