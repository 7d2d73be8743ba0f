// BPE merges (rank order, leftmost on ties, stale candidates), ignore_merges, byte_fallback,
// unknown tokens, and every refusal of the model section.
#include <gtest/gtest.h>

#include "text/bpe.h"

namespace memra::text {
namespace {

using nlohmann::json;

json model_json(const json &vocab, const json &merges) {
    return json{{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", false},
                {"vocab", vocab},
                {"merges", merges}};
}

std::vector<int32_t> encode(const BpeModel &m, const std::string &word) {
    std::vector<int32_t> out;
    m.tokenize(word, out);
    return out;
}

std::string error_of(const json &j) {
    auto m = BpeModel::from_json(j, "tokenizer.json: model");
    return m ? std::string("accepted") : m.error().message;
}

const json kVocab = {{"a", 0}, {"b", 1}, {"c", 2}, {"aa", 3}, {"ab", 4}, {"bc", 5}, {"abc", 6}, {"aab", 7}, {"aaa", 8}};

TEST(Bpe, LowestRankFirstLeftmostOnTies) {
    // "aaa": (a,a) at 0 and 1 share rank 0; the leftmost merges, leaving "aa" "a".
    auto m = BpeModel::from_json(model_json(kVocab, json::array({json::array({"a", "a"})})), "m");
    ASSERT_TRUE(m);
    EXPECT_EQ(encode(*m, "aaa"), (std::vector<int32_t>{3, 0}));
    EXPECT_EQ(encode(*m, "aaaa"), (std::vector<int32_t>{3, 3}));
    // Rank decides: (b,c) before (a,b) -> a bc, then nothing merges a+bc ("abc" only via ab+c).
    auto m2 = BpeModel::from_json(
        model_json(kVocab, json::array({json::array({"b", "c"}), json::array({"a", "b"}), json::array({"ab", "c"})})),
        "m");
    ASSERT_TRUE(m2);
    EXPECT_EQ(encode(*m2, "abc"), (std::vector<int32_t>{0, 5}));
    auto m3 = BpeModel::from_json(
        model_json(kVocab, json::array({json::array({"a", "b"}), json::array({"b", "c"}), json::array({"ab", "c"})})),
        "m");
    ASSERT_TRUE(m3);
    EXPECT_EQ(encode(*m3, "abc"), (std::vector<int32_t>{6}));
    // A candidate made stale by a merge on its right is not applied: "aab" with (a,a) r1, (a,b) r0.
    auto m4 = BpeModel::from_json(
        model_json(kVocab, json::array({json::array({"a", "b"}), json::array({"a", "a"}), json::array({"a", "ab"})})),
        "m");
    ASSERT_TRUE(m4);
    EXPECT_EQ(encode(*m4, "aab"), (std::vector<int32_t>{7}));
    // Legacy "a b" strings work like pairs; a repeated pair keeps its last rank.
    auto m5 = BpeModel::from_json(model_json(kVocab, json::array({"a b", "b c", "a a", "a b"})), "m");
    ASSERT_TRUE(m5);
    EXPECT_EQ(encode(*m5, "abc"), (std::vector<int32_t>{0, 5}));  // (b,c) rank 1 now beats (a,b) rank 3
}

TEST(Bpe, LongWordIsLinearithmic) {
    json vocab = {{"a", 0}, {"aa", 1}, {"aaaa", 2}};
    auto m =
        BpeModel::from_json(model_json(vocab, json::array({json::array({"a", "a"}), json::array({"aa", "aa"})})), "m");
    ASSERT_TRUE(m);
    const auto ids = encode(*m, std::string(1 << 20, 'a'));
    EXPECT_EQ(ids.size(), size_t{1} << 18);
    EXPECT_EQ(ids.front(), 2);
}

TEST(Bpe, IgnoreMergesByteFallbackAndUnknown) {
    json j = model_json(kVocab, json::array({json::array({"a", "b"})}));
    j["ignore_merges"] = true;
    auto m = BpeModel::from_json(j, "m");
    ASSERT_TRUE(m);
    EXPECT_EQ(encode(*m, "aab"), (std::vector<int32_t>{7}));  // whole word in the vocabulary
    EXPECT_EQ(encode(*m, "abb"), (std::vector<int32_t>{4, 1}));

    json fb = model_json({{"a", 0}, {"<0xC3>", 1}, {"<0xA9>", 2}, {"<unk>", 3}}, json::array());
    fb["byte_fallback"] = true;
    fb["unk_token"] = "<unk>";
    auto mf = BpeModel::from_json(fb, "m");
    ASSERT_TRUE(mf);
    EXPECT_EQ(encode(*mf, "a\xC3\xA9"
                          "a"),
              (std::vector<int32_t>{0, 1, 2, 0}));
    EXPECT_EQ(encode(*mf, "a\xE2\x82\xAC"
                          "a"),
              (std::vector<int32_t>{0, 3, 0}));  // no <0xE2>: unknown

    json unk = model_json({{"a", 0}, {"<unk>", 1}}, json::array());
    unk["unk_token"] = "<unk>";
    auto mu = BpeModel::from_json(unk, "m");
    ASSERT_TRUE(mu);
    EXPECT_EQ(encode(*mu, "axya"), (std::vector<int32_t>{0, 1, 1, 0}));
    unk["fuse_unk"] = true;
    auto mfu = BpeModel::from_json(unk, "m");
    ASSERT_TRUE(mfu);
    EXPECT_EQ(encode(*mfu, "axya"), (std::vector<int32_t>{0, 1, 0}));
    // Without an unknown token, characters outside the vocabulary are dropped (as in HF).
    auto md = BpeModel::from_json(model_json({{"a", 0}}, json::array()), "m");
    ASSERT_TRUE(md);
    EXPECT_EQ(encode(*md, "axa"), (std::vector<int32_t>{0, 0}));
}

TEST(Bpe, CacheDoesNotChangeResults) {
    auto m = BpeModel::from_json(model_json(kVocab, json::array({json::array({"a", "a"})})), "m");
    ASSERT_TRUE(m);
    for (int i = 0; i < 40000; ++i) {  // more distinct words than the cache holds
        const std::string w =
            std::string(static_cast<size_t>(1 + i % 7), 'a') + std::string(static_cast<size_t>(i % 5), 'b');
        const auto first = encode(*m, w);
        EXPECT_EQ(encode(*m, w), first);
    }
}

TEST(Bpe, Refusals) {
    EXPECT_EQ(error_of(model_json({{"a", 0}}, json::array({json::array({"a", "b"})}))),
              "tokenizer.json: model.merges[0]: token \"b\" is not in the vocabulary");
    EXPECT_EQ(error_of(model_json({{"a", 0}, {"b", 1}}, json::array({json::array({"a", "b"})}))),
              "tokenizer.json: model.merges[0]: merged token \"ab\" is not in the vocabulary");
    EXPECT_NE(error_of(model_json({{"a", 0}}, json::array({"ab"}))).find("merges[0]: expected \"left right\""),
              std::string::npos);
    EXPECT_NE(error_of(model_json({{"a", 0}}, json::array({3}))).find("expected a [\"left\", \"right\"] pair"),
              std::string::npos);
    EXPECT_NE(error_of(model_json({{"a", 0}, {"b", 0}}, json::array())).find("id 0 is used by both"),
              std::string::npos);
    EXPECT_NE(error_of(model_json({{"a", -1}}, json::array())).find("expected a token id in [0, 2^31)"),
              std::string::npos);
    json j = model_json({{"a", 0}}, json::array());
    j["dropout"] = 0.1;
    EXPECT_NE(error_of(j).find("model.dropout: expected null (dropout makes encoding random)"), std::string::npos);
    j = model_json({{"a", 0}}, json::array());
    j["continuing_subword_prefix"] = "##";
    EXPECT_NE(error_of(j).find("model.continuing_subword_prefix: unsupported \"##\""), std::string::npos);
    j = model_json({{"a", 0}}, json::array());
    j["end_of_word_suffix"] = "</w>";
    EXPECT_NE(error_of(j).find("model.end_of_word_suffix: unsupported"), std::string::npos);
    j = model_json({{"a", 0}}, json::array());
    j["unk_token"] = "<unk>";
    EXPECT_NE(error_of(j).find("model.unk_token: \"<unk>\" is not in the vocabulary"), std::string::npos);
    j = model_json({{"a", 0}}, json::array());
    j["byte_fallback"] = "yes";
    EXPECT_NE(error_of(j).find("model.byte_fallback: expected true or false"), std::string::npos);
    j.erase("vocab");
    EXPECT_NE(error_of(j).find("model.vocab: missing"), std::string::npos);
}

}  // namespace
}  // namespace memra::text
