// A checkpoint's chat template applied to a conversation, as transformers' apply_chat_template(messages,
// tools=tools, add_generation_prompt=..., tokenize=False, **kwargs) renders it: messages lose their
// keys whose value is null, reasoning arrives under reasoning_content and thinking as well, and the
// template runs in the Jinja interpreter of jinja.h.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "core/result.h"
#include "text/jinja.h"

namespace memra::text {

class ChatTemplate {
public:
    // Parses the template once; bos_token / eos_token are the texts the template may print.
    static Result<ChatTemplate> create(std::string source, std::string bos_token, std::string eos_token);

    // transformers' apply_chat_template(messages, tools=tools, add_generation_prompt=..., tokenize=False,
    // **kwargs): the context holds messages (null-valued keys dropped, reasoning aliased as above), tools
    // (None when `tools` is null, as transformers passes it), documents (None), add_generation_prompt,
    // bos_token, eos_token, and every key of `kwargs` (an object, e.g. enable_thinking), which overrides
    // the others. `messages` must be a non-empty array of objects. Thread-safe.
    Result<std::string> apply(const nlohmann::ordered_json &messages, const nlohmann::ordered_json *tools,
                              bool add_generation_prompt, const nlohmann::ordered_json &kwargs) const;

private:
    ChatTemplate(jinja::Template tmpl, std::string bos_token, std::string eos_token)
        : template_(std::move(tmpl)), bos_token_(std::move(bos_token)), eos_token_(std::move(eos_token)) {}

    jinja::Template template_;  // immutable and shared by copies
    std::string bos_token_;
    std::string eos_token_;
};

}  // namespace memra::text
