// jinja2's builtin tests (`x is defined`, `n is divisibleby 3`, ...), with Python's type semantics
// (a bool is a number but not an integer; a dict is a sequence; Undefined is iterable).
#include <unordered_map>

#include <fmt/format.h>

#include "text/jinja_impl.h"

namespace memra::text::jinja {
namespace {

using TestFn = bool (*)(Renderer &, const Value &, const CallArgs &);

const Value &operand(const CallArgs &a, std::string_view test) {
    const Value *v = a.get(0, "other");
    if (!v) v = a.get(0, "value");
    if (!v) v = a.get(0, "num");
    if (!v) v = a.get(0, "seq");
    if (!v) fail(fmt::format("the '{}' test needs an argument", test));
    return *v;
}

int64_t int_operand(const Value &v, std::string_view test) {
    if (v.is_undefined()) fail_undefined(v);
    if (!v.is_int()) fail(fmt::format("the '{}' test needs an integer, found {}", test, type_name(v)));
    return v.as_int();
}

bool t_defined(Renderer &, const Value &v, const CallArgs &) { return !v.is_undefined(); }
bool t_undefined(Renderer &, const Value &v, const CallArgs &) { return v.is_undefined(); }
bool t_none(Renderer &, const Value &v, const CallArgs &) { return v.kind == Kind::kNone; }
bool t_string(Renderer &, const Value &v, const CallArgs &) { return v.is_string(); }
bool t_number(Renderer &, const Value &v, const CallArgs &) { return v.is_number(); }
bool t_integer(Renderer &, const Value &v, const CallArgs &) { return v.kind == Kind::kInt; }
bool t_float(Renderer &, const Value &v, const CallArgs &) { return v.kind == Kind::kFloat; }
bool t_boolean(Renderer &, const Value &v, const CallArgs &) { return v.kind == Kind::kBool; }
bool t_mapping(Renderer &, const Value &v, const CallArgs &) { return v.kind == Kind::kDict; }
bool t_true(Renderer &, const Value &v, const CallArgs &) { return v.kind == Kind::kBool && v.b; }
bool t_false(Renderer &, const Value &v, const CallArgs &) { return v.kind == Kind::kBool && !v.b; }
bool t_callable(Renderer &, const Value &v, const CallArgs &) { return v.kind == Kind::kCallable; }
bool t_escaped(Renderer &, const Value &v, const CallArgs &) { return v.is_markup(); }

bool t_iterable(Renderer &, const Value &v, const CallArgs &) {
    return v.is_string() || v.is_sequence() || v.kind == Kind::kDict || v.is_undefined() || v.kind == Kind::kLoop ||
           v.kind == Kind::kIterator;
}

bool t_sequence(Renderer &, const Value &v, const CallArgs &) {
    return v.is_string() || v.is_sequence() || v.kind == Kind::kDict || v.is_undefined();
}

bool t_odd(Renderer &, const Value &v, const CallArgs &) { return int_operand(v, "odd") % 2 != 0; }
bool t_even(Renderer &, const Value &v, const CallArgs &) { return int_operand(v, "even") % 2 == 0; }

bool t_divisibleby(Renderer &, const Value &v, const CallArgs &a) {
    const int64_t n = int_operand(operand(a, "divisibleby"), "divisibleby");
    if (n == 0) fail("integer division or modulo by zero");
    if (n == -1) return true;
    return int_operand(v, "divisibleby") % n == 0;
}

bool t_eq(Renderer &, const Value &v, const CallArgs &a) { return py_equal(v, operand(a, "eq")); }
bool t_ne(Renderer &, const Value &v, const CallArgs &a) { return !py_equal(v, operand(a, "ne")); }
bool t_lt(Renderer &, const Value &v, const CallArgs &a) { return py_less(v, operand(a, "lt"), "<"); }
bool t_gt(Renderer &, const Value &v, const CallArgs &a) { return py_less(operand(a, "gt"), v, ">"); }

bool t_le(Renderer &, const Value &v, const CallArgs &a) {
    const Value &o = operand(a, "le");
    return py_less(v, o, "<=") || py_equal(v, o);
}

bool t_ge(Renderer &, const Value &v, const CallArgs &a) {
    const Value &o = operand(a, "ge");
    return py_less(o, v, ">=") || py_equal(v, o);
}

bool t_in(Renderer &, const Value &v, const CallArgs &a) { return py_contains(operand(a, "in"), v); }

bool t_lower(Renderer &r, const Value &v, const CallArgs &) {
    const std::string s = to_str(v, r.options().max_output_bytes);
    return str_lower(s) == s && str_upper(s) != s;
}

bool t_upper(Renderer &r, const Value &v, const CallArgs &) {
    const std::string s = to_str(v, r.options().max_output_bytes);
    return str_upper(s) == s && str_lower(s) != s;
}

bool t_sameas(Renderer &, const Value &v, const CallArgs &a) {
    const Value &o = operand(a, "sameas");
    if (v.kind != o.kind) return false;
    if (v.obj || o.obj) return v.obj == o.obj;
    return py_equal(v, o);
}

bool t_filter(Renderer &, const Value &v, const CallArgs &) { return v.is_string() && has_filter(v.str()); }
bool t_test(Renderer &, const Value &v, const CallArgs &) { return v.is_string() && has_test(v.str()); }

const std::unordered_map<std::string_view, TestFn> &tests() {
    static const std::unordered_map<std::string_view, TestFn> table = {
        {"defined", t_defined},   {"undefined", t_undefined}, {"none", t_none},         {"string", t_string},
        {"number", t_number},     {"integer", t_integer},     {"float", t_float},       {"boolean", t_boolean},
        {"mapping", t_mapping},   {"iterable", t_iterable},   {"sequence", t_sequence}, {"true", t_true},
        {"false", t_false},       {"odd", t_odd},             {"even", t_even},         {"divisibleby", t_divisibleby},
        {"eq", t_eq},             {"equalto", t_eq},          {"==", t_eq},             {"ne", t_ne},
        {"!=", t_ne},             {"lt", t_lt},               {"lessthan", t_lt},       {"<", t_lt},
        {"le", t_le},             {"<=", t_le},               {"gt", t_gt},             {"greaterthan", t_gt},
        {">", t_gt},              {"ge", t_ge},               {">=", t_ge},             {"in", t_in},
        {"lower", t_lower},       {"upper", t_upper},         {"callable", t_callable}, {"sameas", t_sameas},
        {"escaped", t_escaped},   {"filter", t_filter},       {"test", t_test},
    };
    return table;
}

}  // namespace

bool has_test(std::string_view name) { return tests().count(name) > 0; }

bool apply_test(Renderer &r, std::string_view name, const Value &v, const CallArgs &args) {
    const auto it = tests().find(name);
    if (it == tests().end()) fail(fmt::format("No test named '{}'", name));
    return it->second(r, v, args);
}

}  // namespace memra::text::jinja
