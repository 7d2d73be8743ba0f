// The Oniguruma -> PCRE2 translation: match iteration like the onig crate, the patterns of
// Step-3.5 / DeepSeek-V3 / Llama-3 / GPT-2 pre-tokenizers, each rewritten construct, the Unicode
// 16 property patches, and every refusal.
#include <gtest/gtest.h>

#include "text/onig_regex.h"
#include "text/pipeline.h"

namespace memra::text {
namespace {

// The pieces Split(pattern, Isolated) makes of `text` (expected values: HF tokenizers 0.23).
std::vector<std::string> pieces(const std::string &pattern, const std::string &text,
                                SplitBehavior behavior = SplitBehavior::kIsolated, bool invert = false) {
    auto re = Regex::compile(pattern);
    EXPECT_TRUE(re.has_value()) << (re ? "" : re.error().message);
    if (!re) return {};
    std::vector<std::string> out;
    auto ok = split_text(text, *re, invert, behavior, out);
    EXPECT_TRUE(ok.has_value());
    return out;
}

using V = std::vector<std::string>;

std::string refusal(const std::string &pattern) {
    auto re = Regex::compile(pattern);
    return re ? std::string("accepted") : re.error().message;
}

TEST(OnigRegex, FindAllStepsOverEmptyMatchesLikeTheOnigCrate) {
    auto re = Regex::compile("x*");
    ASSERT_TRUE(re);
    auto m = re->find_all("abxxc");
    ASSERT_TRUE(m);
    std::vector<std::pair<size_t, size_t>> got;
    for (auto r : *m) got.emplace_back(r.start, r.end);
    // Empty at 0 and 1, "xx" at 2, then the empty match at 4 right after it is skipped; 5 is the end.
    EXPECT_EQ(got, (std::vector<std::pair<size_t, size_t>>{{0, 0}, {1, 1}, {2, 4}, {5, 5}}));
    auto empty = Regex::compile("");
    ASSERT_TRUE(empty);
    EXPECT_EQ(empty
                  ->find_all("\xC3\xA9"
                             "a")
                  ->size(),
              3u);  // before é, before a, at the end
}

TEST(OnigRegex, StepAndDeepSeekPatterns) {
    EXPECT_EQ(pieces("\\p{N}{1,3}", "x12345y"), (V{"x", "123", "45", "y"}));
    EXPECT_EQ(pieces("[一-龥぀-ゟ゠-ヿ]+", "a日本\u3099語bカタカナ"), (V{"a", "日本\u3099語", "b", "カタカナ"}));
    EXPECT_EQ(pieces("\\s+(?!\\S)|\\s+", "a   b\n\n c  "), (V{"a", "  ", " ", "b", "\n\n", " ", "c", "  "}));
    EXPECT_EQ(pieces("(?i:'s|'t|'re|'ve|'m|'ll|'d)", "it'S we'LL x'\u017F"),
              (V{"it", "'S", " we", "'LL", " x", "'\u017F"}));
    EXPECT_EQ(pieces("[^\\r\\n\\p{L}\\p{N}]?\\p{L}+", "\nhello, world"), (V{"\n", "hello", ",", " world"}));
    const std::string ds =
        "[!-/:-@\\[-`{-~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*"
        "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
    EXPECT_EQ(pieces(ds, "Hello, #world!\n\n  x"), (V{"Hello", ",", " #", "world", "!\n\n", " ", " x"}));
}

TEST(OnigRegex, UnicodeSixteenData) {
    // U+1FAE8 (Unicode 15 emoji) is So for Oniguruma; U+31350 (CJK Ext. H) is a letter and Han;
    // U+1171E became Mc in Unicode 16.
    EXPECT_EQ(pieces("\\p{So}", "a\U0001FAE8"), (V{"a", "\U0001FAE8"}));
    EXPECT_EQ(pieces("\\p{L}+", "1\U00031350\U00031351"), (V{"1", "\U00031350\U00031351"}));
    EXPECT_EQ(pieces("\\p{Han}+", "1\U00031350"), (V{"1", "\U00031350"}));
    EXPECT_EQ(pieces("\\p{Mn}+", "a\U0001171E"), (V{"a\U0001171E"}));
    EXPECT_EQ(pieces("\\p{Mc}", "a\U0001171E"), (V{"a", "\U0001171E"}));
    EXPECT_EQ(pieces("\\P{Mn}", "\u0301\U0001171E"), (V{"\u0301", "\U0001171E"}));
    EXPECT_EQ(pieces("\\p{Kawi}+", "a\U00011F00\U00011F01"), (V{"a", "\U00011F00\U00011F01"}));
    // Scripts are Script, not Script_Extensions: U+30FC (Common) is not Hiragana.
    EXPECT_EQ(pieces("\\p{Hiragana}+", "\u3042\u30FC"), (V{"\u3042", "\u30FC"}));
}

TEST(OnigRegex, ClassEscapesFollowOniguruma) {
    // \s is White_Space: U+0085 yes, U+180E no.
    EXPECT_EQ(pieces("\\s", "a\u0085b\u180Ec"), (V{"a", "\u0085", "b\u180Ec"}));
    // Bare \w has U+00B2 (onig's table), [\w] does not; \w has marks but not No.
    EXPECT_EQ(pieces("\\w+", "a\u00B2 \u00B2"), (V{"a\u00B2", " ", "\u00B2"}));
    EXPECT_EQ(pieces("[\\w]+", "a\u00B2b"), (V{"a", "\u00B2", "b"}));
    EXPECT_EQ(pieces("\\w+", "e\u0301\u2460"), (V{"e\u0301", "\u2460"}));
    EXPECT_EQ(pieces("\\d+", "1\u0661\u00B2"), (V{"1\u0661", "\u00B2"}));
    EXPECT_EQ(pieces("\\h+", "xa9F g"), (V{"x", "a9F", " g"}));  // hex digit, not horizontal space
    EXPECT_EQ(pieces("\\v", "a\x0B"
                            "b\nc"),
              (V{"a", "\x0B", "b\nc"}));
    EXPECT_EQ(pieces("\\bab", "ab xab"), (V{"ab", " xab"}));
    EXPECT_EQ(pieces("[\\P{L}a]+", "a1bc2"), (V{"a1", "bc", "2"}));
    EXPECT_EQ(pieces("[^\\P{L}a]+", "a1bc2"), (V{"a1", "bc", "2"}));
}

TEST(OnigRegex, RewrittenSyntax) {
    EXPECT_EQ(pieces("a{,2}", "aaaaa"), (V{"aa", "aa", "a"}));
    EXPECT_EQ(pieces("ba{2}?", "ba,baa"), (V{"b", "a,", "baa"}));  // {n}? is an optional {n}
    EXPECT_EQ(pieces("a{1,2}+", "aaaaa"), (V{"aaaaa"}));  // a repeat of a repeat
    EXPECT_EQ(pieces("x(?i)y|z", "z,xz,XY,xY"), (V{"z,", "xz", ",XY,", "xY"}));
    EXPECT_EQ(pieces("(?m:a.)b", "a\nb"), (V{"a\nb"}));  // (?m) is dot-all
    EXPECT_EQ(pieces("^a", "a\na"), (V{"a", "\n", "a"}));  // ^ is a line anchor
    EXPECT_EQ(pieces("\\u0041", "xAx"), (V{"x", "A", "x"}));
    EXPECT_EQ(pieces("[a-c-e]", "d-"), (V{"d", "-"}));
    EXPECT_EQ(pieces("(?<n>.)\\k<n>", "abbc"), (V{"a", "bb", "c"}));
}

TEST(OnigRegex, LongRunsExceedPcre2DefaultLimits) {
    // A repeated group over 200k letters outgrows the default 32 KiB JIT stack; memra retries
    // with larger limits instead of failing (Oniguruma has no such limit).
    const std::string text(200000, 'a');
    auto re = Regex::compile("(?:\\p{L}|\\p{N})+");
    ASSERT_TRUE(re);
    auto m = re->find_all(text);
    ASSERT_TRUE(m) << m.error().message;
    ASSERT_EQ(m->size(), 1u);
    EXPECT_EQ((*m)[0].end, text.size());
}

TEST(OnigRegex, Refusals) {
    EXPECT_NE(refusal("[a-z&&[^b]]").find("intersection && is not supported"), std::string::npos);
    EXPECT_NE(refusal("[a[b]]").find("nested character classes"), std::string::npos);
    EXPECT_NE(refusal("[[:alpha:]]").find("POSIX brackets"), std::string::npos);
    EXPECT_NE(refusal("(?i)ss").find("matches one character in Oniguruma"), std::string::npos);
    EXPECT_NE(refusal("(?i:\u00DF)").find("matches several characters"), std::string::npos);
    EXPECT_NE(refusal("(?i)[\\p{L}]").find("case-insensitive classes"), std::string::npos);
    EXPECT_NE(refusal("(?x) a").find("(?x) is not supported"), std::string::npos);
    EXPECT_NE(refusal("\\p{Foo}").find("unsupported property \\p{Foo}"), std::string::npos);
    EXPECT_NE(refusal("\\pL").find("\\p without braces"), std::string::npos);
    EXPECT_NE(refusal("\\0101").find("unsupported escape \\0"), std::string::npos);
    EXPECT_NE(refusal("\\12").find("multi-digit back-references"), std::string::npos);
    EXPECT_NE(refusal("\\y").find("unsupported escape \\y"), std::string::npos);
    EXPECT_NE(refusal("\\QA+\\E").find("\\Q...\\E quoting is not supported"), std::string::npos);
    EXPECT_NE(refusal("\\X").find("\\X is not supported"), std::string::npos);
    EXPECT_NE(refusal("(?~a)").find("unsupported group syntax (?~"), std::string::npos);
    EXPECT_NE(refusal("a{3,2}").find("n > m"), std::string::npos);
    EXPECT_NE(refusal("*a").find("quantifier without a target"), std::string::npos);
    EXPECT_NE(refusal("(a").find("unclosed group"), std::string::npos);
    EXPECT_NE(refusal("a)").find("unmatched ')'"), std::string::npos);
    EXPECT_NE(refusal("[ab").find("unterminated character class"), std::string::npos);
    EXPECT_NE(refusal("[\\d-z]").find("range from a class escape"), std::string::npos);
    EXPECT_NE(refusal("\xFF").find("not valid UTF-8"), std::string::npos);
    // Errors name the pattern and the offset.
    EXPECT_EQ(refusal("ab\\y").rfind("regex \"ab\\y\": offset 3:", 0), 0u);
}

TEST(OnigRegex, LiteralPatterns) {
    auto re = Regex::literal("a.b");
    ASSERT_TRUE(re);
    EXPECT_EQ(re->find_all("a.b axb a.b")->size(), 2u);
}

TEST(Split, EveryBehaviorAndInvert) {
    // Expected: pre_tokenizers.Split(Regex("-"), behavior, invert) on "a-b--c-" in HF tokenizers.
    const std::string t = "a-b--c-";
    EXPECT_EQ(pieces("-", t, SplitBehavior::kRemoved), (V{"a", "b", "c"}));
    EXPECT_EQ(pieces("-", t, SplitBehavior::kIsolated), (V{"a", "-", "b", "-", "-", "c", "-"}));
    EXPECT_EQ(pieces("-", t, SplitBehavior::kMergedWithPrevious), (V{"a-", "b-", "-", "c-"}));
    EXPECT_EQ(pieces("-", t, SplitBehavior::kMergedWithNext), (V{"a", "-b", "-", "-c", "-"}));
    EXPECT_EQ(pieces("-", t, SplitBehavior::kContiguous), (V{"a", "-", "b", "--", "c", "-"}));
    EXPECT_EQ(pieces("-", t, SplitBehavior::kRemoved, true), (V{"-", "-", "-", "-"}));
    EXPECT_EQ(pieces("-", t, SplitBehavior::kMergedWithPrevious, true), (V{"a", "-b", "-", "-c", "-"}));
    EXPECT_EQ(pieces("-", t, SplitBehavior::kMergedWithNext, true), (V{"a-", "b-", "-", "c-"}));
    // Empty matches take part in merging.
    EXPECT_EQ(pieces("x*", "abxxc", SplitBehavior::kMergedWithPrevious), (V{"a", "bxx", "c"}));
    EXPECT_EQ(pieces("x*", "abxxc", SplitBehavior::kContiguous), (V{"a", "b", "xx", "c"}));
    EXPECT_EQ(pieces("-", "", SplitBehavior::kIsolated), V{});
}

}  // namespace
}  // namespace memra::text
