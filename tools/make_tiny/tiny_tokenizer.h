// The tiny checkpoint's tokenizer: a real byte-level BPE (HF tokenizers format) learned by
// bpe_trainer from the embedded corpus, plus the special tokens and chat template of a
// Step-3.5-style chat model. Independent of the weight seed and of the preset.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "make_tiny/bpe_trainer.h"

namespace memra::tools {

// Special token contents (DeepSeek-style sentence markers use U+FF5C and U+2581).
inline constexpr char kBosToken[] = "<\xEF\xBD\x9C" "begin\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>";
inline constexpr char kEosToken[] = "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>";
inline constexpr char kImEndToken[] = "<|im_end|>";

// Merge budget: ids 0-1 specials, 2-257 bytes, 258.. merges, then 8 chat specials. The embedded
// corpus runs out of pairs seen twice after 473 merges, so the tokenizer has 739 real tokens
// (<|im_end|> = 732), below the smallest preset vocab_size (1024): the rest are padding rows.
inline constexpr size_t kTinyMaxMerges = 500;

// Id layout: 0 = kBosToken, 1 = kEosToken, 2 + b = byte b (raw byte order), then one id per merge
// in merge order, then <|im_start|>, <|im_end|>, <think>, </think>, <tool_call>, </tool_call>,
// <tool_response>, </tool_response>.
struct TinyTokenizer {
    std::vector<std::string> tokens;  // id -> token text as tokenizer.json stores it (BPE tokens: byte-level alphabet)
    std::vector<bool> special;        // id -> added special token
    std::vector<BpeMerge> merges;     // rank order, both halves in the byte-level alphabet
    int64_t bos_id = 0;
    int64_t eos_id = 1;  // <｜end▁of▁sentence｜>, also the pad token
    int64_t im_end_id = 0;
    int64_t n_tokens() const { return static_cast<int64_t>(tokens.size()); }
};

// Tokens every tokenizer has besides its merges: BOS, EOS, the 256 bytes and the 8 chat specials.
inline constexpr int64_t kTokenizerFixedTokens = 2 + 256 + 8;

// Trains at most max_merges merges on `corpus` (bpe_training_split, min count 2) and lays out the ids
// (deterministic: the same corpus gives the same tokenizer).
TinyTokenizer build_tokenizer(std::string_view corpus, size_t max_merges);
// build_tokenizer on the embedded corpus with kTinyMaxMerges.
TinyTokenizer build_tiny_tokenizer();

// File contents (UTF-8 JSON, fixed key order, trailing newline).
std::string tiny_tokenizer_json(const TinyTokenizer &tok);
std::string tiny_tokenizer_config_json(const TinyTokenizer &tok, int64_t model_max_length);
// The Jinja chat template stored in tokenizer_config.json (ChatML turns, STEP35.md section 8).
std::string tiny_chat_template();

}  // namespace memra::tools
