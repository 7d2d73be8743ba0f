// Stop strings (one KMP automaton per string), tool schemas reduced to per-parameter JSON types,
// and the Step-3.5 reasoning / XML tool-call parser; the rules are in chat_output.h. Every decision
// is a function of the whole text, and the streaming code only holds text back until the rule can
// be applied, which is what makes the totals independent of how the text is split.
#include "text/chat_output.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "text/json_fields.h"
#include "text/utf8.h"

namespace memra::text {

namespace {

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";
constexpr std::string_view kNewlineThinkClose = "\n</think>";
constexpr std::string_view kToolCallOpen = "<tool_call>";
constexpr std::string_view kToolCallClose = "</tool_call>";
constexpr std::string_view kFunctionOpen = "<function=";
constexpr std::string_view kFunctionClose = "</function>";
constexpr std::string_view kParameterOpen = "<parameter=";
constexpr std::string_view kParameterClose = "</parameter>";

// ASCII whitespace as JSON defines it; also what "whitespace-only" content means.
bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

std::string_view trim_space(std::string_view s) {
    while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
    while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
    return s;
}

// Length of the longest proper prefix of `word` that `text` ends with.
size_t partial_suffix(std::string_view text, std::string_view word) {
    for (size_t k = std::min(text.size(), word.size() - 1); k > 0; --k) {
        if (text.substr(text.size() - k) == word.substr(0, k)) return k;
    }
    return 0;
}

// Appends `s` as a JSON string; invalid UTF-8 becomes U+FFFD (one per maximal invalid subpart).
void append_json_string(std::string &out, std::string_view s) {
    out.push_back('"');
    size_t pos = 0;
    while (pos < s.size()) {
        const auto b = static_cast<uint8_t>(s[pos]);
        if (b >= 0x80) {
            const Utf8Step step = utf8_step(s.substr(pos));
            if (step.kind == Utf8Kind::kValid) {
                out.append(s, pos, step.len);
            } else {
                out.append(kReplacementChar);
            }
            pos += step.len;
            continue;
        }
        switch (b) {
        case '"': out.append("\\\""); break;
        case '\\': out.append("\\\\"); break;
        case '\b': out.append("\\b"); break;
        case '\f': out.append("\\f"); break;
        case '\n': out.append("\\n"); break;
        case '\r': out.append("\\r"); break;
        case '\t': out.append("\\t"); break;
        default:
            if (b < 0x20) {
                out.append(fmt::format("\\u{:04x}", b));
            } else {
                out.push_back(static_cast<char>(b));
            }
        }
        ++pos;
    }
    out.push_back('"');
}

// ---- tool schemas ----

constexpr uint8_t kTypeString = 1;
constexpr uint8_t kTypeNull = 2;
constexpr uint8_t kTypeOther = 4;  // integer, number, boolean, object, array, or a name we do not know
constexpr int kSchemaMaxDepth = 16;  // nested anyOf / $ref steps before a schema counts as unconstrained
constexpr int kSchemaBudget = 256;  // schema nodes visited per parameter (a hostile anyOf fan-out stays cheap)

uint8_t type_name_bit(std::string_view name) {
    if (name == "string" || name == "str" || name == "text" || name == "varchar" || name == "char" || name == "enum")
        return kTypeString;
    if (name == "null") return kTypeNull;
    return kTypeOther;
}

uint8_t value_type_bit(const Json &v) {
    if (v.is_string()) return kTypeString;
    if (v.is_null()) return kTypeNull;
    return kTypeOther;
}

// Resolves a local JSON pointer reference ("#/$defs/x", RFC 6901 escapes) inside `root`.
const Json *resolve_ref(const Json &root, std::string_view ref) {
    if (!ref.starts_with('#')) return nullptr;
    ref.remove_prefix(1);
    const Json *node = &root;
    while (!ref.empty()) {
        if (ref.front() != '/') return nullptr;
        ref.remove_prefix(1);
        const size_t slash = ref.find('/');
        const std::string_view raw = ref.substr(0, slash);
        ref = slash == std::string_view::npos ? std::string_view() : ref.substr(slash);
        std::string token;
        for (size_t i = 0; i < raw.size(); ++i) {
            if (raw[i] != '~') {
                token.push_back(raw[i]);
            } else if (i + 1 < raw.size() && (raw[i + 1] == '0' || raw[i + 1] == '1')) {
                token.push_back(raw[++i] == '0' ? '~' : '/');
            } else {
                return nullptr;
            }
        }
        if (node->is_object()) {
            node = json_find(*node, token);
            if (node == nullptr) return nullptr;
        } else if (node->is_array()) {
            if (token.empty() || token.size() > 9 || (token.size() > 1 && token[0] == '0')) return nullptr;
            size_t index = 0;
            for (char c : token) {
                if (c < '0' || c > '9') return nullptr;
                index = index * 10 + static_cast<size_t>(c - '0');
            }
            if (index >= node->size()) return nullptr;
            node = &(*node)[index];
        } else {
            return nullptr;
        }
    }
    return node;
}

// The JSON types `schema` allows, as kType* bits; 0 when it does not constrain the type.
uint8_t schema_types(const Json &schema, const Json &root, int depth, int &budget) {
    if (depth > kSchemaMaxDepth || --budget < 0 || !schema.is_object()) return 0;
    if (const Json *type = json_find(schema, "type")) {
        uint8_t bits = 0;
        if (type->is_string()) {
            bits = type_name_bit(type->get_ref<const std::string &>());
        } else if (type->is_array()) {
            for (const Json &t : *type) {
                if (t.is_string()) bits |= type_name_bit(t.get_ref<const std::string &>());
            }
        }
        if (bits != 0) return bits;
    }
    if (const Json *values = json_find(schema, "enum"); values != nullptr && values->is_array() && !values->empty()) {
        uint8_t bits = 0;
        for (const Json &v : *values) bits |= value_type_bit(v);
        return bits;
    }
    if (const Json *value = json_find(schema, "const")) return value_type_bit(*value);
    for (const char *key : {"anyOf", "oneOf"}) {
        const Json *alts = json_find(schema, key);
        if (alts == nullptr || !alts->is_array() || alts->empty()) continue;
        uint8_t bits = 0;
        for (const Json &alt : *alts) {
            const uint8_t b = schema_types(alt, root, depth + 1, budget);
            if (b == 0) return 0;  // one unconstrained alternative: anything goes
            bits |= b;
        }
        return bits;
    }
    if (const Json *parts = json_find(schema, "allOf"); parts != nullptr && parts->is_array()) {
        for (const Json &part : *parts) {
            if (const uint8_t b = schema_types(part, root, depth + 1, budget)) return b;
        }
    }
    if (const Json *ref = json_find(schema, "$ref"); ref != nullptr && ref->is_string()) {
        if (const Json *target = resolve_ref(root, ref->get_ref<const std::string &>()))
            return schema_types(*target, root, depth + 1, budget);
    }
    return 0;
}

// ---- tool-call blocks ----

struct ParsedCall {
    std::string_view name;
    std::vector<std::pair<std::string_view, std::string_view>> params;  // (name, raw value), as written
};

void skip_space(std::string_view text, size_t &pos) {
    while (pos < text.size() && is_space(text[pos])) ++pos;
}

// Reads "NAME>" at text[pos] (after "<function=" or "<parameter="): false when a '<' or a newline
// comes before the '>', or the trimmed name is empty.
bool read_tag_name(std::string_view text, size_t &pos, std::string_view &name) {
    const size_t end = text.find_first_of("<>\n", pos);
    if (end == std::string_view::npos || text[end] != '>') return false;
    name = trim_space(text.substr(pos, end - pos));
    pos = end + 1;
    return !name.empty();
}

enum class FunctionEnd { kFailed, kClosed, kUnclosed };

// Parses "<function=NAME>" (parameters) "</function>" starting at text[pos]; kUnclosed: the text
// ended (after whitespace) where "</function>" or another parameter was expected.
FunctionEnd parse_function(std::string_view text, size_t &pos, ParsedCall &call) {
    pos += kFunctionOpen.size();
    if (!read_tag_name(text, pos, call.name)) return FunctionEnd::kFailed;
    while (true) {
        skip_space(text, pos);
        if (pos == text.size()) return FunctionEnd::kUnclosed;
        const std::string_view rest = text.substr(pos);
        if (rest.starts_with(kFunctionClose)) {
            pos += kFunctionClose.size();
            return FunctionEnd::kClosed;
        }
        if (!rest.starts_with(kParameterOpen)) return FunctionEnd::kFailed;
        pos += kParameterOpen.size();
        std::string_view param;
        if (!read_tag_name(text, pos, param)) return FunctionEnd::kFailed;
        const size_t end = text.find(kParameterClose, pos);
        if (end == std::string_view::npos) return FunctionEnd::kFailed;
        std::string_view value = text.substr(pos, end - pos);
        if (value.starts_with('\n')) value.remove_prefix(1);
        if (value.ends_with('\n')) value.remove_suffix(1);
        call.params.emplace_back(param, value);
        pos = end + kParameterClose.size();
    }
}

// The calls of a complete block, or nothing when it is malformed. `wrapped`: the block is
// "<tool_call>" ... "</tool_call>"; otherwise it is "<function=" ... "</function>".
std::optional<std::vector<ParsedCall>> parse_block(std::string_view block, bool wrapped) {
    std::vector<ParsedCall> calls;
    if (!wrapped) {
        size_t pos = 0;
        ParsedCall call;
        if (parse_function(block, pos, call) != FunctionEnd::kClosed || pos != block.size()) return std::nullopt;
        calls.push_back(std::move(call));
        return calls;
    }
    const std::string_view body =
        block.substr(kToolCallOpen.size(), block.size() - kToolCallOpen.size() - kToolCallClose.size());
    size_t pos = 0;
    while (true) {
        skip_space(body, pos);
        if (pos == body.size()) break;
        if (!body.substr(pos).starts_with(kFunctionOpen)) return std::nullopt;
        ParsedCall call;
        const FunctionEnd end = parse_function(body, pos, call);
        if (end == FunctionEnd::kFailed) return std::nullopt;
        calls.push_back(std::move(call));
        if (end == FunctionEnd::kUnclosed) break;  // only the last function may lack "</function>"
    }
    if (calls.empty()) return std::nullopt;
    return calls;
}

// {"param":value,...}: a repeated parameter keeps its first position and takes its last value.
std::string build_arguments(const ToolSchemas &tools, const ParsedCall &call) {
    std::vector<std::pair<std::string_view, std::string_view>> unique;
    std::unordered_map<std::string_view, size_t> where;
    for (const auto &[name, value] : call.params) {
        const auto [it, fresh] = where.emplace(name, unique.size());
        if (fresh) {
            unique.emplace_back(name, value);
        } else {
            unique[it->second].second = value;
        }
    }
    std::string out = "{";
    for (size_t i = 0; i < unique.size(); ++i) {
        if (i > 0) out.push_back(',');
        append_json_string(out, unique[i].first);
        out.push_back(':');
        out.append(tools.argument_json(call.name, unique[i].first, unique[i].second));
    }
    out.push_back('}');
    return out;
}

uint64_t hash_field(uint64_t h, std::string_view s) {
    constexpr uint64_t kPrime = 0x100000001b3ULL;  // FNV-1a 64
    uint64_t n = s.size();
    for (int i = 0; i < 8; ++i, n >>= 8) h = (h ^ (n & 0xFF)) * kPrime;  // length first: fields cannot run together
    for (char c : s) h = (h ^ static_cast<uint8_t>(c)) * kPrime;
    return h;
}

std::string make_call_id(std::string_view salt, int index, std::string_view name, std::string_view arguments) {
    uint64_t h = 0xcbf29ce484222325ULL;
    h = hash_field(h, salt);
    h = hash_field(h, std::to_string(index));
    h = hash_field(h, name);
    h = hash_field(h, arguments);
    // splitmix64's finalizer, so that nearby inputs give unrelated ids.
    h ^= h >> 30;
    h *= 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebULL;
    h ^= h >> 31;
    return fmt::format("call_{}_{:016x}", index, h);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// StopMatcher
// ---------------------------------------------------------------------------------------------

Result<StopMatcher> StopMatcher::create(std::span<const std::string> stops) {
    StopMatcher m;
    for (size_t i = 0; i < stops.size(); ++i) {
        const std::string &s = stops[i];
        if (s.empty()) return make_error("stop[{}]: expected a non-empty string, found \"\"", i);
        if (!utf8_is_valid(s)) return make_error("stop[{}]: expected valid UTF-8, found invalid bytes", i);
        Pattern p;
        p.text = s;
        p.fail.assign(s.size(), 0);
        for (size_t j = 1, k = 0; j < s.size(); ++j) {
            while (k > 0 && s[j] != s[k]) k = p.fail[k - 1];
            if (s[j] == s[k]) ++k;
            p.fail[j] = k;
        }
        m.max_len_ = std::max(m.max_len_, s.size());
        m.patterns_.push_back(std::move(p));
    }
    return m;
}

std::optional<size_t> StopMatcher::matched_stop() const {
    if (!stopped_) return std::nullopt;
    return cut_pattern_;
}

std::string StopMatcher::take_held(uint64_t end) {
    const auto n = static_cast<size_t>(end - emitted_);
    std::string out = held_.substr(held_begin_, n);
    held_begin_ += n;
    emitted_ = end;
    if (held_begin_ > 4096 && held_begin_ * 2 > held_.size()) {  // compact now and then: amortized O(1) a byte
        held_.erase(0, held_begin_);
        held_begin_ = 0;
    }
    return out;
}

StopStep StopMatcher::feed(std::string_view piece) {
    if (stopped_ || finished_) return {"", stopped_};
    size_t used = 0;
    while (used < piece.size() && !stopped_) {
        const char c = piece[used++];
        ++fed_;
        for (size_t i = 0; i < patterns_.size(); ++i) {
            Pattern &p = patterns_[i];
            size_t s = p.state;
            while (s > 0 && p.text[s] != c) s = p.fail[s - 1];
            if (p.text[s] == c) ++s;
            if (s == p.text.size()) {
                const uint64_t start = fed_ - s;
                if (!cut_ || start < *cut_ || (start == *cut_ && s < patterns_[cut_pattern_].text.size())) {
                    cut_ = start;
                    cut_pattern_ = i;
                }
                s = p.fail[s - 1];
            }
            p.state = s;
        }
        if (cut_) {
            // Final once no partial match that started before the cut is still alive.
            bool alive = false;
            for (const Pattern &p : patterns_) alive = alive || fed_ - p.state < *cut_;
            stopped_ = !alive;
        }
    }
    held_.append(piece.substr(0, used));
    if (stopped_) {
        StopStep out{take_held(*cut_), true};
        held_.clear();
        held_begin_ = 0;
        emitted_ = fed_;
        return out;
    }
    size_t longest = 0;
    for (const Pattern &p : patterns_) longest = std::max(longest, p.state);
    uint64_t end = fed_ - longest;
    if (cut_) end = std::min(end, *cut_);
    // Keep back a character whose last bytes have not arrived yet.
    const std::string_view ready(held_.data() + held_begin_, static_cast<size_t>(end - emitted_));
    for (size_t back = 1; back <= std::min<size_t>(4, ready.size()); ++back) {
        const size_t at = ready.size() - back;
        if ((static_cast<uint8_t>(ready[at]) & 0xC0) == 0x80) continue;  // continuation byte: look further back
        const Utf8Step step = utf8_step(ready.substr(at));
        if (step.kind == Utf8Kind::kIncomplete && step.len == back) end -= back;
        break;
    }
    return {take_held(end), false};
}

StopStep StopMatcher::finish() {
    if (stopped_ || finished_) {
        finished_ = true;
        return {"", stopped_};
    }
    finished_ = true;
    if (cut_) {
        stopped_ = true;  // the longer candidates that started earlier can no longer complete
        StopStep out{take_held(*cut_), true};
        held_.clear();
        held_begin_ = 0;
        return out;
    }
    return {take_held(fed_), false};
}

// ---------------------------------------------------------------------------------------------
// ToolSchemas
// ---------------------------------------------------------------------------------------------

Result<ToolSchemas> ToolSchemas::from_json(const nlohmann::json &tools) {
    ToolSchemas out;
    if (tools.is_null()) return out;
    if (!tools.is_array()) return make_error("tools: expected an array, found {}", describe_json(tools));
    std::unordered_map<std::string, size_t> seen;
    for (size_t i = 0; i < tools.size(); ++i) {
        const Json &tool = tools[i];
        const std::string path = json_path("tools", i);
        if (!tool.is_object()) return make_error("{}: expected an object, found {}", path, describe_json(tool));
        if (const Json *type = json_find(tool, "type")) {
            if (!type->is_string())
                return make_error("{}: expected a string, found {}", json_path(path, "type"), describe_json(*type));
            if (type->get_ref<const std::string &>() != "function") continue;
        }
        const Json *fn = json_find(tool, "function");
        if (fn == nullptr || !fn->is_object()) {
            return make_error("{}: expected an object, found {}", json_path(path, "function"),
                              fn == nullptr ? std::string("nothing") : describe_json(*fn));
        }
        const std::string fn_path = json_path(path, "function");
        const Json *name = json_find(*fn, "name");
        if (name == nullptr || !name->is_string()) {
            return make_error("{}: expected a string, found {}", json_path(fn_path, "name"),
                              name == nullptr ? std::string("nothing") : describe_json(*name));
        }
        const std::string &fn_name = name->get_ref<const std::string &>();
        const auto [it, fresh] = seen.emplace(fn_name, i);
        if (!fresh) {
            return make_error("{}: expected a unique function name, found \"{}\" again (first in tools[{}])",
                              json_path(fn_path, "name"), fn_name, it->second);
        }
        auto &params = out.functions_[fn_name];
        const Json *parameters = json_find(*fn, "parameters");
        if (parameters == nullptr || parameters->is_null()) continue;
        if (!parameters->is_object()) {
            return make_error("{}: expected an object, found {}", json_path(fn_path, "parameters"),
                              describe_json(*parameters));
        }
        const Json *properties = json_find(*parameters, "properties");
        if (properties == nullptr || !properties->is_object()) continue;
        for (const auto &[param, schema] : properties->items()) {
            int budget = kSchemaBudget;
            params[param] = schema_types(schema, *parameters, 0, budget);
        }
    }
    return out;
}

std::string ToolSchemas::argument_json(std::string_view function, std::string_view param,
                                       std::string_view value) const {
    uint8_t types = 0;
    if (const auto fn = functions_.find(std::string(function)); fn != functions_.end()) {
        if (const auto p = fn->second.find(std::string(param)); p != fn->second.end()) types = p->second;
    }
    std::string out;
    if ((types & kTypeString) != 0) {
        if ((types & kTypeNull) != 0 && value == "null") return "null";
        append_json_string(out, value);
        return out;
    }
    // Non-string or unconstrained: the JSON reading when there is one. accept() runs the SAX
    // parser without building a tree, iteratively, and reports errors without throwing. Its lexer
    // takes a NUL byte for the end of the input ("8\0x" would pass), and a NUL is never part of
    // JSON text, so such a value is a string.
    const std::string_view trimmed = trim_space(value);  // is_space() is JSON's whitespace
    if (!trimmed.empty() && trimmed.find('\0') == std::string_view::npos && Json::accept(trimmed))
        return std::string(trimmed);
    append_json_string(out, value);
    return out;
}

// ---------------------------------------------------------------------------------------------
// ChatOutputParser
// ---------------------------------------------------------------------------------------------

void ChatOutputDelta::append(ChatOutputDelta &&next) {
    reasoning += next.reasoning;
    content += next.content;
    for (ToolCall &call : next.tool_calls) tool_calls.push_back(std::move(call));
}

ChatOutputParser::ChatOutputParser(ChatOutputOptions options, ToolSchemas tools)
    : options_(std::move(options)), tools_(std::move(tools)) {
    if (options_.parse_tool_calls) sentinels_ = {kToolCallOpen, kFunctionOpen, kToolCallClose};
    if (options_.parse_reasoning) {
        sentinels_.push_back(kThinkOpen);
        sentinels_.push_back(kThinkClose);
    }
    phase_ = options_.parse_reasoning ? Phase::kStart : Phase::kContent;
}

ChatOutputDelta ChatOutputParser::feed(std::string_view piece) {
    ChatOutputDelta out;
    if (!finished_) split_reasoning(piece, false, out);
    return out;
}

ChatOutputDelta ChatOutputParser::finish() {
    ChatOutputDelta out;
    if (finished_) return out;
    finished_ = true;
    split_reasoning({}, true, out);
    scan_content({}, true, out);
    if (options_.parse_tool_calls && !run_has_text_) {
        // A whitespace-only last run: kept only when the output has no call for it to touch.
        if (n_calls_ == 0) out.content += ws_pending_;
        ws_pending_.clear();
    }
    return out;
}

void ChatOutputParser::split_reasoning(std::string_view piece, bool final, ChatOutputDelta &out) {
    if (phase_ == Phase::kContent) {
        scan_content(piece, false, out);
        return;
    }
    r_buf_.append(piece);
    while (true) {
        switch (phase_) {
        case Phase::kStart: {
            size_t i = start_ws_;
            while (i < r_buf_.size() && is_space(r_buf_[i])) ++i;
            start_ws_ = i;
            const std::string_view rest = std::string_view(r_buf_).substr(i);
            if (rest.starts_with(kThinkOpen)) {
                r_buf_.erase(0, i + kThinkOpen.size());
                phase_ = Phase::kAfterThinkOpen;
                break;
            }
            if (!final && kThinkOpen.starts_with(rest)) return;  // whitespace, maybe a partial "<think>"
            phase_ = options_.starts_in_reasoning ? Phase::kReasoning : Phase::kContent;
            break;
        }
        case Phase::kAfterThinkOpen:
        case Phase::kAfterThinkClose: {
            if (r_buf_.empty() && !final) return;  // the next byte decides
            if (!r_buf_.empty() && r_buf_[0] == '\n') r_buf_.erase(0, 1);
            phase_ = phase_ == Phase::kAfterThinkOpen ? Phase::kReasoning : Phase::kContent;
            break;
        }
        case Phase::kReasoning: {
            const size_t end = r_buf_.find(kThinkClose);
            if (end != std::string::npos) {
                std::string_view reasoning = std::string_view(r_buf_).substr(0, end);
                if (reasoning.ends_with('\n')) reasoning.remove_suffix(1);
                out.reasoning += reasoning;
                r_buf_.erase(0, end + kThinkClose.size());
                phase_ = Phase::kAfterThinkClose;
                break;
            }
            const size_t hold =
                final ? 0 : std::max(partial_suffix(r_buf_, kNewlineThinkClose), partial_suffix(r_buf_, kThinkClose));
            out.reasoning.append(r_buf_, 0, r_buf_.size() - hold);
            r_buf_.erase(0, r_buf_.size() - hold);
            return;
        }
        case Phase::kContent: {
            const std::string rest = std::move(r_buf_);
            r_buf_.clear();
            scan_content(rest, false, out);
            return;
        }
        }
    }
}

void ChatOutputParser::scan_content(std::string_view text, bool final, ChatOutputDelta &out) {
    if (sentinels_.empty()) {
        emit_content(text, out);
        return;
    }
    c_buf_.append(text);
    const std::string_view buf = c_buf_;
    size_t pos = 0;  // buf[0, pos) is dealt with
    while (pos < buf.size()) {
        if (scan_ == Scan::kText) {
            // Every sentinel starts with '<': look at each '<' for a sentinel or the start of one.
            size_t q = pos;
            std::string_view match;
            bool hold = false;
            while ((q = buf.find('<', q)) != std::string_view::npos) {
                const std::string_view rest = buf.substr(q);
                for (std::string_view s : sentinels_) {
                    if (rest.starts_with(s)) {
                        match = s;
                    } else if (!final && s.starts_with(rest)) {
                        hold = true;  // rest is shorter than s: a sentinel may begin here
                    }
                }
                if (!match.empty() || hold) break;
                ++q;
            }
            if (q == std::string_view::npos) {
                emit_content(buf.substr(pos), out);
                pos = buf.size();
                break;
            }
            emit_content(buf.substr(pos, q - pos), out);
            pos = q;
            if (match.empty()) break;  // hold the possible sentinel start
            if (match == kToolCallOpen || match == kFunctionOpen) {
                scan_ = match == kToolCallOpen ? Scan::kToolCall : Scan::kBareFunction;
                block_scan_ = q + match.size();
            } else {
                pos = q + match.size();  // a stray "</tool_call>", "<think>" or "</think>": markup, dropped
            }
            continue;
        }
        // An open block starts at buf[pos]: its end, or a new "<tool_call>" that cuts it short.
        const std::string_view close = scan_ == Scan::kToolCall ? kToolCallClose : kFunctionClose;
        const size_t close_at = buf.find(close, block_scan_);
        const size_t reopen_at = buf.find(kToolCallOpen, block_scan_);
        if (close_at != std::string_view::npos && (reopen_at == std::string_view::npos || close_at < reopen_at)) {
            const size_t end = close_at + close.size();
            end_block(buf.substr(pos, end - pos), scan_ == Scan::kToolCall, out);
            pos = end;
        } else if (reopen_at != std::string_view::npos) {
            emit_content(buf.substr(pos, reopen_at - pos), out);  // malformed: verbatim
            pos = reopen_at;
        } else if (final) {
            emit_content(buf.substr(pos), out);  // never closed: verbatim
            pos = buf.size();
        } else {
            // Resume the search where a sentinel cut by the end of this text could begin.
            const size_t keep = std::max(close.size(), kToolCallOpen.size()) - 1;
            if (buf.size() > keep) block_scan_ = std::max(block_scan_, buf.size() - keep);
            break;
        }
        scan_ = Scan::kText;
    }
    c_buf_.erase(0, pos);
    if (scan_ != Scan::kText) block_scan_ -= pos;
}

void ChatOutputParser::emit_content(std::string_view text, ChatOutputDelta &out) {
    if (text.empty()) return;
    if (!options_.parse_tool_calls || run_has_text_) {
        out.content += text;
        return;
    }
    size_t i = 0;
    while (i < text.size() && is_space(text[i])) ++i;
    if (i == text.size()) {
        ws_pending_ += text;  // whitespace only so far: dropped if a call comes next
        return;
    }
    out.content += ws_pending_;
    out.content += text;
    ws_pending_.clear();
    run_has_text_ = true;
}

void ChatOutputParser::end_block(std::string_view block, bool wrapped, ChatOutputDelta &out) {
    const std::optional<std::vector<ParsedCall>> calls = parse_block(block, wrapped);
    if (!calls) {
        emit_content(block, out);  // not the format: verbatim content
        return;
    }
    ws_pending_.clear();  // a whitespace-only run before a call is dropped
    run_has_text_ = false;  // and the text after the call starts a new run
    for (const ParsedCall &parsed : *calls) {
        ToolCall call;
        call.index = n_calls_++;
        call.name = std::string(parsed.name);
        call.arguments = build_arguments(tools_, parsed);
        call.id = make_call_id(options_.call_id_salt, call.index, call.name, call.arguments);
        out.tool_calls.push_back(std::move(call));
    }
}

ChatOutputDelta parse_chat_output(std::string_view text, const ChatOutputOptions &options, const ToolSchemas &tools) {
    ChatOutputParser parser(options, tools);
    ChatOutputDelta out = parser.feed(text);
    out.append(parser.finish());
    return out;
}

}  // namespace memra::text
