// ChatTemplate: the conversation preprocessing of transformers' apply_chat_template (null-valued
// message keys dropped; reasoning aliased under reasoning_content and thinking) and the rendering
// context it builds, around a parsed jinja::Template.
#include "text/chat_template.h"

#include <fmt/format.h>

namespace memra::text {

using Json = nlohmann::ordered_json;

Result<ChatTemplate> ChatTemplate::create(std::string source, std::string bos_token, std::string eos_token) {
    auto tmpl = jinja::Template::parse(source);
    if (!tmpl) return tl::unexpected(tmpl.error());
    return ChatTemplate(std::move(*tmpl), std::move(bos_token), std::move(eos_token));
}

namespace {

// One message as transformers hands it to the template: keys with a null value dropped
// (_normalize_chat_messages), then, when the message carries reasoning under reasoning_content,
// thinking or reasoning (the first non-null in that order), {"thinking": r, **message,
// "reasoning_content": r} (_alias_reasoning_fields): thinking first unless the message has it,
// reasoning_content last unless the message has it.
Json template_message(const Json &message) {
    if (!message.is_object()) return message;
    Json kept = Json::object();
    for (const auto &[k, v] : message.items()) {
        if (!v.is_null()) kept[k] = v;
    }
    const Json *reasoning = nullptr;
    for (const char *key : {"reasoning_content", "thinking", "reasoning"}) {
        if (auto it = kept.find(key); it != kept.end()) {
            reasoning = &*it;
            break;
        }
    }
    if (!reasoning) return kept;
    Json out = Json::object();
    out["thinking"] = *reasoning;
    for (const auto &[k, v] : kept.items()) out[k] = v;
    out["reasoning_content"] = *reasoning;
    return out;
}

}  // namespace

Result<std::string> ChatTemplate::apply(const Json &messages, const Json *tools, bool add_generation_prompt,
                                        const Json &kwargs) const {
    if (!messages.is_array()) return make_error("messages: expected an array, found {}", messages.type_name());
    if (messages.empty()) return make_error("messages: a chat template needs at least one message");
    if (!kwargs.is_object() && !kwargs.is_null()) {
        return make_error("chat template kwargs: expected an object, found {}", kwargs.type_name());
    }
    Json context = Json::object();
    Json &msgs = context["messages"] = Json::array();
    for (const Json &m : messages) {
        if (!m.is_object()) return make_error("messages: expected objects, found {}", m.type_name());
        msgs.push_back(template_message(m));
    }
    context["tools"] = tools ? *tools : Json();
    context["documents"] = Json();
    context["add_generation_prompt"] = add_generation_prompt;
    context["bos_token"] = bos_token_;
    context["eos_token"] = eos_token_;
    if (kwargs.is_object()) {
        for (const auto &[k, v] : kwargs.items()) context[k] = v;
    }
    return template_.render(context);
}

}  // namespace memra::text
