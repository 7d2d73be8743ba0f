// Added-token matching (see added_tokens.h). Whitespace for lstrip/rstrip is Unicode White_Space
// and "word" for single_word is Rust regex's \w (Alphabetic, marks, Nd, Pc, Join_Control), the
// definitions Hugging Face's helper regexes use.
#include "text/added_tokens.h"

#include <algorithm>

#include "core/check.h"
#include "text/utf8.h"

namespace memra::text {

namespace {

bool is_white_space(char32_t c) {
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// Byte offset where the run of trailing whitespace of `text` starts.
size_t trailing_space_start(std::string_view text) {
    size_t pos = 0, run_start = 0;
    bool in_run = false;
    while (pos < text.size()) {
        const size_t at = pos;
        const bool space = is_white_space(utf8_next(text, pos));
        if (space && !in_run) run_start = at;
        in_run = space;
    }
    return in_run ? run_start : text.size();
}

// Byte length of the run of leading whitespace of `text`.
size_t leading_space_len(std::string_view text) {
    size_t pos = 0;
    while (pos < text.size()) {
        size_t next = pos;
        if (!is_white_space(utf8_next(text, next))) break;
        pos = next;
    }
    return pos;
}

// Start of the last character of non-empty valid UTF-8 `text`.
size_t last_char_start(std::string_view text) {
    size_t pos = text.size() - 1;
    while (pos > 0 && (static_cast<uint8_t>(text[pos]) & 0xC0) == 0x80) --pos;
    return pos;
}

}  // namespace

void TokenTrie::build(const std::vector<std::string> &patterns) {
    nodes_.assign(1, Node{});
    std::fill(std::begin(first_byte_), std::end(first_byte_), false);
    for (size_t p = 0; p < patterns.size(); ++p) {
        const std::string &pattern = patterns[p];
        MEMRA_CHECK(!pattern.empty(), "empty added-token pattern");
        first_byte_[static_cast<uint8_t>(pattern[0])] = true;
        int32_t node = 0;
        for (char c : pattern) {
            const auto b = static_cast<uint8_t>(c);
            auto it = nodes_[node].next.find(b);
            if (it == nodes_[node].next.end()) {
                nodes_.push_back(Node{});
                const auto child = static_cast<int32_t>(nodes_.size() - 1);
                nodes_[node].next.emplace(b, child);
                node = child;
            } else {
                node = it->second;
            }
        }
        if (nodes_[node].pattern < 0) nodes_[node].pattern = static_cast<int64_t>(p);
    }
}

std::vector<TokenTrie::Match> TokenTrie::find_all(std::string_view text) const {
    std::vector<Match> out;
    if (empty()) return out;
    size_t i = 0;
    while (i < text.size()) {
        if (!first_byte_[static_cast<uint8_t>(text[i])]) {
            ++i;
            continue;
        }
        int32_t node = 0;
        int64_t best = -1;
        size_t best_end = 0;
        for (size_t j = i; j < text.size(); ++j) {
            auto it = nodes_[node].next.find(static_cast<uint8_t>(text[j]));
            if (it == nodes_[node].next.end()) break;
            node = it->second;
            if (nodes_[node].pattern >= 0) {
                best = nodes_[node].pattern;
                best_end = j + 1;
            }
        }
        if (best < 0) {
            ++i;
            continue;
        }
        out.push_back(Match{i, best_end, static_cast<size_t>(best)});
        i = best_end;
    }
    return out;
}

Result<AddedVocabulary> AddedVocabulary::build(std::vector<AddedToken> tokens,
                                               const std::vector<std::string> &normalized_contents) {
    MEMRA_CHECK(tokens.size() == normalized_contents.size(), "added tokens and normalized contents differ in size");
    AddedVocabulary vocab;
    auto word = Regex::compile("[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}]");
    if (!word) return tl::unexpected(word.error());
    vocab.word_char_ = std::move(*word);
    std::vector<std::string> raw, normalized;
    for (size_t i = 0; i < tokens.size(); ++i) {
        AddedToken &t = tokens[i];
        t.decoded = t.normalized ? normalized_contents[i] : t.content;
        vocab.by_id_.emplace(t.id, i);
        vocab.by_content_.emplace(t.content, t.id);
        if (t.normalized) {
            normalized.push_back(normalized_contents[i]);
            vocab.normalized_index_.push_back(i);
        } else {
            raw.push_back(t.content);
            vocab.raw_index_.push_back(i);
        }
    }
    vocab.tokens_ = std::move(tokens);
    vocab.raw_trie_.build(raw);
    vocab.normalized_trie_.build(normalized);
    return vocab;
}

const AddedToken *AddedVocabulary::by_id(int32_t id) const {
    auto it = by_id_.find(id);
    return it == by_id_.end() ? nullptr : &tokens_[it->second];
}

std::optional<int32_t> AddedVocabulary::id_of(std::string_view content) const {
    auto it = by_content_.find(std::string(content));
    if (it == by_content_.end()) return std::nullopt;
    return it->second;
}

bool AddedVocabulary::is_special_content(std::string_view content) const {
    auto id = id_of(content);
    return id && by_id(*id)->special;
}

std::vector<TextSplit> AddedVocabulary::split(std::string_view text, bool normalized, bool encode_special) const {
    if (text.empty()) return {TextSplit{0, 0, -1}};
    const TokenTrie &trie = normalized ? normalized_trie_ : raw_trie_;
    const std::vector<size_t> &index = normalized ? normalized_index_ : raw_index_;
    auto is_word = [&](std::string_view one_char) {
        auto m = word_char_.find_all(one_char);
        return m && !m->empty() && m->front().end == one_char.size();
    };
    std::vector<TextSplit> out;
    size_t start_offset = 0;
    for (const TokenTrie::Match &m : trie.find_all(text)) {
        const AddedToken &token = tokens_[index[m.pattern]];
        size_t start = m.start, stop = m.end;
        if (encode_special && token.special) continue;
        if (token.single_word) {
            bool start_space = true, stop_space = true;
            if (start > 0) {
                const std::string_view before = text.substr(0, start);
                start_space = !is_word(before.substr(last_char_start(before)));
            }
            if (stop < text.size()) {
                size_t next = stop;
                utf8_next(text, next);
                stop_space = !is_word(text.substr(stop, next - stop));
            }
            if (!start_space || !stop_space) continue;
        }
        if (token.lstrip) start = std::max(trailing_space_start(text.substr(0, start)), start_offset);
        if (token.rstrip) stop += leading_space_len(text.substr(stop));
        if (start_offset < start) out.push_back(TextSplit{start_offset, start, -1});
        out.push_back(TextSplit{start, stop, token.id});
        start_offset = stop;
    }
    if (start_offset != text.size()) out.push_back(TextSplit{start_offset, text.size(), -1});
    return out;
}

}  // namespace memra::text
