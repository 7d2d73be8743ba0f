// What the OpenAI-compatible server makes of generated text: StopMatcher cuts the text at the
// request's `stop` strings, ChatOutputParser splits Step-3.5 output into reasoning (<think>),
// content and XML tool calls. Both take the complete UTF-8 pieces StreamDecoder returns and give
// the same totals however the text is split into pieces (streaming invariance); a server runs the
// stop matcher first and parses what it lets through.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/result.h"

namespace memra::text {

// ---------------------------------------------------------------------------------------------
// Stop strings
// ---------------------------------------------------------------------------------------------

struct StopStep {
    std::string text;  // safe to send now
    bool stopped = false;  // a stop string matched: nothing more will come
};

// OpenAI `stop`: the output ends right before the first occurrence of any stop string, and the
// stop string itself is not returned (as OpenAI and vLLM do). "First" is the smallest start offset
// in the whole text (ties: the shortest stop string, then the lowest index); vLLM instead takes the
// first string of the list found in the newest token's text, which depends on how tokens split.
// Matching runs one KMP automaton per stop string over the bytes: O(total bytes x stop strings).
// Held back: only the longest suffix that could still begin a stop string (at most
// max_stop_len - 1 bytes), plus the bytes of a character cut off by the end of a piece, so every
// returned text is whole UTF-8 when the input is.
// Invariant: the concatenation of all returned text == the full text cut before the first
// occurrence of any stop string (or the full text), for any split into pieces.
class StopMatcher {
public:
    // Refuses an empty stop string or one that is not valid UTF-8. No stop strings: pass-through.
    static Result<StopMatcher> create(std::span<const std::string> stops);

    StopStep feed(std::string_view piece);
    // End of generation: returns the held-back text (or, if a match was still being confirmed
    // against a longer stop string that started earlier, the text before that match).
    // feed() after a stop or after finish() returns nothing.
    StopStep finish();

    bool stopped() const { return stopped_; }
    // Index (into the create() list) of the stop string that ended the output.
    std::optional<size_t> matched_stop() const;
    size_t max_stop_len() const { return max_len_; }

private:
    struct Pattern {
        std::string text;
        std::vector<size_t> fail;  // [len] KMP failure function: longest proper border of text[0..i]
        size_t state = 0;  // bytes of `text` matched by the end of the input so far
    };
    StopMatcher() = default;
    std::string take_held(uint64_t end);  // removes and returns held bytes up to global offset `end`

    std::vector<Pattern> patterns_;
    size_t max_len_ = 0;
    std::string held_;  // fed bytes not yet returned; held_[held_begin_] is at global offset emitted_
    size_t held_begin_ = 0;
    uint64_t fed_ = 0;  // bytes fed so far
    uint64_t emitted_ = 0;  // bytes returned or discarded so far
    std::optional<uint64_t> cut_;  // start offset of the best complete match seen
    size_t cut_pattern_ = 0;
    bool stopped_ = false;
    bool finished_ = false;
};

// ---------------------------------------------------------------------------------------------
// Tool schemas (the request's `tools`)
// ---------------------------------------------------------------------------------------------

// The request's `tools` (OpenAI format: [{"type": "function", "function": {"name": ...,
// "parameters": JSON schema}}]), reduced to what typing a tool call's arguments needs: for each
// function, for each property of its parameters schema, which JSON types the schema allows. The
// types come from "type" (a name or a list), else "enum"/"const" (the types of the listed
// values), else the union over "anyOf"/"oneOf", else the first "allOf" member that says, else a
// local "$ref" ("#/..." inside the function's parameters). vLLM's spellings "str", "text",
// "varchar", "char" and "enum" count as "string".
class ToolSchemas {
public:
    ToolSchemas() = default;
    // `tools`: null (no tools) or the array. Entries whose "type" is not "function" are skipped
    // (custom tools have no parameters schema). Errors name the entry: a non-object entry, a
    // missing or non-string function name, a duplicate name, a non-object "parameters".
    static Result<ToolSchemas> from_json(const nlohmann::json &tools);

    // The JSON text of argument `param` of `function` whose raw XML value is `value`:
    //  - the schema allows "string": the value as a JSON string, except the exact text "null"
    //    when the schema also allows "null" (then null);
    //  - the schema allows only non-string types (integer, number, boolean, object, array, null):
    //    the value itself if it is valid JSON (JSON whitespace around it trimmed, the text kept as
    //    written, so big integers and number spellings survive), else a JSON string;
    //  - no type constraint (unknown function, parameter not in the schema, a schema without
    //    types such as {}): as for non-string types. JSON Schema allows any value there, so the
    //    value's JSON reading is taken when it has one. vLLM (qwen3_coder, step3p5) returns such
    //    values as strings; memra prefers the typed reading ("3" -> 3, "true" -> true, "[1]" ->
    //    [1]) and keeps plain text as a string.
    // Never fails; invalid UTF-8 in a string becomes U+FFFD.
    std::string argument_json(std::string_view function, std::string_view param, std::string_view value) const;

    bool empty() const { return functions_.empty(); }

private:
    // Bits of the JSON types a parameter allows; 0: unconstrained.
    std::unordered_map<std::string, std::unordered_map<std::string, uint8_t>> functions_;
};

// ---------------------------------------------------------------------------------------------
// Reasoning and tool calls
// ---------------------------------------------------------------------------------------------

struct ToolCall {
    int index = 0;  // 0-based position among this output's tool calls (OpenAI tool_calls[].index)
    std::string id;  // "call_<index>_<16 hex digits>", a hash of salt, index, name and arguments
    std::string name;
    std::string arguments;  // a JSON object: {"param":value,...} in the order the model wrote them
};

// What one feed()/finish() adds. Reasoning text comes before the content of the same delta in the
// output; the relative order of content and tool calls inside one delta is not kept.
struct ChatOutputDelta {
    std::string reasoning;
    std::string content;
    std::vector<ToolCall> tool_calls;  // complete calls, each exactly once

    bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
    void append(ChatOutputDelta &&next);
};

struct ChatOutputOptions {
    // Off: all text is content (the template was rendered without <think>); "<think>" and
    // "</think>" are then ordinary text.
    bool parse_reasoning = true;
    // The prompt ends inside reasoning (Step-3.5's generation prompt ends "<think>\n"). When false,
    // reasoning starts only if the output opens with "<think>" (after optional whitespace).
    bool starts_in_reasoning = true;
    // Off: tool-call markup is ordinary content.
    bool parse_tool_calls = true;
    // Mixed into the call ids (e.g. the request id) so that calls of different requests differ
    // while staying reproducible; the ids never depend on anything random.
    std::string call_id_salt;
};

// Streaming parser for one generated message. Behaviour (all of it independent of the split):
//
// Reasoning (parse_reasoning), as vLLM's step3p5 reasoning parser:
//  - Starting inside reasoning, everything up to the first "</think>" is reasoning; one "\n"
//    right before that "</think>" and one "\n" right after it are dropped (the template writes
//    "\n</think>\n"). Output that never closes </think> is all reasoning, returned verbatim by
//    finish() (vLLM also drops a final "\n" there; memra keeps the text as generated).
//  - A "<think>" the model re-emits at the very start (after optional whitespace) is dropped with
//    the whitespace before it and one "\n" after it. Elsewhere in reasoning "<think>" is text.
//  - Not starting inside reasoning, an output that opens with optional whitespace and "<think>"
//    enters reasoning the same way; any other output is content from its first byte.
//  - After reasoning has ended, a late or duplicated "</think>" (or a "<think>") in the content is
//    markup, not text: it is removed and the text around it stays content. Reasoning cannot be
//    re-opened, since the content before it has already been sent (vLLM leaves such tags in the
//    content verbatim).
//
// Tool calls (parse_tool_calls), in content only (markup inside reasoning stays reasoning):
//    <tool_call>
//    <function=NAME>
//    <parameter=ARG>
//    VALUE
//    </parameter>
//    </function>
//    </tool_call>
//  - A call is returned once, whole, when its closing tag arrives; nothing of an open call is
//    ever returned before that. Whitespace between the tags is free; NAME and ARG are trimmed of
//    spaces and may not contain '<', '>' or a newline; VALUE is everything up to the first
//    "</parameter>" less one leading and one trailing "\n" (as vLLM); a repeated ARG keeps its first
//    position and its last value. Several <function=...> blocks in one <tool_call> are several
//    calls; the "</function>" of the last one may be missing. A bare "<function=...>...</function>"
//    without <tool_call> is also a call (vLLM's step3p5 parser accepts it too), and a stray
//    "</tool_call>" outside a call is removed.
//  - A block that does not parse (text that is not the format, a missing "</parameter>", ...) is
//    returned verbatim as content when its end arrives; a "<tool_call>" inside an open block ends
//    that block as malformed and opens a new one; a block still open at finish() (no
//    "</tool_call>") is returned verbatim as content. Nothing is ever lost.
//  - Content text before, between and after calls is content, but a whitespace-only run of
//    content that touches a call (before the first, between two, after the last) is dropped, as
//    vLLM drops whitespace-only text between calls. To decide that, whitespace at the start of a
//    run is held until non-whitespace arrives.
//
// Held back between feeds: text that could still begin a sentinel ("</think>", "<tool_call>",
// ...), a "\n" that may precede "</think>", the byte after "</think>", leading whitespace that may
// precede "<think>" or a call, and an open tool-call block. Every split point is at an ASCII byte,
// so whole-UTF-8 pieces give whole-UTF-8 deltas.
class ChatOutputParser {
public:
    explicit ChatOutputParser(ChatOutputOptions options = {}, ToolSchemas tools = {});

    ChatOutputDelta feed(std::string_view piece);
    // End of generation: flushes everything held back. feed() or finish() after it returns nothing.
    ChatOutputDelta finish();

private:
    enum class Phase { kStart, kAfterThinkOpen, kReasoning, kAfterThinkClose, kContent };
    enum class Scan { kText, kToolCall, kBareFunction };

    void split_reasoning(std::string_view piece, bool final, ChatOutputDelta &out);
    void scan_content(std::string_view text, bool final, ChatOutputDelta &out);
    void emit_content(std::string_view text, ChatOutputDelta &out);
    void end_block(std::string_view block, bool wrapped, ChatOutputDelta &out);

    ChatOutputOptions options_;
    ToolSchemas tools_;
    std::vector<std::string_view> sentinels_;  // content-level sentinels, all starting with '<'
    bool finished_ = false;

    // Reasoning split.
    Phase phase_ = Phase::kStart;
    std::string r_buf_;  // held text of the current phase
    size_t start_ws_ = 0;  // kStart: leading whitespace already scanned in r_buf_

    // Content scan.
    Scan scan_ = Scan::kText;
    std::string c_buf_;  // held text: a possible sentinel start, or the open block from its tag
    size_t block_scan_ = 0;  // open block: offset in c_buf_ where the search for its end resumes
    std::string ws_pending_;  // whitespace at the start of the current content run, not yet sent
    bool run_has_text_ = false;  // the current content run has sent non-whitespace
    int n_calls_ = 0;
};

// Non-streaming: feed(text) then finish(), merged.
ChatOutputDelta parse_chat_output(std::string_view text, const ChatOutputOptions &options = {},
                                  const ToolSchemas &tools = {});

}  // namespace memra::text
