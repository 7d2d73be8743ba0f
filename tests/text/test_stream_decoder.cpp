// StreamDecoder: only complete UTF-8 comes out, incomplete characters are held, impossible ones
// become U+FFFD at once, and the concatenation always equals decode() of all ids.
#include <gtest/gtest.h>

#include <random>

#include "text/utf8.h"
#include "text_test_util.h"

namespace memra::text {
namespace {

using nlohmann::json;
using testing::load_small;
using testing::small_tokenizer_json;

std::string stream_all(const Tokenizer &t, const std::vector<int32_t> &ids, bool skip,
                       std::vector<std::string> *parts) {
    StreamDecoder s = t.stream_decoder(skip);
    std::string out;
    for (int32_t id : ids) {
        std::string piece = s.feed(id);
        if (parts) parts->push_back(piece);
        out += piece;
    }
    std::string tail = s.flush();
    if (parts) parts->push_back(tail);
    return out + tail;
}

TEST(StreamDecoder, HoldsIncompleteCharacters) {
    const Tokenizer t = load_small(small_tokenizer_json());
    StreamDecoder s = t.stream_decoder();
    EXPECT_EQ(s.feed(0xE2), "");
    EXPECT_EQ(s.feed(0x82), "");
    EXPECT_EQ(s.feed(0xAC), "\xE2\x82\xAC");
    EXPECT_EQ(s.feed(0xF0), "");
    EXPECT_EQ(s.feed('a'), "\xEF\xBF\xBD"
                           "a");  // F0 then 'a' can never complete: U+FFFD at once
    EXPECT_EQ(s.feed(0xC3), "");
    EXPECT_EQ(s.flush(), "\xEF\xBF\xBD");  // cut off at the end
    EXPECT_EQ(s.feed(0xFF), "\xEF\xBF\xBD");  // never a lead byte
    EXPECT_EQ(s.feed(*t.token_id("<s>")), "<s>");
    EXPECT_EQ(s.feed(123456), "");
}

TEST(StreamDecoder, ConcatenationEqualsDecodeOnRandomIds) {
    const Tokenizer t = load_small(small_tokenizer_json());
    std::mt19937 rng(1234);
    const int32_t n = t.n_tokens();
    // Weighted toward the continuation / lead bytes (0x80-0xFF) so characters split often.
    std::uniform_int_distribution<int32_t> any(-2, n + 2), high(0x80, 0xFF), len(0, 30), pick(0, 3);
    for (int round = 0; round < 3000; ++round) {
        std::vector<int32_t> ids;
        const int l = len(rng);
        for (int i = 0; i < l; ++i) ids.push_back(pick(rng) == 0 ? any(rng) : high(rng));
        for (bool skip : {false, true}) {
            std::vector<std::string> parts;
            ASSERT_EQ(stream_all(t, ids, skip, &parts), t.decode(ids, skip)) << "round " << round;
            for (const auto &p : parts) ASSERT_TRUE(utf8_is_valid(p));
        }
    }
    // Every character of real text split into single bytes.
    const std::string text = "h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80 \xE6\x97\xA5";
    std::vector<int32_t> bytes;
    for (char c : text) bytes.push_back(static_cast<uint8_t>(c));
    std::vector<std::string> parts;
    EXPECT_EQ(stream_all(t, bytes, false, &parts), text);
    for (const auto &p : parts) EXPECT_TRUE(utf8_is_valid(p));
}

TEST(StreamDecoder, OtherDecoders) {
    json j = small_tokenizer_json();
    j["decoder"] = nullptr;
    const Tokenizer none = load_small(j);
    const std::vector<int32_t> ids = {'a', *none.token_id("<s>"), 999999, 'b'};
    EXPECT_EQ(stream_all(none, ids, false, nullptr), none.decode(ids));
    EXPECT_EQ(stream_all(none, ids, true, nullptr), none.decode(ids, true));
    j["decoder"] = {{"type", "Sequence"}, {"decoders", json::array()}};
    const Tokenizer concat = load_small(j);
    EXPECT_EQ(stream_all(concat, ids, false, nullptr), concat.decode(ids));
}

}  // namespace
}  // namespace memra::text
