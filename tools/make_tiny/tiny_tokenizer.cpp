// Builds the tiny tokenizer (ids, merges) and renders tokenizer.json and tokenizer_config.json.
// JSON is emitted through nlohmann::ordered_json, so the key order is the one written here and
// the bytes are identical on every run.
#include "make_tiny/tiny_tokenizer.h"

#include <iterator>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "make_tiny/tiny_corpus.h"

namespace memra::tools {

namespace {

using OrderedJson = nlohmann::ordered_json;

// The chat specials that follow the learned tokens, in id order.
constexpr const char *kChatSpecials[] = {"<|im_start|>", "<|im_end|>",   "<think>",          "</think>",
                                         "<tool_call>",  "</tool_call>", "<tool_response>", "</tool_response>"};
static_assert(kTokenizerFixedTokens == 2 + 256 + std::size(kChatSpecials));

// Runtime pre-tokenizer (DeepSeek-V3 style, written for memra). Applied in order, each isolating its
// matches: digit runs of at most 3; runs of CJK ideographs, hiragana and katakana; then the main
// GPT-4-like pattern: an ASCII punctuation char glued to a following ASCII word, letters/marks with
// at most one leading non-letter, punctuation/symbol runs with their line breaks, line breaks with
// leading whitespace, whitespace not followed by a non-space (so " word" keeps its space), and any
// remaining whitespace.
constexpr char kDigitsPattern[] = "\\p{N}{1,3}";
constexpr char kCjkPattern[] = "[\xE4\xB8\x80-\xE9\xBE\xA5\xE3\x81\x80-\xE3\x82\x9F\xE3\x82\xA0-\xE3\x83\xBF]+";
constexpr char kMainPattern[] =
    "[!-/:-@\\[-`{-~][A-Za-z]+"
    "|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+"
    "|\\s+(?!\\S)"
    "|\\s+";

constexpr char kChatTemplate[] =
    R"jinja({#- memra tiny chat template: ChatML turns, reasoning in <think>, XML tool calls. -#}
{{- bos_token }}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call the functions below. Their signatures:\n<tools>\n' }}
    {%- for tool in tools %}
        {{- tool | tojson }}
        {{- '\n' }}
    {%- endfor %}
    {{- '</tools>\n\nTo call a function, answer with:\n' }}
    {{- '<tool_call>\n<function=NAME>\n<parameter=ARGUMENT>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- '<|im_start|>system\n' + message.content + '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_user and message.reasoning_content is defined and message.reasoning_content %}
            {{- '<think>\n' + message.reasoning_content + '\n</think>\n' }}
        {%- endif %}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- if message.tool_calls is defined and message.tool_calls %}
            {%- for call in message.tool_calls %}
                {%- set fn = call.function if call.function is defined else call %}
                {%- if message.content or not loop.first %}
                    {{- '\n' }}
                {%- endif %}
                {{- '<tool_call>\n<function=' + fn.name + '>\n' }}
                {%- if fn.arguments is mapping %}
                    {%- for arg_name, arg_value in fn.arguments.items() %}
                        {{- '<parameter=' + arg_name + '>\n' }}
                        {{- arg_value if arg_value is string else arg_value | tojson }}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>tool_response\n' }}
        {%- endif %}
        {{- '<tool_response>' + message.content + '</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- else %}
            {{- '\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n<think>\n' }}
{%- endif %})jinja";

OrderedJson split_step(const char *pattern) {
    OrderedJson step;
    step["type"] = "Split";
    step["pattern"] = OrderedJson{{"Regex", pattern}};
    step["behavior"] = "Isolated";
    step["invert"] = false;
    return step;
}

OrderedJson added_token_entry(const TinyTokenizer &tok, int64_t id) {
    OrderedJson t;
    t["id"] = id;
    t["content"] = tok.tokens[id];
    t["single_word"] = false;
    t["lstrip"] = false;
    t["rstrip"] = false;
    t["normalized"] = false;
    t["special"] = true;
    return t;
}

OrderedJson bos_template_piece(const char *kind, const char *id, int type_id) {
    return OrderedJson{{kind, OrderedJson{{"id", id}, {"type_id", type_id}}}};
}

}  // namespace

TinyTokenizer build_tokenizer(std::string_view corpus, size_t max_merges) {
    TinyTokenizer tok;
    tok.tokens = {kBosToken, kEosToken};
    tok.special = {true, true};
    for (int b = 0; b < 256; ++b) {
        tok.tokens.push_back(byte_level_char(static_cast<uint8_t>(b)));
        tok.special.push_back(false);
    }
    BpeTrainOptions options;
    options.max_merges = max_merges;
    options.min_count = 2;
    options.reserved = {kBosToken, kEosToken};
    for (const char *s : kChatSpecials) {
        options.reserved.emplace_back(s);
    }
    std::vector<BpeMerge> raw = train_bpe(bpe_training_split(corpus), options);
    for (const BpeMerge &m : raw) {
        tok.merges.push_back({byte_level_encode(m.left), byte_level_encode(m.right)});
        tok.tokens.push_back(byte_level_encode(m.left + m.right));
        tok.special.push_back(false);
    }
    for (const char *s : kChatSpecials) {
        if (std::string_view(s) == kImEndToken) {
            tok.im_end_id = tok.n_tokens();
        }
        tok.tokens.emplace_back(s);
        tok.special.push_back(true);
    }
    MEMRA_CHECK(tok.im_end_id > 1, "tokenizer: <|im_end|> id not assigned");
    return tok;
}

TinyTokenizer build_tiny_tokenizer() {
    return build_tokenizer(tiny_training_corpus(), kTinyMaxMerges);
}

std::string tiny_chat_template() {
    return kChatTemplate;
}

std::string tiny_tokenizer_json(const TinyTokenizer &tok) {
    OrderedJson root;
    root["version"] = "1.0";
    root["truncation"] = nullptr;
    root["padding"] = nullptr;
    OrderedJson added = OrderedJson::array();
    for (int64_t id = 0; id < tok.n_tokens(); ++id) {
        if (tok.special[id]) {
            added.push_back(added_token_entry(tok, id));
        }
    }
    root["added_tokens"] = added;
    root["normalizer"] = nullptr;

    OrderedJson byte_level;
    byte_level["type"] = "ByteLevel";
    byte_level["add_prefix_space"] = false;
    byte_level["trim_offsets"] = true;
    byte_level["use_regex"] = false;
    OrderedJson pre;
    pre["type"] = "Sequence";
    pre["pretokenizers"] = OrderedJson::array(
        {split_step(kDigitsPattern), split_step(kCjkPattern), split_step(kMainPattern), byte_level});
    root["pre_tokenizer"] = pre;

    // add_bos_token is true: BOS (id 0) is prepended to every sequence, nothing appended.
    OrderedJson post;
    post["type"] = "TemplateProcessing";
    post["single"] = OrderedJson::array({bos_template_piece("SpecialToken", kBosToken, 0),
                                         bos_template_piece("Sequence", "A", 0)});
    post["pair"] = OrderedJson::array(
        {bos_template_piece("SpecialToken", kBosToken, 0), bos_template_piece("Sequence", "A", 0),
         bos_template_piece("SpecialToken", kBosToken, 1), bos_template_piece("Sequence", "B", 1)});
    OrderedJson bos_entry;
    bos_entry["id"] = kBosToken;
    bos_entry["ids"] = OrderedJson::array({tok.bos_id});
    bos_entry["tokens"] = OrderedJson::array({kBosToken});
    post["special_tokens"] = OrderedJson{{kBosToken, bos_entry}};
    root["post_processor"] = post;
    root["decoder"] = byte_level;

    OrderedJson model;
    model["type"] = "BPE";
    model["dropout"] = nullptr;
    model["unk_token"] = nullptr;
    model["continuing_subword_prefix"] = nullptr;
    model["end_of_word_suffix"] = nullptr;
    model["fuse_unk"] = false;
    model["byte_fallback"] = false;
    model["ignore_merges"] = false;
    // Every token, specials included, is in the model vocab so its id is fixed by the vocab and
    // not re-assigned when the added tokens are registered.
    OrderedJson vocab = OrderedJson::object();
    for (int64_t id = 0; id < tok.n_tokens(); ++id) {
        vocab[tok.tokens[id]] = id;
    }
    model["vocab"] = vocab;
    OrderedJson merges = OrderedJson::array();
    for (const BpeMerge &m : tok.merges) {
        merges.push_back(OrderedJson::array({m.left, m.right}));
    }
    model["merges"] = merges;
    root["model"] = model;
    return root.dump(2) + "\n";
}

std::string tiny_tokenizer_config_json(const TinyTokenizer &tok, int64_t model_max_length) {
    OrderedJson root;
    root["add_bos_token"] = true;
    root["add_eos_token"] = false;
    OrderedJson decoder = OrderedJson::object();
    OrderedJson additional = OrderedJson::array();
    for (int64_t id = 0; id < tok.n_tokens(); ++id) {
        if (!tok.special[id]) {
            continue;
        }
        OrderedJson entry = added_token_entry(tok, id);
        entry.erase("id");
        decoder[std::to_string(id)] = entry;
        if (id > 1) {
            additional.push_back(tok.tokens[id]);
        }
    }
    root["added_tokens_decoder"] = decoder;
    root["additional_special_tokens"] = additional;
    root["bos_token"] = kBosToken;
    root["chat_template"] = tiny_chat_template();
    root["clean_up_tokenization_spaces"] = false;
    // The chat model ends its turn with <|im_end|>; config.json lists both it and id 1 as EOS.
    root["eos_token"] = kImEndToken;
    root["model_max_length"] = model_max_length;
    root["pad_token"] = kEosToken;
    root["tokenizer_class"] = "PreTrainedTokenizerFast";
    root["unk_token"] = nullptr;
    return root.dump(2) + "\n";
}

}  // namespace memra::tools
