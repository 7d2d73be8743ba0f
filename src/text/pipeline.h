// The tokenizer.json stages around the BPE model: normalizer, pre-tokenizer, post-processor and
// decoder, each parsed from its JSON (unsupported types refused with the JSON path) and applied
// with Hugging Face tokenizers' semantics.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "text/json_fields.h"
#include "text/onig_regex.h"

namespace memra::text {

// Unicode normalization forms applied in order (empty: no normalizer).
enum class NormalForm { kNfc, kNfkc };

class Normalizer {
public:
    static Result<Normalizer> from_json(const Json &value, const std::string &path);
    bool empty() const { return forms_.empty(); }
    std::string apply(std::string_view text) const;
    const std::vector<NormalForm> &forms() const { return forms_; }

private:
    std::vector<NormalForm> forms_;
};

// How a Split keeps the delimiters it finds.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// Splits `text` at the matches of `regex` (inverted: at the non-matches) with `behavior`, appending
// the non-empty pieces.
Result<void> split_text(std::string_view text, const Regex &regex, bool invert, SplitBehavior behavior,
                        std::vector<std::string> &out);

class PreTokenizer {
public:
    static Result<PreTokenizer> from_json(const Json &value, const std::string &path);
    // Pieces of `text` (one piece between added tokens) the model encodes one by one.
    Result<std::vector<std::string>> apply(std::string_view text) const;

private:
    enum class Kind { kSplit, kByteLevel };
    struct Step {
        Kind kind = Kind::kSplit;
        Regex regex;  // kSplit; kByteLevel with use_regex: the GPT-2 pattern
        bool use_regex = false;  // kByteLevel
        bool invert = false;  // kSplit
        SplitBehavior behavior = SplitBehavior::kIsolated;
        bool add_prefix_space = false;  // kByteLevel
    };
    static Result<void> parse(const Json &value, const std::string &path, std::vector<Step> &steps);
    std::vector<Step> steps_;  // Sequence flattened; empty: the text is one piece
};

class PostProcessor {
public:
    static Result<PostProcessor> from_json(const Json &value, const std::string &path);
    // The template of a single sequence applied to `ids` (when add_special).
    std::vector<int32_t> apply(const std::vector<int32_t> &ids, bool add_special) const;

private:
    struct Piece {
        bool is_sequence = false;
        std::vector<int32_t> ids;  // special-token ids when !is_sequence
    };
    std::vector<std::vector<Piece>> templates_;  // one per TemplateProcessing, in order
};

// How token strings become text.
enum class DecoderKind {
    kNone,  // no decoder: tokens joined with " "
    kConcat,  // an empty Sequence: tokens concatenated
    kByteLevel,  // bytes of the alphabet (or the token text), then lossy UTF-8
};

Result<DecoderKind> decoder_from_json(const Json &value, const std::string &path);

}  // namespace memra::text
