// Jinja values behave as the Python objects jinja2 would hold: str() and repr() as Python prints them
// (float repr, string quoting), Python's equality across int/float/bool, its ordering and `in`.
// Strings are UTF-8 measured in code points; an invalid byte counts as one character.
#include <algorithm>
#include <charconv>
#include <cmath>

#include <fmt/format.h>

#include "text/jinja_impl.h"
#include "text/utf8.h"

namespace memra::text::jinja {

void fail(std::string message) { throw RenderError{std::move(message)}; }

// ---------------------------------------------------------------------------------------------
// Construction and access
// ---------------------------------------------------------------------------------------------

Value Value::undefined(std::string message) {
    Value v;
    if (!message.empty()) {
        auto s = std::make_shared<StrObj>();
        s->s = std::move(message);
        v.obj = std::move(s);
    }
    return v;
}

Value Value::boolean(bool x) {
    Value v = make(Kind::kBool);
    v.b = x;
    return v;
}

Value Value::integer(int64_t x) {
    Value v = make(Kind::kInt);
    v.i = x;
    return v;
}

Value Value::number(double x) {
    Value v = make(Kind::kFloat);
    v.f = x;
    return v;
}

Value Value::string(std::string s) {
    Value v = make(Kind::kString);
    auto o = std::make_shared<StrObj>();
    o->s = std::move(s);
    v.obj = std::move(o);
    return v;
}

Value Value::markup(std::string s) {
    Value v = string(std::move(s));
    v.b = true;
    return v;
}

Value Value::list(std::vector<Value> items, Kind kind) {
    Value v = make(kind);
    auto o = std::make_shared<ListObj>();
    for (const Value &x : items) {
        if (const auto *c = dynamic_cast<const ContainerInfo *>(x.obj.get())) {
            o->depth = std::max(o->depth, c->depth + 1);
            o->holds_namespace = o->holds_namespace || c->holds_namespace;
        }
    }
    o->items = std::move(items);
    v.obj = std::move(o);
    return v;
}

Value make_dict(DictObj dict, Kind kind) {
    Value v = Value::make(kind);
    dict.depth = 1;
    dict.holds_namespace = kind == Kind::kNamespace;
    for (const auto &[k, x] : dict.items) {
        if (const auto *c = dynamic_cast<const ContainerInfo *>(x.obj.get())) {
            dict.depth = std::max(dict.depth, c->depth + 1);
            dict.holds_namespace = dict.holds_namespace || c->holds_namespace;
        }
    }
    v.obj = std::make_shared<DictObj>(std::move(dict));
    return v;
}

const std::string &Value::str() const {
    static const std::string kEmpty;
    const auto *s = dynamic_cast<const StrObj *>(obj.get());
    return s ? s->s : kEmpty;
}

const std::vector<Value> &Value::items() const {
    static const std::vector<Value> kEmpty;
    const auto *l = dynamic_cast<const ListObj *>(obj.get());
    return l ? l->items : kEmpty;
}

const DictObj &Value::dict() const {
    static const DictObj kEmpty;
    const auto *d = dynamic_cast<const DictObj *>(obj.get());
    return d ? *d : kEmpty;
}

const Value *DictObj::find(std::string_view key) const {
    const auto it = string_index.find(std::string(key));
    return it == string_index.end() ? nullptr : &items[it->second].second;
}

const Value *DictObj::find(const Value &key) const {
    if (key.is_string()) return find(key.str());
    if (key.kind == Kind::kList || key.kind == Kind::kDict || key.kind == Kind::kNamespace) return nullptr;
    for (const auto &[k, v] : items) {
        if (!k.is_string() && py_equal(k, key)) return &v;
    }
    return nullptr;
}

void DictObj::set(Value key, Value value) {
    if (key.kind == Kind::kList || key.kind == Kind::kDict || key.kind == Kind::kNamespace) {
        fail(fmt::format("unhashable type: '{}'", type_name(key)));
    }
    if (const Value *existing = find(key)) {
        const_cast<Value &>(*existing) = std::move(value);
        return;
    }
    if (key.is_string()) string_index.emplace(key.str(), items.size());
    items.emplace_back(std::move(key), std::move(value));
}

// ---------------------------------------------------------------------------------------------
// UTF-8
// ---------------------------------------------------------------------------------------------

size_t utf8_decode(std::string_view s, size_t pos, char32_t &cp) {
    const auto c = static_cast<unsigned char>(s[pos]);
    if (c < 0x80) {
        cp = c;
        return 1;
    }
    const Utf8Step step = utf8_step(s.substr(pos));
    if (step.kind != Utf8Kind::kValid) {
        cp = 0xFFFD;
        return 1;
    }
    size_t p = pos;
    cp = utf8_next(s, p);
    return step.len;
}

size_t utf8_length(std::string_view s) {
    size_t n = 0;
    for (size_t p = 0; p < s.size(); ++n) {
        char32_t cp;
        p += utf8_decode(s, p, cp);
    }
    return n;
}

std::vector<size_t> utf8_offsets(std::string_view s) {
    std::vector<size_t> out;
    out.reserve(s.size() + 1);
    for (size_t p = 0; p < s.size();) {
        out.push_back(p);
        char32_t cp;
        p += utf8_decode(s, p, cp);
    }
    out.push_back(s.size());
    return out;
}

bool py_isspace(char32_t c) {
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// ---------------------------------------------------------------------------------------------
// str() and repr()
// ---------------------------------------------------------------------------------------------

bool truthy(const Value &v) {
    switch (v.kind) {
    case Kind::kUndefined:
    case Kind::kNone: return false;
    case Kind::kBool: return v.b;
    case Kind::kInt: return v.i != 0;
    case Kind::kFloat: return v.f != 0;
    case Kind::kString: return !v.str().empty();
    case Kind::kList:
    case Kind::kTuple: return !v.items().empty();
    case Kind::kDict: return !v.dict().items.empty();
    case Kind::kIterator: return !static_cast<const IterObj &>(*v.obj).sized() || !v.items().empty();
    default: return true;
    }
}

std::string format_float(double v) {
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    char buf[64];
    const auto res = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
    std::string_view s(buf, static_cast<size_t>(res.ptr - buf));  // shortest round trip: -d.ddde+XX
    std::string out;
    if (s[0] == '-') {
        out += '-';
        s.remove_prefix(1);
    }
    const size_t e = s.find('e');
    std::string digits;
    for (char c : s.substr(0, e)) {
        if (c != '.') digits += c;
    }
    int exp = 0;
    std::from_chars(s.data() + e + 1 + (s[e + 1] == '+' ? 1 : 0), s.data() + s.size(), exp);
    if (exp >= -4 && exp < 16) {  // Python's repr switches to exponents outside [1e-4, 1e16)
        if (exp >= 0) {
            const auto int_len = static_cast<size_t>(exp) + 1;
            if (digits.size() <= int_len) {
                out += digits + std::string(int_len - digits.size(), '0') + ".0";
            } else {
                out += digits.substr(0, int_len) + "." + digits.substr(int_len);
            }
        } else {
            out += "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
        }
        return out;
    }
    out += digits.substr(0, 1);
    if (digits.size() > 1) out.append(1, '.').append(digits, 1);
    out += fmt::format("e{}{:02d}", exp < 0 ? '-' : '+', std::abs(exp));
    return out;
}

const char *type_name(const Value &v) {
    switch (v.kind) {
    case Kind::kUndefined: return "Undefined";
    case Kind::kNone: return "NoneType";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kString: return "str";
    case Kind::kList: return "list";
    case Kind::kTuple: return "tuple";
    case Kind::kDict: return "dict";
    case Kind::kNamespace: return "Namespace";
    case Kind::kCallable: return "function";
    case Kind::kLoop: return "LoopContext";
    case Kind::kIterator: return static_cast<const IterObj &>(*v.obj).type.c_str();
    }
    return "object";
}

std::string undefined_message(const Value &v) {
    const std::string &m = v.str();
    return m.empty() ? std::string("value is undefined") : m;
}

void fail_undefined(const Value &v) { fail(undefined_message(v)); }

namespace {

// Python's str.isprintable() is false for controls, format characters, separators other than the
// space, private use and a few non-characters; repr() escapes those.
bool py_printable(char32_t c) {
    if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD) return false;
    if (c == 0x1680 || (c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F) ||
        (c >= 0x205F && c <= 0x206F) || c == 0x3000 || c == 0xFEFF || (c >= 0xFFF9 && c <= 0xFFFB)) {
        return false;
    }
    if ((c >= 0x600 && c <= 0x605) || c == 0x61C || c == 0x6DD || c == 0x70F || c == 0x180E) return false;
    if ((c >= 0xD800 && c <= 0xF8FF) || (c >= 0xFDD0 && c <= 0xFDEF) || (c & 0xFFFE) == 0xFFFE) return false;
    if (c >= 0xE0000 || (c >= 0x1D173 && c <= 0x1D17A)) return false;
    return true;
}

void append_string_repr(std::string &out, const std::string &s) {
    const bool has_single = s.find('\'') != std::string::npos;
    const bool has_double = s.find('"') != std::string::npos;
    const char quote = has_single && !has_double ? '"' : '\'';
    out += quote;
    for (size_t p = 0; p < s.size();) {
        char32_t c;
        const size_t n = utf8_decode(s, p, c);
        if (c == 0xFFFD && n == 1 && static_cast<unsigned char>(s[p]) >= 0x80) {
            out += s[p];  // an invalid byte: Python never holds one; pass it through
        } else if (c == static_cast<char32_t>(quote) || c == '\\') {
            out += '\\';
            out += static_cast<char>(c);
        } else if (c == '\n') {
            out += "\\n";
        } else if (c == '\r') {
            out += "\\r";
        } else if (c == '\t') {
            out += "\\t";
        } else if (!py_printable(c)) {
            out += c < 0x100 ? fmt::format("\\x{:02x}", static_cast<uint32_t>(c))
                   : c < 0x10000 ? fmt::format("\\u{:04x}", static_cast<uint32_t>(c))
                                 : fmt::format("\\U{:08x}", static_cast<uint32_t>(c));
        } else {
            out.append(s, p, n);
        }
        p += n;
    }
    out += quote;
}

void check_limit(const std::string &out, size_t limit) {
    if (out.size() > limit) fail(fmt::format("output exceeds {} bytes", limit));
}

void append_dict_repr(std::string &out, const DictObj &d, size_t limit) {
    out += '{';
    bool first = true;
    for (const auto &[k, v] : d.items) {
        if (!first) out += ", ";
        first = false;
        append_repr(out, k, limit);
        out += ": ";
        append_repr(out, v, limit);
    }
    out += '}';
}

}  // namespace

void append_repr(std::string &out, const Value &v, size_t limit) {
    switch (v.kind) {
    case Kind::kString:
        append_string_repr(out, v.str());
        check_limit(out, limit);
        return;
    case Kind::kUndefined: out += "Undefined"; return;
    case Kind::kList:
    case Kind::kTuple: {
        const bool tuple = v.kind == Kind::kTuple;
        out += tuple ? '(' : '[';
        const auto &items = v.items();
        for (size_t k = 0; k < items.size(); ++k) {
            if (k) out += ", ";
            append_repr(out, items[k], limit);
        }
        if (tuple && items.size() == 1) out += ',';
        out += tuple ? ')' : ']';
        return;
    }
    case Kind::kDict: append_dict_repr(out, v.dict(), limit); return;
    case Kind::kIterator: {
        const auto &it = static_cast<const IterObj &>(*v.obj);
        if (!it.sized()) {
            out += fmt::format("<{} object>", it.type);
            return;
        }
        out += it.type + "([";
        for (size_t k = 0; k < it.items.size(); ++k) {
            if (k) out += ", ";
            append_repr(out, it.items[k], limit);
        }
        out += "])";
        return;
    }
    default: append_str(out, v, limit);
    }
}

void append_str(std::string &out, const Value &v, size_t limit) {
    switch (v.kind) {
    case Kind::kUndefined: return;
    case Kind::kNone: out += "None"; return;
    case Kind::kBool: out += v.b ? "True" : "False"; return;
    case Kind::kInt: out += fmt::format("{}", v.i); return;
    case Kind::kFloat: out += format_float(v.f); return;
    case Kind::kString:
        out += v.str();
        check_limit(out, limit);
        return;
    case Kind::kNamespace:
        out += "<Namespace ";
        append_dict_repr(out, v.dict(), limit);
        out += '>';
        return;
    case Kind::kCallable: {
        const auto &c = static_cast<const CallableObj &>(*v.obj);
        out += c.fn == CallableObj::Fn::kMacro ? fmt::format("<Macro '{}'>", c.name)
                                               : fmt::format("<built-in method {}>", c.name);
        return;
    }
    case Kind::kLoop: {
        const auto &l = static_cast<const LoopObj &>(*v.obj);
        out += fmt::format("<LoopContext {}/{}>", l.index0 + 1, l.length);
        return;
    }
    default: append_repr(out, v, limit);
    }
}

std::string to_str(const Value &v, size_t limit) {
    if (v.is_string()) return v.str();
    std::string out;
    append_str(out, v, limit);
    return out;
}

std::string repr(const Value &v, size_t limit) {
    std::string out;
    append_repr(out, v, limit);
    return out;
}

std::string repr_short(const Value &v) {
    constexpr size_t kShown = 200;
    if (v.is_string() && v.str().size() <= kShown) return repr(v, kShown * 4 + 2);
    if (v.is_string() || v.kind == Kind::kList || v.kind == Kind::kTuple || v.kind == Kind::kDict ||
        v.kind == Kind::kNamespace || v.kind == Kind::kIterator) {
        return fmt::format("<{} object>", type_name(v));  // too long or nested to print in a message
    }
    return repr(v, kShown);
}

// ---------------------------------------------------------------------------------------------
// Comparison
// ---------------------------------------------------------------------------------------------

namespace {

// Exact comparison of an integer with a double, as Python compares int and float: -1, 0, 1, or 2 for NaN.
int compare_int_float(int64_t a, double b) {
    if (std::isnan(b)) return 2;
    if (b >= 9223372036854775808.0) return -1;
    if (b < -9223372036854775808.0) return 1;
    const double t = std::trunc(b);
    const auto bi = static_cast<int64_t>(t);
    if (a != bi) return a < bi ? -1 : 1;
    return t == b ? 0 : (b > t ? -1 : 1);
}

// -1 / 0 / 1, or 2 when unordered (NaN).
int compare_numbers(const Value &a, const Value &b) {
    if (a.is_int() && b.is_int()) return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int() ? 1 : 0;
    if (a.is_int()) return compare_int_float(a.as_int(), b.f);
    if (b.is_int()) {
        const int c = compare_int_float(b.as_int(), a.f);
        return c == 2 ? 2 : -c;
    }
    if (std::isnan(a.f) || std::isnan(b.f)) return 2;
    return a.f < b.f ? -1 : a.f > b.f ? 1 : 0;
}

}  // namespace

bool py_equal(const Value &a, const Value &b) {
    if (a.is_number() && b.is_number()) return compare_numbers(a, b) == 0;
    if (a.kind != b.kind) return false;
    switch (a.kind) {
    case Kind::kUndefined:
    case Kind::kNone: return true;
    case Kind::kString: return a.str() == b.str();
    case Kind::kList:
    case Kind::kTuple: {
        const auto &x = a.items();
        const auto &y = b.items();
        if (x.size() != y.size()) return false;
        for (size_t k = 0; k < x.size(); ++k) {
            if (!py_equal(x[k], y[k])) return false;
        }
        return true;
    }
    case Kind::kDict: {
        const DictObj &x = a.dict();
        const DictObj &y = b.dict();
        if (x.items.size() != y.items.size()) return false;
        for (const auto &[k, v] : x.items) {
            const Value *other = y.find(k);
            if (!other || !py_equal(v, *other)) return false;
        }
        return true;
    }
    default: return a.obj == b.obj;
    }
}

bool py_less(const Value &a, const Value &b, std::string_view op) {
    if (a.is_undefined()) fail_undefined(a);
    if (b.is_undefined()) fail_undefined(b);
    if (a.is_number() && b.is_number()) return compare_numbers(a, b) == -1;
    if (a.is_string() && b.is_string()) return a.str() < b.str();  // UTF-8 byte order is code point order
    if (a.kind == b.kind && a.is_sequence()) {
        const auto &x = a.items();
        const auto &y = b.items();
        for (size_t k = 0; k < x.size() && k < y.size(); ++k) {
            if (!py_equal(x[k], y[k])) return py_less(x[k], y[k], op);
        }
        return x.size() < y.size();
    }
    fail(fmt::format("'{}' not supported between instances of '{}' and '{}'", op, type_name(a), type_name(b)));
}

bool py_contains(const Value &container, const Value &item) {
    switch (container.kind) {
    case Kind::kString:
        if (!item.is_string()) {
            fail(fmt::format("'in <string>' requires string as left operand, not {}", type_name(item)));
        }
        return container.str().find(item.str()) != std::string::npos;
    case Kind::kList:
    case Kind::kTuple:
    case Kind::kIterator:
        for (const Value &x : container.items()) {
            if (py_equal(x, item)) return true;
        }
        return false;
    case Kind::kDict:
        if (item.kind == Kind::kList || item.kind == Kind::kDict) {
            fail(fmt::format("unhashable type: '{}'", type_name(item)));
        }
        return container.dict().find(item) != nullptr;
    case Kind::kUndefined: return false;
    default: fail(fmt::format("argument of type '{}' is not iterable", type_name(container)));
    }
}

}  // namespace memra::text::jinja
