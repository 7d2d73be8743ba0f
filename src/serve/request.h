// What a generation request asks for and what it produces, as the scheduler (serve/scheduler.h) and the API
// layer (serve/openai.h) share them. Plain values: nothing here depends on the engine.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "core/sampling_hd.h"

namespace memra::serve {

using Clock = std::chrono::steady_clock;

// Why a request ended. kStop: an end-of-sequence token, a stop token id or a stop string; kLength: max_tokens or
// the context edge; the others end it without a normal finish.
enum class Finish { kNone, kStop, kLength, kCancelled, kTimeout, kError };
// OpenAI's finish_reason for the normal finishes ("stop", "length"); "cancelled", "timeout", "error" otherwise.
const char *finish_name(Finish finish);

struct GenerationRequest {
    std::vector<int32_t> prompt;     // token ids, BOS included where the caller wants one; at least one
    SamplingParams sampling;         // validated at submit
    std::vector<LogitBias> logit_bias;  // OpenAI's logit_bias: sorted unique ids, validated at submit (core/sampling.h)
    uint64_t choice = 0;             // the random stream's choice index (OpenAI's n: 0, 1, ...)
    int64_t max_tokens = -1;         // tokens to generate at most; -1: up to the context edge
    std::vector<std::string> stop;   // stop strings: the text ends right before the first one
    std::vector<int32_t> stop_ids;   // stop token ids besides the model's end-of-sequence ids
    bool ignore_eos = false;         // do not stop at the model's end-of-sequence ids
    bool skip_special = true;        // leave special tokens out of the text
    int32_t top_logprobs = -1;       // -1: none; 0 .. kMaxTopLogprobs alternatives per token
    bool hash_logits = false;        // record a hash of each sampled position's logit row (tests)
    // The penalties look at the generated tokens only (OpenAI's presence and frequency penalties): the window
    // (sampling.penalty_last_n) is set to the tokens generated so far before each step.
    bool penalize_generated = false;
};

struct GeneratedToken {
    int32_t id = 0;
    TokenLogprobs logprobs;    // with top_logprobs >= 0
    uint64_t logits_hash = 0;  // with hash_logits: FNV-1a over the row's raw float bits
};

// What a consumer has read of a request so far.
struct Cursor {
    size_t tokens = 0;
    size_t text = 0;
    bool finished = false;  // the finish was reported
};

// The part of a request that consumers have not read yet.
struct Delta {
    std::vector<GeneratedToken> tokens;
    std::string text;
    Finish finish = Finish::kNone;  // set once, with the last delta
    std::string error;              // with kError / kTimeout: what went wrong
};

}  // namespace memra::serve
