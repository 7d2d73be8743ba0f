// libFuzzer target for text/chat_output: streaming invariance of StopMatcher and ChatOutputParser
// under fuzzer-chosen splits. Input layout:
//   byte 0     flags: bit 0 parse_reasoning, bit 1 starts_in_reasoning, bit 2 parse_tool_calls,
//              bit 3 type the arguments with a fixed tools schema, bits 4-5 the number of stop strings;
//   then       two bytes per stop string: (start, length) of a slice of the text (1-16 bytes);
//   the rest   the generated text; each 0xFF byte (never in UTF-8) is removed and marks a split point.
// Checks (trap on failure): the stop matcher's pieces concatenate to the text cut before the earliest
// stop string, in whole UTF-8 when the text is UTF-8; the parser's totals over the pieces equal
// parse_chat_output of the whole text, also when fed what the stop matcher lets through; every tool
// call's arguments are a valid-UTF-8 JSON object.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/chat_output.h"
#include "text/utf8.h"

namespace {

using namespace memra::text;

const ToolSchemas &typed_tools() {
    static const ToolSchemas tools = *ToolSchemas::from_json(nlohmann::json::parse(R"([
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
            "$defs": {"S": {"type": "string"}},
            "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "object"},
                           "d": {"type": ["string", "null"]}, "e": {"$ref": "#/$defs/S"},
                           "g": {"anyOf": [{"type": "number"}, {"type": "null"}]}}}}},
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
    ])"));
    return tools;
}

void check_same(const ChatOutputDelta &a, const ChatOutputDelta &b) {
    if (a.reasoning != b.reasoning || a.content != b.content || a.tool_calls.size() != b.tool_calls.size())
        __builtin_trap();
    for (size_t i = 0; i < a.tool_calls.size(); ++i) {
        const ToolCall &x = a.tool_calls[i], &y = b.tool_calls[i];
        if (x.index != y.index || x.id != y.id || x.name != y.name || x.arguments != y.arguments) __builtin_trap();
    }
}

void check_calls(const ChatOutputDelta &d) {
    for (size_t i = 0; i < d.tool_calls.size(); ++i) {
        const ToolCall &c = d.tool_calls[i];
        if (c.index != static_cast<int>(i)) __builtin_trap();
        if (!utf8_is_valid(c.arguments) || c.arguments.empty() || c.arguments.front() != '{') __builtin_trap();
        if (!nlohmann::json::accept(c.arguments)) __builtin_trap();
    }
}

ChatOutputDelta stream(const std::vector<std::string> &pieces, const ChatOutputOptions &options,
                       const ToolSchemas &tools) {
    ChatOutputParser parser(options, tools);
    ChatOutputDelta all;
    for (const std::string &p : pieces) all.append(parser.feed(p));
    all.append(parser.finish());
    if (!parser.finish().empty() || !parser.feed("x").empty()) __builtin_trap();
    return all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    const uint8_t flags = data[0];
    const size_t n_stops = (flags >> 4) & 3;
    if (size < 1 + 2 * n_stops) return 0;
    std::string text;
    std::vector<size_t> cuts;
    for (size_t i = 1 + 2 * n_stops; i < size; ++i) {
        if (data[i] == 0xFF) {
            cuts.push_back(text.size());
        } else {
            text.push_back(static_cast<char>(data[i]));
        }
    }
    std::vector<std::string> pieces;
    size_t prev = 0;
    for (size_t c : cuts) {
        pieces.push_back(text.substr(prev, c - prev));
        prev = c;
    }
    pieces.push_back(text.substr(prev));
    const bool valid_text = utf8_is_valid(text);

    // Stop strings: slices of the text, so that they match; invalid UTF-8 slices are refused.
    std::vector<std::string> stops;
    for (size_t i = 0; i < n_stops && !text.empty(); ++i) {
        const size_t start = data[1 + 2 * i] % text.size();
        const std::string stop = text.substr(start, 1 + data[2 + 2 * i] % 16);
        auto probe = StopMatcher::create(std::vector<std::string>{stop});
        if (probe.has_value() != utf8_is_valid(stop)) __builtin_trap();
        if (probe) stops.push_back(stop);
    }
    auto matcher = StopMatcher::create(stops);
    if (!matcher) __builtin_trap();
    size_t cut = std::string::npos;
    for (const std::string &s : stops) cut = std::min(cut, text.find(s));
    const std::string expect_cut = text.substr(0, cut);
    std::vector<std::string> let_through;
    std::string joined;
    bool stopped = false;
    for (const std::string &p : pieces) {
        const StopStep step = matcher->feed(p);
        if (valid_text && !utf8_is_valid(step.text)) __builtin_trap();
        stopped = stopped || step.stopped;
        joined += step.text;
        let_through.push_back(step.text);
    }
    const StopStep tail = matcher->finish();
    joined += tail.text;
    let_through.push_back(tail.text);
    stopped = stopped || tail.stopped;
    if (joined != expect_cut || stopped != (cut != std::string::npos) || stopped != matcher->stopped())
        __builtin_trap();
    if (stopped && text.compare(cut, stops[*matcher->matched_stop()].size(), stops[*matcher->matched_stop()]) != 0)
        __builtin_trap();

    ChatOutputOptions options;
    options.parse_reasoning = (flags & 1) != 0;
    options.starts_in_reasoning = (flags & 2) != 0;
    options.parse_tool_calls = (flags & 4) != 0;
    const ToolSchemas none;
    const ToolSchemas &tools = (flags & 8) != 0 ? typed_tools() : none;

    const ChatOutputDelta whole = parse_chat_output(text, options, tools);
    check_calls(whole);
    if (valid_text && (!utf8_is_valid(whole.reasoning) || !utf8_is_valid(whole.content))) __builtin_trap();
    check_same(stream(pieces, options, tools), whole);
    check_same(stream(let_through, options, tools), parse_chat_output(expect_cut, options, tools));
    return 0;
}
