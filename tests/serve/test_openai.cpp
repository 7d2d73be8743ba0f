// serve/openai.h: request bodies parsed into scheduler requests (OpenAI's defaults, every field's type and range,
// each refusal's status, field and message), chat messages rendered through the default model's template, and
// responses built from scheduler deltas (reasoning / content / tool calls split, log-probabilities in both
// formats, finish reasons).
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <gtest/gtest.h>

#include "core/sampling.h"
#include "serve/openai.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace memra::serve {
namespace {

namespace fs = std::filesystem;

struct Served {
    std::unique_ptr<text::Tokenizer> tok;
    std::optional<text::ChatTemplate> chat;
    ModelInfo info;
};

const Served &served() {
    static const Served *s = [] {
        auto *out = new Served;
        const fs::path dir = fs::path(MEMRA_SOURCE_DIR) / "models" / "default";
        auto tok = text::Tokenizer::load(dir);
        EXPECT_TRUE(tok.has_value());
        out->tok = std::make_unique<text::Tokenizer>(std::move(*tok));
        auto chat = text::ChatTemplate::create(out->tok->chat_template(), out->tok->token_text(*out->tok->bos_id()),
                                               out->tok->token_text(out->tok->eos_ids()[0]));
        EXPECT_TRUE(chat.has_value()) << chat.error().message;
        out->chat.emplace(std::move(*chat));
        out->info.name = "default";
        out->info.context = 64;
        out->info.tokenizer = out->tok.get();
        out->info.chat_template = &*out->chat;
        return out;
    }();
    return *s;
}

tl::expected<ParsedRequest, ApiError> completion(const Json &body) {
    return parse_request(Endpoint::kCompletions, body.dump(), served().info, 1234);
}
tl::expected<ParsedRequest, ApiError> chat(const Json &body) {
    return parse_request(Endpoint::kChat, body.dump(), served().info, 1234);
}

void expect_refused(const tl::expected<ParsedRequest, ApiError> &r, int status, const std::string &message,
                    const std::string &param = {}, const std::string &code = {}) {
    ASSERT_FALSE(r.has_value());
    EXPECT_EQ(r.error().status, status);
    EXPECT_EQ(r.error().message, message);
    EXPECT_EQ(r.error().param, param);
    EXPECT_EQ(r.error().code, code);
}

TEST(OpenAiRequest, CompletionDefaultsAreOpenAis) {
    auto r = completion({{"prompt", "A list"}});
    ASSERT_TRUE(r.has_value()) << r.error().message;
    const GenerationRequest &g = r->generation;
    EXPECT_EQ(g.sampling.temperature, 1.0f);
    EXPECT_EQ(g.sampling.top_k, 0);
    EXPECT_EQ(g.sampling.top_p, 1.0f);
    EXPECT_EQ(g.sampling.min_p, 0.0f);
    EXPECT_EQ(g.sampling.seed, 1234u);  // drawn: no seed given
    EXPECT_TRUE(r->seed_drawn);
    EXPECT_EQ(g.max_tokens, -1);
    EXPECT_EQ(g.top_logprobs, -1);
    EXPECT_FALSE(r->stream);
    EXPECT_EQ(r->n, 1);
    ASSERT_EQ(r->prompts.size(), 1u);
    EXPECT_EQ(r->prompts[0].front(), *served().tok->bos_id());  // add_special_tokens: BOS first
}

TEST(OpenAiRequest, CompletionFieldsAreRead) {
    auto r = completion({{"model", "default"}, {"prompt", {{0, 5, 6}, {0, 7}}}, {"max_tokens", 9},
                         {"max_completion_tokens", 4}, {"seed", -1}, {"temperature", 0.5}, {"top_k", -1},
                         {"top_p", 0.9}, {"min_p", 0.1}, {"stop", "\n"}, {"n", 3}, {"logprobs", 2},
                         {"presence_penalty", 0.5}, {"stream", true},
                         {"stream_options", {{"include_usage", true}}}, {"ignore_eos", true},
                         {"stop_token_ids", {1, 2}}, {"skip_special_tokens", false}});
    ASSERT_TRUE(r.has_value()) << r.error().message;
    const GenerationRequest &g = r->generation;
    EXPECT_EQ(r->prompts, (std::vector<std::vector<int32_t>>{{0, 5, 6}, {0, 7}}));
    EXPECT_EQ(g.max_tokens, 4);  // max_completion_tokens wins
    EXPECT_EQ(g.sampling.seed, UINT64_MAX);
    EXPECT_FALSE(r->seed_drawn);
    EXPECT_EQ(g.sampling.temperature, 0.5f);
    EXPECT_EQ(g.sampling.top_k, 0);  // vLLM's -1: off
    EXPECT_EQ(g.stop, std::vector<std::string>{"\n"});
    EXPECT_EQ(r->n, 3);
    EXPECT_EQ(g.top_logprobs, 2);
    EXPECT_TRUE(r->logprobs);
    EXPECT_TRUE(g.penalize_generated);  // presence / frequency count the generated tokens
    EXPECT_EQ(g.sampling.penalty_last_n, 0);
    EXPECT_TRUE(r->stream && r->include_usage && g.ignore_eos && !g.skip_special);
    EXPECT_EQ(g.stop_ids, (std::vector<int32_t>{1, 2}));
    // The repetition penalty alone reads the whole context.
    auto rep = completion({{"prompt", "x"}, {"repetition_penalty", 1.2}});
    ASSERT_TRUE(rep.has_value());
    EXPECT_FALSE(rep->generation.penalize_generated);
    EXPECT_EQ(rep->generation.sampling.penalty_last_n, -1);
}

TEST(OpenAiRequest, LogitBiasIsReadSortedById) {
    auto r = completion({{"prompt", "x"}, {"logit_bias", {{"50", -100}, {"7", 2.5}, {"1023", 100}, {"0", 0}}}});
    ASSERT_TRUE(r.has_value()) << r.error().message;
    const std::vector<LogitBias> &b = r->generation.logit_bias;
    ASSERT_EQ(b.size(), 4u);
    const std::vector<std::pair<int32_t, float>> want = {{0, 0.0f}, {7, 2.5f}, {50, -100.0f}, {1023, 100.0f}};
    for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_EQ(b[i].id, want[i].first) << i;
        EXPECT_EQ(b[i].value, want[i].second) << i;
    }
    EXPECT_TRUE(validate_logit_bias(b, 1024).has_value());
    // Chat too; null and {} are none; the full 1024 entries are accepted.
    auto c = chat({{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"logit_bias", {{"3", -1}}}});
    ASSERT_TRUE(c.has_value()) << c.error().message;
    ASSERT_EQ(c->generation.logit_bias.size(), 1u);
    EXPECT_EQ(c->generation.logit_bias[0].id, 3);
    for (const Json &none : {Json(nullptr), Json::object()}) {
        auto n = completion({{"prompt", "x"}, {"logit_bias", none}});
        ASSERT_TRUE(n.has_value()) << n.error().message;
        EXPECT_TRUE(n->generation.logit_bias.empty());
    }
    Json full = Json::object();
    for (int i = 0; i < kMaxLogitBias; ++i) full[std::to_string(i)] = i % 2 == 0 ? 1 : -1;
    auto f = completion({{"prompt", "x"}, {"logit_bias", full}});
    ASSERT_TRUE(f.has_value()) << f.error().message;
    EXPECT_EQ(f->generation.logit_bias.size(), static_cast<size_t>(kMaxLogitBias));
    EXPECT_TRUE(validate_logit_bias(f->generation.logit_bias, 1024).has_value());
}

TEST(OpenAiRequest, RefusalsNameTheFieldTheExpectationAndTheValue) {
    expect_refused(completion({{"prompt", "x"}, {"temperature", "hot"}}), 400,
                   "temperature: expected a number, found a string", "temperature");
    expect_refused(completion({{"prompt", "x"}, {"top_p", 1.5}}), 400, "top_p: expected a number in [0, 1], found 1.5",
                   "top_p");
    expect_refused(completion({{"prompt", "x"}, {"top_p", 0}}), 400, "top_p: expected a number in (0, 1], found 0",
                   "top_p");
    expect_refused(completion({{"prompt", "x"}, {"n", 0}}), 400, "n: expected an integer in [1, 128], found 0", "n");
    expect_refused(completion({{"prompt", "x"}, {"max_tokens", 0}}), 400,
                   "max_tokens: expected an integer in [1, 9223372036854775807], found 0", "max_tokens");
    expect_refused(completion({{"prompt", "x"}, {"logprobs", 21}}), 400,
                   "logprobs: expected an integer in [0, 20], found 21", "logprobs");
    expect_refused(completion({{"prompt", "x"}, {"stop", {"a", 3}}}), 400,
                   "stop: expected a string or an array of strings, found an integer", "stop");
    expect_refused(completion({{"prompt", "x"}, {"stop", ""}}), 400, "stop: an empty stop string", "stop");
    expect_refused(completion({{"prompt", "x"}, {"logit_bias", {{"5", 10}, {"1024", 1}}}}), 400,
                   "logit_bias: token id 1024 is outside the vocabulary of 1024", "logit_bias");
    expect_refused(completion({{"prompt", "x"}, {"logit_bias", {{"-3", 1}}}}), 400,
                   "logit_bias: token id -3 is outside the vocabulary of 1024", "logit_bias");
    expect_refused(completion({{"prompt", "x"}, {"logit_bias", {{"99999999999999999999999", 1}}}}), 400,
                   "logit_bias: token id 99999999999999999999999 is outside the vocabulary of 1024", "logit_bias");
    for (const char *key : {"abc", "", "5.0", " 5", "0x10", "-"}) {
        expect_refused(chat({{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"logit_bias", {{key, 1}}}}), 400,
                       fmt::format("logit_bias: key \"{}\" is not a decimal token id", key), "logit_bias");
    }
    expect_refused(completion({{"prompt", "x"}, {"logit_bias", {{"5", "up"}}}}), 400,
                   "logit_bias[\"5\"]: expected a number in [-100, 100], found a string", "logit_bias");
    expect_refused(completion({{"prompt", "x"}, {"logit_bias", {{"5", 100.5}}}}), 400,
                   "logit_bias[\"5\"]: expected a number in [-100, 100], found 100.5", "logit_bias");
    expect_refused(completion({{"prompt", "x"}, {"logit_bias", {{"5", -101}}}}), 400,
                   "logit_bias[\"5\"]: expected a number in [-100, 100], found -101", "logit_bias");
    expect_refused(completion({{"prompt", "x"}, {"logit_bias", {{"7", 1}, {"007", 2}}}}), 400,
                   "logit_bias: token id 7 appears twice", "logit_bias");
    expect_refused(completion({{"prompt", "x"}, {"logit_bias", {5, 10}}}), 400,
                   "logit_bias: expected an object mapping token ids to numbers, found an array", "logit_bias");
    Json too_many = Json::object();
    for (int i = 0; i <= kMaxLogitBias; ++i) too_many[std::to_string(i % 1024) + (i >= 1024 ? "0" : "")] = 1;
    ASSERT_EQ(too_many.size(), 1025u);
    expect_refused(completion({{"prompt", "x"}, {"logit_bias", too_many}}), 400,
                   "logit_bias: expected at most 1024 entries, found 1025", "logit_bias");
    expect_refused(completion({{"prompt", "x"}, {"echo", true}}), 400, "echo: not supported", "echo");
    expect_refused(completion({{"prompt", "x"}, {"best_of", 2}}), 400,
                   "best_of: only best_of = n is supported (every choice is returned)", "best_of");
    expect_refused(completion({{"prompt", {0, 999999}}}), 400, "prompt: token id 999999 is outside the vocabulary of 1024",
                   "prompt");
    expect_refused(completion({{"prompt", "x"}, {"stop_token_ids", {2, 1024}}}), 400,
                   "stop_token_ids: token id 1024 is outside the vocabulary of 1024", "stop_token_ids");
    expect_refused(completion({{"prompt", "x"}, {"stop_token_ids", {int64_t{1} << 40}}}), 400,
                   "stop_token_ids: token id 1099511627776 is outside the vocabulary of 1024", "stop_token_ids");
    expect_refused(completion(Json::object()), 400, "prompt: required", "prompt");
    expect_refused(completion({{"prompt", "x"}, {"model", "gpt-4"}}), 404,
                   "The model `gpt-4` does not exist; this server serves `default`", "model", "model_not_found");
    std::string words;
    for (int i = 0; i < 80; ++i) words += " word";
    auto long_prompt = completion({{"prompt", words}});
    ASSERT_FALSE(long_prompt.has_value());
    EXPECT_EQ(long_prompt.error().code, "context_length_exceeded");
    EXPECT_NE(long_prompt.error().message.find("maximum context length is 64 tokens"), std::string::npos);
    auto not_json = parse_request(Endpoint::kCompletions, "{nope", served().info, 1);
    ASSERT_FALSE(not_json.has_value());
    EXPECT_EQ(not_json.error().message, "the request body is not valid JSON");
    auto array = parse_request(Endpoint::kCompletions, "[1]", served().info, 1);
    ASSERT_FALSE(array.has_value());
    EXPECT_EQ(array.error().message, "the request body: expected a JSON object, found an array");
}

TEST(OpenAiRequest, ErrorBodiesUseTheOpenAiEnvelope) {
    auto r = completion({{"prompt", "x"}, {"top_k", "many"}});
    ASSERT_FALSE(r.has_value());
    EXPECT_EQ(error_body(r.error()),
              R"({"error":{"message":"top_k: expected an integer, found a string","type":"invalid_request_error",)"
              R"("param":"top_k","code":null}})");
}

TEST(OpenAiChat, MessagesAreRenderedThroughTheTemplate) {
    const Json messages = {{{"role", "system"}, {"content", "Be brief."}},
                           {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "Hi"}},
                                                           {{"type", "text"}, {"text", "there"}}}}}};
    auto r = chat({{"messages", messages}, {"max_tokens", 5}});
    ASSERT_TRUE(r.has_value()) << r.error().message;
    EXPECT_EQ(r->prompt_text,
              served().tok->token_text(*served().tok->bos_id()) +
                  "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>\n"
                  "<|im_start|>assistant\n<think>\n");
    EXPECT_TRUE(r->output.starts_in_reasoning);
    EXPECT_TRUE(r->output.parse_tool_calls);
    auto ids = served().tok->encode(r->prompt_text, text::EncodeOptions{false, true});
    EXPECT_EQ(r->prompts[0], *ids);  // the template wrote BOS; encoding adds none
    // Tool-call arguments arrive as JSON strings and reach the template as objects.
    const Json with_call = {{{"role", "user"}, {"content", "Weather?"}},
                            {{"role", "assistant"},
                             {"content", ""},
                             {"tool_calls", {{{"id", "c"}, {"type", "function"},
                                              {"function", {{"name", "get"}, {"arguments", R"({"city": "Paris"})"}}}}}}}};
    auto rendered = render_chat({{"messages", with_call}, {"add_generation_prompt", false}}, served().info);
    ASSERT_TRUE(rendered.has_value()) << rendered.error().message;
    EXPECT_NE(rendered->find("<function=get>\n<parameter=city>\nParis\n</parameter>"), std::string::npos) << *rendered;
}

TEST(OpenAiChat, Refusals) {
    expect_refused(chat({{"messages", Json::array()}}), 400, "messages: expected a non-empty array of messages",
                   "messages");
    expect_refused(chat({{"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}}}}}}}}), 400,
                   "messages[0].content[0]: type \"image_url\" is not supported: the model reads text only",
                   "messages[0].content");
    expect_refused(chat({{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"tool_choice", "required"}}), 400,
                   "tool_choice: only \"auto\" and \"none\" are supported", "tool_choice");
    expect_refused(chat({{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"top_logprobs", 2}}), 400,
                   "top_logprobs: needs logprobs: true", "top_logprobs");
    auto none = chat({{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"tool_choice", "none"}});
    ASSERT_TRUE(none.has_value());
    EXPECT_FALSE(none->output.parse_tool_calls);
}

TEST(OpenAiChat, PromptOpensReasoning) {
    EXPECT_TRUE(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
    EXPECT_TRUE(prompt_opens_reasoning("<think>"));
    EXPECT_FALSE(prompt_opens_reasoning("<|im_start|>assistant\n"));
    EXPECT_FALSE(prompt_opens_reasoning("<think>x"));
    EXPECT_FALSE(prompt_opens_reasoning(""));
}

GeneratedToken token(int32_t id, float logprob) {
    GeneratedToken t;
    t.id = id;
    t.logprobs.chosen = logprob;
    t.logprobs.n_top = 1;
    t.logprobs.top_ids[0] = id;
    t.logprobs.top_logprobs[0] = logprob;
    return t;
}

TEST(OpenAiResponse, ChatSplitsReasoningContentAndToolCalls) {
    auto r = chat({{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"logprobs", true}, {"top_logprobs", 1}});
    ASSERT_TRUE(r.has_value());
    ChoiceOutput out(*r, served().info, 0);
    Delta d1;
    d1.tokens = {token(300, -0.5f)};
    d1.text = "I think\n</think>\nSure.\n<tool_call>\n<function=get>\n<parameter=city>\nParis\n</parameter>\n";
    const Json j1 = out.add(d1);
    EXPECT_EQ(j1["reasoning_content"], "I think");
    EXPECT_EQ(j1["content"], "Sure.\n");
    EXPECT_FALSE(j1.contains("tool_calls"));  // the call is not complete yet
    EXPECT_EQ(j1["logprobs"]["content"][0]["logprob"], -0.5f);
    Delta d2;
    d2.text = "</function>\n</tool_call>";
    d2.finish = Finish::kStop;
    const Json j2 = out.add(d2);
    ASSERT_TRUE(j2.contains("tool_calls"));
    EXPECT_EQ(j2["tool_calls"][0]["function"]["name"], "get");
    EXPECT_EQ(j2["tool_calls"][0]["function"]["arguments"], R"({"city":"Paris"})");
    EXPECT_EQ(out.finish_reason(), "tool_calls");
    const Json whole = out.whole();
    EXPECT_EQ(whole["message"]["content"], "Sure.\n");
    EXPECT_EQ(whole["message"]["reasoning_content"], "I think");
    EXPECT_FALSE(whole["message"]["tool_calls"][0].contains("index"));
    EXPECT_EQ(whole["finish_reason"], "tool_calls");
    EXPECT_EQ(out.completion_tokens(), 1);
    const Json last = out.chunk_choice(Json::object(), true);
    EXPECT_EQ(last["delta"], Json::object());
    EXPECT_EQ(last["finish_reason"], "tool_calls");
}

TEST(OpenAiResponse, CompletionLogprobsUseTheLegacyFormat) {
    auto r = completion({{"prompt", "x"}, {"logprobs", 1}});
    ASSERT_TRUE(r.has_value());
    ChoiceOutput out(*r, served().info, 2);
    const int32_t a = served().tok->token_id("a").value();
    Delta d;
    d.tokens = {token(a, -1.0f), token(a, -2.0f)};
    d.text = "aa";
    d.finish = Finish::kLength;
    const Json j = out.add(d);
    EXPECT_EQ(j["text"], "aa");
    EXPECT_EQ(j["logprobs"]["tokens"], Json({"a", "a"}));
    EXPECT_EQ(j["logprobs"]["text_offset"], Json({0, 1}));
    EXPECT_EQ(j["logprobs"]["top_logprobs"][1]["a"], -2.0f);
    const Json whole = out.whole();
    EXPECT_EQ(whole["index"], 2);
    EXPECT_EQ(whole["text"], "aa");
    EXPECT_EQ(whole["finish_reason"], "length");
    EXPECT_EQ(whole["logprobs"]["token_logprobs"], Json({-1.0f, -2.0f}));
    EXPECT_EQ(usage_json(5, 2), Json({{"prompt_tokens", 5}, {"completion_tokens", 2}, {"total_tokens", 7}}));
}

}  // namespace
}  // namespace memra::serve
