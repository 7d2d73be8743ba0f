// Added tokens (tokenizer.json "added_tokens"): matched in the raw text before the model, with
// Hugging Face's rules: a leftmost-longest scan (the Aho-Corasick MatchKind::LeftmostLongest it
// uses), then per-token single_word / lstrip / rstrip handling, special tokens skipped when the
// caller asks for special tokens to be encoded as text.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/result.h"
#include "text/onig_regex.h"

namespace memra::text {

struct AddedToken {
    std::string content;
    int32_t id = 0;
    bool special = false;
    bool single_word = false;
    bool lstrip = false;
    bool rstrip = false;
    bool normalized = false;
    // What decode shows: the content, or for a normalized token the content after the normalizer
    // (Hugging Face's id -> token map holds the normalized form).
    std::string decoded;
};

// Leftmost-longest literal matcher over bytes (a trie walked from each start position).
class TokenTrie {
public:
    // Patterns in priority order: for two identical patterns the first wins.
    void build(const std::vector<std::string> &patterns);
    struct Match {
        size_t start;
        size_t end;
        size_t pattern;
    };
    // Non-overlapping matches: at the leftmost position where a pattern starts, the longest one.
    std::vector<Match> find_all(std::string_view text) const;
    bool empty() const { return nodes_.size() <= 1; }

private:
    struct Node {
        std::unordered_map<uint8_t, int32_t> next;
        int64_t pattern = -1;
    };
    std::vector<Node> nodes_;
    bool first_byte_[256] = {};
};

// A slice of the text: [start, end) of the input, and the added token it is (-1: plain text).
struct TextSplit {
    size_t start;
    size_t end;
    int32_t token = -1;
};

class AddedVocabulary {
public:
    // `tokens` in matching priority order (special tokens first, each group in tokenizer.json
    // order); normalized_contents[i] is tokens[i].content after the normalizer (the pattern of a
    // token with `normalized` set).
    static Result<AddedVocabulary> build(std::vector<AddedToken> tokens,
                                         const std::vector<std::string> &normalized_contents);

    const std::vector<AddedToken> &tokens() const { return tokens_; }
    const AddedToken *by_id(int32_t id) const;
    std::optional<int32_t> id_of(std::string_view content) const;
    bool is_special_content(std::string_view content) const;

    // Splits `text` on the non-normalized (raw) or normalized tokens; covers the whole text.
    std::vector<TextSplit> split(std::string_view text, bool normalized, bool encode_special) const;

private:
    std::vector<AddedToken> tokens_;
    std::unordered_map<int32_t, size_t> by_id_;
    std::unordered_map<std::string, int32_t> by_content_;
    TokenTrie raw_trie_, normalized_trie_;
    std::vector<size_t> raw_index_, normalized_index_;  // trie pattern -> index in tokens_
    Regex word_char_;  // Rust regex \w, for single_word
};

}  // namespace memra::text
