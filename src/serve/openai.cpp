#include "serve/openai.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <utility>

#include <fmt/format.h>

namespace memra::serve {
namespace {

const char *type_name(const Json &v) {
    switch (v.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return "a boolean";
    case Json::value_t::string: return "a string";
    case Json::value_t::array: return "an array";
    case Json::value_t::object: return "an object";
    case Json::value_t::number_float: return "a number";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return "an integer";
    default: return "an unknown value";
    }
}

tl::unexpected<ApiError> wrong_type(const std::string &field, const char *expected, const Json &found) {
    return bad_request(fmt::format("{}: expected {}, found {}", field, expected, type_name(found)), field);
}

// The request's fields, read with their types checked. A field that is absent or null reads as not given.
class Fields {
public:
    explicit Fields(const Json &body) : body_(body) {}

    const Json *get(const char *name) const {
        auto it = body_.find(name);
        return it == body_.end() || it->is_null() ? nullptr : &*it;
    }

    tl::expected<std::optional<bool>, ApiError> boolean(const char *name) const {
        const Json *v = get(name);
        if (!v) return std::nullopt;
        if (!v->is_boolean()) return wrong_type(name, "a boolean", *v);
        return v->get<bool>();
    }

    tl::expected<std::optional<double>, ApiError> number(const char *name, double lo, double hi) const {
        const Json *v = get(name);
        if (!v) return std::nullopt;
        if (!v->is_number()) return wrong_type(name, "a number", *v);
        const double x = v->get<double>();
        if (!(x >= lo && x <= hi)) {
            return bad_request(fmt::format("{}: expected a number in [{}, {}], found {}", name, lo, hi, x), name);
        }
        return x;
    }

    tl::expected<std::optional<int64_t>, ApiError> integer(const char *name, int64_t lo, int64_t hi) const {
        const Json *v = get(name);
        if (!v) return std::nullopt;
        if (!v->is_number_integer()) return wrong_type(name, "an integer", *v);
        if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(hi)) {
            return bad_request(fmt::format("{}: expected an integer in [{}, {}], found {}", name, lo, hi,
                                           v->get<uint64_t>()),
                               name);
        }
        const int64_t x = v->get<int64_t>();
        if (x < lo || x > hi) {
            return bad_request(fmt::format("{}: expected an integer in [{}, {}], found {}", name, lo, hi, x), name);
        }
        return x;
    }

private:
    const Json &body_;
};

#define MEMRA_TRY(var, expr)              \
    auto var = (expr);                    \
    if (!var) return tl::unexpected(var.error())

// Token ids of a completions prompt element: a string (tokenized with the tokenizer's specials) or ids.
tl::expected<std::vector<int32_t>, ApiError> prompt_ids(const Json &p, const ModelInfo &model, bool add_special) {
    if (p.is_string()) {
        auto ids = model.tokenizer->encode(p.get<std::string>(), text::EncodeOptions{add_special, true});
        if (!ids) return bad_request(fmt::format("prompt: {}", ids.error().message), "prompt");
        return std::move(*ids);
    }
    if (p.is_array()) {
        std::vector<int32_t> ids;
        for (const Json &t : p) {
            if (!t.is_number_integer()) return wrong_type("prompt", "a string or an array of token ids", t);
            const int64_t id = t.get<int64_t>();
            if (id < 0 || id >= model.tokenizer->n_tokens()) {
                return bad_request(fmt::format("prompt: token id {} is outside the vocabulary of {}", id,
                                               model.tokenizer->n_tokens()),
                                   "prompt");
            }
            ids.push_back(static_cast<int32_t>(id));
        }
        return ids;
    }
    return wrong_type("prompt", "a string, an array of strings or an array of token ids", p);
}

// OpenAI's logit_bias: an object mapping token ids (decimal strings, e.g. "50256") to numbers in [-100, 100],
// at most kMaxLogitBias entries; the list sorted by id. null or {} is none.
tl::expected<std::vector<LogitBias>, ApiError> parse_logit_bias(const Json &lb, int32_t vocab) {
    const std::string field = "logit_bias";
    if (!lb.is_object()) return wrong_type(field, "an object mapping token ids to numbers", lb);
    if (lb.size() > static_cast<size_t>(kMaxLogitBias)) {
        return bad_request(fmt::format("logit_bias: expected at most {} entries, found {}", kMaxLogitBias, lb.size()),
                           field);
    }
    std::vector<LogitBias> bias;
    for (auto it = lb.begin(); it != lb.end(); ++it) {
        const std::string &key = it.key();
        const size_t digits_at = !key.empty() && key[0] == '-' ? 1 : 0;
        const bool decimal = key.size() > digits_at &&
                             std::all_of(key.begin() + static_cast<std::ptrdiff_t>(digits_at), key.end(),
                                         [](char c) { return c >= '0' && c <= '9'; });
        if (!decimal) {
            return bad_request(fmt::format("logit_bias: key \"{}\" is not a decimal token id", key), field);
        }
        int64_t id = 0;
        const std::from_chars_result parsed = std::from_chars(key.data(), key.data() + key.size(), id);
        if (parsed.ec != std::errc() || id < 0 || id >= vocab) {
            return bad_request(fmt::format("logit_bias: token id {} is outside the vocabulary of {}", key, vocab),
                               field);
        }
        const Json &v = it.value();
        const std::string entry = fmt::format("logit_bias[\"{}\"]", key);
        if (!v.is_number()) {
            return bad_request(fmt::format("{}: expected a number in [-100, 100], found {}", entry, type_name(v)),
                               field);
        }
        const double x = v.get<double>();
        if (!(x >= -kMaxLogitBiasValue && x <= kMaxLogitBiasValue)) {
            return bad_request(fmt::format("{}: expected a number in [-100, 100], found {}", entry, x), field);
        }
        bias.push_back(LogitBias{static_cast<int32_t>(id), static_cast<float>(x)});
    }
    std::sort(bias.begin(), bias.end(), [](const LogitBias &a, const LogitBias &b) { return a.id < b.id; });
    for (size_t i = 1; i < bias.size(); ++i) {
        if (bias[i].id == bias[i - 1].id) {
            return bad_request(fmt::format("logit_bias: token id {} appears twice", bias[i].id), field);
        }
    }
    return bias;
}

// A message's content as text: a string, or an array of {"type": "text", "text": ...} parts joined by "\n"
// (images and audio are refused: the model reads text only).
tl::expected<Json, ApiError> content_text(const Json &content, size_t i) {
    const std::string field = fmt::format("messages[{}].content", i);
    if (content.is_null() || content.is_string()) return content;
    if (!content.is_array()) return wrong_type(field, "a string or an array of text parts", content);
    std::string text;
    for (size_t k = 0; k < content.size(); ++k) {
        const Json &part = content[k];
        const auto type = part.is_object() ? part.find("type") : part.end();
        if (!part.is_object() || type == part.end() || !type->is_string()) {
            return bad_request(fmt::format("{}[{}]: expected an object with a \"type\"", field, k), field);
        }
        if (type->get<std::string>() != "text") {
            return bad_request(fmt::format("{}[{}]: type \"{}\" is not supported: the model reads text only", field, k,
                                           type->get<std::string>()),
                               field);
        }
        const auto t = part.find("text");
        if (t == part.end() || !t->is_string()) return bad_request(fmt::format("{}[{}].text: expected a string", field, k), field);
        if (k > 0) text += '\n';
        text += t->get<std::string>();
    }
    return text;
}

// The messages as the template reads them: content parts joined, and tool-call arguments sent as JSON strings
// (OpenAI's format) turned into objects, which templates iterate.
tl::expected<Json, ApiError> template_messages(const Json &messages) {
    if (!messages.is_array() || messages.empty()) {
        return bad_request("messages: expected a non-empty array of messages", "messages");
    }
    Json out = Json::array();
    for (size_t i = 0; i < messages.size(); ++i) {
        const Json &m = messages[i];
        if (!m.is_object()) return wrong_type(fmt::format("messages[{}]", i), "an object", m);
        const auto role = m.find("role");
        if (role == m.end() || !role->is_string()) {
            return bad_request(fmt::format("messages[{}].role: expected a string", i), "messages");
        }
        Json msg = m;
        if (auto c = m.find("content"); c != m.end()) {
            MEMRA_TRY(text, content_text(*c, i));
            msg["content"] = std::move(*text);
        }
        if (auto calls = msg.find("tool_calls"); calls != msg.end() && calls->is_array()) {
            for (Json &call : *calls) {
                if (!call.is_object()) continue;
                auto fn = call.find("function");
                if (fn == call.end() || !fn->is_object()) continue;
                auto args = fn->find("arguments");
                if (args == fn->end() || !args->is_string()) continue;
                Json parsed = Json::parse(args->get<std::string>(), nullptr, false);
                if (parsed.is_discarded() || !parsed.is_object()) {
                    return bad_request(fmt::format("messages[{}].tool_calls: arguments are not a JSON object", i),
                                       "messages");
                }
                *args = std::move(parsed);
            }
        }
        out.push_back(std::move(msg));
    }
    return out;
}

}  // namespace

bool prompt_opens_reasoning(std::string_view prompt) {
    size_t end = prompt.size();
    while (end > 0 && (prompt[end - 1] == '\n' || prompt[end - 1] == ' ' || prompt[end - 1] == '\r')) --end;
    constexpr std::string_view kThink = "<think>";
    return end >= kThink.size() && prompt.substr(end - kThink.size(), kThink.size()) == kThink;
}

std::string dump_json(const Json &value) { return value.dump(-1, ' ', false, Json::error_handler_t::replace); }

std::string error_body(const ApiError &e) {
    Json err;
    err["message"] = e.message;
    err["type"] = e.type;
    err["param"] = e.param.empty() ? Json(nullptr) : Json(e.param);
    err["code"] = e.code.empty() ? Json(nullptr) : Json(e.code);
    Json body;
    body["error"] = std::move(err);
    return dump_json(body);
}

tl::unexpected<ApiError> bad_request(std::string message, std::string param, std::string code) {
    ApiError e;
    e.message = std::move(message);
    e.param = std::move(param);
    e.code = std::move(code);
    return tl::unexpected(std::move(e));
}

tl::expected<std::string, ApiError> render_chat(const Json &request, const ModelInfo &model) {
    if (!model.chat_template) {
        return bad_request("this model has no chat template (tokenizer_config.json chat_template); use "
                           "/v1/completions or start the server with --chat-template FILE",
                           "messages");
    }
    const auto messages = request.find("messages");
    if (messages == request.end()) return bad_request("messages: required", "messages");
    MEMRA_TRY(msgs, template_messages(*messages));
    Json tools;
    if (auto t = request.find("tools"); t != request.end() && !t->is_null()) {
        if (!t->is_array()) return wrong_type("tools", "an array", *t);
        tools = *t;
    }
    Json kwargs = Json::object();
    if (auto k = request.find("chat_template_kwargs"); k != request.end() && !k->is_null()) {
        if (!k->is_object()) return wrong_type("chat_template_kwargs", "an object", *k);
        kwargs = *k;
    }
    bool add_generation_prompt = true;
    if (auto a = request.find("add_generation_prompt"); a != request.end() && !a->is_null()) {
        if (!a->is_boolean()) return wrong_type("add_generation_prompt", "a boolean", *a);
        add_generation_prompt = a->get<bool>();
    }
    auto text = model.chat_template->apply(*msgs, tools.is_array() ? &tools : nullptr, add_generation_prompt, kwargs);
    if (!text) return bad_request(fmt::format("chat template: {}", text.error().message), "messages");
    return std::move(*text);
}

tl::expected<ParsedRequest, ApiError> parse_request(Endpoint endpoint, std::string_view body, const ModelInfo &model,
                                                    uint64_t drawn_seed) {
    Json req = Json::parse(body, nullptr, false);
    if (req.is_discarded()) return bad_request("the request body is not valid JSON");
    if (!req.is_object()) return bad_request(fmt::format("the request body: expected a JSON object, found {}", type_name(req)));
    const Fields f(req);
    ParsedRequest out;
    out.endpoint = endpoint;
    GenerationRequest &g = out.generation;

    if (const Json *m = f.get("model")) {
        if (!m->is_string()) return wrong_type("model", "a string", *m);
        if (m->get<std::string>() != model.name) {
            ApiError e;
            e.status = 404;
            e.type = "invalid_request_error";
            e.message = fmt::format("The model `{}` does not exist; this server serves `{}`", m->get<std::string>(),
                                    model.name);
            e.param = "model";
            e.code = "model_not_found";
            return tl::unexpected(std::move(e));
        }
    }
    MEMRA_TRY(stream, f.boolean("stream"));
    out.stream = stream->value_or(false);
    if (const Json *so = f.get("stream_options")) {
        if (!so->is_object()) return wrong_type("stream_options", "an object", *so);
        if (auto iu = so->find("include_usage"); iu != so->end() && !iu->is_null()) {
            if (!iu->is_boolean()) return wrong_type("stream_options.include_usage", "a boolean", *iu);
            out.include_usage = iu->get<bool>();
        }
    }
    MEMRA_TRY(n, f.integer("n", 1, 128));
    out.n = static_cast<int>(n->value_or(1));
    if (const Json *b = f.get("best_of"); b && !(b->is_number_integer() && b->get<int64_t>() == out.n)) {
        return bad_request("best_of: only best_of = n is supported (every choice is returned)", "best_of");
    }

    // Sampling: OpenAI's defaults (temperature 1, no top-k / top-p / min-p, no penalties).
    SamplingParams &s = g.sampling;
    s.temperature = 1.0f;
    s.top_k = 0;
    s.top_p = 1.0f;
    s.min_p = 0.0f;
    MEMRA_TRY(temperature, f.number("temperature", 0.0, 1e6));
    if (*temperature) s.temperature = static_cast<float>(**temperature);
    MEMRA_TRY(top_p, f.number("top_p", 0.0, 1.0));
    if (*top_p) {
        if (**top_p <= 0.0) return bad_request("top_p: expected a number in (0, 1], found 0", "top_p");
        s.top_p = static_cast<float>(**top_p);
    }
    MEMRA_TRY(top_k, f.integer("top_k", -1, std::numeric_limits<int32_t>::max()));
    if (*top_k) s.top_k = static_cast<int32_t>(std::max<int64_t>(0, **top_k));  // vLLM's -1 = off, as 0
    MEMRA_TRY(min_p, f.number("min_p", 0.0, 1.0));
    if (*min_p) s.min_p = static_cast<float>(**min_p);
    MEMRA_TRY(presence, f.number("presence_penalty", -2.0, 2.0));
    if (*presence) s.presence_penalty = static_cast<float>(**presence);
    MEMRA_TRY(frequency, f.number("frequency_penalty", -2.0, 2.0));
    if (*frequency) s.frequency_penalty = static_cast<float>(**frequency);
    MEMRA_TRY(repetition, f.number("repetition_penalty", 1e-6, 1e6));
    if (*repetition) s.repetition_penalty = static_cast<float>(**repetition);
    // Presence and frequency penalties count the generated tokens (OpenAI); the repetition penalty alone, the
    // prompt too (vLLM).
    g.penalize_generated = s.presence_penalty != 0.0f || s.frequency_penalty != 0.0f;
    s.penalty_last_n = g.penalize_generated ? 0 : -1;
    if (const Json *seed = f.get("seed")) {
        if (!seed->is_number_integer()) return wrong_type("seed", "an integer", *seed);
        // A negative seed (OpenAI's type is a signed 64-bit integer) keeps its two's-complement bits.
        s.seed = seed->is_number_unsigned() ? seed->get<uint64_t>() : static_cast<uint64_t>(seed->get<int64_t>());
    } else {
        s.seed = drawn_seed;
        out.seed_drawn = true;
    }
    out.seed = s.seed;
    if (const Json *lb = f.get("logit_bias")) {
        MEMRA_TRY(bias, parse_logit_bias(*lb, model.tokenizer->n_tokens()));
        g.logit_bias = std::move(*bias);
    }

    // Lengths and stops.
    MEMRA_TRY(max_tokens, f.integer("max_tokens", 1, std::numeric_limits<int64_t>::max()));
    MEMRA_TRY(max_completion, f.integer("max_completion_tokens", 1, std::numeric_limits<int64_t>::max()));
    g.max_tokens = max_completion->value_or(max_tokens->value_or(-1));
    if (const Json *stop = f.get("stop")) {
        if (stop->is_string()) {
            g.stop.push_back(stop->get<std::string>());
        } else if (stop->is_array()) {
            for (const Json &st : *stop) {
                if (!st.is_string()) return wrong_type("stop", "a string or an array of strings", st);
                g.stop.push_back(st.get<std::string>());
            }
        } else {
            return wrong_type("stop", "a string or an array of strings", *stop);
        }
        for (const std::string &st : g.stop) {
            if (st.empty()) return bad_request("stop: an empty stop string", "stop");
        }
    }
    if (const Json *ids = f.get("stop_token_ids")) {
        if (!ids->is_array()) return wrong_type("stop_token_ids", "an array of token ids", *ids);
        for (const Json &id : *ids) {
            if (!id.is_number_integer()) return wrong_type("stop_token_ids", "an array of token ids", id);
            const int64_t value = id.get<int64_t>();
            if (value < 0 || value >= model.tokenizer->n_tokens()) {
                return bad_request(fmt::format("stop_token_ids: token id {} is outside the vocabulary of {}", value,
                                               model.tokenizer->n_tokens()),
                                   "stop_token_ids");
            }
            g.stop_ids.push_back(static_cast<int32_t>(value));
        }
    }
    MEMRA_TRY(ignore_eos, f.boolean("ignore_eos"));
    g.ignore_eos = ignore_eos->value_or(false);
    // Chat keeps special tokens in the text by default: the output parser needs Step-3.5's <think> / </think> and
    // tool-call markup, which are special tokens, and removes them itself.
    MEMRA_TRY(skip_special, f.boolean("skip_special_tokens"));
    g.skip_special = skip_special->value_or(endpoint == Endpoint::kCompletions);

    // Log-probabilities: completions' "logprobs" is the alternatives count; chat's is a switch beside
    // "top_logprobs".
    if (endpoint == Endpoint::kCompletions) {
        MEMRA_TRY(lp, f.integer("logprobs", 0, kMaxTopLogprobs));
        out.logprobs = lp->has_value();
        g.top_logprobs = lp->has_value() ? static_cast<int32_t>(**lp) : -1;
    } else {
        MEMRA_TRY(lp, f.boolean("logprobs"));
        MEMRA_TRY(top, f.integer("top_logprobs", 0, kMaxTopLogprobs));
        out.logprobs = lp->value_or(false);
        if (top->has_value() && !out.logprobs) return bad_request("top_logprobs: needs logprobs: true", "top_logprobs");
        g.top_logprobs = out.logprobs ? static_cast<int32_t>(top->value_or(0)) : -1;
    }

    if (endpoint == Endpoint::kCompletions) {
        MEMRA_TRY(echo, f.boolean("echo"));
        if (echo->value_or(false)) return bad_request("echo: not supported", "echo");
        if (const Json *suffix = f.get("suffix"); suffix && !(suffix->is_string() && suffix->get<std::string>().empty())) {
            return bad_request("suffix: not supported", "suffix");
        }
        const Json *prompt = f.get("prompt");
        if (!prompt) return bad_request("prompt: required", "prompt");
        MEMRA_TRY(add_special, f.boolean("add_special_tokens"));
        const bool special = add_special->value_or(true);
        // A string, token ids, or a list of either (several prompts).
        const bool list = prompt->is_array() && !prompt->empty() && (prompt->front().is_string() || prompt->front().is_array());
        if (list) {
            for (const Json &p : *prompt) {
                MEMRA_TRY(ids, prompt_ids(p, model, special));
                out.prompts.push_back(std::move(*ids));
            }
        } else {
            MEMRA_TRY(ids, prompt_ids(*prompt, model, special));
            out.prompts.push_back(std::move(*ids));
        }
    } else {
        MEMRA_TRY(text, render_chat(req, model));
        out.prompt_text = std::move(*text);
        // The template writes the specials (BOS included) as text; encoding adds none (as transformers does).
        auto ids = model.tokenizer->encode(out.prompt_text, text::EncodeOptions{false, true});
        if (!ids) return bad_request(fmt::format("messages: {}", ids.error().message), "messages");
        out.prompts.push_back(std::move(*ids));
        // The output parser: reasoning when the template opened a <think> block for the answer, tool calls
        // unless tool_choice is "none".
        out.output.parse_reasoning = true;
        out.output.starts_in_reasoning = prompt_opens_reasoning(out.prompt_text);
        out.output.call_id_salt = fmt::format("{:016x}", s.seed);
        if (const Json *tools = f.get("tools")) {
            auto schemas = text::ToolSchemas::from_json(nlohmann::json::parse(tools->dump()));
            if (!schemas) return bad_request(fmt::format("tools: {}", schemas.error().message), "tools");
            out.tools = std::move(*schemas);
        }
        out.output.parse_tool_calls = true;
        if (const Json *choice = f.get("tool_choice")) {
            if (choice->is_string() && choice->get<std::string>() == "none") {
                out.output.parse_tool_calls = false;
            } else if (!(choice->is_string() && choice->get<std::string>() == "auto")) {
                return bad_request("tool_choice: only \"auto\" and \"none\" are supported", "tool_choice");
            }
        }
        if (const Json *rf = f.get("response_format")) {
            const auto type = rf->is_object() ? rf->find("type") : rf->end();
            if (!rf->is_object() || type == rf->end() || *type != "text") {
                return bad_request("response_format: only {\"type\": \"text\"} is supported", "response_format");
            }
        }
    }
    for (const std::vector<int32_t> &p : out.prompts) {
        if (p.empty()) return bad_request("prompt: no tokens to evaluate", "prompt");
        if (static_cast<int64_t>(p.size()) >= model.context) {
            return bad_request(fmt::format("This model's maximum context length is {} tokens; the prompt has {} tokens, "
                                           "leaving no room to generate",
                                           model.context, p.size()),
                               endpoint == Endpoint::kChat ? "messages" : "prompt", "context_length_exceeded");
        }
    }
    return out;
}

// ---- Responses ----

Json usage_json(int64_t prompt_tokens, int64_t completion_tokens) {
    Json u;
    u["prompt_tokens"] = prompt_tokens;
    u["completion_tokens"] = completion_tokens;
    u["total_tokens"] = prompt_tokens + completion_tokens;
    return u;
}

ChoiceOutput::ChoiceOutput(const ParsedRequest &request, const ModelInfo &model, int index)
    : endpoint_(request.endpoint), tokenizer_(model.tokenizer), index_(index), logprobs_(request.logprobs) {
    if (endpoint_ == Endpoint::kChat) parser_.emplace(request.output, request.tools);
    legacy_logprobs_["tokens"] = Json::array();
    legacy_logprobs_["token_logprobs"] = Json::array();
    legacy_logprobs_["top_logprobs"] = Json::array();
    legacy_logprobs_["text_offset"] = Json::array();
}

Json ChoiceOutput::logprob_entries(const std::vector<GeneratedToken> &tokens) {
    const auto bytes_of = [](const std::string &s) {
        Json b = Json::array();
        for (const char c : s) b.push_back(static_cast<unsigned char>(c));
        return b;
    };
    Json chat = Json::array();
    Json legacy = {{"tokens", Json::array()}, {"token_logprobs", Json::array()}, {"top_logprobs", Json::array()},
                   {"text_offset", Json::array()}};
    for (const GeneratedToken &t : tokens) {
        const std::string piece = tokenizer_->token_text(t.id);
        if (endpoint_ == Endpoint::kChat) {
            Json e;
            e["token"] = piece;
            e["logprob"] = t.logprobs.chosen;
            e["bytes"] = bytes_of(piece);
            Json top = Json::array();
            for (int k = 0; k < t.logprobs.n_top; ++k) {
                const std::string alt = tokenizer_->token_text(t.logprobs.top_ids[k]);
                top.push_back({{"token", alt}, {"logprob", t.logprobs.top_logprobs[k]}, {"bytes", bytes_of(alt)}});
            }
            e["top_logprobs"] = std::move(top);
            chat.push_back(std::move(e));
        } else {
            legacy["tokens"].push_back(piece);
            legacy["token_logprobs"].push_back(t.logprobs.chosen);
            Json top = Json::object();
            for (int k = 0; k < t.logprobs.n_top; ++k) {
                top[tokenizer_->token_text(t.logprobs.top_ids[k])] = t.logprobs.top_logprobs[k];
            }
            legacy["top_logprobs"].push_back(std::move(top));
            legacy["text_offset"].push_back(text_offset_);
            text_offset_ += static_cast<int64_t>(piece.size());
        }
    }
    if (endpoint_ == Endpoint::kChat) return Json{{"content", std::move(chat)}};
    return legacy;
}

Json ChoiceOutput::add(const Delta &delta) {
    tokens_ += static_cast<int64_t>(delta.tokens.size());
    Json d = Json::object();
    if (logprobs_ && !delta.tokens.empty()) {
        Json lp = logprob_entries(delta.tokens);
        if (endpoint_ == Endpoint::kChat) {
            for (Json &e : lp["content"]) logprobs_all_.push_back(e);
        } else {
            for (const char *key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"}) {
                for (Json &e : lp[key]) legacy_logprobs_[key].push_back(e);
            }
        }
        d["logprobs"] = std::move(lp);
    }
    if (delta.finish != Finish::kNone) {
        finish_ = delta.finish;
        error_ = delta.error;
    }
    if (endpoint_ == Endpoint::kCompletions) {
        text_ += delta.text;
        if (!delta.text.empty()) d["text"] = delta.text;
        return d;
    }
    text::ChatOutputDelta cd = parser_->feed(delta.text);
    if (delta.finish != Finish::kNone) cd.append(parser_->finish());
    if (!cd.reasoning.empty()) {
        reasoning_ += cd.reasoning;
        d["reasoning_content"] = cd.reasoning;
    }
    if (!cd.content.empty()) {
        text_ += cd.content;
        d["content"] = cd.content;
    }
    if (!cd.tool_calls.empty()) {
        Json calls = Json::array();
        for (const text::ToolCall &c : cd.tool_calls) {
            Json call;
            call["index"] = c.index;
            call["id"] = c.id;
            call["type"] = "function";
            call["function"] = {{"name", c.name}, {"arguments", c.arguments}};
            tool_calls_.push_back(call);
            calls.push_back(std::move(call));
        }
        d["tool_calls"] = std::move(calls);
    }
    return d;
}

std::string ChoiceOutput::finish_reason() const {
    if (finish_ == Finish::kStop && !tool_calls_.empty()) return "tool_calls";
    return finish_name(finish_);
}

Json ChoiceOutput::whole() const {
    Json c;
    c["index"] = index_;
    if (endpoint_ == Endpoint::kCompletions) {
        c["text"] = text_;
        c["logprobs"] = logprobs_ ? legacy_logprobs_ : Json(nullptr);
    } else {
        Json msg;
        msg["role"] = "assistant";
        msg["content"] = text_.empty() && !tool_calls_.empty() ? Json(nullptr) : Json(text_);
        if (!reasoning_.empty()) msg["reasoning_content"] = reasoning_;
        if (!tool_calls_.empty()) {
            Json calls = tool_calls_;
            for (Json &call : calls) call.erase("index");
            msg["tool_calls"] = std::move(calls);
        }
        c["message"] = std::move(msg);
        c["logprobs"] = logprobs_ ? Json{{"content", logprobs_all_}} : Json(nullptr);
    }
    c["finish_reason"] = finish_reason();
    return c;
}

Json ChoiceOutput::chunk_choice(const Json &delta, bool last) const {
    Json c;
    c["index"] = index_;
    if (endpoint_ == Endpoint::kCompletions) {
        c["text"] = delta.contains("text") ? delta["text"] : Json("");
        c["logprobs"] = delta.contains("logprobs") ? delta["logprobs"] : Json(nullptr);
    } else {
        Json d = Json::object();
        for (const char *key : {"reasoning_content", "content", "tool_calls"}) {
            if (delta.contains(key)) d[key] = delta[key];
        }
        c["delta"] = std::move(d);
        c["logprobs"] = delta.contains("logprobs") ? delta["logprobs"] : Json(nullptr);
    }
    c["finish_reason"] = last ? Json(finish_reason()) : Json(nullptr);
    return c;
}

}  // namespace memra::serve
