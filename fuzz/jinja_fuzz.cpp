// libFuzzer target for text/jinja: the input is a template, parsed and (when it parses) rendered twice
// with a fixed context that looks like a chat request (messages with reasoning and tool calls, tools,
// flags) under small limits. Checks (trap on failure): no crash, hang or sanitizer report; an error
// always has a message; the output respects max_output_bytes; rendering is deterministic.
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "text/jinja.h"

namespace {

using Json = nlohmann::ordered_json;
using memra::text::jinja::RenderOptions;
using memra::text::jinja::Template;

const Json &context() {
    static const Json c = [] {
        Json ctx = Json::object();
        ctx["messages"] = Json::parse(R"([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris? ü 日本"},
        {"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
        {"role": "assistant", "content": "21 degrees."}])");
        ctx["tools"] = Json::parse(R"([{"type": "function", "function": {"name": "get_weather",
            "description": "Weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"},
            "days": {"type": "integer"}}, "required": ["city"]}}}])");
        ctx["add_generation_prompt"] = true;
        ctx["bos_token"] = "<s>";
        ctx["eos_token"] = "</s>";
        ctx["enable_thinking"] = false;
        ctx["xs"] = Json::array({3, 1.5, "a", nullptr, true, Json::array({1}), Json::object({{"k", "v"}})});
        return ctx;
    }();
    return c;
}

RenderOptions options() {
    RenderOptions o;
    o.max_output_bytes = 1 << 20;
    o.max_iterations = 200'000;
    o.max_depth = 100;
    std::tm now{};
    now.tm_year = 124;
    now.tm_mday = 1;
    o.now = now;
    return o;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const std::string source(reinterpret_cast<const char *>(data), size);
    auto tmpl = Template::parse(source);
    if (!tmpl) {
        if (tmpl.error().message.empty()) __builtin_trap();
        return 0;
    }
    static const RenderOptions opts = options();
    auto first = tmpl->render(context(), opts);
    auto second = tmpl->render(context(), opts);
    if (first.has_value() != second.has_value()) __builtin_trap();
    if (first) {
        if (first->size() > opts.max_output_bytes || *first != *second) __builtin_trap();
    } else if (first.error().message.empty() || first.error().message != second.error().message) {
        __builtin_trap();
    }
    return 0;
}
