// Jinja expressions, parsed with jinja2's precedence: conditional, or, and, not, comparisons (chained,
// `in`, `not in`), + -, ~, * / // %, ** (left-associative, as jinja2 has it), unary - + (binding looser
// than filters: -x|abs is abs(-x)), then postfix subscripts, calls, filters and `is` tests.
#include "text/jinja_parser.h"

namespace memra::text::jinja {

NodePtr Parser::parse_tuple(bool simplified, bool with_condexpr, std::initializer_list<std::string_view> end_names,
                    bool explicit_parens) {
    auto tuple = node(NodeKind::kTuple, cur());
    bool is_tuple = false;
    while (true) {
        if (!tuple->kids.empty()) expect_op(",");
        const Token &t = cur();
        bool at_end = t.kind == TokenKind::kVarEnd || t.kind == TokenKind::kBlockEnd || is_op(")");
        for (std::string_view e : end_names) at_end = at_end || is_name(e);
        if (at_end) break;
        add(*tuple, simplified ? parse_primary() : parse_expression(with_condexpr));
        if (is_op(",")) is_tuple = true;
        else break;
    }
    if (!is_tuple) {
        if (!tuple->kids.empty()) return std::move(tuple->kids[0]);
        if (!explicit_parens) fail_at(cur(), "expected an expression");
    }
    return tuple;
}

NodePtr Parser::parse_condexpr() {
    NodePtr expr = parse_or();
    while (is_name("if")) {
        auto n = node(NodeKind::kCondExpr, next());
        add(*n, parse_or());
        add(*n, std::move(expr));
        if (skip_name("else")) {
            const Nest nest(*this, cur());
            add(*n, parse_condexpr());
        } else {
            n->kids.push_back(nullptr);
        }
        expr = std::move(n);
    }
    return expr;
}

NodePtr Parser::binary(NodeKind kind, const Token &at, std::string op, NodePtr left, NodePtr right) {
    auto n = node(kind, at);
    n->text = std::move(op);
    add(*n, std::move(left));
    add(*n, std::move(right));
    return n;
}

NodePtr Parser::parse_or() {
    NodePtr left = parse_and();
    while (is_name("or")) {
        const Token &at = next();
        left = binary(NodeKind::kOr, at, "or", std::move(left), parse_and());
    }
    return left;
}

NodePtr Parser::parse_and() {
    NodePtr left = parse_not();
    while (is_name("and")) {
        const Token &at = next();
        left = binary(NodeKind::kAnd, at, "and", std::move(left), parse_not());
    }
    return left;
}

NodePtr Parser::parse_not() {
    if (is_name("not")) {
        const Token &at = next();
        const Nest nest(*this, at);
        auto n = node(NodeKind::kUnary, at);
        n->text = "not";
        add(*n, parse_not());
        return n;
    }
    return parse_compare();
}

NodePtr Parser::parse_compare() {
    const Token &at = cur();
    NodePtr first = parse_math1();
    NodePtr n;
    while (true) {
        std::string op;
        if (cur().kind == TokenKind::kOperator &&
            (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == "<=" ||
             cur().text == ">" || cur().text == ">=")) {
            op = next().text;
        } else if (skip_name("in")) {
            op = "in";
        } else if (is_name("not") && peek().kind == TokenKind::kName && peek().text == "in") {
            next();
            next();
            op = "notin";
        } else {
            break;
        }
        if (!n) {
            n = node(NodeKind::kCompare, at);
            add(*n, std::move(first));
        }
        n->names.push_back(op);
        add(*n, parse_math1());
    }
    return n ? std::move(n) : std::move(first);
}

NodePtr Parser::parse_math1() {
    NodePtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
        const Token &at = next();
        left = binary(NodeKind::kBinary, at, at.text, std::move(left), parse_concat());
    }
    return left;
}

NodePtr Parser::parse_concat() {
    NodePtr left = parse_math2();
    while (is_op("~")) {
        const Token &at = next();
        left = binary(NodeKind::kBinary, at, "~", std::move(left), parse_math2());
    }
    return left;
}

NodePtr Parser::parse_math2() {
    NodePtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
        const Token &at = next();
        left = binary(NodeKind::kBinary, at, at.text, std::move(left), parse_pow());
    }
    return left;
}

NodePtr Parser::parse_pow() {
    NodePtr left = parse_unary(true);
    while (is_op("**")) {
        const Token &at = next();
        left = binary(NodeKind::kBinary, at, "**", std::move(left), parse_unary(true));
    }
    return left;
}

NodePtr Parser::parse_unary(bool with_filter) {
    const Token &at = cur();
    const Nest nest(*this, at);
    NodePtr n;
    if (is_op("-") || is_op("+")) {
        n = node(NodeKind::kUnary, at);
        n->text = next().text;
        add(*n, parse_unary(false));
    } else {
        n = parse_primary();
    }
    n = parse_postfix(std::move(n));
    if (with_filter) n = parse_filter_expr(std::move(n));
    return n;
}

NodePtr Parser::parse_primary() {
    const Token &t = cur();
    switch (t.kind) {
    case TokenKind::kName: {
        next();
        auto n = node(NodeKind::kConst, t);
        if (t.text == "true" || t.text == "True") n->value = Value::boolean(true);
        else if (t.text == "false" || t.text == "False") n->value = Value::boolean(false);
        else if (t.text == "none" || t.text == "None") n->value = Value::none();
        else n->kind = NodeKind::kName, n->text = t.text;
        return n;
    }
    case TokenKind::kString: {
        std::string s;
        while (cur().kind == TokenKind::kString) s += next().text;
        auto n = node(NodeKind::kConst, t);
        n->value = Value::string(std::move(s));
        return n;
    }
    case TokenKind::kInt:
    case TokenKind::kFloat: {
        next();
        auto n = node(NodeKind::kConst, t);
        n->value = t.kind == TokenKind::kInt ? Value::integer(t.int_value) : Value::number(t.float_value);
        return n;
    }
    case TokenKind::kOperator:
        if (t.text == "(") {
            next();
            NodePtr n = parse_tuple(false, true, {}, true);
            expect_op(")");
            return n;
        }
        if (t.text == "[" || t.text == "{") return parse_collection();
        break;
    default: break;
    }
    fail_at(t, "expected an expression");
}

NodePtr Parser::parse_collection() {
    const Token &at = next();
    const bool is_dict = at.text == "{";
    const char *close = is_dict ? "}" : "]";
    auto n = node(is_dict ? NodeKind::kDict : NodeKind::kList, at);
    while (!is_op(close)) {
        if (!n->kids.empty()) {
            expect_op(",");
            if (is_op(close)) break;
        }
        add(*n, parse_expression(true));
        if (is_dict) {
            expect_op(":");
            add(*n, parse_expression(true));
        }
    }
    next();
    return n;
}

NodePtr Parser::parse_postfix(NodePtr n) {
    while (true) {
        if (is_op(".")) {
            const Token &at = next();
            const Token &attr = cur();
            if (attr.kind == TokenKind::kName) {
                auto g = node(NodeKind::kGetattr, at);
                g->text = next().text;
                add(*g, std::move(n));
                n = std::move(g);
            } else if (attr.kind == TokenKind::kInt) {
                auto g = node(NodeKind::kGetitem, at);
                auto index = node(NodeKind::kConst, attr);
                index->value = Value::integer(next().int_value);
                add(*g, std::move(n));
                add(*g, std::move(index));
                n = std::move(g);
            } else {
                fail_at(attr, "expected an attribute name or number");
            }
        } else if (is_op("[")) {
            const Token &at = next();
            auto g = node(NodeKind::kGetitem, at);
            auto tuple = node(NodeKind::kTuple, at);
            while (!is_op("]")) {
                if (!tuple->kids.empty()) expect_op(",");
                add(*tuple, parse_subscribed());
            }
            next();
            if (tuple->kids.empty()) fail_at(cur(), "expected a subscript");
            add(*g, std::move(n));
            add(*g, tuple->kids.size() == 1 ? std::move(tuple->kids[0]) : std::move(tuple));
            n = std::move(g);
        } else if (is_op("(")) {
            n = parse_call(std::move(n));
        } else {
            return n;
        }
    }
}

NodePtr Parser::parse_subscribed() {
    const Token &at = cur();
    NodePtr start;
    if (!is_op(":")) {
        start = parse_expression(true);
        if (!is_op(":")) return start;
    }
    next();
    auto s = node(NodeKind::kSlice, at);
    add(*s, std::move(start));
    add(*s, is_op(":") || is_op("]") || is_op(",") ? nullptr : parse_expression(true));
    if (skip_op(":")) add(*s, is_op("]") || is_op(",") ? nullptr : parse_expression(true));
    else s->kids.push_back(nullptr);
    return s;
}

void Parser::parse_call_args(Arguments &args) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
        if (!first) {
            expect_op(",");
            if (is_op(")")) break;
        }
        first = false;
        if (is_op("*") || is_op("**")) fail_at(cur(), "*args and **kwargs in calls are not supported");
        if (cur().kind == TokenKind::kName && peek().kind == TokenKind::kOperator && peek().text == "=") {
            std::string key = next().text;
            next();
            args.keyword.emplace_back(std::move(key), parse_expression(true));
        } else {
            if (!args.keyword.empty()) fail_at(cur(), "expected a keyword argument (positional follows keyword)");
            args.positional.push_back(parse_expression(true));
        }
    }
    next();
}

NodePtr Parser::parse_call(NodePtr callee) {
    auto n = node(NodeKind::kCall, cur());
    add(*n, std::move(callee));
    parse_call_args(n->args);
    add_args_depth(*n);
    return n;
}

NodePtr Parser::parse_filter_expr(NodePtr n) {
    while (true) {
        if (is_op("|")) n = parse_filters(std::move(n), false);
        else if (is_name("is")) n = parse_test(std::move(n));
        else if (is_op("(")) n = parse_call(std::move(n));
        else return n;
    }
}

std::string Parser::dotted_name(const char *what) {
    std::string name = expect_name(what);
    while (skip_op(".")) name.append(1, '.').append(expect_name(what));
    return name;
}

NodePtr Parser::parse_filters(NodePtr operand, bool inline_first) {
    while (inline_first || is_op("|")) {
        if (!inline_first) next();
        inline_first = false;
        auto f = node(NodeKind::kFilter, cur());
        f->text = dotted_name("expected a filter name");
        add(*f, std::move(operand));
        if (is_op("(")) parse_call_args(f->args);
        add_args_depth(*f);
        operand = std::move(f);
    }
    return operand;
}

NodePtr Parser::parse_test(NodePtr operand) {
    next();
    const bool negated = skip_name("not");
    auto t = node(NodeKind::kTest, cur());
    t->flag = negated;
    t->text = dotted_name("expected a test name");
    add(*t, std::move(operand));
    const Token &c = cur();
    if (is_op("(")) {
        parse_call_args(t->args);
    } else if ((c.kind == TokenKind::kName || c.kind == TokenKind::kString || c.kind == TokenKind::kInt ||
                c.kind == TokenKind::kFloat || is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
        if (is_name("is")) fail_at(c, "expected one test (tests cannot be chained with 'is')");
        t->args.positional.push_back(parse_postfix(parse_primary()));
    }
    add_args_depth(*t);
    return t;
}

}  // namespace memra::text::jinja
