// ChatTemplate: make-tiny's template applied to conversations, and the preprocessing of
// transformers' apply_chat_template (null keys dropped, reasoning aliased, tools and documents
// None, kwargs over the special tokens). Expected strings were rendered by transformers 5.24 /
// jinja2 3.1.6 (render_jinja_template after _normalize_chat_messages, bos "<s>", eos "</s>") and
// pasted here; tests/oracle/test_chat_template.py compares many more templates live.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/chat_template.h"

namespace memra::text {
namespace {

using Json = nlohmann::ordered_json;

// The chat template `memra make-tiny` writes, from the committed default model's tokenizer_config.json.
std::string tiny_template() {
    std::ifstream in(std::string(MEMRA_SOURCE_DIR) + "/models/default/tokenizer_config.json");
    std::stringstream ss;
    ss << in.rdbuf();
    const Json config = Json::parse(ss.str(), nullptr, false);
    EXPECT_TRUE(config.is_object() && config.contains("chat_template")) << "models/default/tokenizer_config.json";
    return config.is_object() && config.contains("chat_template") ? config["chat_template"].get<std::string>() : "";
}

std::string apply(const ChatTemplate &t, const Json &messages, const Json *tools, bool add_generation_prompt,
                  const Json &kwargs = Json::object()) {
    auto out = t.apply(messages, tools, add_generation_prompt, kwargs);
    return out ? *out : "ERROR: " + out.error().message;
}

ChatTemplate make(std::string source) {
    auto t = ChatTemplate::create(std::move(source), "<s>", "</s>");
    EXPECT_TRUE(t) << t.error().message;
    return std::move(*t);
}

TEST(ChatTemplate, TinyTemplateMultiTurn) {
    const ChatTemplate t = make(tiny_template());
    const Json messages = Json::parse(R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Joke in 日本語?"}])");
    EXPECT_EQ(apply(t, messages, nullptr, true),
              "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
              "Hello!<|im_end|>\n<|im_start|>user\nJoke in 日本語?<|im_end|>\n<|im_start|>assistant\n<think>\n");
    const Json short_chat =
        Json::parse(R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])");
    EXPECT_EQ(apply(t, short_chat, nullptr, false),
              "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n");
}

// Reasoning shows only after the last user turn; `reasoning` is read as reasoning_content.
TEST(ChatTemplate, TinyTemplateReasoning) {
    const ChatTemplate t = make(tiny_template());
    const Json messages = Json::parse(R"([{"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add."}, {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "reasoning": "Add again."}])");
    EXPECT_EQ(apply(t, messages, nullptr, false),
              "<s><|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n3+3?"
              "<|im_end|>\n<|im_start|>assistant\n<think>\nAdd again.\n</think>\n6<|im_end|>\n");
}

TEST(ChatTemplate, TinyTemplateToolCalls) {
    const ChatTemplate t = make(tiny_template());
    const Json tools = Json::parse(R"([{"type": "function", "function": {"name": "get_weather",
        "description": "Weather for a city", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])");
    const Json messages = Json::parse(R"([{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "units": ["C"]}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21C"}, {"role": "tool", "content": "sunny"}])");
    EXPECT_EQ(apply(t, messages, &tools, true, Json{{"enable_thinking", false}}),
              "<s><|im_start|>system\n# Tools\n\nYou may call the functions below. Their signatures:\n<tools>\n"
              "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather for a "
              "city\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, "
              "\"required\": [\"city\"]}}}\n</tools>\n\nTo call a function, answer with:\n<tool_call>\n"
              "<function=NAME>\n<parameter=ARGUMENT>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
              "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
              "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
              "<parameter=units>\n[\"C\"]\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
              "<|im_start|>tool_response\n<tool_response>21C</tool_response>\n<tool_response>sunny</tool_response>"
              "<|im_end|>\n<|im_start|>assistant\n<think>\n");
}

// What the template sees: null-valued keys gone; reasoning (the first non-null of reasoning_content,
// thinking, reasoning) copied to `thinking` (first, unless present) and `reasoning_content` (last,
// unless present); tools and documents None; kwargs as variables.
TEST(ChatTemplate, ContextMatchesTransformers) {
    const ChatTemplate t = make(
        "{% for m in messages %}{{ m|tojson }}\n{% endfor %}{{ tools is none }} {{ documents is none }} "
        "{{ add_generation_prompt }} {{ bos_token }}{{ eos_token }} {{ enable_thinking }}");
    const Json messages = Json::parse(R"([{"role": "user", "content": "q", "name": null},
        {"role": "assistant", "reasoning": "r1", "content": "a"},
        {"role": "assistant", "content": "b", "thinking": "t2", "reasoning_content": "r2"},
        {"role": "assistant", "content": "c", "reasoning_content": null, "thinking": "t3"}])");
    EXPECT_EQ(apply(t, messages, nullptr, false, Json{{"enable_thinking", false}}),
              "{\"role\": \"user\", \"content\": \"q\"}\n"
              "{\"thinking\": \"r1\", \"role\": \"assistant\", \"reasoning\": \"r1\", \"content\": \"a\", "
              "\"reasoning_content\": \"r1\"}\n"
              "{\"thinking\": \"t2\", \"role\": \"assistant\", \"content\": \"b\", \"reasoning_content\": \"r2\"}\n"
              "{\"thinking\": \"t3\", \"role\": \"assistant\", \"content\": \"c\", \"reasoning_content\": \"t3\"}\n"
              "True True False <s></s> False");
    // apply_chat_template's kwargs override the special tokens.
    const ChatTemplate tok = make("{{ bos_token }}|{{ tools|length }}");
    const Json tools = Json::array({Json::object()});
    EXPECT_EQ(apply(tok, Json::parse(R"([{"role": "user", "content": "x"}])"), &tools, true,
                    Json{{"bos_token", "<override>"}}),
              "<override>|1");
}

TEST(ChatTemplate, Errors) {
    auto bad = ChatTemplate::create("{% if %}", "", "");
    ASSERT_FALSE(bad);
    EXPECT_EQ(bad.error().message, "line 1:7: expected an expression, found '%}'");
    const ChatTemplate t = make("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
                                "{{ raise_exception('Unexpected role: ' + m.role) }}{% endif %}{% endfor %}");
    EXPECT_EQ(apply(t, Json::parse(R"([{"role": "robot", "content": "x"}])"), nullptr, true),
              "ERROR: line 1: Unexpected role: robot");
    EXPECT_EQ(apply(t, Json::array(), nullptr, true), "ERROR: messages: a chat template needs at least one message");
    EXPECT_EQ(apply(t, Json::array({1}), nullptr, true), "ERROR: messages: expected objects, found number");
}

TEST(ChatTemplate, CopiesApplyConcurrently) {
    const ChatTemplate original = make(tiny_template());
    const ChatTemplate copy = original;
    const Json messages = Json::parse(R"([{"role": "user", "content": "Hi"}])");
    const std::string want = apply(original, messages, nullptr, true);
    EXPECT_EQ(want, "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n");
    std::vector<std::thread> threads;
    std::vector<int> mismatches(4, 0);
    for (int k = 0; k < 4; ++k) {
        threads.emplace_back([&, k] {
            for (int rep = 0; rep < 100; ++rep) {
                mismatches[static_cast<size_t>(k)] += apply(k % 2 ? copy : original, messages, nullptr, true) != want;
            }
        });
    }
    for (auto &th : threads) th.join();
    EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

}  // namespace
}  // namespace memra::text
