// Internals of the Jinja interpreter (jinja.h), shared by its source files: the value model (Python's
// None/bool/int/float/str/list/tuple/dict plus jinja2's Undefined, namespace, loop and callables),
// the syntax tree, and the entry points of the lexer, parser, evaluator, filters, tests and methods.
// Inside the interpreter errors are thrown (SyntaxError while parsing, RenderError while rendering)
// and jinja.cpp turns them into Result errors at the API boundary.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/jinja.h"

namespace memra::text::jinja {

// Slice and range arithmetic on Python-sized operands (int64 bounds times steps) without overflow; GCC and clang
// have the type, ISO C++ does not (hence __extension__ for -Wpedantic).
__extension__ typedef __int128 Int128;

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

struct SyntaxError {
    std::string message;  // "expected <what>, found <what>"
    int line = 0;
    int col = 0;
};

struct RenderError {
    std::string message;  // without the "line N: " prefix, which the renderer adds
};

[[noreturn]] void fail(std::string message);

// ---------------------------------------------------------------------------------------------
// Values
// ---------------------------------------------------------------------------------------------

enum class Kind : uint8_t {
    kUndefined,  // a missing name, attribute or key; obj (if set) is a StrObj with the error message
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kTuple,
    kDict,
    kNamespace,  // namespace(): the one mutable object, shared by reference
    kCallable,
    kLoop,
    kIterator,  // a generator or dict view (select, map, items()...): iterable, not indexable; obj: IterObj
};

struct Object {
    virtual ~Object() = default;
};

struct Value {
    Kind kind = Kind::kUndefined;
    bool b = false;  // kBool: the value; kString: Markup
    int64_t i = 0;  // kInt
    double f = 0;  // kFloat
    std::shared_ptr<Object> obj;  // by kind: StrObj, ListObj (IterObj), DictObj, CallableObj, LoopObj

    static Value undefined(std::string message = {});
    static Value none() { return make(Kind::kNone); }
    static Value boolean(bool v);
    static Value integer(int64_t v);
    static Value number(double v);
    static Value string(std::string s);
    // markupsafe.Markup (from |safe and |escape): `+` with a plain string HTML-escapes the plain one.
    static Value markup(std::string s);
    static Value list(std::vector<Value> items, Kind kind = Kind::kList);
    static Value make(Kind k) {
        Value v;
        v.kind = k;
        return v;
    }

    bool is_undefined() const { return kind == Kind::kUndefined; }
    bool is_string() const { return kind == Kind::kString; }
    bool is_markup() const { return kind == Kind::kString && b; }
    bool is_sequence() const { return kind == Kind::kList || kind == Kind::kTuple; }
    bool is_int() const { return kind == Kind::kInt || kind == Kind::kBool; }  // bool is an int, as in Python
    bool is_number() const { return is_int() || kind == Kind::kFloat; }

    const std::string &str() const;  // kString (or an Undefined's message)
    const std::vector<Value> &items() const;  // kList / kTuple / kIterator
    const struct DictObj &dict() const;  // kDict / kNamespace
    int64_t as_int() const { return kind == Kind::kBool ? int64_t{b} : i; }
    double as_float() const { return kind == Kind::kFloat ? f : static_cast<double>(as_int()); }
};

struct StrObj : Object {
    std::string s;
};

// Nesting depth and whether a namespace is inside: containers are refused past a depth limit (printing
// and destruction recurse), and a namespace may not hold one (which could close a reference cycle).
struct ContainerInfo {
    int depth = 1;
    bool holds_namespace = false;
};

struct ListObj : Object, ContainerInfo {
    std::vector<Value> items;
};

// What jinja2 gets from filters that yield (a generator) and from dict.items() / keys() / values()
// (views): iterable once materialized here, but not JSON-serializable, not indexable, and only
// views have a length. `type` is the Python type name ("generator", "dict_items", ...).
struct IterObj : ListObj {
    std::string type;
    bool sized() const { return type.rfind("dict_", 0) == 0; }
};

// An insertion-ordered dict with Python key equality (1 == 1.0 == True); string keys are indexed.
struct DictObj : Object, ContainerInfo {
    std::vector<std::pair<Value, Value>> items;
    std::unordered_map<std::string, size_t> string_index;

    const Value *find(const Value &key) const;
    const Value *find(std::string_view key) const;
    void set(Value key, Value value);
};

Value make_dict(DictObj dict, Kind kind = Kind::kDict);

struct Node;
struct Scope;

struct CallableObj : Object {
    enum class Fn {
        kMacro,  // node: the macro statement; scope: where it was defined
        kCaller,  // the body of a {% call %}: node is the call block, scope the caller's
        kBuiltin,  // name: range, namespace, dict, raise_exception, strftime_now
        kMethod,  // name: the method of `self` (a str, dict, list or loop method)
    };
    Fn fn = Fn::kBuiltin;
    std::string name;
    Value self;
    const Node *node = nullptr;
    std::weak_ptr<Scope> scope;  // weak: a scope holding its own macro must not form a cycle
};

struct LoopObj : Object {
    int64_t index0 = 0;
    int64_t length = 0;
    Value previtem, nextitem;  // Undefined at the ends
    Value last_changed;  // what loop.changed() saw last
    bool changed_called = false;
};

// Python's truthiness, str() and repr(). Printing fails once the text passes `limit` bytes (a list of
// many long strings could otherwise print to gigabytes); renderers pass max_output_bytes.
bool truthy(const Value &v);
std::string to_str(const Value &v, size_t limit);
void append_str(std::string &out, const Value &v, size_t limit);
void append_repr(std::string &out, const Value &v, size_t limit);
std::string repr(const Value &v, size_t limit);
// repr() for error messages: scalars and short strings, else "<list object>" and the like.
std::string repr_short(const Value &v);
std::string format_float(double v);  // float.__repr__
// Python type names for messages: "int", "str", "list", "dict", "NoneType", "Undefined", ...
const char *type_name(const Value &v);
// The error message an Undefined carries (its own, else a generic one).
std::string undefined_message(const Value &v);
[[noreturn]] void fail_undefined(const Value &v);

bool py_equal(const Value &a, const Value &b);
// a < b as Python orders numbers, strings and sequences; other pairs raise a TypeError-like error.
bool py_less(const Value &a, const Value &b, std::string_view op);
// Whether `item in container` (substring, element, key).
bool py_contains(const Value &container, const Value &item);

// json.dumps(v, ensure_ascii, indent, separators, sort_keys). The caller picks Python's default
// separators: (", ", ": ") without an indent, ("," , ": ") with one. Fails past max_bytes of text.
struct JsonFormat {
    size_t max_bytes = SIZE_MAX;
    bool ensure_ascii = false;
    bool has_indent = false;
    std::string indent;
    std::string item_sep = ", ";
    std::string key_sep = ": ";
    bool sort_keys = false;
};
std::string to_json(const Value &v, const JsonFormat &format);
// ordered_json -> Value; containers deeper than max_depth fail.
Value from_json(const nlohmann::ordered_json &j, int max_depth);

// UTF-8 measured in code points; invalid bytes count as one character each.
size_t utf8_length(std::string_view s);
// Byte offset of each character start plus s.size() at the end.
std::vector<size_t> utf8_offsets(std::string_view s);
size_t utf8_decode(std::string_view s, size_t pos, char32_t &cp);  // bytes consumed (>= 1)
bool py_isspace(char32_t cp);

// ---------------------------------------------------------------------------------------------
// Syntax tree
// ---------------------------------------------------------------------------------------------

enum class NodeKind : uint8_t {
    // expressions
    kConst,  // value
    kName,  // text
    kList,  // kids
    kTuple,  // kids
    kDict,  // kids: key, value, key, value...
    kGetattr,  // kids[0].text
    kGetitem,  // kids[0][kids[1]]
    kSlice,  // kids: start, stop, step (each may be null)
    kUnary,  // text: "not", "-", "+"; kids[0]
    kBinary,  // text: + - * / // % ** ~; kids[0], kids[1]
    kAnd,
    kOr,
    kCompare,  // kids[0] then names[k] kids[k + 1]: ==, !=, <, <=, >, >=, in, notin
    kCondExpr,  // kids: test, then, else (null: Undefined)
    kCall,  // kids[0](args)
    kFilter,  // text(kids[0], args); kids[0] is null inside a filter block or block set
    kTest,  // kids[0] is text(args); flag: `is not`
    // statements
    kText,  // text
    kOutput,  // {{ kids[0] }}
    kIf,  // kids: test, test...; bodies[k] for each test, else_body
    kFor,  // target kids[0], iterable kids[1], filter kids[2] (may be null); body, else_body
    kSet,  // target kids[0], value kids[1]; or a block set: value null, body, filter kids[2]
    kMacro,  // text: name; names: parameters; kids: defaults of the last parameters; body
    kCallBlock,  // kids[0]: the call; names: caller parameters, kids[1..]: their defaults; body
    kFilterBlock,  // kids[0]: the filter chain (innermost operand null); body
    kWith,  // names = kids; body
    kScopeBody,  // body rendered in place: {% generation %}, {% block %}
    kBreak,
    kContinue,
};

using NodePtr = std::unique_ptr<Node>;

struct Arguments {
    std::vector<NodePtr> positional;
    std::vector<std::pair<std::string, NodePtr>> keyword;
};

struct Node {
    NodeKind kind;
    int line = 0;
    int col = 0;
    std::string text;
    Value value;
    std::vector<NodePtr> kids;
    std::vector<std::string> names;
    Arguments args;  // kCall, kFilter, kTest
    std::vector<NodePtr> body, else_body;
    std::vector<std::vector<NodePtr>> bodies;  // kIf
    bool flag = false;
    int depth = 1;  // of the expression tree below (the parser bounds it)
};

// ---------------------------------------------------------------------------------------------
// Lexer and parser
// ---------------------------------------------------------------------------------------------

enum class TokenKind : uint8_t {
    kText,  // template data between tags
    kVarBegin,
    kVarEnd,
    kBlockBegin,
    kBlockEnd,
    kName,
    kString,  // value: the unescaped text
    kInt,
    kFloat,
    kOperator,  // text: + - * / // % ** ~ [ ] ( ) { } == != < <= > >= = . : | , ;
    kEnd,
};

struct Token {
    TokenKind kind;
    std::string text;
    int line = 1;
    int col = 1;
    int64_t int_value = 0;
    double float_value = 0;
};

// jinja2's lexer with trim_blocks and lstrip_blocks on and keep_trailing_newline off. Comments vanish.
std::vector<Token> lex(std::string_view source);

std::vector<NodePtr> parse_template(std::string_view source);

struct Template::Impl {
    std::vector<NodePtr> body;
};

// ---------------------------------------------------------------------------------------------
// Evaluation
// ---------------------------------------------------------------------------------------------

class Renderer;

// Call-site arguments, evaluated.
struct CallArgs {
    std::vector<Value> positional;
    std::vector<std::pair<std::string, Value>> keyword;

    // The parameter `name` at `position` (or by keyword), or null; used by filters and methods.
    const Value *get(size_t position, std::string_view name) const;
    // Fails on more positional arguments than `params` has or on a keyword outside `params`.
    void check(std::string_view callee, std::initializer_list<std::string_view> params) const;
};

// The argument at `position` or named `name`, else `fallback` (filters and methods take their
// arguments by jinja2's and Python's signatures).
Value param(const CallArgs &args, size_t position, std::string_view name, const Value &fallback = Value::none());
// An int argument; None or absent gives `fallback`.
int64_t int_param(const CallArgs &args, size_t position, std::string_view name, int64_t fallback);
// str(v), without a copy when v is a string (`storage` holds the converted text otherwise).
std::string_view str_of(const Renderer &r, const Value &v, std::string &storage);

using FilterFn = Value (*)(Renderer &, const Value &, const CallArgs &);
const std::unordered_map<std::string_view, FilterFn> &text_filters();  // jinja_filters_text.cpp
bool has_filter(std::string_view name);
Value apply_filter(Renderer &r, std::string_view name, const Value &v, const CallArgs &args);
bool has_test(std::string_view name);
bool apply_test(Renderer &r, std::string_view name, const Value &v, const CallArgs &args);

// obj.name for builtin types: a bound method, a dict key, or Undefined.
Value get_attribute(const Value &obj, const std::string &name);
// obj[key]: dict key, sequence / string index (negative from the end), or Undefined.
Value get_item(const Value &obj, const Value &key);
Value slice_value(Renderer &r, const Value &obj, const Value &start, const Value &stop, const Value &step);
Value call_method(Renderer &r, const CallableObj &method, const CallArgs &args);
Value call_builtin(Renderer &r, const CallableObj &fn, const CallArgs &args);
// The global functions' names; null when `name` is none of them.
Value builtin_global(std::string_view name);

// printf-style formatting of `str % args` and the format filter; fails past `limit` bytes.
std::string percent_format(const std::string &format, const Value &args, size_t limit);

// Python's str methods on UTF-8 text (jinja_strings.cpp). Case mapping covers ASCII, Latin-1, Latin
// Extended-A, Greek and Cyrillic; other scripts pass through unchanged.
char32_t cp_upper(char32_t c);
char32_t cp_lower(char32_t c);
std::string str_upper(std::string_view s);
std::string str_lower(std::string_view s);
std::string str_capitalize(std::string_view s);
std::string str_title(std::string_view s);  // str.title(), not the title filter
// strip / lstrip / rstrip; `chars` None or Undefined strips whitespace.
std::string str_strip(std::string_view s, const Value &chars, bool left, bool right);
// split / rsplit; `sep` None or Undefined splits on whitespace runs. maxsplit < 0: no limit.
std::vector<std::string> str_split(std::string_view s, const Value &sep, int64_t maxsplit, bool from_right);
std::string str_replace(std::string_view s, std::string_view old, std::string_view replacement, int64_t count);
int64_t str_find(std::string_view s, std::string_view sub, bool reverse);  // a code point index, or -1
int64_t str_count(std::string_view s, std::string_view sub);
bool is_letter(char32_t c);  // str.isalpha() for the scripts the case mapping covers, plus CJK and Hangul
std::string html_escape(std::string_view s);  // markupsafe.escape: & < > " '
// str.format(*args, **kwargs) with {} / {0} / {name} fields, .attr / [key] lookups and format specs.
std::string str_format(const std::string &format, const CallArgs &args, size_t limit);
// format(value, spec) for the spec mini-language ([[fill]align][sign][0][width][,][.precision][type]);
// widths and precisions past `limit` fail before anything is built.
std::string format_spec(const Value &v, std::string_view spec, size_t limit);

// Shared by filters and methods: the elements of an iterable (list, tuple, dict keys, string characters,
// Undefined as empty); fails on other values.
std::vector<Value> iterate(Renderer &r, const Value &v);

// Variables of one scope level. Loop iterations, macro calls, call and with blocks open a new level;
// lookups walk up through `parent` to the template level, then the context, then the globals.
struct Scope {
    std::vector<std::pair<std::string, Value>> vars;
    std::shared_ptr<Scope> parent;

    Value *find(std::string_view name);
    void set(const std::string &name, Value value);
};

// One render: the mutable state beside the immutable tree (so one Template renders on many threads).
class Renderer {
public:
    Renderer(const RenderOptions &options, std::shared_ptr<Scope> globals);

    void render(const std::vector<NodePtr> &body, std::string &out);

    // Counts `n` units of work (loop iterations, built elements) against max_iterations.
    void charge(uint64_t n);
    // Charges for walking `v`: a unit per 256 bytes of a string, a unit per element of a sequence.
    // Operations whose cost grows with their operands (string methods and filters, comparisons,
    // indexing into UTF-8) charge it, so that repeating them on large values is bounded too.
    void charge_walk(const Value &v);
    // Fails when a string being built would exceed max_output_bytes.
    void check_size(size_t bytes) const;
    // Enforces max_depth on nested containers being built.
    void check_depth(int depth) const;
    const RenderOptions &options() const { return options_; }

    Value call(const Value &callee, const CallArgs &args);
    Value make_list(std::vector<Value> items, Kind kind = Kind::kList);
    Value make_iterator(std::vector<Value> items, std::string type);

private:
    enum class Flow { kNormal, kBreak, kContinue };

    Flow exec_body(const std::vector<NodePtr> &body, const std::shared_ptr<Scope> &scope);
    Flow exec(const Node &node, const std::shared_ptr<Scope> &scope);
    void exec_for(const Node &node, const std::shared_ptr<Scope> &scope);
    void exec_set(const Node &node, const std::shared_ptr<Scope> &scope);
    void assign(const Node &target, const Value &value, const std::shared_ptr<Scope> &scope);
    std::string capture(const std::vector<NodePtr> &body, const std::shared_ptr<Scope> &scope);

    Value eval(const Node &node, const std::shared_ptr<Scope> &scope);
    Value eval_binary(const Node &node, const std::shared_ptr<Scope> &scope);
    Value eval_compare(const Node &node, const std::shared_ptr<Scope> &scope);
    Value eval_filter(const Node &node, const Value *operand, const std::shared_ptr<Scope> &scope);
    CallArgs eval_args(const Arguments &args, const std::shared_ptr<Scope> &scope);
    Value lookup(const std::string &name, const std::shared_ptr<Scope> &scope);
    Value call_macro(const CallableObj &macro, const CallArgs &args, const Value *caller);

    struct DepthGuard {
        explicit DepthGuard(Renderer &r);
        ~DepthGuard() { --r.depth_; }
        Renderer &r;
    };

    const RenderOptions &options_;
    std::shared_ptr<Scope> globals_;  // the context's variables
    std::shared_ptr<Scope> root_;  // template-level variables
    std::string *out_ = nullptr;  // where output goes now (block set, macros and filters swap it)
    uint64_t iterations_ = 0;
    int depth_ = 0;

public:
    int line = 0;  // the template line being evaluated, for error messages
};

}  // namespace memra::text::jinja
