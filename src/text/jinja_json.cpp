// JSON for the Jinja interpreter: json.dumps as transformers' tojson filter calls it (ensure_ascii,
// indent, separators, sort_keys; Infinity / NaN like Python), and the conversion of the render context
// from nlohmann::ordered_json into values, bounded in depth.
#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "text/jinja_impl.h"

namespace memra::text::jinja {

namespace {

void append_json_string(std::string &out, const std::string &s, bool ensure_ascii) {
    out += '"';
    for (size_t p = 0; p < s.size();) {
        char32_t c;
        const size_t n = utf8_decode(s, p, c);
        switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        default:
            if (c < 0x20) {
                out += fmt::format("\\u{:04x}", static_cast<uint32_t>(c));
            } else if (ensure_ascii && c >= 0x80) {
                if (c >= 0x10000) {
                    const uint32_t v = static_cast<uint32_t>(c) - 0x10000;
                    out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
                } else {
                    out += fmt::format("\\u{:04x}", static_cast<uint32_t>(c));
                }
            } else {
                out.append(s, p, n);
            }
        }
        p += n;
    }
    out += '"';
}

std::string json_float(double v) {
    if (std::isnan(v)) return "NaN";
    if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
    return format_float(v);
}

void append_json(std::string &out, const Value &v, const JsonFormat &f, int level);

void newline_indent(std::string &out, const JsonFormat &f, int level) {
    out += '\n';
    for (int k = 0; k < level && out.size() <= f.max_bytes; ++k) out += f.indent;
    if (out.size() > f.max_bytes) fail(fmt::format("output exceeds {} bytes", f.max_bytes));
}

void append_json_dict(std::string &out, const DictObj &d, const JsonFormat &f, int level) {
    if (d.items.empty()) {
        out += "{}";
        return;
    }
    std::vector<const std::pair<Value, Value> *> items;
    for (const auto &kv : d.items) items.push_back(&kv);
    if (f.sort_keys) {
        std::stable_sort(items.begin(), items.end(),
                         [](const auto *a, const auto *b) { return py_less(a->first, b->first, "<"); });
    }
    out += '{';
    bool first = true;
    for (const auto *kv : items) {
        if (!first) out += f.item_sep;
        first = false;
        if (f.has_indent) newline_indent(out, f, level + 1);
        const Value &k = kv->first;
        switch (k.kind) {
        case Kind::kString: append_json_string(out, k.str(), f.ensure_ascii); break;
        case Kind::kNone: out += "\"null\""; break;
        case Kind::kBool: out += k.b ? "\"true\"" : "\"false\""; break;
        case Kind::kInt: out += fmt::format("\"{}\"", k.i); break;
        case Kind::kFloat: out.append(1, '"').append(json_float(k.f)).append(1, '"'); break;
        default: fail(fmt::format("keys must be str, int, float, bool or None, not {}", type_name(k)));
        }
        out += f.key_sep;
        append_json(out, kv->second, f, level + 1);
    }
    if (f.has_indent) newline_indent(out, f, level);
    out += '}';
}

void append_json(std::string &out, const Value &v, const JsonFormat &f, int level) {
    switch (v.kind) {
    case Kind::kNone: out += "null"; return;
    case Kind::kBool: out += v.b ? "true" : "false"; return;
    case Kind::kInt: out += fmt::format("{}", v.i); return;
    case Kind::kFloat: out += json_float(v.f); return;
    case Kind::kString:
        append_json_string(out, v.str(), f.ensure_ascii);
        if (out.size() > f.max_bytes) fail(fmt::format("output exceeds {} bytes", f.max_bytes));
        return;
    case Kind::kList:
    case Kind::kTuple: {
        const auto &items = v.items();
        if (items.empty()) {
            out += "[]";
            return;
        }
        out += '[';
        for (size_t k = 0; k < items.size(); ++k) {
            if (k) out += f.item_sep;
            if (f.has_indent) newline_indent(out, f, level + 1);
            append_json(out, items[k], f, level + 1);
        }
        if (f.has_indent) newline_indent(out, f, level);
        out += ']';
        return;
    }
    case Kind::kDict: append_json_dict(out, v.dict(), f, level); return;
    default: {
        const std::string name = v.kind == Kind::kNamespace  ? "TemplateNamespace"
                                 : v.kind == Kind::kCallable ? "Macro"
                                                             : type_name(v);
        fail(fmt::format("Object of type {} is not JSON serializable", name));
    }
    }
}

}  // namespace

std::string to_json(const Value &v, const JsonFormat &format) {
    std::string out;
    append_json(out, v, format, 0);
    return out;
}

Value from_json(const nlohmann::ordered_json &j, int max_depth) {
    using T = nlohmann::ordered_json::value_t;
    switch (j.type()) {
    case T::null: return Value::none();
    case T::boolean: return Value::boolean(j.get<bool>());
    case T::number_integer: return Value::integer(j.get<int64_t>());
    case T::number_unsigned: {
        const auto u = j.get<uint64_t>();
        return u <= static_cast<uint64_t>(INT64_MAX) ? Value::integer(static_cast<int64_t>(u))
                                                     : Value::number(static_cast<double>(u));
    }
    case T::number_float: return Value::number(j.get<double>());
    case T::string: return Value::string(j.get<std::string>());
    case T::array:
    case T::object: {
        if (max_depth <= 0) fail("the context is nested too deeply");
        if (j.is_array()) {
            std::vector<Value> items;
            items.reserve(j.size());
            for (const auto &x : j) items.push_back(from_json(x, max_depth - 1));
            return Value::list(std::move(items));
        }
        DictObj d;
        for (const auto &[k, x] : j.items()) d.set(Value::string(k), from_json(x, max_depth - 1));
        return make_dict(std::move(d));
    }
    default: fail("the context holds a value JSON cannot express (binary)");
    }
}

}  // namespace memra::text::jinja
