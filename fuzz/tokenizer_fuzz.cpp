// libFuzzer target for memra::text. The first input byte picks what the rest is:
//   0: text for a byte-level tokenizer with Step-3.5's split regexes: encode (specials parsed and
//      not), then decode == String::from_utf8_lossy of the text, and the stream decoder's output ==
//      decode for the same ids, in complete UTF-8 pieces;
//   1: an Oniguruma pattern: translation and matching on a fixed text must end in matches or an
//      Error, and every match must lie inside the text on character boundaries;
//   2: a tokenizer.json: loading must give a Tokenizer or an Error, an accepted one must have fewer
//      than 2^24 ids (larger ids are refused before any table is sized by them) and must encode and
//      decode a fixed text.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/byte_level.h"
#include "text/json_fields.h"
#include "text/onig_regex.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

namespace {

using memra::text::Tokenizer;
using nlohmann::json;

std::string bl(std::string_view s) { return memra::text::byte_level_encode(s); }

std::string tokenizer_json() {
    json vocab = json::object();
    for (int b = 0; b < 256; ++b) vocab[bl(std::string(1, static_cast<char>(b)))] = b;
    json merges = json::array();
    int next = 256;
    for (const char *pair : {"th", "he", "in", "er", " t", "\xE6\x97", "\xE6\x97\xA5"}) {
        const std::string whole = pair;
        const std::string a = bl(whole.substr(0, whole.size() - 1)), b = bl(whole.substr(whole.size() - 1));
        if (!vocab.contains(a)) continue;
        if (!vocab.contains(a + b)) vocab[a + b] = next++;
        merges.push_back(json::array({a, b}));
    }
    json added = json::array();
    for (const char *special : {"<s>", "<|im_end|>"}) {
        added.push_back({{"id", next++},
                         {"content", special},
                         {"single_word", false},
                         {"lstrip", false},
                         {"rstrip", false},
                         {"normalized", false},
                         {"special", true}});
    }
    auto split = [](const char *re) {
        return json{{"type", "Split"}, {"pattern", {{"Regex", re}}}, {"behavior", "Isolated"}, {"invert", false}};
    };
    json pre = {{"type", "Sequence"},
                {"pretokenizers",
                 json::array({split("\\p{N}{1,3}"),
                              split("[一-龥぀-ゟ゠-ヿ]+"),
                              split("[!-/:-@\\[-`{-~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}"
                                    "\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"),
                              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
    return json{{"added_tokens", added},
                {"pre_tokenizer", pre},
                {"decoder", {{"type", "ByteLevel"}}},
                {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}}
        .dump();
}

void check_text(const Tokenizer &tok, std::string_view text) {
    for (bool parse_special : {true, false}) {
        auto ids = tok.encode(text, {false, parse_special});
        if (!ids) __builtin_trap();  // these patterns cannot hit a match limit
        const std::string decoded = tok.decode(*ids);
        if (!parse_special && decoded != memra::text::utf8_lossy(text)) __builtin_trap();
        auto stream = tok.stream_decoder();
        std::string streamed;
        for (int32_t id : *ids) {
            const std::string piece = stream.feed(id);
            if (!memra::text::utf8_is_valid(piece)) __builtin_trap();
            streamed += piece;
        }
        streamed += stream.flush();
        if (streamed != decoded) __builtin_trap();
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    const std::string_view rest(reinterpret_cast<const char *>(data) + 1, size - 1);
    switch (data[0] % 3) {
    case 0: {
        static const Tokenizer tok = *Tokenizer::from_json_text(tokenizer_json());
        check_text(tok, rest);
        break;
    }
    case 1: {
        auto re = memra::text::Regex::compile(rest);
        if (!re) break;
        const std::string text = "ab 12\n\xC3\xA9\xE6\x97\xA5 x'S \xF0\x9F\x98\x80";
        auto matches = re->find_all(text);
        if (!matches) break;
        for (const auto &m : *matches) {
            if (m.start > m.end || m.end > text.size()) __builtin_trap();
            if (m.end < text.size() && (static_cast<uint8_t>(text[m.end]) & 0xC0) == 0x80) __builtin_trap();
        }
        break;
    }
    default: {
        auto tok = Tokenizer::from_json_text(rest);
        if (!tok) break;
        if (tok->n_tokens() > memra::text::kTokenIdLimit) __builtin_trap();
        auto ids = tok->encode("Hello <s> world \xE6\x97\xA5\xE6\x9C\xAC 123");
        if (ids) (void)tok->decode(*ids);
        break;
    }
    }
    return 0;
}
