// memra's tokenizer: loads a Hugging Face tokenizer.json (byte-level BPE, as used by Step-3.5 /
// DeepSeek-V3) plus tokenizer_config.json, and encodes / decodes exactly like the `tokenizers`
// library. Text to encode that is not valid UTF-8 is first repaired the way Rust's
// String::from_utf8_lossy does (each maximal invalid byte sequence becomes U+FFFD).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"

namespace memra::text {

struct EncodeOptions {
    bool add_special = true;  // apply the post-processor template (BOS for Step-3.5)
    bool parse_special = true;  // match special added tokens in the text; false encodes them as text
};

class StreamDecoder;
struct TokenizerImpl;

class Tokenizer {
public:
    // `model_dir_or_file`: a directory with tokenizer.json (and optionally tokenizer_config.json and
    // generation_config.json), or the tokenizer.json file itself (the config files beside it).
    static Result<Tokenizer> load(const std::filesystem::path &model_dir_or_file);
    // From file contents; `config_json` / `generation_json` may be empty (absent).
    static Result<Tokenizer> from_json_text(std::string_view tokenizer_json, std::string_view config_json = {},
                                            std::string_view generation_json = {});

    Tokenizer(Tokenizer &&) noexcept;
    Tokenizer &operator=(Tokenizer &&) noexcept;
    ~Tokenizer();

    // Thread-safe. Fails only if a split regex cannot finish within PCRE2's raised limits (4 GiB of
    // backtracking heap), which no tokenizer pattern reaches on real text.
    Result<std::vector<int32_t>> encode(std::string_view text, const EncodeOptions &options = {}) const;
    // Unknown ids are skipped, as Hugging Face does; `skip_special` drops special added tokens.
    std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;
    // The raw bytes one token stands for (may be part of a UTF-8 character); empty for unknown ids.
    std::string token_text(int32_t id) const;
    // Size of the id space: 1 + the largest id of the vocabulary or of an added token; at most 2^24,
    // since loading refuses larger ids (kTokenIdLimit in json_fields.h).
    int32_t n_tokens() const;
    // Id of a vocabulary entry or added token, by its tokenizer.json spelling.
    std::optional<int32_t> token_id(std::string_view piece) const;
    bool is_special(int32_t id) const;

    // From tokenizer_config.json (bos/eos/pad tokens, add_*_token) and generation_config.json
    // (eos_token_id: int or list, added after the config's eos_token).
    std::optional<int32_t> bos_id() const;
    std::span<const int32_t> eos_ids() const;
    std::optional<int32_t> pad_id() const;
    bool add_bos_token() const;
    bool add_eos_token() const;
    // The Jinja chat template (the default one when the config lists several); empty if none.
    const std::string &chat_template() const;

    // A decoder for ids that arrive one at a time (generation); see StreamDecoder.
    StreamDecoder stream_decoder(bool skip_special = false) const;

private:
    Tokenizer();
    friend class StreamDecoder;
    std::unique_ptr<TokenizerImpl> impl_;
};

// Incremental decode: feed() returns only complete UTF-8 text, holding back the bytes of a
// character whose remaining bytes may still come; bytes that can never complete a character
// become U+FFFD as soon as that is certain. flush() ends the stream. The concatenation of all
// returned text equals Tokenizer::decode(all ids, skip_special). The tokenizer must outlive it.
class StreamDecoder {
public:
    std::string feed(int32_t id);
    std::string flush();

private:
    friend class Tokenizer;
    StreamDecoder(const TokenizerImpl *impl, bool skip_special) : impl_(impl), skip_special_(skip_special) {}
    const TokenizerImpl *impl_;
    bool skip_special_;
    bool first_ = true;  // no token emitted yet (the " " separator without a decoder)
    std::string pending_;  // bytes of an incomplete character (ByteLevel decoder)
};

}  // namespace memra::text
