// Tokenizer loading, encode / decode, config files, and every refusal of tokenizer.json sections;
// plus the tokenizer `memra make-tiny` writes. Bit-exactness against HF tokenizers itself is the
// job of tests/oracle/test_tokenizer.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include <sys/resource.h>
#include <unistd.h>

#include "text/utf8.h"
#include "text_test_util.h"

namespace memra::text {
namespace {

using nlohmann::json;
using testing::bl;
using testing::load_error;
using testing::load_small;
using testing::small_tokenizer_json;

int32_t id_of(const Tokenizer &t, const std::string &piece) {
    auto id = t.token_id(piece);
    EXPECT_TRUE(id.has_value()) << piece;
    return id.value_or(-1);
}

std::vector<int32_t> enc(const Tokenizer &t, std::string_view text, EncodeOptions options = {}) {
    auto ids = t.encode(text, options);
    EXPECT_TRUE(ids) << ids.error().message;
    return ids ? *ids : std::vector<int32_t>{};
}

TEST(Tokenizer, EncodesThroughThePipeline) {
    const Tokenizer t = load_small(small_tokenizer_json());
    const int32_t bos = id_of(t, "<s>");
    EXPECT_EQ(enc(t, "hello world"),
              (std::vector<int32_t>{bos, id_of(t, "hello"), id_of(t, bl(" wo")), 'r', 'l', 'd'}));
    EXPECT_EQ(enc(t, "hello", {false, true}), (std::vector<int32_t>{id_of(t, "hello")}));
    EXPECT_EQ(enc(t, ""), (std::vector<int32_t>{bos}));
    EXPECT_EQ(enc(t, "", {false, true}), std::vector<int32_t>{});
    // Digits split by \p{N}{1,3}; the euro sign merges from its three bytes.
    EXPECT_EQ(enc(t, "12345\xE2\x82\xAC", {false, true}),
              (std::vector<int32_t>{'1', '2', '3', '4', '5', id_of(t, bl("\xE2\x82\xAC"))}));
    // Specials are matched before the pre-tokenizer, or encoded as text when parse_special is off.
    const int32_t im_end = id_of(t, "<|im_end|>");
    EXPECT_EQ(enc(t, "a<|im_end|>b", {false, true}), (std::vector<int32_t>{'a', im_end, 'b'}));
    const auto as_text = enc(t, "<|im_end|>", {false, false});
    EXPECT_EQ(as_text.size(), 10u);  // one token per byte: none of the merges applies
    EXPECT_EQ(t.decode(as_text), "<|im_end|>");
    EXPECT_EQ(std::count(as_text.begin(), as_text.end(), im_end), 0);
}

TEST(Tokenizer, InvalidUtf8IsRepairedLikeFromUtf8Lossy) {
    const Tokenizer t = load_small(small_tokenizer_json());
    EXPECT_EQ(enc(t, "a\xFF"
                     "b"),
              enc(t, "a\xEF\xBF\xBD"
                     "b"));
    EXPECT_EQ(enc(t, "\xE2\x82"), enc(t, "\xEF\xBF\xBD"));  // truncated: one U+FFFD
    EXPECT_EQ(enc(t, "\xED\xA0\x80"), enc(t, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"));
}

TEST(Tokenizer, DecodeTokenTextAndLookups) {
    const Tokenizer t = load_small(small_tokenizer_json());
    const int32_t bos = id_of(t, "<s>");
    const std::vector<int32_t> ids = {bos, id_of(t, "hello"), 999999, -4, id_of(t, bl(" wo")), 'r'};
    EXPECT_EQ(t.decode(ids), "<s>hello wor");  // unknown ids skipped
    EXPECT_EQ(t.decode(ids, true), "hello wor");
    EXPECT_EQ(t.decode(std::vector<int32_t>{0xE2, 0x82}), "\xEF\xBF\xBD");
    EXPECT_EQ(t.decode(std::vector<int32_t>{0xE2, 0x82, 0xAC, 0xFF}), "\xE2\x82\xAC\xEF\xBF\xBD");
    EXPECT_EQ(t.token_text(0xE2), "\xE2");
    EXPECT_EQ(t.token_text(id_of(t, bl(" wo"))), " wo");
    EXPECT_EQ(t.token_text(bos), "<s>");
    EXPECT_EQ(t.token_text(999999), "");
    EXPECT_EQ(t.token_text(-1), "");
    EXPECT_TRUE(t.is_special(bos));
    EXPECT_FALSE(t.is_special('a'));
    EXPECT_EQ(t.n_tokens(), bos + 3);
    EXPECT_FALSE(t.token_id("no such token").has_value());
}

TEST(Tokenizer, DecoderKinds) {
    json j = small_tokenizer_json();
    j["decoder"] = nullptr;  // no decoder: token strings joined by spaces
    const Tokenizer none = load_small(j);
    const std::vector<int32_t> ids = {id_of(none, "hello"), id_of(none, bl(" wo"))};
    EXPECT_EQ(none.decode(ids), "hello " + bl(" wo"));
    j["decoder"] = {{"type", "Sequence"}, {"decoders", json::array()}};
    EXPECT_EQ(load_small(j).decode(ids), "hello" + bl(" wo"));
    j["decoder"] = {{"type", "Sequence"}, {"decoders", json::array({{{"type", "ByteLevel"}}})}};
    EXPECT_EQ(load_small(j).decode(ids), "hello wo");
}

TEST(Tokenizer, ConfigFiles) {
    const json config = {{"add_bos_token", true},
                         {"add_eos_token", false},
                         {"bos_token", {{"content", "<s>"}, {"__type", "AddedToken"}}},
                         {"eos_token", "<|im_end|>"},
                         {"pad_token", "</s>"},
                         {"chat_template", json::array({{{"name", "tool_use"}, {"template", "T"}},
                                                        {{"name", "default"}, {"template", "D"}}})}};
    auto t = Tokenizer::from_json_text(
        small_tokenizer_json().dump(), config.dump(),
        json{{"eos_token_id", json::array({id_of(load_small(small_tokenizer_json()), "</s>"), 5})}, {"bos_token_id", 7}}
            .dump());
    ASSERT_TRUE(t) << t.error().message;
    EXPECT_EQ(t->bos_id(), t->token_id("<s>"));  // the config wins over generation_config
    EXPECT_EQ(std::vector<int32_t>(t->eos_ids().begin(), t->eos_ids().end()),
              (std::vector<int32_t>{*t->token_id("<|im_end|>"), *t->token_id("</s>"), 5}));
    EXPECT_EQ(t->pad_id(), t->token_id("</s>"));
    EXPECT_TRUE(t->add_bos_token());
    EXPECT_FALSE(t->add_eos_token());
    EXPECT_EQ(t->chat_template(), "D");
    const Tokenizer bare = load_small(small_tokenizer_json());
    EXPECT_FALSE(bare.bos_id().has_value());
    EXPECT_TRUE(bare.eos_ids().empty());
    EXPECT_EQ(bare.chat_template(), "");
}

TEST(Tokenizer, ConcurrentEncodeMatchesSerial) {
    const Tokenizer t = load_small(small_tokenizer_json());
    std::vector<std::string> texts;
    for (int i = 0; i < 200; ++i)
        texts.push_back("hello world " + std::to_string(i * 7919) + " aaa\xE2\x82\xAC  x" +
                        std::string(static_cast<size_t>(i % 13), 'h'));
    std::vector<std::vector<int32_t>> serial;
    for (const auto &s : texts) serial.push_back(enc(t, s));
    std::vector<std::thread> threads;
    std::vector<int> mismatches(4, 0);
    for (int k = 0; k < 4; ++k) {
        threads.emplace_back([&, k] {
            for (size_t i = 0; i < texts.size(); ++i) {
                auto ids = t.encode(texts[(i + static_cast<size_t>(k) * 31) % texts.size()]);
                if (!ids || *ids != serial[(i + static_cast<size_t>(k) * 31) % texts.size()]) ++mismatches[k];
            }
        });
    }
    for (auto &th : threads) th.join();
    EXPECT_EQ(mismatches, (std::vector<int>{0, 0, 0, 0}));
}

// ---- refusals ------------------------------------------------------------------------------

TEST(TokenizerRefusals, UnsupportedSections) {
    json j = small_tokenizer_json();
    j["pre_tokenizer"]["pretokenizers"].push_back({{"type", "Metaspace"}, {"replacement", "_"}});
    EXPECT_EQ(load_error(j), "tokenizer.json: pre_tokenizer.pretokenizers[3].type: unsupported \"Metaspace\"");
    j = small_tokenizer_json();
    j["model"]["type"] = "WordPiece";
    EXPECT_EQ(load_error(j), "tokenizer.json: model.type: unsupported \"WordPiece\"");
    j = small_tokenizer_json();
    j["normalizer"] = {{"type", "Sequence"}, {"normalizers", json::array({{{"type", "Lowercase"}}})}};
    EXPECT_EQ(load_error(j), "tokenizer.json: normalizer.normalizers[0].type: unsupported \"Lowercase\"");
    j = small_tokenizer_json();
    j["decoder"] = {{"type", "WordPiece"}};
    EXPECT_EQ(load_error(j), "tokenizer.json: decoder.type: unsupported \"WordPiece\"");
    j["decoder"] = {{"type", "Sequence"},
                    {"decoders", json::array({{{"type", "ByteLevel"}}, {{"type", "ByteLevel"}}})}};
    EXPECT_EQ(load_error(j), "tokenizer.json: decoder.decoders[1]: unsupported second ByteLevel decoder");
    j = small_tokenizer_json();
    j["post_processor"] = {{"type", "BertProcessing"}};
    EXPECT_EQ(load_error(j), "tokenizer.json: post_processor.type: unsupported \"BertProcessing\"");
    j = small_tokenizer_json();
    j["truncation"] = {{"max_length", 5}};
    EXPECT_NE(load_error(j).find("tokenizer.json: truncation: expected null"), std::string::npos);
    j = small_tokenizer_json();
    j["padding"] = {{"strategy", "BatchLongest"}};
    EXPECT_NE(load_error(j).find("tokenizer.json: padding: expected null"), std::string::npos);
    j = small_tokenizer_json();
    j["pre_tokenizer"] = {
        {"type", "Split"}, {"pattern", {{"Regex", "a"}}}, {"behavior", "Sideways"}, {"invert", false}};
    EXPECT_EQ(load_error(j), "tokenizer.json: pre_tokenizer.behavior: unsupported \"Sideways\"");
    j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "a"}, {"String", "a"}}}, {"behavior", "Isolated"}};
    EXPECT_NE(load_error(j).find("pre_tokenizer.pattern: expected {\"Regex\": ...} or {\"String\": ...}"),
              std::string::npos);
    j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(?i)ss"}}}, {"behavior", "Isolated"}};
    EXPECT_EQ(load_error(j).rfind("tokenizer.json: pre_tokenizer.pattern.Regex: regex \"(?i)ss\"", 0), 0u);
    j["pre_tokenizer"] = {{"type", "ByteLevel"}};
    EXPECT_EQ(load_error(j), "tokenizer.json: pre_tokenizer.add_prefix_space: missing");
    j = small_tokenizer_json();
    j["post_processor"]["single"].push_back({{"Sequence", {{"id", "B"}, {"type_id", 1}}}});
    EXPECT_EQ(load_error(j),
              "tokenizer.json: post_processor.single: expected exactly one Sequence \"A\", found \"AB\"");
    j = small_tokenizer_json();
    j["post_processor"]["single"][0]["SpecialToken"]["id"] = "<x>";
    EXPECT_NE(load_error(j).find("post_processor.single[0].SpecialToken.id: \"<x>\" is not in"), std::string::npos);
}

TEST(TokenizerRefusals, AddedTokensAndFiles) {
    json j = small_tokenizer_json();
    j["added_tokens"][1]["id"] = 5;
    EXPECT_NE(load_error(j).find("added_tokens[1].id: Hugging Face tokenizers gives \"</s>\" id"), std::string::npos);
    j = small_tokenizer_json();
    j["added_tokens"][1]["content"] = "<s>";
    EXPECT_EQ(load_error(j), "tokenizer.json: added_tokens[1].content: \"<s>\" is listed twice");
    j = small_tokenizer_json();
    j["added_tokens"][1]["content"] = "";
    EXPECT_NE(load_error(j).find("added_tokens[1].content: expected a non-empty string"), std::string::npos);
    j = small_tokenizer_json();
    j["added_tokens"][0].erase("lstrip");
    EXPECT_EQ(load_error(j), "tokenizer.json: added_tokens[0].lstrip: missing");
    EXPECT_NE(load_error(json::array()).find("expected an object, found an array"), std::string::npos);
    auto bad = Tokenizer::from_json_text("{\"model\": ");
    ASSERT_FALSE(bad);
    EXPECT_EQ(bad.error().message.rfind("tokenizer.json: invalid JSON:", 0), 0u);
    EXPECT_EQ(load_error(small_tokenizer_json(), R"({"bos_token": "<nope>"})"),
              "tokenizer_config.json: bos_token: \"<nope>\" is not a token of tokenizer.json");
    EXPECT_NE(load_error(small_tokenizer_json(), R"({"chat_template": 3})").find("chat_template: expected a string"),
              std::string::npos);
    EXPECT_NE(
        load_error(small_tokenizer_json(), R"({"add_bos_token": "yes"})").find("add_bos_token: expected true or false"),
        std::string::npos);
    auto gen = Tokenizer::from_json_text(small_tokenizer_json().dump(), "", R"({"eos_token_id": [1, 99999]})");
    ASSERT_FALSE(gen);
    EXPECT_EQ(gen.error().message,
              "generation_config.json: eos_token_id[1]: id 99999 is outside the vocabulary (269 ids)");
    auto missing = Tokenizer::load("/nonexistent/dir/tokenizer.json");
    ASSERT_FALSE(missing);
    EXPECT_EQ(missing.error().message, "/nonexistent/dir/tokenizer.json: cannot open for reading");
}

// Runs `load` (returning a load's error message) in a child process whose address space may grow by at most
// 1 GiB beyond what it already maps (under ASan that includes the shadow, so the margin is the same), and
// expects the child to finish with exactly `expected`. A loader that sized a table by a hostile id fails its
// allocation there (bad_alloc, or the sanitizer's out-of-memory report) instead of taking tens of GiB from
// the machine, as it would in this process on a host with that much memory.
template <class Load>
void expect_refused_within_1_gib(Load load, const std::string &expected) {
    EXPECT_EXIT(
        {
            long pages = 0;
            std::ifstream("/proc/self/statm") >> pages;  // first field: the mapped size in pages
            const auto mapped = static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE));
            rlimit limit{};
            ::getrlimit(RLIMIT_AS, &limit);
            limit.rlim_cur = std::min(limit.rlim_max, mapped + (rlim_t{1} << 30));
            ::setrlimit(RLIMIT_AS, &limit);
            const std::string message = load();
            std::fprintf(stderr, "load error: %s\n", message.c_str());
            std::_Exit(message == expected ? 0 : 1);
        },
        ::testing::ExitedWithCode(0), "")
        << "expected: " << expected;
}

TEST(TokenizerRefusals, TokenIdsAtOrAbove2To24) {
    // A vocabulary id near 2^31 sized the id -> token table (64 GiB of std::string) before the fix.
    json j = small_tokenizer_json();
    j["model"]["vocab"]["huge"] = 2147483000;
    expect_refused_within_1_gib(
        [&] { return load_error(j); },
        "tokenizer.json: model.vocab: token \"huge\" has id 2147483000, memra refuses ids >= 16777216 (2^24)");
    j["model"]["vocab"]["huge"] = 16777216;  // the bound itself (a 512 MiB table before the fix)
    expect_refused_within_1_gib(
        [&] { return load_error(j); },
        "tokenizer.json: model.vocab: token \"huge\" has id 16777216, memra refuses ids >= 16777216 (2^24)");
    j = small_tokenizer_json();
    j["model"]["vocab"]["hello"] = 100000;  // a sparse id below the bound still loads
    const Tokenizer sparse = load_small(j);
    EXPECT_EQ(sparse.token_id("hello"), 100000);
    EXPECT_EQ(sparse.n_tokens(), 100001);

    // An added token is checked before Hugging Face's id assignment, so the message is about the bound.
    j = small_tokenizer_json();
    json huge = j["added_tokens"][2];
    huge["content"] = "<huge>";
    huge["id"] = 2147483000;
    j["added_tokens"].push_back(huge);
    expect_refused_within_1_gib([&] { return load_error(j); },
                                "tokenizer.json: added_tokens[3].id: token \"<huge>\" has id 2147483000, memra "
                                "refuses ids >= 16777216 (2^24)");

    // Loaded from disk, the message names the file.
    const std::filesystem::path dir =
        std::filesystem::temp_directory_path() / ("memra_text_huge_id_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    j = small_tokenizer_json();
    j["model"]["vocab"]["huge"] = 2147483000;
    std::ofstream(dir / "tokenizer.json") << j.dump();
    expect_refused_within_1_gib(
        [&] {
            auto tok = Tokenizer::load(dir);
            return tok ? std::string() : tok.error().message;
        },
        (dir / "tokenizer.json").string() +
            ": model.vocab: token \"huge\" has id 2147483000, memra refuses ids >= 16777216 (2^24)");
    std::filesystem::remove_all(dir);
}

// ---- the tokenizer of `memra make-tiny` ----------------------------------------------------

class TinyTokenizer : public ::testing::Test {
protected:
    static void SetUpTestSuite() {
        ASSERT_TRUE(std::filesystem::exists(MEMRA_EXE)) << "memra CLI not built: " << MEMRA_EXE;
        dir_ = std::filesystem::temp_directory_path() / ("memra_text_tiny_" + std::to_string(::getpid()));
        std::filesystem::remove_all(dir_);
        const std::string cmd = std::string(MEMRA_EXE) + " make-tiny " + dir_.string() + " > /dev/null";
        ASSERT_EQ(std::system(cmd.c_str()), 0);
    }
    static void TearDownTestSuite() {
        if (!dir_.empty()) std::filesystem::remove_all(dir_);
    }
    static std::filesystem::path dir_;
};
std::filesystem::path TinyTokenizer::dir_;

TEST_F(TinyTokenizer, LoadsWithConfigAndRoundTrips) {
    auto t = Tokenizer::load(dir_);
    ASSERT_TRUE(t) << t.error().message;
    auto from_file = Tokenizer::load(dir_ / "tokenizer.json");
    ASSERT_TRUE(from_file) << from_file.error().message;
    EXPECT_EQ(t->bos_id(), 0);
    EXPECT_EQ(t->pad_id(), 1);
    EXPECT_EQ(std::vector<int32_t>(t->eos_ids().begin(), t->eos_ids().end()), (std::vector<int32_t>{732, 1}));
    EXPECT_TRUE(t->add_bos_token());
    EXPECT_NE(t->chat_template().find("<|im_start|>"), std::string::npos);
    EXPECT_EQ(t->n_tokens(), 739);
    EXPECT_EQ(t->token_id("<|im_end|>"), 732);
    const std::string chat = "<|im_start|>user\nWhat is 12345 + 678? 日本語 ひらがな 😀<|im_end|>\n";
    auto ids = t->encode(chat);
    ASSERT_TRUE(ids);
    EXPECT_EQ(ids->front(), 0);
    EXPECT_EQ((*ids)[1], 731);
    EXPECT_NE(std::find(ids->begin(), ids->end(), 732), ids->end());
    EXPECT_EQ(t->decode(*ids), t->token_text(0) + chat);
    EXPECT_EQ(t->decode(*ids, true), "user\nWhat is 12345 + 678? 日本語 ひらがな 😀\n");
    EXPECT_EQ(*from_file->encode(chat), *ids);
}

}  // namespace
}  // namespace memra::text
