// The Jinja evaluator: renders a parsed template against a context with jinja2's scoping (each loop
// iteration, macro call and call block opens a scope; `set` writes the innermost one; namespaces are
// shared), Python's operator semantics, and the limits of RenderOptions.
#include <cmath>

#include <fmt/format.h>

#include "text/jinja_impl.h"

namespace memra::text::jinja {

Value *Scope::find(std::string_view name) {
    for (auto &[k, v] : vars) {
        if (k == name) return &v;
    }
    return nullptr;
}

void Scope::set(const std::string &name, Value value) {
    if (Value *v = find(name)) *v = std::move(value);
    else vars.emplace_back(name, std::move(value));
}

Renderer::DepthGuard::DepthGuard(Renderer &renderer) : r(renderer) {
    if (++r.depth_ > r.options_.max_depth) {
        --r.depth_;
        fail(fmt::format("nesting deeper than {} levels (macro recursion or nested expressions)",
                         r.options_.max_depth));
    }
}

Renderer::Renderer(const RenderOptions &options, std::shared_ptr<Scope> globals)
    : options_(options), globals_(std::move(globals)), root_(std::make_shared<Scope>()) {
    root_->parent = globals_;
}

void Renderer::charge(uint64_t n) {
    iterations_ += n;
    if (iterations_ > options_.max_iterations) {
        fail(fmt::format("more than {} loop iterations and built elements", options_.max_iterations));
    }
}

void Renderer::charge_walk(const Value &v) {
    if (v.is_string()) charge(v.str().size() / 256);
    else if (v.is_sequence() || v.kind == Kind::kIterator) charge(v.items().size());
}

void Renderer::check_size(size_t bytes) const {
    if (bytes > options_.max_output_bytes) fail(fmt::format("output exceeds {} bytes", options_.max_output_bytes));
}

void Renderer::check_depth(int depth) const {
    if (depth > options_.max_depth) fail(fmt::format("a value nested deeper than {} levels", options_.max_depth));
}

Value Renderer::make_list(std::vector<Value> items, Kind kind) {
    charge(items.size());
    Value v = Value::list(std::move(items), kind);
    check_depth(static_cast<const ListObj &>(*v.obj).depth);
    return v;
}

Value Renderer::make_iterator(std::vector<Value> items, std::string type) {
    charge(items.size());
    Value v = Value::make(Kind::kIterator);
    auto it = std::make_shared<IterObj>();
    for (const Value &x : items) {
        if (const auto *c = dynamic_cast<const ContainerInfo *>(x.obj.get())) {
            it->depth = std::max(it->depth, c->depth + 1);
            it->holds_namespace = it->holds_namespace || c->holds_namespace;
        }
    }
    check_depth(it->depth);
    it->items = std::move(items);
    it->type = std::move(type);
    v.obj = std::move(it);
    return v;
}

void Renderer::render(const std::vector<NodePtr> &body, std::string &out) {
    out_ = &out;
    exec_body(body, root_);
}

std::string Renderer::capture(const std::vector<NodePtr> &body, const std::shared_ptr<Scope> &scope) {
    std::string buffer;
    std::string *saved = out_;
    out_ = &buffer;
    struct Restore {
        Renderer &r;
        std::string *saved;
        ~Restore() { r.out_ = saved; }
    } restore{*this, saved};
    exec_body(body, scope);
    return buffer;
}

// ---------------------------------------------------------------------------------------------
// Statements
// ---------------------------------------------------------------------------------------------

Renderer::Flow Renderer::exec_body(const std::vector<NodePtr> &body, const std::shared_ptr<Scope> &scope) {
    for (const NodePtr &stmt : body) {
        const Flow flow = exec(*stmt, scope);
        if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
}

Renderer::Flow Renderer::exec(const Node &node, const std::shared_ptr<Scope> &scope) {
    const DepthGuard guard(*this);
    line = node.line;
    const auto child = [&] {
        auto s = std::make_shared<Scope>();
        s->parent = scope;
        return s;
    };
    switch (node.kind) {
    case NodeKind::kText:
        out_->append(node.text);
        check_size(out_->size());
        return Flow::kNormal;
    case NodeKind::kOutput: {
        const Value v = eval(*node.kids[0], scope);
        append_str(*out_, v, options_.max_output_bytes);
        check_size(out_->size());
        return Flow::kNormal;
    }
    case NodeKind::kIf:
        for (size_t k = 0; k < node.kids.size(); ++k) {
            if (truthy(eval(*node.kids[k], scope))) return exec_body(node.bodies[k], scope);
        }
        return exec_body(node.else_body, scope);
    case NodeKind::kFor: exec_for(node, scope); return Flow::kNormal;
    case NodeKind::kSet: exec_set(node, scope); return Flow::kNormal;
    case NodeKind::kMacro: {
        Value v = Value::make(Kind::kCallable);
        auto c = std::make_shared<CallableObj>();
        c->fn = CallableObj::Fn::kMacro;
        c->name = node.text;
        c->node = &node;
        c->scope = scope;
        v.obj = std::move(c);
        scope->set(node.text, std::move(v));
        return Flow::kNormal;
    }
    case NodeKind::kCallBlock: {
        const Node &call = *node.kids[0];
        Value caller = Value::make(Kind::kCallable);
        auto c = std::make_shared<CallableObj>();
        c->fn = CallableObj::Fn::kCaller;
        c->name = "caller";
        c->node = &node;
        c->scope = scope;
        caller.obj = std::move(c);
        const Value callee = eval(*call.kids[0], scope);
        CallArgs args = eval_args(call.args, scope);
        if (callee.kind != Kind::kCallable ||
            static_cast<const CallableObj &>(*callee.obj).fn != CallableObj::Fn::kMacro) {
            if (callee.is_undefined()) fail_undefined(callee);
            fail("{% call %} needs a macro");
        }
        append_str(*out_, call_macro(static_cast<const CallableObj &>(*callee.obj), args, &caller),
                   options_.max_output_bytes);
        check_size(out_->size());
        return Flow::kNormal;
    }
    case NodeKind::kFilterBlock: {
        const Value text = Value::string(capture(node.body, child()));
        append_str(*out_, eval_filter(*node.kids[0], &text, scope), options_.max_output_bytes);
        check_size(out_->size());
        return Flow::kNormal;
    }
    case NodeKind::kWith: {
        auto s = child();
        for (size_t k = 0; k < node.names.size(); ++k) s->set(node.names[k], eval(*node.kids[k], scope));
        return exec_body(node.body, s);
    }
    case NodeKind::kScopeBody: return exec_body(node.body, child());
    case NodeKind::kBreak: return Flow::kBreak;
    case NodeKind::kContinue: return Flow::kContinue;
    default: fail("an expression where a statement belongs");
    }
}

void Renderer::exec_for(const Node &node, const std::shared_ptr<Scope> &scope) {
    const Value iterable = eval(*node.kids[1], scope);
    std::vector<Value> items = iterate(*this, iterable);
    const auto iteration_scope = [&] {
        auto s = std::make_shared<Scope>();
        s->parent = scope;
        return s;
    };
    if (const Node *cond = node.kids[2].get()) {  // `for x in xs if cond`: loop.length counts what passes
        std::vector<Value> kept;
        for (Value &item : items) {
            charge(1);
            auto s = iteration_scope();
            assign(*node.kids[0], item, s);
            if (truthy(eval(*cond, s))) kept.push_back(std::move(item));
        }
        items = std::move(kept);
    }
    if (items.empty()) {
        exec_body(node.else_body, iteration_scope());
        return;
    }
    Value loop_value = Value::make(Kind::kLoop);
    auto loop = std::make_shared<LoopObj>();
    loop->length = static_cast<int64_t>(items.size());  // depth stays 1: only recursive loops nest it
    loop_value.obj = loop;
    for (size_t k = 0; k < items.size(); ++k) {
        charge(1);
        loop->index0 = static_cast<int64_t>(k);
        loop->previtem = k > 0 ? items[k - 1] : Value::undefined("there is no previous item");
        loop->nextitem = k + 1 < items.size() ? items[k + 1] : Value::undefined("there is no next item");
        auto s = iteration_scope();
        s->set("loop", loop_value);
        assign(*node.kids[0], items[k], s);
        if (exec_body(node.body, s) == Flow::kBreak) break;
    }
}

void Renderer::assign(const Node &target, const Value &value, const std::shared_ptr<Scope> &scope) {
    if (target.kind == NodeKind::kName) {
        scope->set(target.text, value);
        return;
    }
    if (!(value.is_string() || value.is_sequence() || value.kind == Kind::kDict || value.kind == Kind::kIterator)) {
        fail(fmt::format("cannot unpack non-iterable {} object", type_name(value)));
    }
    const std::vector<Value> items = iterate(*this, value);
    if (items.size() != target.kids.size()) {
        if (items.size() > target.kids.size()) {
            fail(fmt::format("too many values to unpack (expected {})", target.kids.size()));
        }
        fail(fmt::format("not enough values to unpack (expected {}, got {})", target.kids.size(), items.size()));
    }
    for (size_t k = 0; k < items.size(); ++k) assign(*target.kids[k], items[k], scope);
}

void Renderer::exec_set(const Node &node, const std::shared_ptr<Scope> &scope) {
    Value value;
    if (node.kids[1]) {
        value = eval(*node.kids[1], scope);
    } else {
        auto s = std::make_shared<Scope>();
        s->parent = scope;
        value = Value::string(capture(node.body, s));
        if (node.kids[2]) value = eval_filter(*node.kids[2], &value, scope);
    }
    const Node &target = *node.kids[0];
    if (target.kind != NodeKind::kGetattr) {
        assign(target, value, scope);
        return;
    }
    const std::string &ns_name = target.kids[0]->text;
    const Value ns = lookup(ns_name, scope);
    if (ns.kind != Kind::kNamespace) fail(fmt::format("cannot assign attribute on non-namespace object '{}'", ns_name));
    if (!target.text.empty() && target.text[0] == '_') {
        fail(fmt::format("chat templates cannot store underscore-prefixed attributes on a namespace ('{}')",
                         target.text));
    }
    int depth = 1;
    if (const auto *c = dynamic_cast<const ContainerInfo *>(value.obj.get())) {
        if (c->holds_namespace) fail("a namespace cannot hold a namespace");
        depth = c->depth + 1;
    }
    auto &dict = static_cast<DictObj &>(*ns.obj);
    check_depth(depth);
    dict.depth = std::max(dict.depth, depth);
    dict.set(Value::string(target.text), std::move(value));
}

// ---------------------------------------------------------------------------------------------
// Expressions
// ---------------------------------------------------------------------------------------------

Value Renderer::lookup(const std::string &name, const std::shared_ptr<Scope> &scope) {
    for (Scope *s = scope.get(); s; s = s->parent.get()) {
        if (const Value *v = s->find(name)) return *v;
    }
    Value builtin = builtin_global(name);
    if (!builtin.is_undefined()) return builtin;
    return Value::undefined(fmt::format("'{}' is undefined", name));
}

CallArgs Renderer::eval_args(const Arguments &args, const std::shared_ptr<Scope> &scope) {
    CallArgs out;
    for (const NodePtr &a : args.positional) out.positional.push_back(eval(*a, scope));
    for (const auto &[k, a] : args.keyword) out.keyword.emplace_back(k, eval(*a, scope));
    return out;
}

Value Renderer::eval(const Node &node, const std::shared_ptr<Scope> &scope) {
    const DepthGuard guard(*this);
    line = node.line;
    switch (node.kind) {
    case NodeKind::kConst: return node.value;
    case NodeKind::kName: return lookup(node.text, scope);
    case NodeKind::kList:
    case NodeKind::kTuple: {
        std::vector<Value> items;
        items.reserve(node.kids.size());
        for (const NodePtr &k : node.kids) items.push_back(eval(*k, scope));
        return make_list(std::move(items), node.kind == NodeKind::kList ? Kind::kList : Kind::kTuple);
    }
    case NodeKind::kDict: {
        DictObj d;
        for (size_t k = 0; k + 1 < node.kids.size(); k += 2) {
            Value key = eval(*node.kids[k], scope);
            d.set(std::move(key), eval(*node.kids[k + 1], scope));
        }
        charge(d.items.size());
        Value v = make_dict(std::move(d));
        check_depth(v.dict().depth);
        return v;
    }
    case NodeKind::kGetattr: {
        const Value obj = eval(*node.kids[0], scope);
        if (obj.is_undefined()) fail_undefined(obj);
        return get_attribute(obj, node.text);
    }
    case NodeKind::kGetitem: {
        const Value obj = eval(*node.kids[0], scope);
        if (obj.is_string()) charge_walk(obj);  // characters are found by walking the UTF-8
        const Node &index = *node.kids[1];
        if (index.kind == NodeKind::kSlice) {
            const auto part = [&](size_t k) { return index.kids[k] ? eval(*index.kids[k], scope) : Value::none(); };
            const Value start = part(0), stop = part(1), step = part(2);
            if (obj.is_undefined()) fail_undefined(obj);
            return slice_value(*this, obj, start, stop, step);
        }
        const Value key = eval(index, scope);
        if (obj.is_undefined()) fail_undefined(obj);
        return get_item(obj, key);
    }
    case NodeKind::kUnary: {
        const Value v = eval(*node.kids[0], scope);
        if (node.text == "not") return Value::boolean(!truthy(v));
        if (v.is_undefined()) fail_undefined(v);
        if (!v.is_number()) fail(fmt::format("bad operand type for unary {}: '{}'", node.text, type_name(v)));
        if (node.text == "+") return v.kind == Kind::kBool ? Value::integer(v.as_int()) : v;
        if (v.kind == Kind::kFloat) return Value::number(-v.f);
        if (v.as_int() == INT64_MIN) fail("integer overflow");
        return Value::integer(-v.as_int());
    }
    case NodeKind::kBinary: return eval_binary(node, scope);
    case NodeKind::kAnd: {
        Value left = eval(*node.kids[0], scope);
        return truthy(left) ? eval(*node.kids[1], scope) : left;
    }
    case NodeKind::kOr: {
        Value left = eval(*node.kids[0], scope);
        return truthy(left) ? left : eval(*node.kids[1], scope);
    }
    case NodeKind::kCompare: return eval_compare(node, scope);
    case NodeKind::kCondExpr:
        if (truthy(eval(*node.kids[0], scope))) return eval(*node.kids[1], scope);
        if (node.kids[2]) return eval(*node.kids[2], scope);
        return Value::undefined(fmt::format(
            "the inline if-expression on line {} evaluated to false and no else section was defined", node.line));
    case NodeKind::kCall: {
        const Value callee = eval(*node.kids[0], scope);
        const CallArgs args = eval_args(node.args, scope);
        line = node.line;
        return call(callee, args);
    }
    case NodeKind::kFilter: return eval_filter(node, nullptr, scope);
    case NodeKind::kTest: {
        const Value v = eval(*node.kids[0], scope);
        const CallArgs args = eval_args(node.args, scope);
        line = node.line;
        if (v.is_string()) charge_walk(v);
        return Value::boolean(apply_test(*this, node.text, v, args) != node.flag);
    }
    case NodeKind::kSlice: fail("a slice outside a subscript");
    default: fail("a statement where an expression belongs");
    }
}

Value Renderer::eval_filter(const Node &node, const Value *operand, const std::shared_ptr<Scope> &scope) {
    Value v;
    if (!node.kids[0]) v = *operand;
    else if (node.kids[0]->kind == NodeKind::kFilter && operand) v = eval_filter(*node.kids[0], operand, scope);
    else v = eval(*node.kids[0], scope);
    const CallArgs args = eval_args(node.args, scope);
    line = node.line;
    if (v.is_string()) charge_walk(v);
    Value result = apply_filter(*this, node.text, v, args);
    if (result.is_string()) charge_walk(result);
    return result;
}

Value Renderer::eval_compare(const Node &node, const std::shared_ptr<Scope> &scope) {
    Value left = eval(*node.kids[0], scope);
    bool result = true;
    for (size_t k = 0; k < node.names.size() && result; ++k) {
        Value right = eval(*node.kids[k + 1], scope);
        const std::string &op = node.names[k];
        line = node.line;
        charge_walk(left);
        charge_walk(right);
        if (op == "==") result = py_equal(left, right);
        else if (op == "!=") result = !py_equal(left, right);
        else if (op == "<") result = py_less(left, right, op);
        else if (op == ">") result = py_less(right, left, op);
        else if (op == "<=") result = py_less(left, right, op) || py_equal(left, right);
        else if (op == ">=") result = py_less(right, left, op) || py_equal(left, right);
        else if (op == "in") result = py_contains(right, left);
        else result = !py_contains(right, left);  // notin
        left = std::move(right);
    }
    return Value::boolean(result);
}

namespace {

[[noreturn]] void fail_operands(std::string_view op, const Value &a, const Value &b) {
    fail(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, type_name(a), type_name(b)));
}

[[noreturn]] void fail_overflow() { fail("integer overflow (Python integers are unbounded, memra's are 64-bit)"); }

int64_t add_checked(int64_t a, int64_t b) {
    int64_t r;
    if (__builtin_add_overflow(a, b, &r)) fail_overflow();
    return r;
}

int64_t sub_checked(int64_t a, int64_t b) {
    int64_t r;
    if (__builtin_sub_overflow(a, b, &r)) fail_overflow();
    return r;
}

int64_t mul_checked(int64_t a, int64_t b) {
    int64_t r;
    if (__builtin_mul_overflow(a, b, &r)) fail_overflow();
    return r;
}

Value python_mod(const Value &a, const Value &b) {
    if (a.is_int() && b.is_int()) {
        const int64_t x = a.as_int(), y = b.as_int();
        if (y == 0) fail("integer division or modulo by zero");
        if (y == -1) return Value::integer(0);
        int64_t r = x % y;
        if (r != 0 && ((r < 0) != (y < 0))) r += y;
        return Value::integer(r);
    }
    const double x = a.as_float(), y = b.as_float();
    if (y == 0) fail("float modulo");
    double r = std::fmod(x, y);
    if (r != 0 && ((r < 0) != (y < 0))) r += y;
    else if (r == 0) r = std::copysign(0.0, y);
    return Value::number(r);
}

Value python_floordiv(const Value &a, const Value &b) {
    if (a.is_int() && b.is_int()) {
        const int64_t x = a.as_int(), y = b.as_int();
        if (y == 0) fail("integer division or modulo by zero");
        if (x == INT64_MIN && y == -1) fail_overflow();
        int64_t q = x / y;
        if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
        return Value::integer(q);
    }
    const double x = a.as_float(), y = b.as_float();
    if (y == 0) fail("float floor division by zero");
    return Value::number(std::floor(x / y));
}

Value python_pow(const Value &a, const Value &b) {
    if (a.is_int() && b.is_int() && b.as_int() >= 0) {
        int64_t base = a.as_int(), e = b.as_int(), result = 1;
        while (e > 0) {
            if (e & 1) result = mul_checked(result, base);
            e >>= 1;
            if (e > 0) base = mul_checked(base, base);
        }
        return Value::integer(result);
    }
    const double x = a.as_float(), y = b.as_float();
    if (x == 0 && y < 0) fail("0.0 cannot be raised to a negative power");
    if (x < 0 && y != std::floor(y)) fail("a negative number raised to a fractional power (a complex number)");
    return Value::number(std::pow(x, y));
}

}  // namespace

Value Renderer::eval_binary(const Node &node, const std::shared_ptr<Scope> &scope) {
    const Value a = eval(*node.kids[0], scope);
    const Value b = eval(*node.kids[1], scope);
    line = node.line;
    const std::string &op = node.text;
    if (op == "~") {
        std::string s = to_str(a, options_.max_output_bytes);
        append_str(s, b, options_.max_output_bytes);
        check_size(s.size());
        charge(s.size() / 256);
        return Value::string(std::move(s));
    }
    if (a.is_undefined()) fail_undefined(a);
    if (b.is_undefined()) fail_undefined(b);
    const bool numbers = a.is_number() && b.is_number();
    const bool ints = a.is_int() && b.is_int();
    if (op == "+") {
        if (ints) return Value::integer(add_checked(a.as_int(), b.as_int()));
        if (numbers) return Value::number(a.as_float() + b.as_float());
        if (a.is_string() && b.is_string()) {
            check_size(a.str().size() + b.str().size());
            charge((a.str().size() + b.str().size()) / 256);
            if (!a.is_markup() && !b.is_markup()) return Value::string(a.str() + b.str());
            // Markup + str escapes the plain side (markupsafe); the result is Markup.
            const auto side = [](const Value &v) { return v.is_markup() ? v.str() : html_escape(v.str()); };
            std::string s = side(a) + side(b);
            check_size(s.size());
            return Value::markup(std::move(s));
        }
        if (a.is_sequence() && a.kind == b.kind) {
            std::vector<Value> items = a.items();
            items.insert(items.end(), b.items().begin(), b.items().end());
            return make_list(std::move(items), a.kind);
        }
        if (a.is_string() || a.kind == Kind::kList) {
            fail(fmt::format("can only concatenate {} (not \"{}\") to {}", type_name(a), type_name(b), type_name(a)));
        }
        fail_operands(op, a, b);
    }
    if (op == "*") {
        if (ints) return Value::integer(mul_checked(a.as_int(), b.as_int()));
        if (numbers) return Value::number(a.as_float() * b.as_float());
        const Value &seq = a.is_int() ? b : a;
        const Value &count = a.is_int() ? a : b;
        if (!count.is_int() || !(seq.is_string() || seq.is_sequence())) fail_operands(op, a, b);
        const int64_t n = std::max<int64_t>(0, count.as_int());
        if (seq.is_string()) {
            const size_t len = seq.str().size();
            if (len > 0 && static_cast<uint64_t>(n) > options_.max_output_bytes / len) check_size(SIZE_MAX);
            charge(static_cast<uint64_t>(n) * len / 256);
            std::string s;
            s.reserve(static_cast<size_t>(n) * len);
            for (int64_t k = 0; k < n; ++k) s += seq.str();
            return Value::string(std::move(s));
        }
        const auto &src = seq.items();
        if (!src.empty()) charge(static_cast<uint64_t>(n) > options_.max_iterations / src.size() ? UINT64_MAX / 2
                                                                                               : n * src.size());
        std::vector<Value> items;
        for (int64_t k = 0; k < n; ++k) items.insert(items.end(), src.begin(), src.end());
        return make_list(std::move(items), seq.kind);
    }
    if (op == "%" && a.is_string()) return Value::string(percent_format(a.str(), b, options_.max_output_bytes));
    if (!numbers) fail_operands(op, a, b);
    if (op == "-") {
        if (ints) return Value::integer(sub_checked(a.as_int(), b.as_int()));
        return Value::number(a.as_float() - b.as_float());
    }
    if (op == "/") {
        if (b.as_float() == 0) fail("division by zero");
        return Value::number(a.as_float() / b.as_float());
    }
    if (op == "//") return python_floordiv(a, b);
    if (op == "%") return python_mod(a, b);
    return python_pow(a, b);
}

// ---------------------------------------------------------------------------------------------
// Calls
// ---------------------------------------------------------------------------------------------

Value Renderer::call(const Value &callee, const CallArgs &args) {
    if (callee.kind != Kind::kCallable) {
        if (callee.is_undefined()) fail_undefined(callee);
        fail(fmt::format("'{}' object is not callable", type_name(callee)));
    }
    const auto &c = static_cast<const CallableObj &>(*callee.obj);
    switch (c.fn) {
    case CallableObj::Fn::kMacro: return call_macro(c, args, nullptr);
    case CallableObj::Fn::kCaller: {
        const DepthGuard guard(*this);
        auto parent = c.scope.lock();
        if (!parent) fail("caller() used after its call block ended");
        const Node &block = *c.node;
        auto s = std::make_shared<Scope>();
        s->parent = parent;
        if (args.positional.size() > block.names.size()) fail("caller() got too many arguments");
        for (size_t k = 0; k < block.names.size(); ++k) {
            if (k < args.positional.size()) s->set(block.names[k], args.positional[k]);
            else if (const Value *v = args.get(SIZE_MAX, block.names[k])) s->set(block.names[k], *v);
            else if (block.kids[k + 1]) s->set(block.names[k], eval(*block.kids[k + 1], s));
            else s->set(block.names[k], Value::undefined(fmt::format("parameter '{}' was not provided",
                                                                     block.names[k])));
        }
        return Value::string(capture(block.body, s));
    }
    case CallableObj::Fn::kBuiltin: return call_builtin(*this, c, args);
    case CallableObj::Fn::kMethod: {
        if (c.self.is_string()) charge_walk(c.self);
        for (const Value &a : args.positional) {
            if (a.is_string()) charge_walk(a);
        }
        Value result = call_method(*this, c, args);
        if (result.is_string()) charge_walk(result);
        return result;
    }
    }
    fail("not callable");
}

Value Renderer::call_macro(const CallableObj &macro, const CallArgs &args, const Value *caller) {
    const DepthGuard guard(*this);
    const Node &m = *macro.node;
    auto parent = macro.scope.lock();
    auto s = std::make_shared<Scope>();
    s->parent = parent ? parent : root_;
    if (args.positional.size() > m.names.size()) {
        fail(fmt::format("macro '{}' takes not more than {} argument(s)", m.text, m.names.size()));
    }
    for (const auto &[k, v] : args.keyword) {
        if (std::find(m.names.begin(), m.names.end(), k) == m.names.end() && !(caller && k == "caller")) {
            fail(fmt::format("macro '{}' takes no keyword argument '{}'", m.text, k));
        }
    }
    for (size_t k = 0; k < m.names.size(); ++k) {
        if (k < args.positional.size()) s->set(m.names[k], args.positional[k]);
        else if (const Value *v = args.get(SIZE_MAX, m.names[k])) s->set(m.names[k], *v);
        else if (m.kids[k]) s->set(m.names[k], eval(*m.kids[k], s));
        else s->set(m.names[k], Value::undefined(fmt::format("parameter '{}' was not provided", m.names[k])));
    }
    if (caller) s->set("caller", *caller);
    return Value::string(capture(m.body, s));
}

}  // namespace memra::text::jinja
