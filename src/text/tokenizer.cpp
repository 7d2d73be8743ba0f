// Tokenizer loading and the encode / decode pipelines (see tokenizer.h). Encode follows Hugging Face
// tokenizers: split on raw added tokens, normalize the rest, split on normalized added tokens,
// pre-tokenize, BPE each piece, then the post-processor template.
#include "text/tokenizer.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "core/check.h"
#include "text/added_tokens.h"
#include "text/bpe.h"
#include "text/byte_level.h"
#include "text/json_fields.h"
#include "text/pipeline.h"
#include "text/utf8.h"

namespace memra::text {

struct TokenizerImpl {
    BpeModel model;
    AddedVocabulary added;
    Normalizer normalizer;
    PreTokenizer pre_tokenizer;
    PostProcessor post_processor;
    DecoderKind decoder = DecoderKind::kNone;
    int32_t n_tokens = 0;

    std::optional<int32_t> bos, pad;
    std::vector<int32_t> eos;
    bool add_bos = false, add_eos = false;
    std::string chat_template;

    // The token string decode sees for `id` (added token content first, then the vocabulary).
    const std::string *token_string(int32_t id) const {
        if (const AddedToken *t = added.by_id(id)) return &t->decoded;
        return model.token(id);
    }
    bool skipped(const std::string &token, bool skip_special) const {
        return skip_special && added.is_special_content(token);
    }
    // Bytes of one token under a ByteLevel decoder: the alphabet's bytes, or the text itself when a
    // character is outside the alphabet (added tokens such as "<｜begin▁of▁sentence｜>").
    static void append_byte_level(const std::string &token, std::string &out) {
        if (auto bytes = byte_level_decode(token)) {
            out += *bytes;
        } else {
            out += token;
        }
    }
    std::optional<int32_t> id_of(std::string_view piece) const {
        if (auto id = added.id_of(piece)) return id;
        return model.token_id(piece);
    }
};

namespace {

Result<Json> parse_json(std::string_view text, const std::string &name) {
    try {
        return Json::parse(text.begin(), text.end());
    } catch (const Json::exception &e) {
        return make_error("{}: invalid JSON: {}", name, e.what());
    }
}

Result<std::string> read_file(const std::filesystem::path &path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return make_error("{}: cannot open for reading", path.string());
    std::ostringstream ss;
    ss << in.rdbuf();
    if (in.bad()) return make_error("{}: read error", path.string());
    return ss.str();
}

// Added tokens: ids as Hugging Face assigns them (the vocabulary's id when the content is there,
// otherwise the next free id above the vocabulary); a file whose "id" disagrees is refused.
Result<std::vector<AddedToken>> parse_added_tokens(const Json &root, const std::string &root_path,
                                                   const BpeModel &model) {
    std::vector<AddedToken> tokens;
    const Json *list = json_find(root, "added_tokens");
    if (list == nullptr || list->is_null()) return tokens;
    const std::string path = json_path(root_path, "added_tokens");
    if (!list->is_array()) return make_error("{}: expected an array, found {}", path, describe_json(*list));
    std::unordered_map<std::string, int32_t> assigned;
    std::optional<int32_t> max_added;
    const auto vocab_size = static_cast<int64_t>(model.vocab_size());
    for (size_t i = 0; i < list->size(); ++i) {
        const Json &item = (*list)[i];
        const std::string ipath = json_path(path, i);
        if (!item.is_object()) return make_error("{}: expected an object, found {}", ipath, describe_json(item));
        AddedToken t;
        auto content = json_string(item, "content", ipath, true, false);
        if (!content) return tl::unexpected(content.error());
        t.content = **content;
        if (t.content.empty()) return make_error("{}.content: expected a non-empty string, found \"\"", ipath);
        if (assigned.count(t.content) != 0) return make_error("{}.content: \"{}\" is listed twice", ipath, t.content);
        const Json *id_value = json_find(item, "id");
        if (id_value == nullptr) return make_error("{}.id: missing", ipath);
        auto file_id = json_id(*id_value, json_path(ipath, "id"));
        if (!file_id) return tl::unexpected(file_id.error());
        // Bounded first: n_tokens (1 + the largest id) sizes the id space the engine and its tables use.
        if (auto ok = check_token_id(*file_id, t.content, json_path(ipath, "id")); !ok) {
            return tl::unexpected(ok.error());
        }
        struct Flag {
            const char *key;
            bool *dst;
        };
        for (Flag f : {Flag{"special", &t.special}, Flag{"single_word", &t.single_word}, Flag{"lstrip", &t.lstrip},
                       Flag{"rstrip", &t.rstrip}, Flag{"normalized", &t.normalized}}) {
            auto v = json_bool(item, f.key, ipath, std::nullopt);
            if (!v) return tl::unexpected(v.error());
            *f.dst = *v;
        }
        int64_t id = 0;
        if (auto in_vocab = model.token_id(t.content)) {
            id = *in_vocab;
        } else if (!max_added) {
            id = vocab_size;
        } else {
            id = (*max_added >= vocab_size || vocab_size == 0) ? int64_t{*max_added} + 1 : vocab_size;
        }
        if (id != *file_id) {
            return make_error("{}.id: Hugging Face tokenizers gives \"{}\" id {}, the file says {}", ipath, t.content,
                              id, *file_id);
        }
        t.id = static_cast<int32_t>(id);
        assigned.emplace(t.content, t.id);
        max_added = std::max(max_added.value_or(t.id), t.id);
        tokens.push_back(std::move(t));
    }
    return tokens;
}

// A token given in tokenizer_config.json: a string, {"content": ...}, null or absent.
Result<std::optional<int32_t>> config_token(const Json &config, std::string_view key, const std::string &path,
                                            const TokenizerImpl &impl) {
    const Json *v = json_find(config, key);
    if (v == nullptr || v->is_null()) return std::optional<int32_t>();
    const std::string kpath = json_path(path, key);
    std::string content;
    if (v->is_string()) {
        content = v->get<std::string>();
    } else if (v->is_object()) {
        auto c = json_string(*v, "content", kpath, true, false);
        if (!c) return tl::unexpected(c.error());
        content = **c;
    } else {
        return make_error("{}: expected a token string, found {}", kpath, describe_json(*v));
    }
    auto id = impl.id_of(content);
    if (!id) return make_error("{}: \"{}\" is not a token of tokenizer.json", kpath, content);
    return std::optional<int32_t>(*id);
}

Result<void> parse_config(const Json &config, const std::string &path, TokenizerImpl &impl) {
    if (!config.is_object()) return make_error("{}: expected an object, found {}", path, describe_json(config));
    auto add_bos = json_bool(config, "add_bos_token", path, false);
    auto add_eos = json_bool(config, "add_eos_token", path, false);
    if (!add_bos) return tl::unexpected(add_bos.error());
    if (!add_eos) return tl::unexpected(add_eos.error());
    impl.add_bos = *add_bos;
    impl.add_eos = *add_eos;
    auto bos = config_token(config, "bos_token", path, impl);
    auto eos = config_token(config, "eos_token", path, impl);
    auto pad = config_token(config, "pad_token", path, impl);
    if (!bos) return tl::unexpected(bos.error());
    if (!eos) return tl::unexpected(eos.error());
    if (!pad) return tl::unexpected(pad.error());
    impl.bos = *bos;
    impl.pad = *pad;
    if (*eos) impl.eos.push_back(**eos);
    const Json *tmpl = json_find(config, "chat_template");
    if (tmpl != nullptr && !tmpl->is_null()) {
        const std::string tpath = json_path(path, "chat_template");
        if (tmpl->is_string()) {
            impl.chat_template = tmpl->get<std::string>();
        } else if (tmpl->is_array()) {
            // [{"name": ..., "template": ...}]: keep "default", else the first.
            for (size_t i = 0; i < tmpl->size(); ++i) {
                const std::string ipath = json_path(tpath, i);
                auto name = json_string((*tmpl)[i], "name", ipath, true, false);
                auto text = json_string((*tmpl)[i], "template", ipath, true, false);
                if (!name) return tl::unexpected(name.error());
                if (!text) return tl::unexpected(text.error());
                if (i == 0 || **name == "default") impl.chat_template = **text;
            }
        } else {
            return make_error("{}: expected a string or a list of named templates, found {}", tpath,
                              describe_json(*tmpl));
        }
    }
    return {};
}

Result<void> parse_generation_config(const Json &gen, const std::string &path, TokenizerImpl &impl) {
    if (!gen.is_object()) return make_error("{}: expected an object, found {}", path, describe_json(gen));
    auto one_id = [&](const Json &v, const std::string &vpath) -> Result<int32_t> {
        auto id = json_id(v, vpath);
        if (!id) return id;
        if (*id >= impl.n_tokens)
            return make_error("{}: id {} is outside the vocabulary ({} ids)", vpath, *id, impl.n_tokens);
        return id;
    };
    if (const Json *eos = json_find(gen, "eos_token_id"); eos != nullptr && !eos->is_null()) {
        const std::string epath = json_path(path, "eos_token_id");
        std::vector<const Json *> values;
        if (eos->is_array()) {
            for (const Json &v : *eos) values.push_back(&v);
        } else {
            values.push_back(eos);
        }
        for (size_t i = 0; i < values.size(); ++i) {
            auto id = one_id(*values[i], eos->is_array() ? json_path(epath, i) : epath);
            if (!id) return tl::unexpected(id.error());
            if (std::find(impl.eos.begin(), impl.eos.end(), *id) == impl.eos.end()) impl.eos.push_back(*id);
        }
    }
    for (auto [key, dst] : {std::pair{"bos_token_id", &impl.bos}, std::pair{"pad_token_id", &impl.pad}}) {
        const Json *v = json_find(gen, key);
        if (v == nullptr || v->is_null() || dst->has_value()) continue;
        auto id = one_id(*v, json_path(path, key));
        if (!id) return tl::unexpected(id.error());
        *dst = *id;
    }
    return {};
}

Result<std::unique_ptr<TokenizerImpl>> build(std::string_view tokenizer_json, const std::string &name,
                                             std::string_view config_json, const std::string &config_name,
                                             std::string_view generation_json, const std::string &generation_name) {
    auto root_value = parse_json(tokenizer_json, name);
    if (!root_value) return tl::unexpected(root_value.error());
    const Json &root = *root_value;
    const std::string root_path = name + ": ";
    if (!root.is_object()) return make_error("{}: expected an object, found {}", name, describe_json(root));
    for (const char *key : {"truncation", "padding"}) {
        const Json *v = json_find(root, key);
        if (v != nullptr && !v->is_null()) {
            return make_error("{}{}: expected null (memra does not truncate or pad), found {}", root_path, key,
                              describe_json(*v));
        }
    }
    auto impl = std::make_unique<TokenizerImpl>();
    auto model = json_object(root, "model", root_path);
    if (!model) return tl::unexpected(model.error());
    const std::string model_path = json_path(root_path, "model");
    auto model_type = json_string(**model, "type", model_path, true, false);
    if (!model_type) return tl::unexpected(model_type.error());
    if (**model_type != "BPE") return make_error("{}.type: unsupported \"{}\"", model_path, **model_type);
    auto bpe = BpeModel::from_json(**model, model_path);
    if (!bpe) return tl::unexpected(bpe.error());
    impl->model = std::move(*bpe);

    const Json kNull;
    auto stage = [&](const char *key) -> const Json & {
        const Json *v = json_find(root, key);
        return v != nullptr ? *v : kNull;
    };
    auto normalizer = Normalizer::from_json(stage("normalizer"), json_path(root_path, "normalizer"));
    if (!normalizer) return tl::unexpected(normalizer.error());
    impl->normalizer = std::move(*normalizer);
    auto pre = PreTokenizer::from_json(stage("pre_tokenizer"), json_path(root_path, "pre_tokenizer"));
    if (!pre) return tl::unexpected(pre.error());
    impl->pre_tokenizer = std::move(*pre);
    auto post = PostProcessor::from_json(stage("post_processor"), json_path(root_path, "post_processor"));
    if (!post) return tl::unexpected(post.error());
    impl->post_processor = std::move(*post);
    auto decoder = decoder_from_json(stage("decoder"), json_path(root_path, "decoder"));
    if (!decoder) return tl::unexpected(decoder.error());
    impl->decoder = *decoder;

    auto added = parse_added_tokens(root, root_path, impl->model);
    if (!added) return tl::unexpected(added.error());
    // Matching priority: special tokens, then the others, each in file order.
    std::stable_partition(added->begin(), added->end(), [](const AddedToken &t) { return t.special; });
    std::vector<std::string> normalized_contents;
    impl->n_tokens = impl->model.id_end();
    for (const AddedToken &t : *added) {
        normalized_contents.push_back(t.normalized ? impl->normalizer.apply(t.content) : t.content);
        if (normalized_contents.back().empty()) {
            return make_error("{}added_tokens: \"{}\" normalizes to an empty string", root_path, t.content);
        }
        impl->n_tokens = std::max(impl->n_tokens, t.id + 1);
    }
    auto vocab = AddedVocabulary::build(std::move(*added), normalized_contents);
    if (!vocab) return tl::unexpected(vocab.error());
    impl->added = std::move(*vocab);

    if (!config_json.empty()) {
        auto config = parse_json(config_json, config_name);
        if (!config) return tl::unexpected(config.error());
        auto ok = parse_config(*config, config_name + ": ", *impl);
        if (!ok) return tl::unexpected(ok.error());
    }
    if (!generation_json.empty()) {
        auto gen = parse_json(generation_json, generation_name);
        if (!gen) return tl::unexpected(gen.error());
        auto ok = parse_generation_config(*gen, generation_name + ": ", *impl);
        if (!ok) return tl::unexpected(ok.error());
    }
    return impl;
}

}  // namespace

Tokenizer::Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer &&) noexcept = default;
Tokenizer &Tokenizer::operator=(Tokenizer &&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Result<Tokenizer> Tokenizer::load(const std::filesystem::path &model_dir_or_file) {
    std::error_code ec;
    const bool is_dir = std::filesystem::is_directory(model_dir_or_file, ec);
    const std::filesystem::path file = is_dir ? model_dir_or_file / "tokenizer.json" : model_dir_or_file;
    const std::filesystem::path dir = file.parent_path();
    auto text = read_file(file);
    if (!text) return tl::unexpected(text.error());
    std::string config, generation;
    const std::filesystem::path config_path = dir / "tokenizer_config.json";
    const std::filesystem::path generation_path = dir / "generation_config.json";
    if (std::filesystem::exists(config_path, ec)) {
        auto c = read_file(config_path);
        if (!c) return tl::unexpected(c.error());
        config = std::move(*c);
        if (config.empty()) return make_error("{}: empty file", config_path.string());
    }
    if (std::filesystem::exists(generation_path, ec)) {
        auto g = read_file(generation_path);
        if (!g) return tl::unexpected(g.error());
        generation = std::move(*g);
        if (generation.empty()) return make_error("{}: empty file", generation_path.string());
    }
    auto impl = build(*text, file.string(), config, config_path.string(), generation, generation_path.string());
    if (!impl) return tl::unexpected(impl.error());
    Tokenizer tok;
    tok.impl_ = std::move(*impl);
    return tok;
}

Result<Tokenizer> Tokenizer::from_json_text(std::string_view tokenizer_json, std::string_view config_json,
                                            std::string_view generation_json) {
    auto impl = build(tokenizer_json, "tokenizer.json", config_json, "tokenizer_config.json", generation_json,
                      "generation_config.json");
    if (!impl) return tl::unexpected(impl.error());
    Tokenizer tok;
    tok.impl_ = std::move(*impl);
    return tok;
}

Result<std::vector<int32_t>> Tokenizer::encode(std::string_view input, const EncodeOptions &options) const {
    const TokenizerImpl &t = *impl_;
    std::string repaired;
    std::string_view text = input;
    if (!utf8_is_valid(input)) {
        repaired = utf8_lossy(input);
        text = repaired;
    }
    const bool encode_special = !options.parse_special;
    std::vector<int32_t> ids;
    for (const TextSplit &raw : t.added.split(text, false, encode_special)) {
        if (raw.token >= 0) {
            ids.push_back(raw.token);
            continue;
        }
        if (raw.end == raw.start) continue;
        const std::string_view piece = text.substr(raw.start, raw.end - raw.start);
        std::string normalized_storage;
        std::string_view normalized = piece;
        if (!t.normalizer.empty()) {
            normalized_storage = t.normalizer.apply(piece);
            normalized = normalized_storage;
        }
        for (const TextSplit &ns : t.added.split(normalized, true, encode_special)) {
            if (ns.token >= 0) {
                ids.push_back(ns.token);
                continue;
            }
            if (ns.end == ns.start) continue;
            auto words = t.pre_tokenizer.apply(normalized.substr(ns.start, ns.end - ns.start));
            if (!words) return tl::unexpected(words.error());
            for (const std::string &w : *words) t.model.tokenize(w, ids);
        }
    }
    return t.post_processor.apply(ids, options.add_special);
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
    const TokenizerImpl &t = *impl_;
    std::string out;
    bool first = true;
    for (int32_t id : ids) {
        const std::string *token = t.token_string(id);
        if (token == nullptr || t.skipped(*token, skip_special)) continue;
        switch (t.decoder) {
        case DecoderKind::kNone:
            if (!first) out += ' ';
            out += *token;
            break;
        case DecoderKind::kConcat: out += *token; break;
        case DecoderKind::kByteLevel: TokenizerImpl::append_byte_level(*token, out); break;
        }
        first = false;
    }
    if (t.decoder == DecoderKind::kByteLevel) return utf8_lossy(out);
    return out;
}

std::string Tokenizer::token_text(int32_t id) const {
    const std::string *token = impl_->token_string(id);
    if (token == nullptr) return {};
    if (impl_->decoder != DecoderKind::kByteLevel) return *token;
    std::string out;
    TokenizerImpl::append_byte_level(*token, out);
    return out;
}

int32_t Tokenizer::n_tokens() const { return impl_->n_tokens; }

std::optional<int32_t> Tokenizer::token_id(std::string_view piece) const { return impl_->id_of(piece); }

bool Tokenizer::is_special(int32_t id) const {
    const AddedToken *t = impl_->added.by_id(id);
    return t != nullptr && t->special;
}

std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }
std::span<const int32_t> Tokenizer::eos_ids() const { return impl_->eos; }
std::optional<int32_t> Tokenizer::pad_id() const { return impl_->pad; }
bool Tokenizer::add_bos_token() const { return impl_->add_bos; }
bool Tokenizer::add_eos_token() const { return impl_->add_eos; }
const std::string &Tokenizer::chat_template() const { return impl_->chat_template; }

StreamDecoder Tokenizer::stream_decoder(bool skip_special) const { return StreamDecoder(impl_.get(), skip_special); }

std::string StreamDecoder::feed(int32_t id) {
    const std::string *token = impl_->token_string(id);
    if (token == nullptr || impl_->skipped(*token, skip_special_)) return {};
    switch (impl_->decoder) {
    case DecoderKind::kNone: {
        std::string out = first_ ? *token : " " + *token;
        first_ = false;
        return out;
    }
    case DecoderKind::kConcat: return *token;
    case DecoderKind::kByteLevel: break;
    }
    TokenizerImpl::append_byte_level(*token, pending_);
    // Emit every complete character and every sequence that can no longer become one; keep a
    // truncated prefix of a character, which the next token may complete.
    std::string out;
    size_t pos = 0;
    while (pos < pending_.size()) {
        if (static_cast<uint8_t>(pending_[pos]) < 0x80) {
            out.push_back(pending_[pos++]);
            continue;
        }
        const Utf8Step step = utf8_step(std::string_view(pending_).substr(pos));
        if (step.kind == Utf8Kind::kIncomplete) break;
        if (step.kind == Utf8Kind::kValid) {
            out.append(pending_, pos, step.len);
        } else {
            out += kReplacementChar;
        }
        pos += step.len;
    }
    pending_.erase(0, pos);
    return out;
}

std::string StreamDecoder::flush() {
    std::string out = utf8_lossy(pending_);
    pending_.clear();
    return out;
}

}  // namespace memra::text
