// Normalizer, pre-tokenizer, post-processor and decoder of a tokenizer.json (see pipeline.h).
#include "text/pipeline.h"

#include <algorithm>
#include <cstdlib>

#include <fmt/format.h>

#include <utf8proc.h>

#include "core/check.h"
#include "text/byte_level.h"
#include "text/unicode_patches.h"
#include "text/utf8.h"

namespace memra::text {

namespace {

// The GPT-2 pattern the ByteLevel pre-tokenizer splits with when use_regex is true.
constexpr char kGpt2Pattern[] = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

Result<std::string> type_of(const Json &value, const std::string &path) {
    if (!value.is_object()) return make_error("{}: expected an object, found {}", path, describe_json(value));
    auto type = json_string(value, "type", path, true, false);
    if (!type) return tl::unexpected(type.error());
    return **type;
}

tl::unexpected<Error> unsupported(const std::string &path, const std::string &type) {
    return make_error("{}.type: unsupported \"{}\"", path, type);
}

}  // namespace

// ---- Normalizer --------------------------------------------------------------------------------

Result<Normalizer> Normalizer::from_json(const Json &value, const std::string &path) {
    Normalizer n;
    if (value.is_null()) return n;
    auto type = type_of(value, path);
    if (!type) return tl::unexpected(type.error());
    if (*type == "Sequence") {
        auto list = json_array(value, "normalizers", path);
        if (!list) return tl::unexpected(list.error());
        for (size_t i = 0; i < (*list)->size(); ++i) {
            auto inner = from_json((**list)[i], json_path(json_path(path, "normalizers"), i));
            if (!inner) return tl::unexpected(inner.error());
            if (inner->empty()) {
                return make_error("{}: expected a normalizer, found null",
                                  json_path(json_path(path, "normalizers"), i));
            }
            n.forms_.insert(n.forms_.end(), inner->forms_.begin(), inner->forms_.end());
        }
        return n;
    }
    if (*type != "NFC" && *type != "NFKC") return unsupported(path, *type);
    n.forms_.push_back(*type == "NFC" ? NormalForm::kNfc : NormalForm::kNfkc);
    return n;
}

namespace {

bool is_barrier(char32_t cp) {
    for (const CodeRange &r : normalization_barriers()) {
        if (cp < r.first) return false;  // ranges ascend
        if (cp <= r.last) return true;
    }
    return false;
}

void normalize_segment(std::string_view text, NormalForm form, std::string &out) {
    if (text.empty()) return;
    const auto options = static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE |
                                                        (form == NormalForm::kNfkc ? UTF8PROC_COMPAT : 0));
    utf8proc_uint8_t *result = nullptr;
    const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t *>(text.data()),
                                            static_cast<utf8proc_ssize_t>(text.size()), &result, options);
    MEMRA_CHECK(n >= 0, "utf8proc_map failed on valid UTF-8: {}", utf8proc_errmsg(n));
    out.append(reinterpret_cast<const char *>(result), static_cast<size_t>(n));
    std::free(result);
}

}  // namespace

std::string Normalizer::apply(std::string_view text) const {
    std::string out(text);
    // Code points HF's tables lack are starters without decomposition or composition for it, so
    // the text between them normalizes independently, and they stay as they are.
    for (NormalForm form : forms_) {
        std::string next;
        next.reserve(out.size());
        size_t seg = 0, pos = 0;
        while (pos < out.size()) {
            const size_t at = pos;
            if (!is_barrier(utf8_next(out, pos))) continue;
            normalize_segment(std::string_view(out).substr(seg, at - seg), form, next);
            next.append(out, at, pos - at);
            seg = pos;
        }
        normalize_segment(std::string_view(out).substr(seg), form, next);
        out.swap(next);
    }
    return out;
}

// ---- Split -------------------------------------------------------------------------------------

Result<void> split_text(std::string_view text, const Regex &regex, bool invert, SplitBehavior behavior,
                        std::vector<std::string> &out) {
    if (text.empty()) return {};
    // (start, end, is_match) covering the text, empty matches included (they matter to merging).
    struct Part {
        size_t start;
        size_t end;
        bool flag;  // is_match, then "remove" after the behavior is applied
    };
    std::vector<Part> parts;
    auto matches = regex.find_all(text);
    if (!matches) return tl::unexpected(matches.error());
    size_t prev = 0;
    for (const RegexMatch &m : *matches) {
        if (prev != m.start) parts.push_back(Part{prev, m.start, false});
        parts.push_back(Part{m.start, m.end, true});
        prev = m.end;
    }
    if (prev != text.size()) parts.push_back(Part{prev, text.size(), false});
    if (invert) {
        for (Part &p : parts) p.flag = !p.flag;
    }
    std::vector<Part> kept;
    switch (behavior) {
    case SplitBehavior::kRemoved: kept = parts; break;
    case SplitBehavior::kIsolated:
        for (const Part &p : parts) kept.push_back(Part{p.start, p.end, false});
        break;
    case SplitBehavior::kContiguous: {
        bool previous_match = false;
        for (const Part &p : parts) {
            if (p.flag == previous_match && !kept.empty()) {
                kept.back().end = p.end;
            } else {
                kept.push_back(Part{p.start, p.end, false});
            }
            previous_match = p.flag;
        }
        break;
    }
    case SplitBehavior::kMergedWithPrevious: {
        bool previous_match = false;
        for (const Part &p : parts) {
            if (p.flag && !previous_match && !kept.empty()) {
                kept.back().end = p.end;
            } else {
                kept.push_back(Part{p.start, p.end, false});
            }
            previous_match = p.flag;
        }
        break;
    }
    case SplitBehavior::kMergedWithNext: {
        bool previous_match = false;
        for (size_t i = parts.size(); i-- > 0;) {
            const Part &p = parts[i];
            if (p.flag && !previous_match && !kept.empty()) {
                kept.back().start = p.start;
            } else {
                kept.push_back(Part{p.start, p.end, false});
            }
            previous_match = p.flag;
        }
        std::reverse(kept.begin(), kept.end());
        break;
    }
    }
    for (const Part &p : kept) {
        if (!p.flag && p.end > p.start) out.emplace_back(text.substr(p.start, p.end - p.start));
    }
    return {};
}

// ---- PreTokenizer ------------------------------------------------------------------------------

Result<void> PreTokenizer::parse(const Json &value, const std::string &path, std::vector<Step> &steps) {
    auto type = type_of(value, path);
    if (!type) return tl::unexpected(type.error());
    if (*type == "Sequence") {
        auto list = json_array(value, "pretokenizers", path);
        if (!list) return tl::unexpected(list.error());
        for (size_t i = 0; i < (*list)->size(); ++i) {
            auto ok = parse((**list)[i], json_path(json_path(path, "pretokenizers"), i), steps);
            if (!ok) return ok;
        }
        return {};
    }
    Step step;
    if (*type == "Split") {
        auto pattern = json_object(value, "pattern", path);
        if (!pattern) return tl::unexpected(pattern.error());
        const std::string ppath = json_path(path, "pattern");
        const Json *regex = json_find(**pattern, "Regex");
        const Json *literal = json_find(**pattern, "String");
        if ((regex == nullptr) == (literal == nullptr) || (**pattern).size() != 1) {
            return make_error("{}: expected {{\"Regex\": ...}} or {{\"String\": ...}}, found {}", ppath,
                              (**pattern).dump());
        }
        const Json &p = regex != nullptr ? *regex : *literal;
        const std::string which = json_path(ppath, regex != nullptr ? "Regex" : "String");
        if (!p.is_string()) return make_error("{}: expected a string, found {}", which, describe_json(p));
        auto compiled = regex != nullptr ? Regex::compile(p.get<std::string>()) : Regex::literal(p.get<std::string>());
        if (!compiled) return wrap_error(which, compiled.error());
        step.regex = std::move(*compiled);
        auto behavior = json_string(value, "behavior", path, true, false);
        if (!behavior) return tl::unexpected(behavior.error());
        const std::string &b = **behavior;
        if (b == "Removed") {
            step.behavior = SplitBehavior::kRemoved;
        } else if (b == "Isolated") {
            step.behavior = SplitBehavior::kIsolated;
        } else if (b == "MergedWithPrevious") {
            step.behavior = SplitBehavior::kMergedWithPrevious;
        } else if (b == "MergedWithNext") {
            step.behavior = SplitBehavior::kMergedWithNext;
        } else if (b == "Contiguous") {
            step.behavior = SplitBehavior::kContiguous;
        } else {
            return make_error("{}: unsupported \"{}\"", json_path(path, "behavior"), b);
        }
        auto invert = json_bool(value, "invert", path, false);
        if (!invert) return tl::unexpected(invert.error());
        step.invert = *invert;
    } else if (*type == "ByteLevel") {
        auto prefix = json_bool(value, "add_prefix_space", path, std::nullopt);
        auto use_regex = json_bool(value, "use_regex", path, true);
        if (!prefix) return tl::unexpected(prefix.error());
        if (!use_regex) return tl::unexpected(use_regex.error());
        step.kind = Kind::kByteLevel;
        step.add_prefix_space = *prefix;
        step.use_regex = *use_regex;
        if (step.use_regex) {
            auto gpt2 = Regex::compile(kGpt2Pattern);
            if (!gpt2) return tl::unexpected(gpt2.error());
            step.regex = std::move(*gpt2);
        }
    } else if (*type == "Digits") {
        // Rust char::is_numeric (Unicode N*): each digit alone, or runs of digits kept together.
        auto individual = json_bool(value, "individual_digits", path, false);
        if (!individual) return tl::unexpected(individual.error());
        auto digit = Regex::compile("\\p{N}");
        if (!digit) return tl::unexpected(digit.error());
        step.regex = std::move(*digit);
        step.behavior = *individual ? SplitBehavior::kIsolated : SplitBehavior::kContiguous;
    } else {
        return unsupported(path, *type);
    }
    steps.push_back(std::move(step));
    return {};
}

Result<PreTokenizer> PreTokenizer::from_json(const Json &value, const std::string &path) {
    PreTokenizer pt;
    if (value.is_null()) return pt;
    auto ok = parse(value, path, pt.steps_);
    if (!ok) return tl::unexpected(ok.error());
    return pt;
}

Result<std::vector<std::string>> PreTokenizer::apply(std::string_view text) const {
    std::vector<std::string> pieces;
    if (text.empty()) return pieces;
    pieces.emplace_back(text);
    std::vector<std::string> next;
    for (const Step &step : steps_) {
        next.clear();
        for (std::string &piece : pieces) {
            if (step.kind == Kind::kSplit) {
                auto ok = split_text(piece, step.regex, step.invert, step.behavior, next);
                if (!ok) return tl::unexpected(ok.error());
                continue;
            }
            if (step.add_prefix_space && piece[0] != ' ') piece.insert(piece.begin(), ' ');
            const size_t first = next.size();
            if (step.use_regex) {
                auto ok = split_text(piece, step.regex, false, SplitBehavior::kIsolated, next);
                if (!ok) return tl::unexpected(ok.error());
            } else {
                next.push_back(std::move(piece));
            }
            for (size_t i = first; i < next.size(); ++i) next[i] = byte_level_encode(next[i]);
        }
        pieces.swap(next);
    }
    return pieces;
}

// ---- PostProcessor -----------------------------------------------------------------------------

namespace {

// One TemplateProcessing template ("single" or "pair"): pieces and the sequences it holds.
Result<std::vector<std::vector<int32_t>>> parse_template(const Json &value, std::string_view key,
                                                         const std::string &path, const Json &specials,
                                                         std::string &sequences) {
    auto list = json_array(value, key, path);
    if (!list) return tl::unexpected(list.error());
    const std::string tpath = json_path(path, key);
    std::vector<std::vector<int32_t>> pieces;  // empty vector: the sequence; else special ids
    for (size_t i = 0; i < (*list)->size(); ++i) {
        const Json &piece = (**list)[i];
        const std::string ppath = json_path(tpath, i);
        const Json *seq = json_find(piece, "Sequence");
        const Json *special = json_find(piece, "SpecialToken");
        if ((seq == nullptr) == (special == nullptr) || piece.size() != 1) {
            return make_error("{}: expected {{\"Sequence\": ...}} or {{\"SpecialToken\": ...}}, found {}", ppath,
                              piece.dump());
        }
        if (seq != nullptr) {
            auto id = json_string(*seq, "id", json_path(ppath, "Sequence"), true, false);
            if (!id) return tl::unexpected(id.error());
            if (**id != "A" && **id != "B") {
                return make_error("{}.Sequence.id: expected \"A\" or \"B\", found \"{}\"", ppath, **id);
            }
            sequences += **id;
            pieces.emplace_back();
            continue;
        }
        auto name = json_string(*special, "id", json_path(ppath, "SpecialToken"), true, false);
        if (!name) return tl::unexpected(name.error());
        const Json *entry = json_find(specials, **name);
        if (entry == nullptr) {
            return make_error("{}.SpecialToken.id: \"{}\" is not in {}", ppath, **name,
                              json_path(path, "special_tokens"));
        }
        const std::string epath = json_path(json_path(path, "special_tokens"), **name);
        auto ids = json_array(*entry, "ids", epath);
        if (!ids) return tl::unexpected(ids.error());
        std::vector<int32_t> out;
        for (size_t k = 0; k < (*ids)->size(); ++k) {
            auto id = json_id((**ids)[k], json_path(json_path(epath, "ids"), k));
            if (!id) return tl::unexpected(id.error());
            out.push_back(*id);
        }
        if (out.empty()) return make_error("{}.ids: expected at least one id, found none", epath);
        pieces.push_back(std::move(out));
    }
    return pieces;
}

Result<void> parse_post(const Json &value, const std::string &path,
                        std::vector<std::vector<std::vector<int32_t>>> &out) {
    auto type = type_of(value, path);
    if (!type) return tl::unexpected(type.error());
    if (*type == "Sequence") {
        auto list = json_array(value, "processors", path);
        if (!list) return tl::unexpected(list.error());
        for (size_t i = 0; i < (*list)->size(); ++i) {
            auto ok = parse_post((**list)[i], json_path(json_path(path, "processors"), i), out);
            if (!ok) return ok;
        }
        return {};
    }
    if (*type == "ByteLevel") return {};  // only trims offsets; ids unchanged
    if (*type != "TemplateProcessing") return unsupported(path, *type);
    auto specials = json_object(value, "special_tokens", path);
    if (!specials) return tl::unexpected(specials.error());
    std::string single_seqs, pair_seqs;
    auto single = parse_template(value, "single", path, **specials, single_seqs);
    if (!single) return tl::unexpected(single.error());
    if (single_seqs != "A") {
        return make_error("{}: expected exactly one Sequence \"A\", found \"{}\"", json_path(path, "single"),
                          single_seqs);
    }
    auto pair = parse_template(value, "pair", path, **specials, pair_seqs);
    if (!pair) return tl::unexpected(pair.error());
    if (pair_seqs != "AB" && pair_seqs != "BA") {
        return make_error("{}: expected Sequences \"A\" and \"B\" once each, found \"{}\"", json_path(path, "pair"),
                          pair_seqs);
    }
    out.push_back(std::move(*single));
    return {};
}

}  // namespace

Result<PostProcessor> PostProcessor::from_json(const Json &value, const std::string &path) {
    PostProcessor pp;
    if (value.is_null()) return pp;
    std::vector<std::vector<std::vector<int32_t>>> templates;
    auto ok = parse_post(value, path, templates);
    if (!ok) return tl::unexpected(ok.error());
    for (auto &t : templates) {
        std::vector<Piece> pieces;
        for (auto &ids : t) pieces.push_back(Piece{ids.empty(), std::move(ids)});
        pp.templates_.push_back(std::move(pieces));
    }
    return pp;
}

std::vector<int32_t> PostProcessor::apply(const std::vector<int32_t> &ids, bool add_special) const {
    if (!add_special || templates_.empty()) return ids;
    std::vector<int32_t> cur = ids;
    for (const auto &pieces : templates_) {
        std::vector<int32_t> next;
        for (const Piece &p : pieces) {
            const std::vector<int32_t> &src = p.is_sequence ? cur : p.ids;
            next.insert(next.end(), src.begin(), src.end());
        }
        cur.swap(next);
    }
    return cur;
}

// ---- Decoder -----------------------------------------------------------------------------------

Result<DecoderKind> decoder_from_json(const Json &value, const std::string &path) {
    if (value.is_null()) return DecoderKind::kNone;
    auto type = type_of(value, path);
    if (!type) return tl::unexpected(type.error());
    if (*type == "ByteLevel") return DecoderKind::kByteLevel;
    if (*type != "Sequence") return unsupported(path, *type);
    auto list = json_array(value, "decoders", path);
    if (!list) return tl::unexpected(list.error());
    DecoderKind kind = DecoderKind::kConcat;
    for (size_t i = 0; i < (*list)->size(); ++i) {
        const std::string ipath = json_path(json_path(path, "decoders"), i);
        auto inner = decoder_from_json((**list)[i], ipath);
        if (!inner) return tl::unexpected(inner.error());
        if (*inner == DecoderKind::kNone) return make_error("{}: expected a decoder, found null", ipath);
        if (*inner == DecoderKind::kByteLevel) {
            if (kind == DecoderKind::kByteLevel) return make_error("{}: unsupported second ByteLevel decoder", ipath);
            kind = DecoderKind::kByteLevel;
        }
    }
    return kind;
}

}  // namespace memra::text
