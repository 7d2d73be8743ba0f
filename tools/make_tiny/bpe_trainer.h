// A small deterministic byte-level BPE trainer for the tiny checkpoint's tokenizer. It learns
// merges over raw bytes from pre-split training words; the result is rendered in GPT-2's
// byte-to-unicode alphabet, the form tokenizer.json stores.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace memra::tools {

// One learned merge, as raw byte strings: the new token is left + right.
struct BpeMerge {
    std::string left;
    std::string right;
};

struct BpeTrainOptions {
    size_t max_merges = 0;              // stop after this many merges
    uint64_t min_count = 2;             // stop when the best pair occurs fewer times than this
    std::vector<std::string> reserved;  // byte strings a merge may never produce (special tokens)
};

// Learns merges from training words (each a byte string; repeats count). Every word starts as
// single bytes. Each step counts adjacent symbol pairs weighted by word frequency and merges the
// most frequent pair everywhere (left-to-right, non-overlapping). Tie rule: among pairs with the
// same count, the one whose (left, right) byte strings are lexicographically smallest (unsigned
// bytes, left compared first) wins. A pair whose concatenation is already a token, or is in
// options.reserved, is never merged, so every merge creates a new token and both halves always
// exist before it (token ids stay ordered: halves < result).
std::vector<BpeMerge> train_bpe(const std::vector<std::string> &words, const BpeTrainOptions &options);

// The deterministic pre-split used for training (not the tokenizer's runtime regex): the text is
// cut into maximal runs of one class, where the classes are letters (ASCII letters and every byte
// >= 0x80, so UTF-8 sequences stay whole), digits (runs of at most 3), whitespace (space, tab,
// CR, LF) and punctuation (every other byte). A space directly before a letter run joins that
// run (so "a  b" splits as "a", " ", " b"), as GPT-2 style tokenizers do.
std::vector<std::string> bpe_training_split(std::string_view text);

// GPT-2's byte-to-unicode alphabet: printable bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF map to the
// code point of the same value; the other 68 bytes map, in increasing byte order, to U+0100.. .
// Returns the UTF-8 encoding of each byte's character.
std::string byte_level_char(uint8_t byte);
// Renders a raw byte string in that alphabet (UTF-8).
std::string byte_level_encode(std::string_view bytes);

}  // namespace memra::tools
