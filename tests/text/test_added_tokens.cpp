// Added-token matching: leftmost-longest trie scan, lstrip / rstrip / single_word, special tokens
// skipped when encoded as text, normalized tokens matched in normalized text.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "text/added_tokens.h"

namespace memra::text {
namespace {

AddedToken tok(const std::string &content, int32_t id, bool special = true) {
    AddedToken t;
    t.content = content;
    t.id = id;
    t.special = special;
    return t;
}

AddedVocabulary vocab(std::vector<AddedToken> tokens) {
    std::vector<std::string> contents;
    for (const auto &t : tokens) contents.push_back(t.content);
    auto v = AddedVocabulary::build(std::move(tokens), contents);
    EXPECT_TRUE(v);
    return std::move(*v);
}

// "text|<id>|text" rendering of a split.
std::string render(const std::string &text, const std::vector<TextSplit> &splits) {
    std::string out;
    for (const auto &s : splits) {
        if (!out.empty()) out += '|';
        const std::string piece = text.substr(s.start, s.end - s.start);
        out += s.token >= 0 ? fmt::format("<{}:{}>", s.token, piece) : piece;
    }
    return out;
}

TEST(TokenTrie, LeftmostLongest) {
    TokenTrie trie;
    trie.build({"<a>", "<a><b>", "b>", "<a", "xyz", "<a>"});
    auto m = trie.find_all("<a><b>c<a>b><ax");
    ASSERT_EQ(m.size(), 4u);
    EXPECT_EQ(m[0].pattern, 1u);  // "<a><b>" beats "<a>" and "<a" at the same start
    EXPECT_EQ(m[1].pattern, 0u);  // "<a>": the first of two identical patterns
    EXPECT_EQ(m[2].pattern, 2u);  // "b>" after it (no overlap)
    EXPECT_EQ(m[3].pattern, 3u);
    // The leftmost start wins even when a longer match starts one byte later.
    TokenTrie t2;
    t2.build({"ab", "bcdef"});
    auto m2 = t2.find_all("abcdef");
    ASSERT_EQ(m2.size(), 1u);
    EXPECT_EQ(m2[0].pattern, 0u);
}

TEST(AddedVocabulary, SplitsAndFlags) {
    AddedToken lstrip = tok("[L]", 11), rstrip = tok("[R]", 12), word = tok("cat", 13, false);
    lstrip.lstrip = true;
    rstrip.rstrip = true;
    word.single_word = true;
    const auto v = vocab({tok("<s>", 10), lstrip, rstrip, word});
    std::string t = "a<s>b";
    EXPECT_EQ(render(t, v.split(t, false, false)), "a|<10:<s>>|b");
    t = "x  \t[L]y";
    EXPECT_EQ(render(t, v.split(t, false, false)), "x|<11:  \t[L]>|y");
    t = "x[R] \u3000 y";
    EXPECT_EQ(render(t, v.split(t, false, false)), "x|<12:[R] \u3000 >|y");
    t = "cat concat cats cat_ \u00E9cat cat.";
    EXPECT_EQ(render(t, v.split(t, false, false)), "<13:cat>| concat cats cat_ \u00E9cat |<13:cat>|.");
    // encode_special: special tokens are text, non-special ones still match.
    t = "<s>cat";
    EXPECT_EQ(render(t, v.split(t, false, true)), "<s>|<13:cat>");
    EXPECT_EQ(render("", v.split("", false, false)), "");
    // lstrip never reaches back into a previous token's span.
    t = "[R]  [L]";
    EXPECT_EQ(render(t, v.split(t, false, false)), "<12:[R]  >|<11:[L]>");
}

TEST(AddedVocabulary, NormalizedTokensUseTheirOwnTrie) {
    AddedToken n = tok("\uFB01ne", 20, false);  // "ﬁne", matched as its NFKC form "fine"
    n.normalized = true;
    auto v = AddedVocabulary::build({n}, {"fine"});
    ASSERT_TRUE(v);
    EXPECT_EQ(render("so fine", v->split("so fine", true, false)), "so |<20:fine>");
    EXPECT_EQ(render("so fine", v->split("so fine", false, false)), "so fine");
    EXPECT_EQ(v->by_id(20)->decoded, "fine");
    EXPECT_EQ(v->id_of("\uFB01ne"), 20);
    EXPECT_FALSE(v->id_of("fine").has_value());
}

}  // namespace
}  // namespace memra::text
