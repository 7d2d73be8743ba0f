// The BPE model of a tokenizer.json: vocabulary, ranked merges, unknown-token and byte-fallback
// rules, applied to one pre-tokenized word the way Hugging Face tokenizers' BPE does (lowest
// rank first, leftmost first among equal ranks), with a bounded word -> ids cache.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/result.h"
#include "text/json_fields.h"

namespace memra::text {

// Hash for unordered maps keyed by std::string that accept std::string_view lookups.
struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StringIdMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

struct BpeCache;  // bpe.cpp

class BpeModel {
public:
    // Parses `model` (an object with "type": "BPE"); `path` names it in errors.
    static Result<BpeModel> from_json(const Json &model, const std::string &path);

    BpeModel();
    ~BpeModel();
    BpeModel(BpeModel &&) noexcept;
    BpeModel &operator=(BpeModel &&) noexcept;

    // Appends the ids of `word` (non-empty, valid UTF-8). Thread-safe.
    void tokenize(std::string_view word, std::vector<int32_t> &out) const;

    std::optional<int32_t> token_id(std::string_view token) const;
    // The vocabulary entry of `id`, nullptr when the vocabulary has none.
    const std::string *token(int32_t id) const;
    size_t vocab_size() const { return vocab_.size(); }
    int32_t id_end() const { return static_cast<int32_t>(tokens_.size()); }  // 1 + the largest id

private:
    struct Merge {
        int32_t rank;
        int32_t new_id;
    };
    static uint64_t pair_key(int32_t a, int32_t b) {
        return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
    }
    void merge_word(std::string_view word, std::vector<int32_t> &out) const;

    StringIdMap vocab_;
    std::vector<std::string> tokens_;  // id -> token
    std::vector<bool> has_token_;  // id -> the vocabulary has it
    std::unordered_map<uint64_t, Merge> merges_;
    std::optional<int32_t> unk_id_;
    bool fuse_unk_ = false;
    bool byte_fallback_ = false;
    bool ignore_merges_ = false;
    std::vector<int32_t> byte_ids_;  // byte -> id of "<0xHH>", -1 when absent (byte_fallback only)
    std::unique_ptr<BpeCache> cache_;
};

}  // namespace memra::text
