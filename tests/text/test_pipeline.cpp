// Pre-tokenizer sequences (per-piece prefix space, Digits, Split on a String) and the
// normalizers, with expected values taken from Hugging Face tokenizers 0.23.
#include <gtest/gtest.h>

#include "text/pipeline.h"

namespace memra::text {
namespace {

using nlohmann::json;
using V = std::vector<std::string>;

V pre_tokenize(const json &j, const std::string &text) {
    auto pt = PreTokenizer::from_json(j, "pre_tokenizer");
    EXPECT_TRUE(pt) << (pt ? "" : pt.error().message);
    if (!pt) return {};
    auto pieces = pt->apply(text);
    EXPECT_TRUE(pieces);
    return pieces ? *pieces : V{};
}

TEST(PreTokenizer, ByteLevelPrefixSpaceIsPerPiece) {
    const json j = {{"type", "Sequence"},
                    {"pretokenizers", json::array({{{"type", "Digits"}, {"individual_digits", true}},
                                                   {{"type", "ByteLevel"}, {"add_prefix_space", true}}})}};
    EXPECT_EQ(pre_tokenize(j, "it's 12 ab"), (V{"\xC4\xA0it", "'s", "\xC4\xA0",
                                                "\xC4\xA0"
                                                "1",
                                                "\xC4\xA0"
                                                "2",
                                                "\xC4\xA0"
                                                "ab"}));
}

TEST(PreTokenizer, StringSplitAndDigitRuns) {
    const json j = {
        {"type", "Sequence"},
        {"pretokenizers",
         json::array(
             {{{"type", "Split"}, {"pattern", {{"String", "--"}}}, {"behavior", "Contiguous"}, {"invert", false}},
              {{"type", "Digits"}, {"individual_digits", false}}})}};
    EXPECT_EQ(pre_tokenize(j, "a----b12c"), (V{"a", "----", "b", "12", "c"}));
    EXPECT_EQ(pre_tokenize(nullptr, "as is"), (V{"as is"}));
    EXPECT_EQ(pre_tokenize(j, ""), V{});
}

TEST(Normalizer, NfcNfkcWithHuggingFacesUnicodeTables) {
    auto nfkc = Normalizer::from_json({{"type", "NFKC"}}, "normalizer");
    auto nfc =
        Normalizer::from_json({{"type", "Sequence"}, {"normalizers", json::array({{{"type", "NFC"}}})}}, "normalizer");
    ASSERT_TRUE(nfkc);
    ASSERT_TRUE(nfc);
    // U+1FBF6 (compatibility digit, Unicode 13) and U+1E130 (a mark of Unicode 12) are unknown to HF's
    // tables: left as they are, and no reordering across them.
    const std::string in = "\uFB01 e\u0301 \U0001FBF6 a\U0001E130\u0316 x\u0301\u0316";
    EXPECT_EQ(nfkc->apply(in), "fi \u00E9 \U0001FBF6 a\U0001E130\u0316 x\u0316\u0301");
    EXPECT_EQ(nfc->apply(in), "\uFB01 \u00E9 \U0001FBF6 a\U0001E130\u0316 x\u0316\u0301");
    EXPECT_EQ(nfc->apply(std::string("a\0b", 3)), std::string("a\0b", 3));
}

TEST(PostProcessor, TemplateSequenceAndByteLevel) {
    const json tp = {
        {"type", "TemplateProcessing"},
        {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                {{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}})},
        {"pair",
         json::array({{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
        {"special_tokens",
         {{"<s>", {{"id", "<s>"}, {"ids", json::array({1})}, {"tokens", json::array({"<s>"})}}},
          {"</s>", {{"id", "</s>"}, {"ids", json::array({2, 3})}, {"tokens", json::array({"</", "s>"})}}}}}};
    auto pp = PostProcessor::from_json(
        {{"type", "Sequence"}, {"processors", json::array({{{"type", "ByteLevel"}}, tp})}}, "post_processor");
    ASSERT_TRUE(pp) << pp.error().message;
    EXPECT_EQ(pp->apply({7, 8}, true), (std::vector<int32_t>{1, 7, 8, 2, 3}));
    EXPECT_EQ(pp->apply({7, 8}, false), (std::vector<int32_t>{7, 8}));
    auto none = PostProcessor::from_json(nullptr, "post_processor");
    ASSERT_TRUE(none);
    EXPECT_EQ(none->apply({7}, true), (std::vector<int32_t>{7}));
    json bad = tp;
    bad["pair"] = json::array({{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}});
    auto err = PostProcessor::from_json(bad, "post_processor");
    ASSERT_FALSE(err);
    EXPECT_EQ(err.error().message, "post_processor.pair: expected Sequences \"A\" and \"B\" once each, found \"A\"");
}

}  // namespace
}  // namespace memra::text
