// The OpenAI-compatible request and response formats (USERS.md section 2): request bodies of /v1/completions
// and /v1/chat/completions parsed into scheduler requests, with every refusal an OpenAI error envelope naming
// the field, what was expected and what was found; and the response bodies, whole or as server-sent-event
// chunks, built from what the scheduler produced. No I/O here: http_server.cpp moves the bytes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>
#include <tl/expected.hpp>

#include "serve/request.h"
#include "text/chat_output.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace memra::serve {

using Json = nlohmann::ordered_json;

// An error as the API returns it: the HTTP status and {"error": {"message", "type", "param", "code"}}.
struct ApiError {
    int status = 400;
    std::string type = "invalid_request_error";  // OpenAI's types: invalid_request_error, authentication_error, ...
    std::string message;
    std::string param;  // the request field at fault, empty: null
    std::string code;   // a stable string (context_length_exceeded, model_not_found, ...), empty: null
};
std::string error_body(const ApiError &error);
tl::unexpected<ApiError> bad_request(std::string message, std::string param = {}, std::string code = {});

// JSON text that never fails: bytes that are not UTF-8 (a token that is part of a character) become U+FFFD.
std::string dump_json(const Json &value);

enum class Endpoint { kCompletions, kChat };

// What the API layer knows of the served model.
struct ModelInfo {
    std::string name;                                     // the served model name (the "model" field)
    int64_t context = 0;                                  // positions one request may fill
    const text::Tokenizer *tokenizer = nullptr;
    const text::ChatTemplate *chat_template = nullptr;    // null: no template, chat completions are refused
    int64_t created = 0;                                  // unix time the server started (/v1/models)
};

// A parsed request: one scheduler request per prompt and choice, and how to present the results.
struct ParsedRequest {
    Endpoint endpoint = Endpoint::kCompletions;
    std::vector<std::vector<int32_t>> prompts;  // completions may carry several; chat has one
    GenerationRequest generation;               // every setting but the prompt and the choice
    int n = 1;                                  // choices per prompt
    bool stream = false;
    bool include_usage = false;                 // stream_options.include_usage
    bool logprobs = false;                      // return log-probabilities (top_logprobs alternatives)
    uint64_t seed = 0;                          // the request's seed, drawn when it gave none
    bool seed_drawn = false;
    // Chat: how the generated text is split (reasoning, content, tool calls).
    text::ChatOutputOptions output;
    text::ToolSchemas tools;  // the request's tools, which type the arguments of the calls parsed
    std::string prompt_text;  // chat: the rendered template (for /apply-template and logs)
};

// Parses a request body. `drawn_seed` is used when the request gives no seed.
tl::expected<ParsedRequest, ApiError> parse_request(Endpoint endpoint, std::string_view body, const ModelInfo &model,
                                                    uint64_t drawn_seed);

// Whether a rendered chat prompt ends inside an opened reasoning block ("<think>" and whitespace): the generated
// text then starts as reasoning (Step-3.5's generation prompt).
bool prompt_opens_reasoning(std::string_view prompt);

// Renders a chat request's messages (and tools) through the chat template: /apply-template and parse_request.
tl::expected<std::string, ApiError> render_chat(const Json &request, const ModelInfo &model);

// One choice's output as it accumulates: the text (split by the chat parser for chat), the tokens with their
// log-probabilities, and the finish.
class ChoiceOutput {
public:
    ChoiceOutput(const ParsedRequest &request, const ModelInfo &model, int index);
    // Takes a delta from the scheduler; returns what is new for a stream chunk (possibly nothing).
    Json add(const Delta &delta);
    // The finish as OpenAI names it: "stop", "length", "tool_calls" (a chat answer that called tools).
    std::string finish_reason() const;
    bool finished() const { return finish_ != Finish::kNone; }
    Finish finish() const { return finish_; }
    const std::string &error() const { return error_; }
    int64_t completion_tokens() const { return tokens_; }
    int index() const { return index_; }
    // The whole choice for a non-streaming response.
    Json whole() const;
    // A streaming chunk's choice entry for `delta` (from add), with its finish_reason when `last`.
    Json chunk_choice(const Json &delta, bool last) const;

private:
    Json logprob_entries(const std::vector<GeneratedToken> &tokens);

    Endpoint endpoint_;
    const text::Tokenizer *tokenizer_;
    int index_;
    bool logprobs_;
    std::optional<text::ChatOutputParser> parser_;  // chat only
    int64_t tokens_ = 0;
    Finish finish_ = Finish::kNone;
    std::string error_;
    // Accumulated for whole().
    std::string text_, reasoning_;
    Json tool_calls_ = Json::array();
    Json logprobs_all_ = Json::array();   // chat: content entries; completions: merged into the legacy object
    Json legacy_logprobs_;                // completions: tokens, token_logprobs, top_logprobs, text_offset
    int64_t text_offset_ = 0;
};

Json usage_json(int64_t prompt_tokens, int64_t completion_tokens);

}  // namespace memra::serve
