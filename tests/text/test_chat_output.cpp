// StopMatcher and ChatOutputParser: the documented rules one by one (OpenAI stop semantics, the
// Step-3.5 reasoning trim, XML tool calls, typed arguments, the failure modes other engines have
// shipped), and the streaming invariance as property tests: for any split of the text into pieces
// the totals equal those of the whole text at once.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/chat_output.h"
#include "text/utf8.h"

namespace memra::text {
namespace {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

// `text` cut at the sorted offsets `cuts` (duplicates give empty pieces).
std::vector<std::string> split_at(std::string_view text, std::vector<size_t> cuts) {
    std::sort(cuts.begin(), cuts.end());
    std::vector<std::string> pieces;
    size_t prev = 0;
    for (size_t c : cuts) {
        pieces.emplace_back(text.substr(prev, c - prev));
        prev = c;
    }
    pieces.emplace_back(text.substr(prev));
    return pieces;
}

std::vector<size_t> random_cuts(std::mt19937 &rng, size_t size, int max_cuts) {
    std::uniform_int_distribution<int> n_dist(0, max_cuts);
    std::uniform_int_distribution<size_t> at(0, size);
    std::vector<size_t> cuts(static_cast<size_t>(n_dist(rng)));
    for (size_t &c : cuts) c = at(rng);
    return cuts;
}

// Offsets of the character boundaries of valid UTF-8 `text`, 0 and size() included.
std::vector<size_t> char_boundaries(std::string_view text) {
    std::vector<size_t> out;
    size_t pos = 0;
    while (pos < text.size()) {
        out.push_back(pos);
        pos += utf8_char_len(static_cast<uint8_t>(text[pos]));
    }
    out.push_back(text.size());
    return out;
}

// The reference: the text cut before the earliest occurrence of any stop string.
std::string stop_reference(std::string_view text, const std::vector<std::string> &stops, bool *stopped) {
    size_t cut = std::string_view::npos;
    for (const std::string &s : stops) cut = std::min(cut, text.find(s));
    *stopped = cut != std::string_view::npos;
    return std::string(text.substr(0, cut));
}

struct StopRun {
    std::string text;
    bool stopped = false;
    std::optional<size_t> matched;
    std::vector<std::string> parts;
};

StopRun stop_stream(const std::vector<std::string> &stops, const std::vector<std::string> &pieces) {
    auto m = StopMatcher::create(stops);
    EXPECT_TRUE(m.has_value());
    StopRun run;
    for (const std::string &p : pieces) {
        StopStep step = m->feed(p);
        run.parts.push_back(step.text);
        run.text += step.text;
        if (step.stopped) run.stopped = true;
    }
    StopStep tail = m->finish();
    run.parts.push_back(tail.text);
    run.text += tail.text;
    run.stopped = run.stopped || tail.stopped;
    EXPECT_EQ(run.stopped, m->stopped());
    run.matched = m->matched_stop();
    return run;
}

std::string describe(const ChatOutputDelta &d) {
    std::string s = "reasoning=" + json(d.reasoning).dump() + " content=" + json(d.content).dump() + " calls=[";
    for (const ToolCall &c : d.tool_calls) {
        s += "{" + std::to_string(c.index) + " " + c.id + " " + c.name + " " + c.arguments + "}";
    }
    return s + "]";
}

ChatOutputDelta stream(const std::vector<std::string> &pieces, const ChatOutputOptions &options = {},
                       const ToolSchemas &tools = {}, std::vector<ChatOutputDelta> *deltas = nullptr) {
    ChatOutputParser parser(options, tools);
    ChatOutputDelta all;
    for (const std::string &p : pieces) {
        ChatOutputDelta d = parser.feed(p);
        if (deltas) deltas->push_back(d);
        all.append(std::move(d));
    }
    ChatOutputDelta tail = parser.finish();
    if (deltas) deltas->push_back(tail);
    all.append(std::move(tail));
    return all;
}

ChatOutputDelta parse(std::string_view text, const ChatOutputOptions &options = {}, const ToolSchemas &tools = {}) {
    return parse_chat_output(text, options, tools);
}

ChatOutputOptions options_from_bits(int bits) {
    ChatOutputOptions o;
    o.parse_reasoning = (bits & 1) != 0;
    o.starts_in_reasoning = (bits & 2) != 0;
    o.parse_tool_calls = (bits & 4) != 0;
    return o;
}

ToolSchemas schemas(const json &tools) {
    auto s = ToolSchemas::from_json(tools);
    EXPECT_TRUE(s.has_value()) << (s ? "" : s.error().message);
    return s ? *s : ToolSchemas();
}

const json &weather_tools() {
    static const json tools = json::parse(R"([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                           "metric": {"type": "boolean"}, "extra": {"type": "object"}}}}},
        {"type": "function", "function": {"name": "search", "parameters": {"type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": ["integer", "null"]}}}}}
    ])");
    return tools;
}

// Every single split point, all one-byte pieces, and random multi-way splits must give the
// totals of the whole text.
void expect_split_invariant(std::string_view text, const ChatOutputOptions &options, const ToolSchemas &tools,
                            std::mt19937 &rng, int random_rounds = 30) {
    const std::string whole = describe(parse(text, options, tools));
    for (size_t i = 0; i <= text.size(); ++i) {
        ASSERT_EQ(describe(stream(split_at(text, {i}), options, tools)), whole)
            << "split at " << i << " of " << json(std::string(text)).dump();
    }
    std::vector<size_t> every(text.size());
    for (size_t i = 0; i < text.size(); ++i) every[i] = i;
    ASSERT_EQ(describe(stream(split_at(text, every), options, tools)), whole)
        << "one-byte pieces of " << json(std::string(text)).dump();
    for (int r = 0; r < random_rounds; ++r) {
        const std::vector<size_t> cuts = random_cuts(rng, text.size(), 8);
        ASSERT_EQ(describe(stream(split_at(text, cuts), options, tools)), whole)
            << "random split of " << json(std::string(text)).dump();
    }
}

// ---------------------------------------------------------------------------------------------
// StopMatcher
// ---------------------------------------------------------------------------------------------

TEST(StopMatcher, RefusesEmptyAndInvalidStopStrings) {
    auto empty = StopMatcher::create(std::vector<std::string>{"ok", ""});
    ASSERT_FALSE(empty.has_value());
    EXPECT_EQ(empty.error().message, "stop[1]: expected a non-empty string, found \"\"");
    auto invalid = StopMatcher::create(std::vector<std::string>{"\xC3"});
    ASSERT_FALSE(invalid.has_value());
    EXPECT_NE(invalid.error().message.find("stop[0]: expected valid UTF-8"), std::string::npos);
    EXPECT_TRUE(StopMatcher::create(std::vector<std::string>{}).has_value());
}

TEST(StopMatcher, NoStopStringsPassThrough) {
    auto m = *StopMatcher::create(std::vector<std::string>{});
    EXPECT_EQ(m.feed("abc").text, "abc");
    EXPECT_EQ(m.feed("").text, "");
    const StopStep tail = m.finish();
    EXPECT_EQ(tail.text, "");
    EXPECT_FALSE(tail.stopped);
    EXPECT_FALSE(m.matched_stop().has_value());
}

TEST(StopMatcher, CutsBeforeTheStopStringAndDropsTheRest) {
    auto m = *StopMatcher::create(std::vector<std::string>{"END"});
    const StopStep a = m.feed("abcENDxyz");
    EXPECT_EQ(a.text, "abc");
    EXPECT_TRUE(a.stopped);
    EXPECT_EQ(m.matched_stop(), 0u);
    const StopStep b = m.feed("more");
    EXPECT_EQ(b.text, "");
    EXPECT_TRUE(b.stopped);
    EXPECT_EQ(m.finish().text, "");
}

TEST(StopMatcher, MatchesAcrossPiecesHoldingOnlyAPossibleStart) {
    auto m = *StopMatcher::create(std::vector<std::string>{"</s>"});
    EXPECT_EQ(m.feed("hello <").text, "hello ");  // "<" could begin "</s>"
    EXPECT_EQ(m.feed("/").text, "");
    EXPECT_EQ(m.feed("x").text, "</x");  // no longer a possible start
    EXPECT_EQ(m.feed("a</").text, "a");
    EXPECT_EQ(m.feed("s").text, "");
    const StopStep end = m.feed(">tail");
    EXPECT_EQ(end.text, "");
    EXPECT_TRUE(end.stopped);
}

TEST(StopMatcher, FinishReturnsTheHeldBackText) {
    auto m = *StopMatcher::create(std::vector<std::string>{"abcd"});
    EXPECT_EQ(m.feed("xxabc").text, "xx");
    const StopStep tail = m.finish();
    EXPECT_EQ(tail.text, "abc");
    EXPECT_FALSE(tail.stopped);
    EXPECT_EQ(m.feed("d").text, "");  // after finish
}

TEST(StopMatcher, EarliestStartWinsOverEarliestEnd) {
    // "bc" completes first, but "abcd" starts earlier: the output waits to see which one it is.
    const std::vector<std::string> stops = {"bc", "abcd"};
    {
        auto m = *StopMatcher::create(stops);
        EXPECT_EQ(m.feed("abc").text, "");
        EXPECT_FALSE(m.stopped());
        const StopStep s = m.feed("d!");
        EXPECT_EQ(s.text, "");
        EXPECT_TRUE(s.stopped);
        EXPECT_EQ(m.matched_stop(), 1u);
    }
    {
        auto m = *StopMatcher::create(stops);
        EXPECT_EQ(m.feed("abc").text, "");
        const StopStep s = m.feed("e");
        EXPECT_EQ(s.text, "a");
        EXPECT_TRUE(s.stopped);
        EXPECT_EQ(m.matched_stop(), 0u);
    }
    {
        auto m = *StopMatcher::create(stops);
        EXPECT_EQ(m.feed("abc").text, "");
        const StopStep s = m.finish();  // "abcd" can no longer complete
        EXPECT_EQ(s.text, "a");
        EXPECT_TRUE(s.stopped);
        EXPECT_EQ(m.matched_stop(), 0u);
    }
}

TEST(StopMatcher, SameStartPrefersTheShorterThenTheLowerIndex) {
    auto m = *StopMatcher::create(std::vector<std::string>{"abc", "ab", "ab"});
    EXPECT_EQ(m.feed("xabc").text, "x");
    EXPECT_EQ(m.matched_stop(), 1u);
}

TEST(StopMatcher, SelfOverlappingStopStrings) {
    bool stopped = false;
    for (const auto &[stop, text] : std::vector<std::pair<std::string, std::string>>{
             {"aab", "aaab"}, {"abab", "abaabab"}, {"aaa", "aa-aaaa"}, {"abcabd", "abcabcabd"}}) {
        const std::string expect = stop_reference(text, {stop}, &stopped);
        for (size_t i = 0; i <= text.size(); ++i) {
            const StopRun run = stop_stream({stop}, split_at(text, {i}));
            EXPECT_EQ(run.text, expect) << stop << " in " << text << " split at " << i;
            EXPECT_TRUE(run.stopped);
        }
    }
}

TEST(StopMatcher, MultiByteStopStringsAndCharactersSplitAcrossPieces) {
    auto m = *StopMatcher::create(std::vector<std::string>{"日本"});
    EXPECT_EQ(m.feed("こんにちは日").text, "こんにちは");
    EXPECT_EQ(m.feed("本語").text, "");
    EXPECT_TRUE(m.stopped());

    // A piece that ends inside a character: those bytes wait for the rest of the character.
    auto n = *StopMatcher::create(std::vector<std::string>{"zz"});
    EXPECT_EQ(n.feed("a\xE6\x97").text, "a");
    EXPECT_EQ(n.feed("\xA5x").text, "日x");
    EXPECT_EQ(n.feed("\xF0\x9F").text, "");
    EXPECT_EQ(n.finish().text, "\xF0\x9F");  // end of generation: returned as they are
}

TEST(StopMatcher, RandomTextsStopsAndSplitsMatchTheReference) {
    std::mt19937 rng(20240611);
    const std::vector<std::string> alphabet = {"a", "b", "ab", "\n", "<", "/", "é", "日", "😀", "</s>", " "};
    std::uniform_int_distribution<size_t> letter(0, alphabet.size() - 1);
    std::uniform_int_distribution<int> text_len(0, 40), n_stops(0, 4), stop_len(1, 4), coin(0, 1);
    for (int round = 0; round < 4000; ++round) {
        std::string text;
        for (int i = text_len(rng); i > 0; --i) text += alphabet[letter(rng)];
        const std::vector<size_t> bounds = char_boundaries(text);
        std::vector<std::string> stops;
        for (int i = n_stops(rng); i > 0; --i) {
            if (coin(rng) == 0 && bounds.size() > 1) {  // a substring of the text: matches often
                std::uniform_int_distribution<size_t> b(0, bounds.size() - 2);
                const size_t from = b(rng);
                const size_t to = std::min(bounds.size() - 1, from + static_cast<size_t>(stop_len(rng)));
                stops.push_back(text.substr(bounds[from], bounds[to] - bounds[from]));
            } else {
                std::string s;
                for (int j = stop_len(rng); j > 0; --j) s += alphabet[letter(rng)];
                stops.push_back(s);
            }
        }
        bool ref_stopped = false;
        const std::string expect = stop_reference(text, stops, &ref_stopped);
        size_t max_len = 0;
        for (const auto &s : stops) max_len = std::max(max_len, s.size());
        for (int split = 0; split < 4; ++split) {
            // Splits anywhere, also inside characters: returned text must still be whole UTF-8.
            const std::vector<std::string> pieces = split_at(text, random_cuts(rng, text.size(), 10));
            const StopRun run = stop_stream(stops, pieces);
            ASSERT_EQ(run.text, expect) << "round " << round;
            ASSERT_EQ(run.stopped, ref_stopped) << "round " << round;
            for (const std::string &p : run.parts) ASSERT_TRUE(utf8_is_valid(p)) << "round " << round;
            if (run.stopped) {
                const std::string &m = stops[*run.matched];
                ASSERT_EQ(text.compare(expect.size(), m.size(), m), 0) << "matched stop is at the cut";
            }
        }
        // Pieces at character boundaries: the held-back text is at most max_stop_len - 1 bytes.
        auto m = *StopMatcher::create(stops);
        size_t fed = 0, got = 0;
        for (size_t i = 0; i + 1 < bounds.size(); ++i) {
            const StopStep s = m.feed(std::string_view(text).substr(bounds[i], bounds[i + 1] - bounds[i]));
            fed = bounds[i + 1];
            got += s.text.size();
            if (s.stopped) break;
            ASSERT_LE(fed - got, max_len == 0 ? 0 : max_len - 1) << "round " << round;
        }
    }
}

TEST(StopMatcher, LinearOnLongAdversarialInput) {
    // "aaa...a" against "a"*1000 + "b": a quadratic matcher would rescan 1000 bytes per byte.
    const std::string stop = std::string(1000, 'a') + "b";
    auto m = *StopMatcher::create(std::vector<std::string>{stop, "x"});
    size_t fed = 0, got = 0;
    for (int i = 0; i < 1 << 20; ++i) {
        got += m.feed("a").text.size();
        ++fed;
        ASSERT_LE(fed - got, stop.size() - 1);
    }
    const StopStep s = m.feed("b");
    EXPECT_TRUE(s.stopped);
    EXPECT_EQ(got + s.text.size(), fed - 1000);
}

// ---------------------------------------------------------------------------------------------
// ChatOutputParser: reasoning
// ---------------------------------------------------------------------------------------------

TEST(ChatOutputReasoning, SplitsAtThinkCloseTrimmingOneNewlineEachSide) {
    ChatOutputDelta d = parse("I should answer.\n</think>\nThe answer is 4.");
    EXPECT_EQ(d.reasoning, "I should answer.");
    EXPECT_EQ(d.content, "The answer is 4.");
    EXPECT_TRUE(d.tool_calls.empty());

    d = parse("a\n\n</think>\n\nb");  // only one newline each side, as vLLM's step3p5 parser
    EXPECT_EQ(d.reasoning, "a\n");
    EXPECT_EQ(d.content, "\nb");

    d = parse("a</think>b");
    EXPECT_EQ(d.reasoning, "a");
    EXPECT_EQ(d.content, "b");

    d = parse("</think>\n");
    EXPECT_EQ(d.reasoning, "");
    EXPECT_EQ(d.content, "");
}

TEST(ChatOutputReasoning, StreamingHoldsOnlyWhatCouldEndReasoning) {
    ChatOutputParser p;
    EXPECT_EQ(p.feed("Let me think").reasoning, "Let me think");
    EXPECT_EQ(p.feed(" more\n").reasoning, " more");  // the "\n" may precede </think>
    EXPECT_EQ(p.feed("x</th").reasoning, "\nx");
    ChatOutputDelta d = p.feed("ink>");
    EXPECT_TRUE(d.empty());
    d = p.feed("\n");  // the newline right after </think> is dropped
    EXPECT_TRUE(d.empty());
    d = p.feed("Hi");
    EXPECT_EQ(d.content, "Hi");
    EXPECT_TRUE(p.finish().empty());
}

TEST(ChatOutputReasoning, NeverClosedIsAllReasoning) {
    ChatOutputDelta d = parse("step one\nstep two\n");
    EXPECT_EQ(d.reasoning, "step one\nstep two\n");  // verbatim, the last newline too
    EXPECT_EQ(d.content, "");

    ChatOutputParser p;
    EXPECT_EQ(p.feed("thinking </thi").reasoning, "thinking ");
    const ChatOutputDelta tail = p.finish();
    EXPECT_EQ(tail.reasoning, "</thi");
    EXPECT_EQ(tail.content, "");
}

TEST(ChatOutputReasoning, EmptyOutputs) {
    for (int bits = 0; bits < 8; ++bits) {
        ChatOutputParser p(options_from_bits(bits));
        EXPECT_TRUE(p.finish().empty()) << bits;
        EXPECT_TRUE(p.finish().empty()) << bits;
        EXPECT_TRUE(p.feed("late").empty()) << "feed after finish";
        EXPECT_TRUE(parse("", options_from_bits(bits)).empty()) << bits;
    }
}

TEST(ChatOutputReasoning, ReEmittedThinkAtTheStartIsDropped) {
    ChatOutputDelta d = parse("<think>\nR\n</think>\nC");
    EXPECT_EQ(d.reasoning, "R");
    EXPECT_EQ(d.content, "C");

    d = parse(" \n<think>R</think>C");  // whitespace before it goes with it
    EXPECT_EQ(d.reasoning, "R");
    EXPECT_EQ(d.content, "C");

    d = parse("\n\nR</think>C");  // no <think>: the whitespace is reasoning
    EXPECT_EQ(d.reasoning, "\n\nR");

    d = parse("a<think>b</think>c");  // not at the start: text
    EXPECT_EQ(d.reasoning, "a<think>b");
    EXPECT_EQ(d.content, "c");

    d = parse("<think>\n<think>\nx");  // only the first one
    EXPECT_EQ(d.reasoning, "<think>\nx");

    d = parse("<thin");  // cut off: text at finish
    EXPECT_EQ(d.reasoning, "<thin");
}

TEST(ChatOutputReasoning, LateOrDuplicatedThinkTagsAreRemovedFromContent) {
    ChatOutputDelta d = parse("R\n</think>\nC1\n</think>\nC2");
    EXPECT_EQ(d.reasoning, "R");
    EXPECT_EQ(d.content, "C1\n\nC2");

    d = parse("R</think>C<think>D</think>E");
    EXPECT_EQ(d.reasoning, "R");
    EXPECT_EQ(d.content, "CDE");

    // Streaming: content before the duplicate is sent at once, the tag never is.
    ChatOutputParser p;
    EXPECT_EQ(p.feed("R</think>Answer").content, "Answer");
    EXPECT_EQ(p.feed(" </thi").content, " ");
    EXPECT_EQ(p.feed("nk> more").content, " more");
    EXPECT_TRUE(p.finish().empty());

    // A partial tag cut off by the end of generation is returned as text.
    EXPECT_EQ(parse("R</think>x</thi").content, "x</thi");
}

TEST(ChatOutputReasoning, ParsingOffMakesEverythingContent) {
    ChatOutputOptions off;
    off.parse_reasoning = false;
    ChatOutputDelta d = parse("<think>R</think>\nC</think>", off);
    EXPECT_EQ(d.reasoning, "");
    EXPECT_EQ(d.content, "<think>R</think>\nC</think>");

    // Tool calls are still parsed.
    d = parse("x<tool_call><function=f></function></tool_call>", off);
    EXPECT_EQ(d.content, "x");
    ASSERT_EQ(d.tool_calls.size(), 1u);
    EXPECT_EQ(d.tool_calls[0].name, "f");
}

TEST(ChatOutputReasoning, NotStartingInReasoning) {
    ChatOutputOptions o;
    o.starts_in_reasoning = false;
    ChatOutputDelta d = parse("<think>\nR\n</think>\nC", o);
    EXPECT_EQ(d.reasoning, "R");
    EXPECT_EQ(d.content, "C");

    d = parse("\n <think>R</think>C", o);
    EXPECT_EQ(d.reasoning, "R");
    EXPECT_EQ(d.content, "C");

    d = parse("Hello</think> world", o);  // no reasoning: the stray tag is removed
    EXPECT_EQ(d.reasoning, "");
    EXPECT_EQ(d.content, "Hello world");

    o.parse_tool_calls = false;
    d = parse(" \nHi", o);
    EXPECT_EQ(d.content, " \nHi");

    ChatOutputParser p(o);
    EXPECT_TRUE(p.feed(" <thi").empty());  // could still open reasoning
    EXPECT_EQ(p.feed("s").content, " <this");
}

// ---------------------------------------------------------------------------------------------
// ChatOutputParser: tool calls
// ---------------------------------------------------------------------------------------------

constexpr char kWeatherCall[] =
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";

TEST(ChatOutputToolCalls, OneCallAfterReasoning) {
    const ToolSchemas tools = schemas(weather_tools());
    const ChatOutputDelta d = parse(std::string("Need weather.\n</think>\n") + kWeatherCall, {}, tools);
    EXPECT_EQ(d.reasoning, "Need weather.");
    EXPECT_EQ(d.content, "");
    ASSERT_EQ(d.tool_calls.size(), 1u);
    EXPECT_EQ(d.tool_calls[0].index, 0);
    EXPECT_EQ(d.tool_calls[0].name, "get_weather");
    EXPECT_EQ(d.tool_calls[0].arguments, R"({"city":"Paris","days":3})");
    EXPECT_TRUE(d.tool_calls[0].id.starts_with("call_0_"));
    EXPECT_EQ(d.tool_calls[0].id.size(), std::string("call_0_").size() + 16);
}

TEST(ChatOutputToolCalls, IdsAreDeterministic) {
    const std::string text = std::string("</think>") + kWeatherCall + kWeatherCall;
    const ChatOutputDelta a = parse(text), b = parse(text);
    ASSERT_EQ(a.tool_calls.size(), 2u);
    EXPECT_EQ(a.tool_calls[0].id, b.tool_calls[0].id);
    EXPECT_EQ(a.tool_calls[1].id, b.tool_calls[1].id);
    EXPECT_NE(a.tool_calls[0].id, a.tool_calls[1].id);  // same call, other index
    EXPECT_TRUE(a.tool_calls[1].id.starts_with("call_1_"));
    ChatOutputOptions salted;
    salted.call_id_salt = "req-42";
    EXPECT_NE(parse(text, salted).tool_calls[0].id, a.tool_calls[0].id);
    EXPECT_EQ(parse(text, salted).tool_calls[0].id, parse(text, salted).tool_calls[0].id);
}

TEST(ChatOutputToolCalls, TextAroundCallsAndWhitespaceBetweenThem) {
    const ToolSchemas tools = schemas(weather_tools());
    const std::string call_b =
        "<tool_call>\n<function=search>\n<parameter=query>\nrain\n</parameter>\n</function>\n</tool_call>";
    ChatOutputDelta d =
        parse(std::string("R</think>\nLet me check.\n") + kWeatherCall + "\n \n" + call_b + "\nDone.", {}, tools);
    EXPECT_EQ(d.content, "Let me check.\n\nDone.");
    ASSERT_EQ(d.tool_calls.size(), 2u);
    EXPECT_EQ(d.tool_calls[0].name, "get_weather");
    EXPECT_EQ(d.tool_calls[1].name, "search");
    EXPECT_EQ(d.tool_calls[1].index, 1);
    EXPECT_EQ(d.tool_calls[1].arguments, R"({"query":"rain"})");

    // Whitespace-only runs touching calls are dropped: before, between, after.
    d = parse(std::string("R</think>\n\n  ") + kWeatherCall + "\n\n" + call_b + " \n\n", {}, tools);
    EXPECT_EQ(d.content, "");
    EXPECT_EQ(d.tool_calls.size(), 2u);

    // Text between calls is content, in order.
    d = parse(std::string("</think>") + kWeatherCall + "\nand then\n" + call_b, {}, tools);
    EXPECT_EQ(d.content, "\nand then\n");

    // Without calls, whitespace-only content is kept.
    d = parse("R</think>\n\n  ", {}, tools);
    EXPECT_EQ(d.content, "\n  ");
}

TEST(ChatOutputToolCalls, ValueLayouts) {
    // Inline values, no newlines anywhere.
    ChatOutputDelta d = parse(
        "</think><tool_call><function=f><parameter=a>x y</parameter><parameter=b> z </parameter></function>"
        "</tool_call>");
    ASSERT_EQ(d.tool_calls.size(), 1u);
    EXPECT_EQ(d.tool_calls[0].arguments, R"({"a":"x y","b":" z "})");

    // Multi-line values: one leading and one trailing newline are the template's.
    d = parse(
        "</think><tool_call>\n<function=write>\n<parameter=text>\n\nline1\nline2\n\n</parameter>\n"
        "</function>\n</tool_call>");
    ASSERT_EQ(d.tool_calls.size(), 1u);
    EXPECT_EQ(d.tool_calls[0].arguments, R"({"text":"\nline1\nline2\n"})");

    // Names are trimmed; a function without parameters has {}.
    d = parse("</think><tool_call><function= ping ></function></tool_call>");
    ASSERT_EQ(d.tool_calls.size(), 1u);
    EXPECT_EQ(d.tool_calls[0].name, "ping");
    EXPECT_EQ(d.tool_calls[0].arguments, "{}");

    // A repeated parameter keeps its first position and its last value.
    d = parse(
        "</think><tool_call><function=f><parameter=a>1</parameter><parameter=b>2</parameter>"
        "<parameter=a>3</parameter></function></tool_call>");
    EXPECT_EQ(d.tool_calls[0].arguments, R"({"a":3,"b":2})");

    // Markup-looking text inside a value other than </parameter> is the value's.
    d = parse(
        "</think><tool_call><function=f><parameter=code>if a<b and </think> <function=x></parameter>"
        "</function></tool_call>");
    ASSERT_EQ(d.tool_calls.size(), 1u);
    EXPECT_EQ(d.tool_calls[0].arguments, R"({"code":"if a<b and </think> <function=x>"})");
}

TEST(ChatOutputToolCalls, SeveralFunctionsInOneBlockAndAMissingFunctionClose) {
    ChatOutputDelta d = parse(
        "</think><tool_call>\n<function=a>\n</function>\n<function=b>\n<parameter=x>\n1\n"
        "</parameter>\n</function>\n</tool_call>");
    ASSERT_EQ(d.tool_calls.size(), 2u);
    EXPECT_EQ(d.tool_calls[0].name, "a");
    EXPECT_EQ(d.tool_calls[1].name, "b");
    EXPECT_EQ(d.tool_calls[1].index, 1);

    d = parse("</think><tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</tool_call>");
    ASSERT_EQ(d.tool_calls.size(), 1u);
    EXPECT_EQ(d.tool_calls[0].arguments, R"({"x":1})");
    EXPECT_EQ(d.content, "");
}

TEST(ChatOutputToolCalls, BareFunctionAndStrayToolCallClose) {
    ChatOutputDelta d =
        parse("</think>Sure.\n<function=f>\n<parameter=a>\nv\n</parameter>\n</function>\n</tool_call>\n");
    EXPECT_EQ(d.content, "Sure.\n");
    ASSERT_EQ(d.tool_calls.size(), 1u);
    EXPECT_EQ(d.tool_calls[0].arguments, R"({"a":"v"})");

    d = parse("</think>a </tool_call>b");
    EXPECT_EQ(d.content, "a b");
    EXPECT_TRUE(d.tool_calls.empty());
}

TEST(ChatOutputToolCalls, MissingToolCallCloseIsContentAtFinish) {
    const std::string open = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n";
    std::vector<ChatOutputDelta> deltas;
    const ChatOutputDelta all = stream({"R</think>Checking.\n", open.substr(0, 20), open.substr(20)}, {}, {}, &deltas);
    EXPECT_EQ(all.content, "Checking.\n" + open);
    EXPECT_TRUE(all.tool_calls.empty());
    // Nothing of the open block is sent before finish().
    for (size_t i = 0; i + 1 < deltas.size(); ++i) {
        EXPECT_EQ(deltas[i].content.find('<'), std::string::npos) << describe(deltas[i]);
    }
    EXPECT_EQ(deltas.back().content, open);
}

TEST(ChatOutputToolCalls, MalformedBlocksAreContentVerbatim) {
    for (const std::string block : {
             "<tool_call>\nhello\n</tool_call>",  // not the format
             "<tool_call></tool_call>",  // no function
             "<tool_call><function=></function></tool_call>",  // empty name
             "<tool_call><function=f\nx></function></tool_call>",  // newline in the name
             "<tool_call><function=f><parameter=a>1</function></tool_call>",  // no </parameter>
             "<tool_call><function=f>text<parameter=a>1</parameter></function></tool_call>",  // stray text
             "<tool_call><function=f></function>tail</tool_call>",  // text after the function
             "<function=f><parameter=a>1</function>",  // bare, no </parameter>
         }) {
        const ChatOutputDelta d = parse("R</think>x " + block + " y");
        EXPECT_EQ(d.content, "x " + block + " y") << block;
        EXPECT_TRUE(d.tool_calls.empty()) << block;
    }
}

TEST(ChatOutputToolCalls, ANewToolCallCutsAnOpenBlockShort) {
    const ChatOutputDelta d = parse(
        "</think><tool_call><function=f><parameter=a>1</parameter>\n<tool_call><function=g></function>"
        "</tool_call>");
    EXPECT_EQ(d.content, "<tool_call><function=f><parameter=a>1</parameter>\n");
    ASSERT_EQ(d.tool_calls.size(), 1u);
    EXPECT_EQ(d.tool_calls[0].name, "g");
    EXPECT_EQ(d.tool_calls[0].index, 0);
}

TEST(ChatOutputToolCalls, MarkupInReasoningStaysReasoning) {
    const ChatOutputDelta d = parse(std::string("I could emit ") + kWeatherCall + "\n</think>\nok");
    EXPECT_EQ(d.reasoning, std::string("I could emit ") + kWeatherCall);
    EXPECT_EQ(d.content, "ok");
    EXPECT_TRUE(d.tool_calls.empty());
}

TEST(ChatOutputToolCalls, ParsingOffKeepsMarkupAsContent) {
    ChatOutputOptions o;
    o.parse_tool_calls = false;
    const ChatOutputDelta d = parse(std::string("</think>\n") + kWeatherCall + "\n</tool_call>", o);
    EXPECT_EQ(d.content, std::string(kWeatherCall) + "\n</tool_call>");
    EXPECT_TRUE(d.tool_calls.empty());
}

TEST(ChatOutputToolCalls, PartialSentinelsAreHeldThenReturnedAsText) {
    ChatOutputParser p;
    EXPECT_EQ(p.feed("R</think>Hi <tool_ca").content, "Hi ");
    EXPECT_EQ(p.finish().content, "<tool_ca");

    ChatOutputParser q;
    EXPECT_EQ(q.feed("R</think>a < b <func").content, "a < b ");
    EXPECT_EQ(q.feed("tor").content, "<functor");
    EXPECT_TRUE(q.finish().empty());
}

TEST(ChatOutputToolCalls, EachCallIsSentOnceWholeWhenItCloses) {
    const std::string text = std::string("R</think>") + kWeatherCall + "\n" + kWeatherCall + "\nbye";
    std::vector<size_t> every;  // one-byte pieces: deltas[i] comes from feeding byte i
    for (size_t i = 1; i < text.size(); ++i) every.push_back(i);
    std::vector<ChatOutputDelta> deltas;
    stream(split_at(text, every), {}, {}, &deltas);
    size_t fed = 0;
    std::vector<size_t> sent_at;
    for (size_t i = 0; i < deltas.size(); ++i) {
        if (i < text.size()) fed = i + 1;
        for (const ToolCall &c : deltas[i].tool_calls) {
            sent_at.push_back(fed);
            EXPECT_TRUE(json::accept(c.arguments));
        }
        EXPECT_EQ(deltas[i].content.find("<"), std::string::npos);
        EXPECT_EQ(deltas[i].content.find("function"), std::string::npos);
    }
    const size_t first_end = text.find("</tool_call>") + std::string("</tool_call>").size();
    const size_t second_end = text.rfind("</tool_call>") + std::string("</tool_call>").size();
    EXPECT_EQ(sent_at, (std::vector<size_t>{first_end, second_end}));
}

TEST(ChatOutputToolCalls, UnicodeStreamsInWholeCharacters) {
    const ToolSchemas tools = schemas(weather_tools());
    const std::string text =
        "Überlegung: 東京か? 😀\n</think>\n天気を調べます。<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\n東京 😀\n</parameter>\n</function>\n</tool_call>さようなら";
    const std::vector<size_t> bounds = char_boundaries(text);
    std::vector<ChatOutputDelta> deltas;
    const ChatOutputDelta all =
        stream(split_at(text, std::vector<size_t>(bounds.begin() + 1, bounds.end() - 1)), {}, tools, &deltas);
    EXPECT_EQ(all.reasoning, "Überlegung: 東京か? 😀");
    EXPECT_EQ(all.content, "天気を調べます。さようなら");
    ASSERT_EQ(all.tool_calls.size(), 1u);
    EXPECT_EQ(all.tool_calls[0].arguments, R"({"city":"東京 😀"})");
    for (const ChatOutputDelta &d : deltas) {
        EXPECT_TRUE(utf8_is_valid(d.reasoning));
        EXPECT_TRUE(utf8_is_valid(d.content));
    }
}

TEST(ChatOutputToolCalls, LongHeldTextStreamsInLinearTime) {
    // One-byte pieces through 1 MiB of leading whitespace, an open call and a whitespace run: a
    // parser that rescanned what it holds would take minutes here.
    constexpr int kBytes = 1 << 20;
    ChatOutputOptions o;
    o.starts_in_reasoning = false;
    ChatOutputParser p(o);
    ChatOutputDelta all;
    for (int i = 0; i < kBytes; ++i) all.append(p.feed(" "));
    all.append(p.feed("<think>r</think><tool_call><function=f><parameter=a>"));
    for (int i = 0; i < kBytes; ++i) all.append(p.feed("x"));
    all.append(p.feed("</parameter></function></tool_call>"));
    for (int i = 0; i < kBytes; ++i) all.append(p.feed("\n"));
    all.append(p.finish());
    EXPECT_EQ(all.reasoning, "r");
    EXPECT_EQ(all.content, "");
    ASSERT_EQ(all.tool_calls.size(), 1u);
    EXPECT_EQ(all.tool_calls[0].arguments, "{\"a\":\"" + std::string(kBytes, 'x') + "\"}");
}

// ---------------------------------------------------------------------------------------------
// Typed arguments
// ---------------------------------------------------------------------------------------------

TEST(ToolSchemas, ArgumentsFollowTheSchemaTypes) {
    const ToolSchemas t = schemas(json::parse(R"([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object",
        "$defs": {"Name": {"type": "string"}, "Point": {"type": "object"}},
        "properties": {
            "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
            "b": {"type": "boolean"}, "o": {"type": "object"}, "a": {"type": "array"}, "z": {"type": "null"},
            "ns": {"type": ["string", "null"]}, "any_si": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            "opt_i": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "e": {"enum": ["red", "green"]}, "ei": {"enum": [1, 2]}, "c": {"const": "x"},
            "ref_s": {"$ref": "#/$defs/Name"}, "ref_o": {"$ref": "#/$defs/Point"}, "bad_ref": {"$ref": "#/$defs/Nope"},
            "all": {"allOf": [{"description": "d"}, {"type": "string"}]}, "free": {}, "text": {"type": "text"}
        }}}}])"));
    EXPECT_EQ(t.argument_json("f", "s", "123"), "\"123\"");
    EXPECT_EQ(t.argument_json("f", "s", "null"), "\"null\"");
    EXPECT_EQ(t.argument_json("f", "s", "say \"hi\"\n\ttab\\"), R"("say \"hi\"\n\ttab\\")");
    EXPECT_EQ(t.argument_json("f", "i", "42"), "42");
    EXPECT_EQ(t.argument_json("f", "i", " 42\n"), "42");
    EXPECT_EQ(t.argument_json("f", "i", "123456789012345678901234567890"), "123456789012345678901234567890");
    EXPECT_EQ(t.argument_json("f", "i", "forty"), "\"forty\"");  // does not parse: the string
    EXPECT_EQ(t.argument_json("f", "i", ""), "\"\"");
    EXPECT_EQ(t.argument_json("f", "n", "1.50"), "1.50");
    EXPECT_EQ(t.argument_json("f", "n", "NaN"), "\"NaN\"");
    EXPECT_EQ(t.argument_json("f", "b", "true"), "true");
    EXPECT_EQ(t.argument_json("f", "b", "True"), "\"True\"");
    EXPECT_EQ(t.argument_json("f", "o", "{\"k\": [1, 2]}"), "{\"k\": [1, 2]}");
    EXPECT_EQ(t.argument_json("f", "o", "{'k': 1}"), "\"{'k': 1}\"");
    EXPECT_EQ(t.argument_json("f", "a", "[1, \"x\"]"), "[1, \"x\"]");
    EXPECT_EQ(t.argument_json("f", "z", "null"), "null");
    EXPECT_EQ(t.argument_json("f", "ns", "null"), "null");
    EXPECT_EQ(t.argument_json("f", "ns", "None"), "\"None\"");
    EXPECT_EQ(t.argument_json("f", "ns", "42"), "\"42\"");
    EXPECT_EQ(t.argument_json("f", "any_si", "5"), "\"5\"");  // string allowed: string wins
    EXPECT_EQ(t.argument_json("f", "opt_i", "5"), "5");
    EXPECT_EQ(t.argument_json("f", "opt_i", "null"), "null");
    EXPECT_EQ(t.argument_json("f", "e", "red"), "\"red\"");
    EXPECT_EQ(t.argument_json("f", "ei", "2"), "2");
    EXPECT_EQ(t.argument_json("f", "c", "x"), "\"x\"");
    EXPECT_EQ(t.argument_json("f", "ref_s", "7"), "\"7\"");
    EXPECT_EQ(t.argument_json("f", "ref_o", "{}"), "{}");
    EXPECT_EQ(t.argument_json("f", "bad_ref", "7"), "7");  // unresolved: unconstrained
    EXPECT_EQ(t.argument_json("f", "all", "7"), "\"7\"");
    EXPECT_EQ(t.argument_json("f", "free", "7"), "7");
    EXPECT_EQ(t.argument_json("f", "text", "7"), "\"7\"");  // vLLM's "text" spelling of string
    // Not in the schema, or an unknown function: the JSON reading when there is one.
    EXPECT_EQ(t.argument_json("f", "other", "7"), "7");
    EXPECT_EQ(t.argument_json("f", "other", "[true]"), "[true]");
    EXPECT_EQ(t.argument_json("f", "other", "hello world"), "\"hello world\"");
    EXPECT_EQ(t.argument_json("g", "x", "null"), "null");
    EXPECT_EQ(ToolSchemas().argument_json("f", "x", "3.5"), "3.5");
    // Never an exception or invalid JSON: invalid UTF-8 and control bytes in strings.
    EXPECT_EQ(t.argument_json("f", "s", "a\xFF\x01z"), "\"a\xEF\xBF\xBD\\u0001z\"");
    EXPECT_EQ(t.argument_json("f", "i", "\"\xFF\""), "\"\\\"\xEF\xBF\xBD\\\"\"");
    // nlohmann's lexer stops at a NUL byte as if the input ended there: "8\0x" is no number.
    EXPECT_EQ(t.argument_json("f", "i", std::string("8\0x", 3)), "\"8\\u0000x\"");
    EXPECT_EQ(t.argument_json("f", "other", std::string("[1]\0", 4)), "\"[1]\\u0000\"");
    const std::string deep = std::string(100000, '[') + std::string(100000, ']');
    EXPECT_EQ(t.argument_json("f", "a", deep), deep);
}

TEST(ToolSchemas, TypedArgumentsInACall) {
    const ToolSchemas tools = schemas(weather_tools());
    const ChatOutputDelta d = parse(
        "</think><tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n7\n"
        "</parameter>\n<parameter=metric>\nfalse\n</parameter>\n<parameter=extra>\n{\"wind\": true}\n</parameter>\n"
        "<parameter=note>\n[1,2]\n</parameter>\n</function>\n</tool_call><tool_call>\n<function=search>\n"
        "<parameter=limit>\nnull\n</parameter>\n</function>\n</tool_call>",
        {}, tools);
    ASSERT_EQ(d.tool_calls.size(), 2u);
    EXPECT_EQ(d.tool_calls[0].arguments,
              R"({"city":"42","days":7,"metric":false,"extra":{"wind": true},"note":[1,2]})");
    EXPECT_EQ(d.tool_calls[1].arguments, R"({"limit":null})");
    for (const ToolCall &c : d.tool_calls) EXPECT_TRUE(json::parse(c.arguments).is_object());
}

TEST(ToolSchemas, FromJsonValidatesTheToolsArray) {
    EXPECT_TRUE(ToolSchemas::from_json(json()).has_value());
    EXPECT_TRUE(ToolSchemas::from_json(json::array())->empty());
    auto err = [](const char *text) {
        auto r = ToolSchemas::from_json(json::parse(text));
        return r ? std::string("ok") : r.error().message;
    };
    EXPECT_EQ(err(R"({"type": "function"})"), "tools: expected an array, found an object");
    EXPECT_EQ(err(R"([3])"), "tools[0]: expected an object, found number 3");
    EXPECT_EQ(err(R"([{"type": "function"}])"), "tools[0].function: expected an object, found nothing");
    EXPECT_EQ(err(R"([{"type": "function", "function": {"name": 1}}])"),
              "tools[0].function.name: expected a string, found number 1");
    EXPECT_EQ(err(R"([{"function": {"name": "f"}}, {"function": {"name": "f"}}])"),
              "tools[1].function.name: expected a unique function name, found \"f\" again (first in tools[0])");
    EXPECT_EQ(err(R"([{"function": {"name": "f", "parameters": []}}])"),
              "tools[0].function.parameters: expected an object, found an array");
    EXPECT_EQ(err(R"([{"type": 7}])"), "tools[0].type: expected a string, found number 7");
    EXPECT_EQ(err(R"([{"type": "custom", "custom": {"name": "x"}}, {"function": {"name": "f"}}])"), "ok");
    // A self-referencing schema ends (depth and budget limits) as unconstrained.
    auto loop = ToolSchemas::from_json(json::parse(R"([{"function": {"name": "f", "parameters": {
        "$defs": {"L": {"anyOf": [{"$ref": "#/$defs/L"}, {"$ref": "#/$defs/L"}]}},
        "properties": {"x": {"$ref": "#/$defs/L"}}}}}])"));
    ASSERT_TRUE(loop.has_value());
    EXPECT_EQ(loop->argument_json("f", "x", "1"), "1");
}

// ---------------------------------------------------------------------------------------------
// Streaming invariance and round trips
// ---------------------------------------------------------------------------------------------

const std::vector<std::string> &tricky_outputs() {
    static const std::vector<std::string> outputs = {
        "",
        "\n",
        "</think>",
        "<think>",
        "plain",
        "a\n</think>\nb",
        "a\n\n</think>\n\nb\n",
        " \n<think>\nR\n</think>\nC",
        "<think><think>x</think></think>y",
        "R</think>C1\n</think>\nC2<think>C3",
        "R</think>\n<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>\n",
        "R</think>x<tool_call><function=f></function></tool_call> \n<tool_call><function=g></function></tool_call>y",
        "R</think>\n\n<tool_call><function=f><parameter=a>v</parameter></function></tool_call>\n\n",
        "R</think>a<tool_call>\nbad\n</tool_call>b",
        "R</think>a<tool_call><function=f><parameter=a>1</parameter>\n<tool_call><function=g></function></tool_call>",
        "R</think>a<tool_call><function=f><parameter=a>1</parameter>",
        "R</think><function=f></function></tool_call>x</tool_call>",
        "R</think><tool_c<tool_call><function=f></function></tool_call><tool_",
        "R</think>a < b </ c <t <f <th </th </tool <function <parameter=x>",
        "R</think><tool_call><function=f><parameter=a></parameter></parameter></function></tool_call>",
        "R</think><tool_call>\n<function=a>\n</function>\n<function=b>\n<parameter=x>\n1\n</parameter>\n</tool_call>",
        "日本語</think>\n東京<tool_call><function=検索><parameter=語>\n😀\n</parameter></function></tool_call>é",
        "<tool_call><function=f></function></tool_call>",
        "\n\n  \n",
        "  <thin",
        "x\n</thi",
    };
    return outputs;
}

TEST(ChatOutputInvariance, EverySplitOfTrickyOutputsForAllOptions) {
    std::mt19937 rng(7);
    const ToolSchemas tools = schemas(weather_tools());
    for (const std::string &text : tricky_outputs()) {
        for (int bits = 0; bits < 8; ++bits) {
            expect_split_invariant(text, options_from_bits(bits), tools, rng);
            if (::testing::Test::HasFatalFailure()) {
                ADD_FAILURE() << "options " << bits;
                return;
            }
        }
    }
}

// Random outputs built from markup fragments, text and whole calls: any split gives the totals of
// the whole text, and every call's arguments are a JSON object.
TEST(ChatOutputInvariance, RandomOutputsRandomSplits) {
    std::mt19937 rng(99);
    const ToolSchemas tools = schemas(weather_tools());
    const std::vector<std::string> fragments = {
        "<think>",
        "</think>",
        "\n",
        " ",
        "<tool_call>",
        "</tool_call>",
        "<function=get_weather>",
        "<function=f>",
        "</function>",
        "<parameter=city>",
        "<parameter=days>",
        "</parameter>",
        "<",
        ">",
        "=",
        "a",
        "bc",
        "3",
        "é",
        "日本",
        "😀",
        "<tool_",
        "</thi",
        "<func",
        kWeatherCall,
        "{\"k\": 1}",
        "null",
        "\n\n",
    };
    std::uniform_int_distribution<size_t> pick(0, fragments.size() - 1);
    std::uniform_int_distribution<int> len(0, 30), bits_dist(0, 7);
    for (int round = 0; round < 3000; ++round) {
        std::string text;
        for (int i = len(rng); i > 0; --i) text += fragments[pick(rng)];
        const ChatOutputOptions options = options_from_bits(bits_dist(rng));
        const ChatOutputDelta whole = parse(text, options, tools);
        const std::string expect = describe(whole);
        for (const ToolCall &c : whole.tool_calls) {
            const json args = json::parse(c.arguments, nullptr, false);
            ASSERT_TRUE(args.is_object()) << c.arguments;
        }
        for (int split = 0; split < 6; ++split) {
            ASSERT_EQ(describe(stream(split_at(text, random_cuts(rng, text.size(), 12)), options, tools)), expect)
                << "round " << round << ": " << json(text).dump();
        }
    }
}

// Messages rendered the way the chat template renders an assistant turn parse back to what was
// rendered: the reasoning, the content (plus the "\n" the template puts before the first call) and
// every call with its string arguments.
TEST(ChatOutputInvariance, TemplateRenderedMessagesRoundTrip) {
    std::mt19937 rng(2025);
    const std::vector<std::string> words = {"a", "b c", "\n", "é", "日本", "😀", " < ", "x=1", "{}", "\t", "</p>"};
    std::uniform_int_distribution<size_t> word(0, words.size() - 1);
    std::uniform_int_distribution<int> n_words(0, 6), n_calls(0, 3), n_params(0, 3);
    auto text_of = [&](int n) {
        std::string s;
        for (int i = 0; i < n; ++i) s += words[word(rng)];
        return s;
    };
    auto trimmed = [](std::string s) {
        while (!s.empty() && std::string(" \t\n\r").find(s.front()) != std::string::npos) s.erase(0, 1);
        return s;
    };
    for (int round = 0; round < 2000; ++round) {
        std::string reasoning = text_of(n_words(rng));
        const std::string content = trimmed(text_of(n_words(rng)));  // the template's content has no leading ws
        std::string text = reasoning + "\n</think>\n" + content;
        ChatOutputDelta expect;
        expect.reasoning = reasoning;
        expect.content = content;
        json tools = json::array();
        const int calls = n_calls(rng);
        for (int c = 0; c < calls; ++c) {
            const std::string name = "fn" + std::to_string(c);
            if (!content.empty() || c > 0) text += "\n";
            if (c == 0 && !content.empty()) expect.content += "\n";
            text += "<tool_call>\n<function=" + name + ">\n";
            json props = json::object(), args = json::object();
            std::string arguments = "{";
            const int params = n_params(rng);
            for (int p = 0; p < params; ++p) {
                const std::string key = "p" + std::to_string(p);
                const std::string value = text_of(n_words(rng));
                props[key] = {{"type", "string"}};
                text += "<parameter=" + key + ">\n" + value + "\n</parameter>\n";
                arguments += (p > 0 ? "," : "") + json(key).dump() + ":" + json(value).dump();
            }
            text += "</function>\n</tool_call>";
            tools.push_back(
                {{"type", "function"}, {"function", {{"name", name}, {"parameters", {{"properties", props}}}}}});
            ToolCall call;
            call.index = c;
            call.name = name;
            call.arguments = arguments + "}";
            expect.tool_calls.push_back(call);
        }
        const ToolSchemas schema = schemas(tools);
        ChatOutputDelta got = stream(split_at(text, random_cuts(rng, text.size(), 10)), {}, schema);
        ASSERT_EQ(got.tool_calls.size(), expect.tool_calls.size()) << json(text).dump();
        for (size_t i = 0; i < got.tool_calls.size(); ++i) expect.tool_calls[i].id = got.tool_calls[i].id;
        ASSERT_EQ(describe(got), describe(expect)) << json(text).dump();
    }
}

}  // namespace
}  // namespace memra::text
