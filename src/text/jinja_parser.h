// The Jinja parser (tokens -> syntax tree), shared by jinja_parser.cpp (statements, and the checks after
// parsing) and jinja_parser_expr.cpp (expressions).
#pragma once

#include <algorithm>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "text/jinja_impl.h"

namespace memra::text::jinja {

// Expression and statement nesting the parser accepts (real templates nest a dozen levels).
inline constexpr int kMaxNesting = 200;

class Parser {
public:
    explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

    std::vector<NodePtr> parse_all();

private:
    // ---- token helpers -----------------------------------------------------------------------

    const Token &cur() const { return toks_[pos_]; }
    const Token &peek(size_t ahead = 1) const { return toks_[std::min(pos_ + ahead, toks_.size() - 1)]; }
    const Token &next();

    static std::string describe(const Token &t);

    [[noreturn]] static void fail_at(const Token &t, const std::string &expected) {
        throw SyntaxError{fmt::format("{}, found {}", expected, describe(t)), t.line, t.col};
    }

    bool is_op(std::string_view op) const { return cur().kind == TokenKind::kOperator && cur().text == op; }
    bool is_name(std::string_view name) const { return cur().kind == TokenKind::kName && cur().text == name; }
    bool skip_op(std::string_view op);
    bool skip_name(std::string_view name);
    void expect_op(std::string_view op) {
        if (!skip_op(op)) fail_at(cur(), fmt::format("expected '{}'", op));
    }
    std::string expect_name(const char *what = "expected a name") {
        if (cur().kind != TokenKind::kName) fail_at(cur(), what);
        return next().text;
    }
    void expect_block_end() {
        if (cur().kind != TokenKind::kBlockEnd) fail_at(cur(), "expected '%}'");
        next();
    }

    // Counts nesting on the way down; the guard undoes it on the way up.
    struct Nest {
        Nest(Parser &parser, const Token &at) : p(parser) {
            if (++p.nesting_ > kMaxNesting) {
                --p.nesting_;
                throw SyntaxError{fmt::format("nesting deeper than {} levels", kMaxNesting), at.line, at.col};
            }
        }
        ~Nest() { --p.nesting_; }
        Parser &p;
    };

    NodePtr node(NodeKind kind, const Token &at);
    // Adds a child and bounds the tree depth (left-deep chains like a+b+c+... grow it in loops).
    void add(Node &parent, NodePtr kid);
    void add_args_depth(Node &n);

    // ---- statements (jinja_parser.cpp) ------------------------------------------------------

    // Statements up to a {% name %} with name in `end_names` (left current, just after the '{%'),
    // or up to the end of the template when end_names is empty.
    std::vector<NodePtr> parse_body(std::initializer_list<std::string_view> end_names);
    NodePtr parse_statement();
    NodePtr parse_if();
    NodePtr parse_for();
    // An assignment target: a name, `ns.attr` (with_namespace), or a tuple of names.
    NodePtr parse_target(bool with_namespace, std::string_view end_name);
    NodePtr parse_set();
    // (a, b=default, ...) of macros and call blocks: names, and in kids each default (null if none).
    void parse_signature(Node &n);
    NodePtr parse_macro();
    NodePtr parse_call_block();
    NodePtr parse_filter_block();
    NodePtr parse_with();

    // ---- expressions (jinja_parser_expr.cpp), loosest binding first --------------------------

    // Comma-separated expressions; a tuple if there is a comma (or in empty parentheses).
    NodePtr parse_tuple(bool simplified, bool with_condexpr, std::initializer_list<std::string_view> end_names,
                        bool explicit_parens);
    NodePtr parse_expression(bool with_condexpr) {
        const Nest nest(*this, cur());
        return with_condexpr ? parse_condexpr() : parse_or();
    }
    NodePtr parse_condexpr();  // a if c else b
    NodePtr binary(NodeKind kind, const Token &at, std::string op, NodePtr left, NodePtr right);
    NodePtr parse_or();
    NodePtr parse_and();
    NodePtr parse_not();
    NodePtr parse_compare();  // == != < <= > >= in, not in (chained)
    NodePtr parse_math1();  // + -
    NodePtr parse_concat();  // ~
    NodePtr parse_math2();  // * / // %
    NodePtr parse_pow();  // **
    NodePtr parse_unary(bool with_filter);  // - + then postfix, then filters and tests
    NodePtr parse_primary();  // names, literals, (tuples), [lists], {dicts}
    NodePtr parse_collection();
    NodePtr parse_postfix(NodePtr n);  // .attr [subscript] (call)
    // An index or a slice a:b:c (each part optional).
    NodePtr parse_subscribed();
    void parse_call_args(Arguments &args);
    NodePtr parse_call(NodePtr callee);
    NodePtr parse_filter_expr(NodePtr n);
    std::string dotted_name(const char *what);
    // `| f(args) | g ...` applied to `operand` (null in filter blocks); `inline_first`: no leading '|'.
    NodePtr parse_filters(NodePtr operand, bool inline_first);
    NodePtr parse_test(NodePtr operand);  // is [not] name [arg | (args)]

    std::vector<Token> toks_;
    size_t pos_ = 0;
    int nesting_ = 0;
    int loop_depth_ = 0;  // for loops around the statement being parsed (break/continue need one)
};

}  // namespace memra::text::jinja
