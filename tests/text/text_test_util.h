// Helpers for the tokenizer unit tests: a small byte-level BPE tokenizer.json built in memory (all
// 256 byte symbols plus a few merges and chat specials) that each test can modify before loading.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/byte_level.h"
#include "text/tokenizer.h"

namespace memra::text::testing {

// Byte-level text of raw bytes ("Ġ" for a space).
inline std::string bl(std::string_view bytes) { return byte_level_encode(bytes); }

// Vocabulary: ids 0..255 = the bytes in byte order, then the merges' results; added tokens
// <s> (special, BOS template), </s> (special), <|im_end|> (special) after them.
inline nlohmann::json small_tokenizer_json() {
    using nlohmann::json;
    json vocab = json::object();
    for (int b = 0; b < 256; ++b) vocab[bl(std::string(1, static_cast<char>(b)))] = b;
    const std::vector<std::pair<std::string, std::string>> merges = {
        {bl("h"), bl("e")},           {bl("l"), bl("l")},  {bl("he"), bl("ll")}, {bl("hell"), bl("o")},
        {bl(" "), bl("w")},           {bl(" w"), bl("o")}, {bl("a"), bl("a")},   {bl("\xE2"), bl("\x82")},
        {bl("\xE2\x82"), bl("\xAC")}, {bl(" "), bl(" ")},
    };
    json jmerges = json::array();
    int next = 256;
    for (const auto &[a, b] : merges) {
        if (!vocab.contains(a + b)) vocab[a + b] = next++;
        jmerges.push_back(json::array({a, b}));
    }
    auto added = [&](const std::string &content, bool special) {
        return json{{"id", next++},    {"content", content},  {"single_word", false}, {"lstrip", false},
                    {"rstrip", false}, {"normalized", false}, {"special", special}};
    };
    json added_tokens = json::array({added("<s>", true), added("</s>", true), added("<|im_end|>", true)});
    const int bos = added_tokens[0]["id"];
    json pre = {
        {"type", "Sequence"},
        {"pretokenizers",
         json::array(
             {{{"type", "Split"}, {"pattern", {{"Regex", "\\p{N}{1,3}"}}}, {"behavior", "Isolated"}, {"invert", false}},
              {{"type", "Split"},
               {"pattern", {{"Regex", "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"}}},
               {"behavior", "Isolated"},
               {"invert", false}},
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}})}};
    json post = {
        {"type", "TemplateProcessing"},
        {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"pair", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                              {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", json::array({bos})}, {"tokens", json::array({"<s>"})}}}}}};
    return json{
        {"version", "1.0"},
        {"truncation", nullptr},
        {"padding", nullptr},
        {"added_tokens", added_tokens},
        {"normalizer", nullptr},
        {"pre_tokenizer", pre},
        {"post_processor", post},
        {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}},
        {"model",
         {{"type", "BPE"},
          {"dropout", nullptr},
          {"unk_token", nullptr},
          {"continuing_subword_prefix", nullptr},
          {"end_of_word_suffix", nullptr},
          {"fuse_unk", false},
          {"byte_fallback", false},
          {"ignore_merges", false},
          {"vocab", vocab},
          {"merges", jmerges}}}};
}

inline Tokenizer load_small(const nlohmann::json &j, const std::string &config = {}) {
    auto tok = Tokenizer::from_json_text(j.dump(), config);
    if (!tok) throw std::runtime_error(tok.error().message);
    return std::move(*tok);
}

// The error message of loading `j`, or "" when it loads.
inline std::string load_error(const nlohmann::json &j, const std::string &config = {}) {
    auto tok = Tokenizer::from_json_text(j.dump(), config);
    return tok ? std::string() : tok.error().message;
}

}  // namespace memra::text::testing
