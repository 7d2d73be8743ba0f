// jinja2's builtin filters on sequences, mappings and numbers as chat templates use them, with the
// transformers override of tojson (json.dumps(x, ensure_ascii=False, indent=None, separators=None,
// sort_keys=False)), and the filter lookup. Argument names and positions follow jinja2's signatures so
// keyword calls work the same; filters that yield in jinja2 return generators here too.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "text/jinja_impl.h"
#include "text/utf8.h"

namespace memra::text::jinja {
namespace {

// jinja2's attribute getter for selectattr / map / sort: "a.b.0" walks getitem (dict keys first),
// digits as list indexes.
Value attribute_path(const Value &item, const std::string &path) {
    Value v = item;
    size_t start = 0;
    while (true) {
        const size_t dot = path.find('.', start);
        const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
        const bool digits = !part.empty() && part.size() < 18 &&
                            std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
        if (v.is_undefined()) return v;
        v = get_item(v, digits ? Value::integer(std::stoll(part)) : Value::string(part));
        if (dot == std::string::npos) return v;
        start = dot + 1;
    }
}

Value lower_if_string(const Value &v) { return v.is_string() ? Value::string(str_lower(v.str())) : v; }

// Sort keys: the attribute(s) of each item (comma-separated), lowercased unless case_sensitive.
Value sort_key(const Value &item, const Value &attribute, bool case_sensitive) {
    Value key = item;
    if (attribute.is_string()) {
        const std::string &a = attribute.str();
        if (a.find(',') != std::string::npos) {
            std::vector<Value> parts;
            for (const std::string &p : str_split(a, Value::string(","), -1, false)) {
                Value x = attribute_path(item, p);
                parts.push_back(case_sensitive ? x : lower_if_string(x));
            }
            return Value::list(std::move(parts));
        }
        key = attribute_path(item, a);
    } else if (attribute.is_int()) {
        key = get_item(item, attribute);
    }
    return case_sensitive ? key : lower_if_string(key);
}

void stable_sort_by(std::vector<Value> &items, std::vector<Value> &keys, bool reverse) {
    std::vector<size_t> order(items.size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        return reverse ? py_less(keys[b], keys[a], "<") : py_less(keys[a], keys[b], "<");
    });
    std::vector<Value> sorted;
    sorted.reserve(items.size());
    for (size_t k : order) sorted.push_back(items[k]);
    items = std::move(sorted);
}

// A hashable identity for unique(): Python's 1 == 1.0 == True collapse to one key.
std::string hash_key(const Value &v, size_t limit) {
    if (v.kind == Kind::kList || v.kind == Kind::kDict || v.kind == Kind::kNamespace) {
        fail(fmt::format("unhashable type: '{}'", type_name(v)));
    }
    if (v.is_number()) {
        const double f = v.as_float();
        if (v.is_int() || (std::isfinite(f) && f == std::floor(f) && std::fabs(f) < 9e18)) {
            return fmt::format("i{}", v.is_int() ? v.as_int() : static_cast<int64_t>(f));
        }
        return "f" + format_float(f);
    }
    if (v.is_string()) return "s" + v.str();
    return "r" + repr(v, limit);
}

size_t length_of(const Value &v) {
    switch (v.kind) {
    case Kind::kString: return utf8_length(v.str());
    case Kind::kList:
    case Kind::kTuple: return v.items().size();
    case Kind::kDict:
    case Kind::kNamespace: return v.dict().items.size();
    case Kind::kUndefined: return 0;
    case Kind::kLoop: return static_cast<size_t>(static_cast<const LoopObj &>(*v.obj).length);
    case Kind::kIterator:
        if (static_cast<const IterObj &>(*v.obj).sized()) return v.items().size();
        fail(fmt::format("object of type '{}' has no len()", type_name(v)));
    default: fail(fmt::format("object of type '{}' has no len()", type_name(v)));
    }
}

// Python's float(str): surrounding whitespace, underscores between digits, inf / nan.
bool parse_float(const std::string &text, double &out) {
    std::string s = str_strip(text, Value::none(), true, true);
    std::string clean;
    for (size_t k = 0; k < s.size(); ++k) {
        if (s[k] == '_') {
            if (k == 0 || k + 1 == s.size() || !std::isdigit(static_cast<unsigned char>(s[k - 1])) ||
                !std::isdigit(static_cast<unsigned char>(s[k + 1]))) {
                return false;
            }
            continue;
        }
        clean += s[k];
    }
    if (clean.empty() || clean.find_first_of("xXpP") != std::string::npos) return false;
    const std::string lower = str_lower(clean);
    const std::string body = lower[0] == '+' || lower[0] == '-' ? lower.substr(1) : lower;
    if (body != "inf" && body != "infinity" && body != "nan" &&
        body.find_first_not_of("0123456789.e+-") != std::string::npos) {
        return false;
    }
    char *end = nullptr;
    out = std::strtod(clean.c_str(), &end);
    return end == clean.c_str() + clean.size();
}

// Python's int(str, base) for bases 2-36 (and 0: from the prefix).
bool parse_int(const std::string &text, int64_t base, int64_t &out) {
    std::string s = str_strip(text, Value::none(), true, true);
    bool negative = false;
    size_t p = 0;
    if (p < s.size() && (s[p] == '+' || s[p] == '-')) negative = s[p++] == '-';
    if (base == 0 || base == 16 || base == 8 || base == 2) {
        if (p + 1 < s.size() && s[p] == '0') {
            const char x = static_cast<char>(std::tolower(s[p + 1]));
            const int64_t prefixed = x == 'x' ? 16 : x == 'o' ? 8 : x == 'b' ? 2 : 0;
            if (prefixed && (base == 0 || base == prefixed)) base = prefixed, p += 2;
        }
        if (base == 0) base = 10;
    }
    if (base < 2 || base > 36 || p >= s.size()) return false;
    Int128 value = 0;
    bool digit_before = false;
    for (; p < s.size(); ++p) {
        const char c = static_cast<char>(std::tolower(s[p]));
        if (c == '_' && digit_before && p + 1 < s.size() && s[p + 1] != '_') continue;
        const int d = std::isdigit(static_cast<unsigned char>(c)) ? c - '0'
                      : (c >= 'a' && c <= 'z')                    ? c - 'a' + 10
                                                                  : 99;
        if (d >= base) return false;
        value = value * base + d;
        if (value > static_cast<Int128>(INT64_MAX) + 1) fail("integer overflow (Python integers are unbounded)");
        digit_before = true;
    }
    if (!digit_before) return false;
    if (negative) value = -value;
    if (value > INT64_MAX) fail("integer overflow (Python integers are unbounded)");
    out = static_cast<int64_t>(value);
    return true;
}

Value to_float_value(double f, const Value &fallback, bool ok) { return ok ? Value::number(f) : fallback; }

// ---- the filters -----------------------------------------------------------------------------

Value f_length(Renderer &, const Value &v, const CallArgs &) {
    return Value::integer(static_cast<int64_t>(length_of(v)));
}

Value f_list(Renderer &r, const Value &v, const CallArgs &) { return r.make_list(iterate(r, v)); }

Value f_join(Renderer &r, const Value &v, const CallArgs &a) {
    const Value sep = param(a, 0, "d", Value::string(""));
    const Value attribute = param(a, 1, "attribute");
    std::string out;
    std::string sep_text = to_str(sep, r.options().max_output_bytes);
    bool first = true;
    for (const Value &item : iterate(r, v)) {
        if (!first) out += sep_text;
        first = false;
        append_str(out, attribute.kind == Kind::kNone ? item : attribute_path(item, to_str(attribute, 1 << 16)),
                   r.options().max_output_bytes);
        r.check_size(out.size());
    }
    return Value::string(std::move(out));
}

Value f_default(Renderer &, const Value &v, const CallArgs &a) {
    const bool boolean = truthy(param(a, 1, "boolean", Value::boolean(false)));
    if (v.is_undefined() || (boolean && !truthy(v))) return param(a, 0, "default_value", Value::string(""));
    return v;
}

Value f_first(Renderer &r, const Value &v, const CallArgs &) {
    if (v.is_sequence()) {
        if (!v.items().empty()) return v.items().front();
    } else {
        std::vector<Value> items = iterate(r, v);
        if (!items.empty()) return items.front();
    }
    return Value::undefined("No first item, sequence was empty.");
}

Value f_last(Renderer &r, const Value &v, const CallArgs &) {
    if (v.kind == Kind::kIterator && !static_cast<const IterObj &>(*v.obj).sized()) {
        fail(fmt::format("'{}' object is not reversible", type_name(v)));
    }
    if (v.is_sequence()) {
        if (!v.items().empty()) return v.items().back();
    } else {
        std::vector<Value> items = iterate(r, v);
        if (!items.empty()) return items.back();
    }
    return Value::undefined("No last item, sequence was empty.");
}

Value f_items(Renderer &r, const Value &v, const CallArgs &) {
    if (v.is_undefined()) return r.make_iterator({}, "generator");
    if (v.kind != Kind::kDict) fail("Can only get item pairs from a mapping.");
    std::vector<Value> items;
    for (const auto &[k, x] : v.dict().items) items.push_back(Value::list({k, x}, Kind::kTuple));
    return r.make_iterator(std::move(items), "generator");
}

Value f_dictsort(Renderer &r, const Value &v, const CallArgs &a) {
    if (v.kind != Kind::kDict) fail("dictsort: expected a mapping");
    const bool case_sensitive = truthy(param(a, 0, "case_sensitive", Value::boolean(false)));
    const Value by = param(a, 1, "by", Value::string("key"));
    const bool reverse = truthy(param(a, 2, "reverse", Value::boolean(false)));
    if (!by.is_string() || (by.str() != "key" && by.str() != "value")) {
        fail("You can only sort by either \"key\" or \"value\"");
    }
    std::vector<Value> items, keys;
    for (const auto &[k, x] : v.dict().items) {
        items.push_back(Value::list({k, x}, Kind::kTuple));
        const Value &key = by.str() == "key" ? k : x;
        keys.push_back(case_sensitive ? key : lower_if_string(key));
    }
    stable_sort_by(items, keys, reverse);
    return r.make_list(std::move(items));
}

// select / reject / selectattr / rejectattr.
Value select_items(Renderer &r, const Value &v, const CallArgs &a, bool with_attribute, bool keep) {
    const size_t test_at = with_attribute ? 1 : 0;
    std::string attribute;
    if (with_attribute) {
        if (a.positional.empty() || !a.positional[0].is_string()) fail("selectattr/rejectattr need an attribute name");
        attribute = a.positional[0].str();
    }
    std::string test;
    CallArgs test_args;
    if (a.positional.size() > test_at) {
        if (!a.positional[test_at].is_string()) fail("the test name must be a string");
        test = a.positional[test_at].str();
        if (!has_test(test)) fail(fmt::format("No test named '{}'", test));
        test_args.positional.assign(a.positional.begin() + static_cast<ptrdiff_t>(test_at) + 1, a.positional.end());
        test_args.keyword = a.keyword;
    }
    std::vector<Value> out;
    if (!truthy(v)) return r.make_iterator({}, "generator");  // jinja2 yields nothing for a falsy input
    for (const Value &item : iterate(r, v)) {
        const Value x = with_attribute ? attribute_path(item, attribute) : item;
        const bool pass = test.empty() ? truthy(x) : apply_test(r, test, x, test_args);
        if (pass == keep) out.push_back(item);
    }
    return r.make_iterator(std::move(out), "generator");
}

Value f_select(Renderer &r, const Value &v, const CallArgs &a) { return select_items(r, v, a, false, true); }
Value f_reject(Renderer &r, const Value &v, const CallArgs &a) { return select_items(r, v, a, false, false); }
Value f_selectattr(Renderer &r, const Value &v, const CallArgs &a) { return select_items(r, v, a, true, true); }
Value f_rejectattr(Renderer &r, const Value &v, const CallArgs &a) { return select_items(r, v, a, true, false); }

Value f_map(Renderer &r, const Value &v, const CallArgs &a) {
    std::vector<Value> out;
    if (!truthy(v)) return r.make_iterator({}, "generator");  // jinja2 yields nothing for a falsy input
    if (a.positional.empty()) {
        const Value *attribute = a.get(SIZE_MAX, "attribute");
        if (!attribute) fail("map requires a filter argument");
        const Value fallback = param(a, SIZE_MAX, "default");
        for (const Value &item : iterate(r, v)) {
            Value x = attribute->is_int() ? get_item(item, *attribute)
                                          : attribute_path(item, to_str(*attribute, 1 << 16));
            out.push_back(x.is_undefined() && fallback.kind != Kind::kNone ? fallback : x);
        }
        return r.make_iterator(std::move(out), "generator");
    }
    if (!a.positional[0].is_string()) fail("map: the filter name must be a string");
    const std::string name = a.positional[0].str();
    if (!has_filter(name)) fail(fmt::format("No filter named '{}'", name));
    CallArgs rest;
    rest.positional.assign(a.positional.begin() + 1, a.positional.end());
    rest.keyword = a.keyword;
    for (const Value &item : iterate(r, v)) out.push_back(apply_filter(r, name, item, rest));
    return r.make_iterator(std::move(out), "generator");
}

Value f_unique(Renderer &r, const Value &v, const CallArgs &a) {
    const bool case_sensitive = truthy(param(a, 0, "case_sensitive", Value::boolean(false)));
    const Value attribute = param(a, 1, "attribute");
    std::unordered_set<std::string> seen;
    std::vector<Value> out;
    for (const Value &item : iterate(r, v)) {
        const Value key = sort_key(item, attribute, case_sensitive);
        if (seen.insert(hash_key(key, r.options().max_output_bytes)).second) out.push_back(item);
    }
    return r.make_iterator(std::move(out), "generator");
}

Value f_sort(Renderer &r, const Value &v, const CallArgs &a) {
    const bool reverse = truthy(param(a, 0, "reverse", Value::boolean(false)));
    const bool case_sensitive = truthy(param(a, 1, "case_sensitive", Value::boolean(false)));
    const Value attribute = param(a, 2, "attribute");
    std::vector<Value> items = iterate(r, v);
    std::vector<Value> keys;
    keys.reserve(items.size());
    for (const Value &item : items) keys.push_back(sort_key(item, attribute, case_sensitive));
    r.charge(items.size() * 8);
    stable_sort_by(items, keys, reverse);
    return r.make_list(std::move(items));
}

Value f_reverse(Renderer &r, const Value &v, const CallArgs &) {
    if (v.is_string()) {
        const std::vector<size_t> offsets = utf8_offsets(v.str());
        std::string out;
        for (size_t k = offsets.size() - 1; k > 0; --k) {
            out.append(v.str(), offsets[k - 1], offsets[k] - offsets[k - 1]);
        }
        return Value::string(std::move(out));
    }
    // reversed(): a reverse iterator over sequences and dicts; other iterables become a reversed list.
    std::vector<Value> items = iterate(r, v);
    std::reverse(items.begin(), items.end());
    if (v.is_sequence()) {
        return r.make_iterator(std::move(items), v.kind == Kind::kList ? "list_reverseiterator" : "reversed");
    }
    if (v.kind == Kind::kDict) return r.make_iterator(std::move(items), "dict_reversekeyiterator");
    return r.make_list(std::move(items));
}

Value f_tojson(Renderer &r, const Value &v, const CallArgs &a) {
    JsonFormat f;
    f.ensure_ascii = truthy(param(a, 0, "ensure_ascii", Value::boolean(false)));
    const Value indent = param(a, 1, "indent");
    if (indent.is_int()) {
        f.has_indent = true;
        f.indent = std::string(static_cast<size_t>(std::clamp<int64_t>(indent.as_int(), 0, 1 << 16)), ' ');
    } else if (indent.is_string()) {
        f.has_indent = true;
        f.indent = indent.str();
    } else if (indent.kind != Kind::kNone) {
        fail(fmt::format("tojson: indent must be an int, a str or None, not {}", type_name(indent)));
    }
    f.item_sep = f.has_indent ? "," : ", ";
    const Value separators = param(a, 2, "separators");
    if (separators.is_sequence()) {
        const auto &pair = separators.items();
        if (pair.size() != 2 || !pair[0].is_string() || !pair[1].is_string()) {
            fail("tojson: separators must be a pair of strings");
        }
        f.item_sep = separators.items()[0].str();
        f.key_sep = separators.items()[1].str();
    }
    f.sort_keys = truthy(param(a, 3, "sort_keys", Value::boolean(false)));
    f.max_bytes = r.options().max_output_bytes;
    return Value::string(to_json(v, f));
}

Value f_int(Renderer &, const Value &v, const CallArgs &a) {
    const Value fallback = param(a, 0, "default", Value::integer(0));
    const int64_t base = int_param(a, 1, "base", 10);
    if (v.is_int()) return Value::integer(v.as_int());
    if (v.kind == Kind::kFloat) {
        if (!std::isfinite(v.f)) fail("cannot convert float infinity or NaN to integer");
        if (std::fabs(v.f) >= 9.2e18) fail("integer overflow (Python integers are unbounded)");
        return Value::integer(static_cast<int64_t>(v.f));
    }
    if (!v.is_string()) return fallback;
    int64_t i;
    if (parse_int(v.str(), base, i)) return Value::integer(i);
    double f;
    if (!parse_float(v.str(), f)) return fallback;
    if (!std::isfinite(f)) fail("cannot convert float infinity or NaN to integer");
    if (std::fabs(f) >= 9.2e18) fail("integer overflow (Python integers are unbounded)");
    return Value::integer(static_cast<int64_t>(f));
}

Value f_float(Renderer &, const Value &v, const CallArgs &a) {
    const Value fallback = param(a, 0, "default", Value::number(0.0));
    if (v.is_number()) return Value::number(v.as_float());
    if (!v.is_string()) return fallback;
    double f = 0;
    const bool ok = parse_float(v.str(), f);
    return to_float_value(f, fallback, ok);
}

Value f_abs(Renderer &, const Value &v, const CallArgs &) {
    if (v.kind == Kind::kFloat) return Value::number(std::fabs(v.f));
    if (!v.is_int()) fail(fmt::format("bad operand type for abs(): '{}'", type_name(v)));
    if (v.as_int() == INT64_MIN) fail("integer overflow (Python integers are unbounded)");
    return Value::integer(std::abs(v.as_int()));
}

// Python's round(x, n): half to even on the exact binary value (as printf rounds), ints stay ints.
Value f_round(Renderer &, const Value &v, const CallArgs &a) {
    const int64_t precision = int_param(a, 0, "precision", 0);
    const Value method = param(a, 1, "method", Value::string("common"));
    if (!v.is_number()) fail(fmt::format("round: expected a number, found {}", type_name(v)));
    if (!method.is_string() || (method.str() != "common" && method.str() != "ceil" && method.str() != "floor")) {
        fail("method must be common, ceil or floor");
    }
    const double x = v.as_float();
    const double scale = std::pow(10.0, static_cast<double>(std::clamp<int64_t>(precision, -400, 400)));
    if (method.str() != "common") {
        const double scaled = method.str() == "ceil" ? std::ceil(x * scale) : std::floor(x * scale);
        return Value::number(scaled / scale);
    }
    if (v.is_int() && precision >= 0) return Value::integer(v.as_int());
    if (!std::isfinite(x)) return Value::number(x);
    if (precision >= 0 && precision <= 300) {
        return Value::number(std::strtod(fmt::format("{:.{}f}", x, precision).c_str(), nullptr));
    }
    const double r = std::nearbyint(x * scale) / scale;
    return v.is_int() ? Value::integer(static_cast<int64_t>(r)) : Value::number(r);
}

Value f_sum(Renderer &r, const Value &v, const CallArgs &a) {
    const Value attribute = param(a, 0, "attribute");
    Value total = param(a, 1, "start", Value::integer(0));
    for (const Value &item : iterate(r, v)) {
        const Value x = attribute.kind == Kind::kNone ? item : attribute_path(item, to_str(attribute, 1 << 16));
        if (!x.is_number() || !total.is_number()) {
            fail(fmt::format("unsupported operand type(s) for +: '{}' and '{}'", type_name(total), type_name(x)));
        }
        if (total.is_int() && x.is_int()) {
            int64_t s;
            if (__builtin_add_overflow(total.as_int(), x.as_int(), &s)) {
                fail("integer overflow (Python integers are unbounded)");
            }
            total = Value::integer(s);
        } else {
            total = Value::number(total.as_float() + x.as_float());
        }
    }
    return total;
}

Value min_max(Renderer &r, const Value &v, const CallArgs &a, bool want_max) {
    const bool case_sensitive = truthy(param(a, 0, "case_sensitive", Value::boolean(false)));
    const Value attribute = param(a, 1, "attribute");
    const std::vector<Value> items = iterate(r, v);
    if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
    size_t best = 0;
    Value best_key = sort_key(items[0], attribute, case_sensitive);
    for (size_t k = 1; k < items.size(); ++k) {
        Value key = sort_key(items[k], attribute, case_sensitive);
        if (want_max ? py_less(best_key, key, "<") : py_less(key, best_key, "<")) best = k, best_key = std::move(key);
    }
    return items[best];
}

Value f_min(Renderer &r, const Value &v, const CallArgs &a) { return min_max(r, v, a, false); }
Value f_max(Renderer &r, const Value &v, const CallArgs &a) { return min_max(r, v, a, true); }


Value f_attr(Renderer &, const Value &v, const CallArgs &a) {
    const Value name = param(a, 0, "name");
    if (!name.is_string()) fail("attr: the attribute name must be a string");
    // Python attributes only: a dict's keys are not its attributes (its methods are).
    if (v.kind == Kind::kDict && get_attribute(Value::make(Kind::kDict), name.str()).is_undefined()) {
        return Value::undefined(fmt::format("'dict object' has no attribute '{}'", name.str()));
    }
    return get_attribute(v, name.str());
}

Value f_batch(Renderer &r, const Value &v, const CallArgs &a) {
    const int64_t size = int_param(a, 0, "linecount", 0);
    if (size <= 0) fail("batch: linecount must be positive");
    const Value *fill = a.get(1, "fill_with");
    std::vector<Value> out, row;
    for (const Value &item : iterate(r, v)) {
        row.push_back(item);
        if (static_cast<int64_t>(row.size()) == size) out.push_back(r.make_list(std::move(row))), row.clear();
    }
    if (!row.empty()) {
        while (fill && fill->kind != Kind::kNone && static_cast<int64_t>(row.size()) < size) row.push_back(*fill);
        out.push_back(r.make_list(std::move(row)));
    }
    return r.make_iterator(std::move(out), "generator");
}

// The sequence, number and JSON filters; text_filters() has the string ones.
const std::unordered_map<std::string_view, FilterFn> &sequence_filters() {
    static const std::unordered_map<std::string_view, FilterFn> table = {
        {"length", f_length},   {"count", f_length},     {"list", f_list},         {"join", f_join},
        {"default", f_default}, {"d", f_default},        {"first", f_first},       {"last", f_last},
        {"items", f_items},     {"dictsort", f_dictsort}, {"select", f_select},    {"reject", f_reject},
        {"selectattr", f_selectattr}, {"rejectattr", f_rejectattr}, {"map", f_map}, {"unique", f_unique},
        {"sort", f_sort},       {"reverse", f_reverse},  {"tojson", f_tojson},     {"int", f_int},
        {"float", f_float},     {"abs", f_abs},          {"round", f_round},       {"sum", f_sum},
        {"min", f_min},         {"max", f_max},          {"attr", f_attr},         {"batch", f_batch},
    };
    return table;
}

FilterFn find_filter(std::string_view name) {
    if (const auto it = sequence_filters().find(name); it != sequence_filters().end()) return it->second;
    if (const auto it = text_filters().find(name); it != text_filters().end()) return it->second;
    return nullptr;
}

}  // namespace

bool has_filter(std::string_view name) { return find_filter(name) != nullptr; }

Value apply_filter(Renderer &r, std::string_view name, const Value &v, const CallArgs &args) {
    const FilterFn f = find_filter(name);
    if (!f) fail(fmt::format("No filter named '{}'", name));
    return f(r, v, args);
}

}  // namespace memra::text::jinja
