// memra_chat_template_tool: renders a Jinja chat template for the Python oracle
// (tests/oracle/test_chat_template.py).
//   memra_chat_template_tool TEMPLATE CONTEXT.json
//       renders TEMPLATE with the JSON object CONTEXT.json as its variables (jinja::Template)
//   memra_chat_template_tool --apply TEMPLATE REQUEST.json
//       ChatTemplate::create(TEMPLATE, bos_token, eos_token).apply(messages, tools, add_generation_prompt,
//       kwargs) with those keys of the JSON object REQUEST.json (tools and kwargs may be absent)
// Prints the rendering on stdout; an error goes to stderr with exit code 1 (2 on usage errors).
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "text/chat_template.h"
#include "text/jinja.h"

namespace {

using Json = nlohmann::ordered_json;

bool read_file(const std::string &path, std::string &out) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        fmt::print(stderr, "memra_chat_template_tool: cannot open {}\n", path);
        return false;
    }
    std::ostringstream ss;
    ss << in.rdbuf();
    out = ss.str();
    return true;
}

int print_result(const memra::Result<std::string> &text) {
    if (!text) {
        fmt::print(stderr, "{}\n", text.error().message);
        return 1;
    }
    std::fwrite(text->data(), 1, text->size(), stdout);
    return 0;
}

}  // namespace

int main(int argc, char **argv) {
    const bool apply = argc == 4 && std::string(argv[1]) == "--apply";
    if (argc != 3 && !apply) {
        fmt::print(stderr, "usage: memra_chat_template_tool [--apply] TEMPLATE CONTEXT.json\n");
        return 2;
    }
    std::string source, context_text;
    if (!read_file(argv[apply ? 2 : 1], source) || !read_file(argv[apply ? 3 : 2], context_text)) return 2;
    const Json context = Json::parse(context_text, nullptr, false);
    if (context.is_discarded() || !context.is_object()) {
        fmt::print(stderr, "memra_chat_template_tool: the context is not a JSON object\n");
        return 2;
    }
    if (!apply) {
        auto tmpl = memra::text::jinja::Template::parse(source);
        if (!tmpl) return print_result(tl::unexpected(tmpl.error()));
        return print_result(tmpl->render(context));
    }
    const auto text = [&](const char *key) {
        const auto it = context.find(key);
        return it != context.end() && it->is_string() ? it->get<std::string>() : std::string();
    };
    auto chat = memra::text::ChatTemplate::create(source, text("bos_token"), text("eos_token"));
    if (!chat) return print_result(tl::unexpected(chat.error()));
    const auto tools = context.find("tools");
    const auto kwargs = context.find("kwargs");
    const auto messages = context.find("messages");
    const auto add_generation_prompt = context.find("add_generation_prompt");
    return print_result(chat->apply(messages != context.end() ? *messages : Json::array(),
                                    tools != context.end() && !tools->is_null() ? &*tools : nullptr,
                                    add_generation_prompt != context.end() && add_generation_prompt->is_boolean() &&
                                        add_generation_prompt->get<bool>(),
                                    kwargs != context.end() ? *kwargs : Json::object()));
}
