// Attribute and item access, slicing, and the Python methods chat templates call on strings, dicts,
// lists and the loop object, as jinja2's ImmutableSandboxedEnvironment exposes them (methods that
// mutate a list or dict are "unsafe": an Undefined that fails when called).
#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "text/jinja_impl.h"
#include "text/utf8.h"

namespace memra::text::jinja {
namespace {

// jinja2's object_type_repr: how an Undefined's message names the object it came from.
std::string object_type(const Value &v) {
    if (v.kind == Kind::kNone) return "None";
    if (v.kind == Kind::kNamespace) return "namespace object";
    return fmt::format("{} object", type_name(v));
}

Value no_attribute(const Value &obj, const std::string &name) {
    return Value::undefined(fmt::format("'{}' has no attribute '{}'", object_type(obj), name));
}

Value bound(const Value &self, std::string name) {
    Value v = Value::make(Kind::kCallable);
    auto c = std::make_shared<CallableObj>();
    c->fn = CallableObj::Fn::kMethod;
    c->name = std::move(name);
    c->self = self;
    v.obj = std::move(c);
    return v;
}

template <class Names>
bool one_of(std::string_view name, const Names &names) {
    return std::find(std::begin(names), std::end(names), name) != std::end(names);
}

constexpr std::string_view kStrMethods[] = {
    "startswith", "endswith", "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "upper", "lower",
    "title", "capitalize", "swapcase", "casefold", "replace", "find", "rfind", "index", "rindex", "count", "join",
    "isdigit", "isnumeric", "isdecimal", "isalpha", "isalnum", "isspace", "islower", "isupper", "center", "ljust",
    "rjust", "zfill", "partition", "rpartition", "removeprefix", "removesuffix", "format"};
constexpr std::string_view kDictMethods[] = {"items", "keys", "values", "get", "copy"};
constexpr std::string_view kDictUnsafe[] = {"pop", "popitem", "setdefault", "update", "clear"};
constexpr std::string_view kListMethods[] = {"index", "count", "copy"};
constexpr std::string_view kListUnsafe[] = {"append", "extend", "insert", "pop",
                                                                 "remove", "clear",  "sort",   "reverse"};

Value unsafe(const Value &obj, const std::string &name) {
    return Value::undefined(fmt::format("access to attribute '{}' of '{}' object is unsafe.", name, type_name(obj)));
}

Value loop_attribute(const Value &obj, const std::string &name) {
    const auto &l = static_cast<const LoopObj &>(*obj.obj);
    if (name == "index") return Value::integer(l.index0 + 1);
    if (name == "index0") return Value::integer(l.index0);
    if (name == "revindex") return Value::integer(l.length - l.index0);
    if (name == "revindex0") return Value::integer(l.length - l.index0 - 1);
    if (name == "first") return Value::boolean(l.index0 == 0);
    if (name == "last") return Value::boolean(l.index0 + 1 == l.length);
    if (name == "length") return Value::integer(l.length);
    if (name == "depth") return Value::integer(1);  // only recursive loops (unsupported) go deeper
    if (name == "depth0") return Value::integer(0);
    if (name == "previtem") return l.previtem;
    if (name == "nextitem") return l.nextitem;
    if (name == "cycle" || name == "changed") return bound(obj, name);
    return no_attribute(obj, name);
}

// A Python index into a sequence of `size` elements, negative from the end; false when out of range.
bool resolve_index(int64_t index, size_t size, size_t &out) {
    const auto n = static_cast<int64_t>(size);
    if (index < 0) index += n;
    if (index < 0 || index >= n) return false;
    out = static_cast<size_t>(index);
    return true;
}

}  // namespace

Value get_attribute(const Value &obj, const std::string &name) {
    switch (obj.kind) {
    case Kind::kDict:
        if (one_of(name, kDictMethods)) return bound(obj, name);
        if (one_of(name, kDictUnsafe)) return unsafe(obj, name);
        if (const Value *v = obj.dict().find(std::string_view(name))) return *v;
        return no_attribute(obj, name);
    case Kind::kNamespace:
        if (const Value *v = obj.dict().find(std::string_view(name))) return *v;
        return no_attribute(obj, name);
    case Kind::kString:
        if (one_of(name, kStrMethods)) return bound(obj, name);
        return no_attribute(obj, name);
    case Kind::kList:
    case Kind::kTuple:
        if (one_of(name, kListMethods)) return bound(obj, name);
        if (obj.kind == Kind::kList && one_of(name, kListUnsafe)) return unsafe(obj, name);
        return no_attribute(obj, name);
    case Kind::kLoop: return loop_attribute(obj, name);
    default: return no_attribute(obj, name);
    }
}

Value get_item(const Value &obj, const Value &key) {
    switch (obj.kind) {
    case Kind::kDict:
        if (const Value *v = obj.dict().find(key)) return *v;
        break;
    case Kind::kList:
    case Kind::kTuple:
        if (key.is_int()) {
            size_t k;
            if (resolve_index(key.as_int(), obj.items().size(), k)) return obj.items()[k];
        }
        break;
    case Kind::kString:
        if (key.is_int()) {
            const std::vector<size_t> offsets = utf8_offsets(obj.str());
            size_t k;
            if (resolve_index(key.as_int(), offsets.size() - 1, k)) {
                return Value::string(obj.str().substr(offsets[k], offsets[k + 1] - offsets[k]));
            }
        }
        break;
    default: break;
    }
    // jinja2 falls back to the attribute of that name, then to Undefined.
    if (key.is_string()) {
        if (obj.kind == Kind::kDict) {
            if (one_of(key.str(), kDictMethods)) return bound(obj, key.str());
            return no_attribute(obj, key.str());
        }
        return get_attribute(obj, key.str());
    }
    std::string what = object_type(obj);
    return Value::undefined(fmt::format("{} has no element {}", what, repr_short(key)));
}

Value slice_value(Renderer &r, const Value &obj, const Value &start, const Value &stop, const Value &step) {
    for (const Value *v : {&start, &stop, &step}) {
        if (!v->is_int() && v->kind != Kind::kNone) fail("slice indices must be integers or None");
    }
    std::vector<size_t> offsets;
    size_t length;
    if (obj.is_string()) {
        offsets = utf8_offsets(obj.str());
        length = offsets.size() - 1;
    } else if (obj.is_sequence()) {
        length = obj.items().size();
    } else {
        fail(fmt::format("'{}' object is not subscriptable", type_name(obj)));
    }
    const Int128 n = static_cast<Int128>(length);
    const Int128 st = step.kind == Kind::kNone ? 1 : step.as_int();
    if (st == 0) fail("slice step cannot be zero");
    const auto adjust = [&](const Value &v, Int128 dflt) -> Int128 {
        if (v.kind == Kind::kNone) return dflt;
        Int128 x = v.as_int();
        if (x < 0) {
            x += n;
            if (x < 0) x = st < 0 ? -1 : 0;
        } else if (x >= n) {
            x = st < 0 ? n - 1 : n;
        }
        return x;
    };
    const Int128 a = adjust(start, st < 0 ? n - 1 : 0);
    const Int128 b = adjust(stop, st < 0 ? -1 : n);
    Int128 count = 0;
    if (st < 0 && b < a) count = (a - b - 1) / (-st) + 1;
    if (st > 0 && a < b) count = (b - a - 1) / st + 1;
    r.charge(static_cast<uint64_t>(count));
    if (obj.is_string()) {
        std::string out;
        for (Int128 k = 0; k < count; ++k) {
            const auto at = static_cast<size_t>(a + k * st);
            out.append(obj.str(), offsets[at], offsets[at + 1] - offsets[at]);
        }
        return Value::string(std::move(out));
    }
    std::vector<Value> items;
    items.reserve(static_cast<size_t>(count));
    for (Int128 k = 0; k < count; ++k) items.push_back(obj.items()[static_cast<size_t>(a + k * st)]);
    return r.make_list(std::move(items), obj.kind);
}

std::vector<Value> iterate(Renderer &r, const Value &v) {
    switch (v.kind) {
    case Kind::kList:
    case Kind::kTuple:
    case Kind::kIterator: r.charge(v.items().size()); return v.items();
    case Kind::kDict: {
        std::vector<Value> keys;
        keys.reserve(v.dict().items.size());
        for (const auto &[k, x] : v.dict().items) keys.push_back(k);
        r.charge(keys.size());
        return keys;
    }
    case Kind::kString: {
        const std::vector<size_t> offsets = utf8_offsets(v.str());
        r.charge(offsets.size());
        std::vector<Value> chars;
        chars.reserve(offsets.size() - 1);
        for (size_t k = 0; k + 1 < offsets.size(); ++k) {
            chars.push_back(Value::string(v.str().substr(offsets[k], offsets[k + 1] - offsets[k])));
        }
        return chars;
    }
    case Kind::kUndefined: return {};
    default: fail(fmt::format("'{}' object is not iterable", type_name(v)));
    }
}

// ---------------------------------------------------------------------------------------------
// Methods
// ---------------------------------------------------------------------------------------------

namespace {

const std::string &str_arg(const CallArgs &args, size_t position, std::string_view name, std::string_view method) {
    const Value *v = args.get(position, name);
    if (!v) fail(fmt::format("{}() missing required argument '{}'", method, name));
    if (!v->is_string()) fail(fmt::format("{}() argument must be str, not {}", method, type_name(*v)));
    return v->str();
}

Value string_list(Renderer &r, std::vector<std::string> parts) {
    std::vector<Value> items;
    items.reserve(parts.size());
    for (std::string &p : parts) items.push_back(Value::string(std::move(p)));
    return r.make_list(std::move(items));
}

bool all_chars(const std::string &s, bool (*pred)(char32_t)) {
    if (s.empty()) return false;
    for (size_t p = 0; p < s.size();) {
        char32_t c;
        p += utf8_decode(s, p, c);
        if (!pred(c)) return false;
    }
    return true;
}

// Python's str.join: every element must be a str.
Value join_strings(Renderer &r, const std::string &sep, const Value &iterable) {
    std::string out;
    const std::vector<Value> items = iterate(r, iterable);
    for (size_t k = 0; k < items.size(); ++k) {
        if (!items[k].is_string()) {
            fail(fmt::format("sequence item {}: expected str instance, {} found", k, type_name(items[k])));
        }
        if (k) out += sep;
        out += items[k].str();
        r.check_size(out.size());
    }
    return Value::string(std::move(out));
}

Value pad(Renderer &r, const std::string &s, const CallArgs &args, char align) {
    const int64_t width = int_param(args, 0, "width", 0);
    const Value fill = param(args, 1, "fillchar", Value::string(" "));
    if (!fill.is_string() || utf8_length(fill.str()) != 1) {
        fail("the fill character must be exactly one character long");
    }
    const auto len = static_cast<int64_t>(utf8_length(s));
    if (width <= len) return Value::string(s);
    r.check_size(static_cast<size_t>(width) * fill.str().size());
    const int64_t total = width - len;
    int64_t left = align == '<' ? 0 : align == '>' ? total : total / 2 + (total & width & 1);
    std::string out;
    for (int64_t k = 0; k < left; ++k) out += fill.str();
    out += s;
    for (int64_t k = 0; k < total - left; ++k) out += fill.str();
    return Value::string(std::move(out));
}

Value string_method(Renderer &r, const std::string &name, const std::string &s, const CallArgs &args) {
    if (name == "startswith" || name == "endswith") {
        const Value *prefix = args.get(0, "prefix");
        if (!prefix) fail(fmt::format("{}() takes at least 1 argument (0 given)", name));
        const bool starts = name == "startswith";
        const auto test = [&](const Value &p) {
            if (!p.is_string()) {
                fail(fmt::format("{} first arg must be str or a tuple of str, not {}", name, type_name(p)));
            }
            const std::string &x = p.str();
            return x.size() <= s.size() && (starts ? s.compare(0, x.size(), x) == 0
                                                   : s.compare(s.size() - x.size(), x.size(), x) == 0);
        };
        if (prefix->kind == Kind::kTuple) {
            for (const Value &p : prefix->items()) {
                if (test(p)) return Value::boolean(true);
            }
            return Value::boolean(false);
        }
        return Value::boolean(test(*prefix));
    }
    const Value none = Value::none();
    if (name == "strip") return Value::string(str_strip(s, param(args, 0, "chars", none), true, true));
    if (name == "lstrip") return Value::string(str_strip(s, param(args, 0, "chars", none), true, false));
    if (name == "rstrip") return Value::string(str_strip(s, param(args, 0, "chars", none), false, true));
    if (name == "split" || name == "rsplit") {
        return string_list(r, str_split(s, param(args, 0, "sep", none), int_param(args, 1, "maxsplit", -1),
                                         name == "rsplit"));
    }
    if (name == "splitlines") {
        const bool keep = truthy(param(args, 0, "keepends", Value::boolean(false)));
        std::vector<std::string> lines;
        size_t start = 0;
        for (size_t p = 0; p < s.size(); ++p) {
            if (s[p] != '\n' && s[p] != '\r') continue;
            const size_t end = p;
            if (s[p] == '\r' && p + 1 < s.size() && s[p + 1] == '\n') ++p;
            lines.push_back(s.substr(start, (keep ? p + 1 : end) - start));
            start = p + 1;
        }
        if (start < s.size()) lines.push_back(s.substr(start));
        return string_list(r, std::move(lines));
    }
    if (name == "upper") return Value::string(str_upper(s));
    if (name == "lower" || name == "casefold") return Value::string(str_lower(s));
    if (name == "title") return Value::string(str_title(s));
    if (name == "capitalize") return Value::string(str_capitalize(s));
    if (name == "swapcase") {
        std::string out;
        for (size_t p = 0; p < s.size();) {
            char32_t c;
            p += utf8_decode(s, p, c);
            utf8_append(out, cp_upper(c) != c ? cp_upper(c) : cp_lower(c));
        }
        return Value::string(std::move(out));
    }
    if (name == "replace") {
        const std::string &old = str_arg(args, 0, "old", name);
        const std::string &repl = str_arg(args, 1, "new", name);
        const int64_t count = int_param(args, 2, "count", -1);
        if (!old.empty() && !repl.empty() && repl.size() > old.size()) {
            r.check_size(s.size() + static_cast<size_t>(str_count(s, old)) * (repl.size() - old.size()));
        } else if (old.empty()) {
            r.check_size(s.size() + (utf8_length(s) + 1) * repl.size());
        }
        return Value::string(str_replace(s, old, repl, count));
    }
    if (name == "find" || name == "rfind" || name == "index" || name == "rindex") {
        const int64_t at = str_find(s, str_arg(args, 0, "sub", name), name[0] == 'r');
        if (at < 0 && name.find("index") != std::string::npos) fail("substring not found");
        return Value::integer(at);
    }
    if (name == "count") return Value::integer(str_count(s, str_arg(args, 0, "sub", name)));
    if (name == "join") {
        const Value *it = args.get(0, "iterable");
        if (!it) fail("join() takes exactly one argument (0 given)");
        return join_strings(r, s, *it);
    }
    if (name == "isdigit" || name == "isnumeric" || name == "isdecimal") {
        return Value::boolean(all_chars(s, [](char32_t c) { return c >= '0' && c <= '9'; }));
    }
    if (name == "isalpha") return Value::boolean(all_chars(s, [](char32_t c) { return is_letter(c); }));
    if (name == "isalnum") {
        return Value::boolean(all_chars(s, [](char32_t c) { return is_letter(c) || (c >= '0' && c <= '9'); }));
    }
    if (name == "isspace") return Value::boolean(all_chars(s, py_isspace));
    if (name == "islower" || name == "isupper") {
        const bool lower = name == "islower";
        bool cased = false;
        for (size_t p = 0; p < s.size();) {
            char32_t c;
            p += utf8_decode(s, p, c);
            if (cp_upper(c) != c) {
                if (!lower) return Value::boolean(false);
                cased = true;
            } else if (cp_lower(c) != c) {
                if (lower) return Value::boolean(false);
                cased = true;
            }
        }
        return Value::boolean(cased);
    }
    if (name == "center") return pad(r, s, args, '^');
    if (name == "ljust") return pad(r, s, args, '<');
    if (name == "rjust") return pad(r, s, args, '>');
    if (name == "zfill") {
        const int64_t width = int_param(args, 0, "width", 0);
        const auto len = static_cast<int64_t>(utf8_length(s));
        if (width <= len) return Value::string(s);
        r.check_size(static_cast<size_t>(width));
        const size_t sign = !s.empty() && (s[0] == '-' || s[0] == '+') ? 1 : 0;
        return Value::string(s.substr(0, sign) + std::string(static_cast<size_t>(width - len), '0') + s.substr(sign));
    }
    if (name == "partition" || name == "rpartition") {
        const std::string &sep = str_arg(args, 0, "sep", name);
        if (sep.empty()) fail("empty separator");
        const size_t p = name == "partition" ? s.find(sep) : s.rfind(sep);
        std::vector<Value> parts;
        if (p == std::string::npos) {
            const Value e = Value::string("");
            parts = name == "partition" ? std::vector<Value>{Value::string(s), e, e}
                                        : std::vector<Value>{e, e, Value::string(s)};
        } else {
            parts = {Value::string(s.substr(0, p)), Value::string(sep), Value::string(s.substr(p + sep.size()))};
        }
        return r.make_list(std::move(parts), Kind::kTuple);
    }
    if (name == "removeprefix" || name == "removesuffix") {
        const std::string &x = str_arg(args, 0, name == "removeprefix" ? "prefix" : "suffix", name);
        if (name == "removeprefix") return Value::string(s.compare(0, x.size(), x) == 0 ? s.substr(x.size()) : s);
        const bool ends = x.size() <= s.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
        return Value::string(ends ? s.substr(0, s.size() - x.size()) : s);
    }
    if (name == "format") {
        std::string out = str_format(s, args, r.options().max_output_bytes);
        r.check_size(out.size());
        return Value::string(std::move(out));
    }
    fail(fmt::format("'str' object has no method '{}'", name));
}

Value dict_method(Renderer &r, const std::string &name, const Value &self, const CallArgs &args) {
    const DictObj &d = self.dict();
    if (name == "items") {
        args.check("items", {});
        std::vector<Value> items;
        items.reserve(d.items.size());
        for (const auto &[k, v] : d.items) items.push_back(Value::list({k, v}, Kind::kTuple));
        return r.make_iterator(std::move(items), "dict_items");
    }
    if (name == "keys" || name == "values") {
        args.check(name, {});
        std::vector<Value> items;
        items.reserve(d.items.size());
        for (const auto &[k, v] : d.items) items.push_back(name == "keys" ? k : v);
        return r.make_iterator(std::move(items), "dict_" + name);
    }
    if (name == "get") {
        args.check("get", {"key", "default"});
        const Value *key = args.get(0, "key");
        if (!key) fail("get expected at least 1 argument, got 0");
        if (const Value *v = d.find(*key)) return *v;
        const Value *fallback = args.get(1, "default");
        return fallback ? *fallback : Value::none();
    }
    return self;  // copy(): values are immutable to the template
}

Value list_method(const std::string &name, const Value &self, const CallArgs &args) {
    if (name == "copy") return self;
    const Value *x = args.get(0, "value");
    if (!x) fail(fmt::format("{}() takes exactly one argument (0 given)", name));
    const auto &items = self.items();
    if (name == "count") return Value::integer(std::count_if(items.begin(), items.end(),
                                                             [&](const Value &v) { return py_equal(v, *x); }));
    for (size_t k = 0; k < items.size(); ++k) {
        if (py_equal(items[k], *x)) return Value::integer(static_cast<int64_t>(k));
    }
    fail(fmt::format("{} is not in list", repr_short(*x)));
}

Value loop_method(const std::string &name, const Value &self, const CallArgs &args) {
    auto &loop = static_cast<LoopObj &>(*self.obj);
    if (name == "cycle") {
        if (args.positional.empty()) fail("no items for cycling given");
        return args.positional[static_cast<size_t>(loop.index0) % args.positional.size()];
    }
    const Value current = Value::list(args.positional, Kind::kTuple);
    const bool changed = !loop.changed_called || !py_equal(current, loop.last_changed);
    loop.changed_called = true;
    loop.last_changed = current;
    return Value::boolean(changed);
}

}  // namespace

bool is_letter(char32_t c) {
    if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
    if (c == 0xAA || c == 0xB5 || c == 0xBA) return true;
    if (c >= 0xC0 && c <= 0x24F) return c != 0xD7 && c != 0xF7;
    return cp_upper(c) != c || cp_lower(c) != c || (c >= 0x3041 && c <= 0x30FF) || (c >= 0x3400 && c <= 0x9FFF) ||
           (c >= 0xAC00 && c <= 0xD7A3);
}

Value call_method(Renderer &r, const CallableObj &method, const CallArgs &args) {
    const Value &self = method.self;
    switch (self.kind) {
    case Kind::kString: return string_method(r, method.name, self.str(), args);
    case Kind::kDict: return dict_method(r, method.name, self, args);
    case Kind::kList:
    case Kind::kTuple: return list_method(method.name, self, args);
    case Kind::kLoop: return loop_method(method.name, self, args);
    default: fail(fmt::format("'{}' object has no method '{}'", type_name(self), method.name));
    }
}

}  // namespace memra::text::jinja
