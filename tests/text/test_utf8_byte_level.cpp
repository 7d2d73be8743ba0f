// UTF-8 classification and lossy repair (Rust from_utf8_lossy rules) and the GPT-2 byte alphabet.
#include <gtest/gtest.h>

#include <set>

#include "text/byte_level.h"
#include "text/utf8.h"

namespace memra::text {
namespace {

const std::string kFffd = "\xEF\xBF\xBD";

TEST(Utf8, StepClassifiesValidInvalidIncomplete) {
    EXPECT_EQ(utf8_step("a").kind, Utf8Kind::kValid);
    auto s = utf8_step("\xE2\x82\xAC");
    EXPECT_EQ(s.kind, Utf8Kind::kValid);
    EXPECT_EQ(s.len, 3u);
    s = utf8_step("\xE2\x82");
    EXPECT_EQ(s.kind, Utf8Kind::kIncomplete);
    EXPECT_EQ(s.len, 2u);
    s = utf8_step("\xE2\x41");
    EXPECT_EQ(s.kind, Utf8Kind::kInvalid);
    EXPECT_EQ(s.len, 1u);
    EXPECT_EQ(utf8_step("\xC0\x80").kind, Utf8Kind::kInvalid);  // overlong lead
    EXPECT_EQ(utf8_step("\xED\xA0\x80").len, 1u);  // surrogate: invalid at byte 2
    EXPECT_EQ(utf8_step("\xF4\x90\x80\x80").kind, Utf8Kind::kInvalid);  // above U+10FFFF
    s = utf8_step("\xF0\x9F\x98");
    EXPECT_EQ(s.kind, Utf8Kind::kIncomplete);
    EXPECT_EQ(s.len, 3u);
    s = utf8_step("\xF0\x9F\x98\x41");
    EXPECT_EQ(s.kind, Utf8Kind::kInvalid);
    EXPECT_EQ(s.len, 3u);
}

// Expected strings are what Rust's String::from_utf8_lossy returns for the same bytes.
TEST(Utf8, LossyReplacesMaximalSubparts) {
    EXPECT_EQ(utf8_lossy("abc"), "abc");
    EXPECT_EQ(utf8_lossy("a\xFF"
                         "b"),
              "a" + kFffd + "b");
    EXPECT_EQ(utf8_lossy("\xF0\x90\x80"), kFffd);  // truncated 4-byte: one
    EXPECT_EQ(utf8_lossy("\xF0\x90\x80"
                         "x"),
              kFffd + "x");
    EXPECT_EQ(utf8_lossy("\xC0\x80"), kFffd + kFffd);  // overlong: two
    EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), kFffd + kFffd + kFffd);  // surrogate: three
    EXPECT_EQ(utf8_lossy("\xF4\x90\x80\x80"), kFffd + kFffd + kFffd + kFffd);
    EXPECT_EQ(utf8_lossy("\xE2\x82\xAC\xE2\x82"), "\xE2\x82\xAC" + kFffd);
    EXPECT_EQ(utf8_lossy(std::string("\0\x80", 2)), std::string("\0", 1) + kFffd);
}

TEST(Utf8, NextAndAppendRoundTrip) {
    for (char32_t cp : {U'\0', U'a', U'\x7F', U'\x80', U'\u07FF', U'\u0800', U'\uFFFD', U'\U00010000', U'\U0010FFFF'}) {
        std::string s;
        utf8_append(s, cp);
        size_t pos = 0;
        EXPECT_EQ(utf8_next(s, pos), cp);
        EXPECT_EQ(pos, s.size());
        EXPECT_TRUE(utf8_is_valid(s));
    }
    EXPECT_FALSE(utf8_is_valid("\xE2\x82"));
}

TEST(ByteLevel, AlphabetIsTheGpt2Bijection) {
    EXPECT_EQ(byte_level_char(' '), U'\u0120');  // "Ġ"
    EXPECT_EQ(byte_level_char('\n'), U'\u010A');  // "Ċ"
    EXPECT_EQ(byte_level_char(0), U'\u0100');
    EXPECT_EQ(byte_level_char(0x7F), U'\u0121');
    EXPECT_EQ(byte_level_char(0xA0), U'\u0142');
    EXPECT_EQ(byte_level_char(0xAD), U'\u0143');
    EXPECT_EQ(byte_level_char('A'), U'A');
    EXPECT_EQ(byte_level_char(0xFF), U'\u00FF');
    std::set<char32_t> seen;
    for (int b = 0; b < 256; ++b) {
        const char32_t c = byte_level_char(static_cast<uint8_t>(b));
        EXPECT_TRUE(seen.insert(c).second);
        EXPECT_EQ(byte_level_byte(c), b);
    }
    EXPECT_FALSE(byte_level_byte(U' ').has_value());
    EXPECT_FALSE(byte_level_byte(U'\u0144').has_value());
    EXPECT_FALSE(byte_level_byte(U'\u00AD').has_value());
}

TEST(ByteLevel, EncodeDecodeTokens) {
    EXPECT_EQ(byte_level_encode(" hi\n"), "\xC4\xA0hi\xC4\x8A");
    EXPECT_EQ(byte_level_decode("\xC4\xA0hi\xC4\x8A"), std::optional<std::string>(" hi\n"));
    const std::string all = [] {
        std::string s;
        for (int b = 0; b < 256; ++b) s.push_back(static_cast<char>(b));
        return s;
    }();
    EXPECT_EQ(byte_level_decode(byte_level_encode(all)), std::optional<std::string>(all));
    // A character outside the alphabet: not a byte-level token (decoders keep its text).
    EXPECT_FALSE(byte_level_decode("<\xEF\xBD\x9C"
                                   "begin>")
                     .has_value());
    EXPECT_FALSE(byte_level_decode("a b").has_value());
}

}  // namespace
}  // namespace memra::text
