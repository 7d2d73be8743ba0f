// libFuzzer target for serve/openai.cpp: the request bodies of /v1/completions and /v1/chat/completions. The
// first input byte picks the endpoint, the rest is the body. Parsing (JSON, every field's type and range, the
// chat template over the messages, tokenization) must end in a parsed request or an API error with a 400 or 404
// status, never a crash, a hang or an exception; an accepted request must hold only token ids of the vocabulary,
// prompts that leave room to generate and a logit bias the sampler accepts. The tokenizer and chat template are
// the embedded default model's (fuzz.sh runs from the repository root).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/sampling.h"
#include "serve/openai.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace {

struct Served {
    memra::text::Tokenizer tok;
    std::optional<memra::text::ChatTemplate> chat;
    memra::serve::ModelInfo info;
};

const Served &served() {
    static const Served *s = [] {
        auto tok = memra::text::Tokenizer::load("models/default");
        if (!tok) std::abort();  // run from the repository root
        auto *out = new Served{std::move(*tok), std::nullopt, {}};
        const auto text_of = [&](std::optional<int32_t> id) { return id ? out->tok.token_text(*id) : std::string(); };
        const auto eos = out->tok.eos_ids();
        auto chat = memra::text::ChatTemplate::create(out->tok.chat_template(), text_of(out->tok.bos_id()),
                                                      eos.empty() ? std::string() : out->tok.token_text(eos[0]));
        if (!chat) std::abort();
        out->chat.emplace(std::move(*chat));
        out->info.name = "default";
        out->info.context = 256;
        out->info.tokenizer = &out->tok;
        out->info.chat_template = &*out->chat;
        return out;
    }();
    return *s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const Served &s = served();
    const auto endpoint = data[0] % 2 == 0 ? memra::serve::Endpoint::kCompletions : memra::serve::Endpoint::kChat;
    const std::string_view body(reinterpret_cast<const char *>(data + 1), size - 1);
    auto parsed = memra::serve::parse_request(endpoint, body, s.info, 42);
    if (!parsed) {
        const int status = parsed.error().status;
        if ((status != 400 && status != 404) || parsed.error().message.empty()) std::abort();
        (void)memra::serve::error_body(parsed.error());
        return 0;
    }
    for (const auto &prompt : parsed->prompts) {
        if (prompt.empty() || static_cast<int64_t>(prompt.size()) >= s.info.context) std::abort();
        for (const int32_t id : prompt) {
            if (id < 0 || id >= s.tok.n_tokens()) std::abort();
        }
    }
    if (!memra::validate_logit_bias(parsed->generation.logit_bias, s.tok.n_tokens())) std::abort();
    return 0;
}
