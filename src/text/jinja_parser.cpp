// The Jinja parser's statements (if, for, set, macro, call, filter, with, break / continue, generation,
// block, print), following jinja2's grammar as far as chat templates use it, and the check after parsing
// that rejects unknown filters and tests where jinja2's compiler does. Nesting is bounded so that deep
// input cannot exhaust the stack while parsing, evaluating or destroying the tree.
#include "text/jinja_parser.h"

namespace memra::text::jinja {

std::vector<NodePtr> Parser::parse_all() {
    std::vector<NodePtr> body = parse_body({});
    if (cur().kind != TokenKind::kEnd) fail_at(cur(), "expected end of template");
    return body;
}

const Token &Parser::next() {
    const Token &t = toks_[pos_];
    if (pos_ + 1 < toks_.size()) ++pos_;
    return t;
}

std::string Parser::describe(const Token &t) {
    switch (t.kind) {
    case TokenKind::kText: return "template text";
    case TokenKind::kVarBegin: return "'{{'";
    case TokenKind::kVarEnd: return "'}}'";
    case TokenKind::kBlockBegin: return "'{%'";
    case TokenKind::kBlockEnd: return "'%}'";
    case TokenKind::kName: return fmt::format("'{}'", t.text);
    case TokenKind::kString: return "a string";
    case TokenKind::kInt:
    case TokenKind::kFloat: return fmt::format("'{}'", t.text);
    case TokenKind::kOperator: return fmt::format("'{}'", t.text);
    case TokenKind::kEnd: return "end of template";
    }
    return "?";
}

bool Parser::skip_op(std::string_view op) {
    if (!is_op(op)) return false;
    next();
    return true;
}

bool Parser::skip_name(std::string_view name) {
    if (!is_name(name)) return false;
    next();
    return true;
}

NodePtr Parser::node(NodeKind kind, const Token &at) {
    auto n = std::make_unique<Node>();
    n->kind = kind;
    n->line = at.line;
    n->col = at.col;
    return n;
}

void Parser::add(Node &parent, NodePtr kid) {
    if (kid) {
        parent.depth = std::max(parent.depth, kid->depth + 1);
        if (parent.depth > kMaxNesting) {
            throw SyntaxError{fmt::format("expression nested deeper than {} levels", kMaxNesting), parent.line,
                              parent.col};
        }
    }
    parent.kids.push_back(std::move(kid));
}

void Parser::add_args_depth(Node &n) {
    for (const NodePtr &a : n.args.positional) n.depth = std::max(n.depth, a->depth + 1);
    for (const auto &[k, a] : n.args.keyword) n.depth = std::max(n.depth, a->depth + 1);
    if (n.depth > kMaxNesting) {
        throw SyntaxError{fmt::format("expression nested deeper than {} levels", kMaxNesting), n.line, n.col};
    }
}

std::vector<NodePtr> Parser::parse_body(std::initializer_list<std::string_view> end_names) {
    std::vector<NodePtr> body;
    while (true) {
        const Token &t = cur();
        if (t.kind == TokenKind::kEnd) {
            if (end_names.size() == 0) return body;
            std::string want;
            for (std::string_view n : end_names) want += fmt::format("{}'{}'", want.empty() ? "" : " or ", n);
            fail_at(t, "expected " + want);
        }
        if (t.kind == TokenKind::kText) {
            auto n = node(NodeKind::kText, t);
            n->text = next().text;
            body.push_back(std::move(n));
        } else if (t.kind == TokenKind::kVarBegin) {
            next();
            auto n = node(NodeKind::kOutput, t);
            add(*n, parse_tuple(false, true, {}, false));
            if (cur().kind != TokenKind::kVarEnd) fail_at(cur(), "expected '}}'");
            next();
            body.push_back(std::move(n));
        } else if (t.kind == TokenKind::kBlockBegin) {
            const Token &name = peek();
            if (name.kind == TokenKind::kName) {
                for (std::string_view end : end_names) {
                    if (name.text == end) {
                        next();
                        return body;
                    }
                }
            }
            next();
            body.push_back(parse_statement());
        } else {
            fail_at(t, "expected template text or a tag");
        }
    }
}

NodePtr Parser::parse_statement() {
    const Token &t = cur();
    const Nest nest(*this, t);
    if (t.kind != TokenKind::kName) fail_at(t, "expected a statement name");
    const std::string &kw = t.text;
    if (kw == "if") return parse_if();
    if (kw == "for") return parse_for();
    if (kw == "set") return parse_set();
    if (kw == "macro") return parse_macro();
    if (kw == "call") return parse_call_block();
    if (kw == "filter") return parse_filter_block();
    if (kw == "with") return parse_with();
    if (kw == "print") {
        next();
        auto n = node(NodeKind::kOutput, t);
        add(*n, parse_tuple(false, true, {}, false));
        expect_block_end();
        return n;
    }
    if (kw == "break" || kw == "continue") {
        if (loop_depth_ == 0) fail_at(t, fmt::format("'{}' outside a loop", kw));
        next();
        auto n = node(kw == "break" ? NodeKind::kBreak : NodeKind::kContinue, t);
        expect_block_end();
        return n;
    }
    if (kw == "generation" || kw == "block") {
        next();
        auto n = node(NodeKind::kScopeBody, t);
        const bool is_block = kw == "block";
        if (is_block) {
            n->text = expect_name("expected a block name");
            while (skip_name("scoped") || skip_name("required")) {
            }
        }
        expect_block_end();
        n->body = parse_body({is_block ? "endblock" : "endgeneration"});
        next();
        if (is_block && cur().kind == TokenKind::kName) next();  // {% endblock name %}
        expect_block_end();
        return n;
    }
    if (kw == "extends" || kw == "include" || kw == "import" || kw == "from") {
        throw SyntaxError{fmt::format("'{}' is not supported: a chat template is a single template", kw), t.line,
                          t.col};
    }
    throw SyntaxError{fmt::format("unknown tag '{}'", kw), t.line, t.col};
}

NodePtr Parser::parse_if() {
    auto n = node(NodeKind::kIf, next());
    while (true) {
        add(*n, parse_tuple(false, false, {}, false));
        expect_block_end();
        n->bodies.push_back(parse_body({"elif", "else", "endif"}));
        const std::string kw = next().text;
        if (kw == "elif") continue;
        if (kw == "else") {
            expect_block_end();
            n->else_body = parse_body({"endif"});
            next();
        }
        break;
    }
    expect_block_end();
    return n;
}

NodePtr Parser::parse_for() {
    auto n = node(NodeKind::kFor, next());
    add(*n, parse_target(false, "in"));
    if (!skip_name("in")) fail_at(cur(), "expected 'in'");
    add(*n, parse_tuple(false, false, {"recursive"}, false));
    if (skip_name("if")) add(*n, parse_expression(true));
    else n->kids.push_back(nullptr);
    if (is_name("recursive")) throw SyntaxError{"recursive loops are not supported", cur().line, cur().col};
    expect_block_end();
    ++loop_depth_;
    n->body = parse_body({"endfor", "else"});
    --loop_depth_;
    if (next().text == "else") {
        expect_block_end();
        n->else_body = parse_body({"endfor"});
        next();
    }
    expect_block_end();
    return n;
}

NodePtr Parser::parse_target(bool with_namespace, std::string_view end_name) {
    const Token &t = cur();
    if (with_namespace && t.kind == TokenKind::kName && peek().kind == TokenKind::kOperator &&
        peek().text == ".") {
        auto n = node(NodeKind::kGetattr, t);
        auto base = node(NodeKind::kName, t);
        base->text = next().text;
        next();
        n->text = expect_name("expected an attribute name");
        add(*n, std::move(base));
        return n;
    }
    auto tuple = node(NodeKind::kTuple, t);
    bool is_tuple = false;
    const bool parens = skip_op("(");
    while (true) {
        if (!tuple->kids.empty()) {
            if (!skip_op(",")) break;
            is_tuple = true;
        }
        if (cur().kind == TokenKind::kBlockEnd || is_op("=") || is_op("|") || is_op(")") ||
            (cur().kind == TokenKind::kName && cur().text == end_name)) {
            break;
        }
        const Token &name_tok = cur();
        auto name = node(NodeKind::kName, name_tok);
        name->text = expect_name("expected a variable name to assign to");
        if (name->text == "true" || name->text == "false" || name->text == "none" || name->text == "True" ||
            name->text == "False" || name->text == "None") {
            fail_at(name_tok, "expected a variable name to assign to");
        }
        add(*tuple, std::move(name));
    }
    if (parens) {
        expect_op(")");
        is_tuple = true;
    }
    if (tuple->kids.empty()) fail_at(cur(), "expected a variable name to assign to");
    if (!is_tuple) return std::move(tuple->kids[0]);
    return tuple;
}

NodePtr Parser::parse_set() {
    auto n = node(NodeKind::kSet, next());
    add(*n, parse_target(true, ""));
    if (skip_op("=")) {
        add(*n, parse_tuple(false, true, {}, false));
        expect_block_end();
        return n;
    }
    n->kids.push_back(nullptr);
    n->kids.push_back(is_op("|") ? parse_filters(nullptr, false) : nullptr);
    expect_block_end();
    n->body = parse_body({"endset"});
    next();
    expect_block_end();
    return n;
}

void Parser::parse_signature(Node &n) {
    expect_op("(");
    bool defaults = false;
    while (!is_op(")")) {
        if (!n.names.empty()) expect_op(",");
        if (is_op(")")) break;
        const Token &at = cur();
        n.names.push_back(expect_name("expected a parameter name"));
        if (skip_op("=")) {
            defaults = true;
            add(n, parse_expression(true));
        } else if (defaults) {
            fail_at(at, "expected a default value (a parameter without one follows one with)");
        } else {
            n.kids.push_back(nullptr);
        }
    }
    next();
}

NodePtr Parser::parse_macro() {
    auto n = node(NodeKind::kMacro, next());
    n->text = expect_name("expected a macro name");
    parse_signature(*n);
    expect_block_end();
    const int loops = loop_depth_;
    loop_depth_ = 0;  // a loop around the definition is not one around the body
    n->body = parse_body({"endmacro"});
    loop_depth_ = loops;
    next();
    if (cur().kind == TokenKind::kName) next();  // {% endmacro name %}
    expect_block_end();
    return n;
}

NodePtr Parser::parse_call_block() {
    auto n = node(NodeKind::kCallBlock, next());
    auto params = node(NodeKind::kMacro, cur());
    if (is_op("(")) parse_signature(*params);
    NodePtr call = parse_expression(true);
    if (call->kind != NodeKind::kCall) fail_at(cur(), "expected a call after 'call'");
    add(*n, std::move(call));
    n->names = std::move(params->names);
    for (NodePtr &d : params->kids) add(*n, std::move(d));
    expect_block_end();
    n->body = parse_body({"endcall"});
    next();
    expect_block_end();
    return n;
}

NodePtr Parser::parse_filter_block() {
    auto n = node(NodeKind::kFilterBlock, next());
    add(*n, parse_filters(nullptr, true));
    expect_block_end();
    n->body = parse_body({"endfilter"});
    next();
    expect_block_end();
    return n;
}

NodePtr Parser::parse_with() {
    auto n = node(NodeKind::kWith, next());
    while (cur().kind != TokenKind::kBlockEnd) {
        if (!n->names.empty()) expect_op(",");
        n->names.push_back(expect_name("expected a variable name"));
        expect_op("=");
        add(*n, parse_expression(true));
    }
    next();
    n->body = parse_body({"endwith"});
    next();
    expect_block_end();
    return n;
}

namespace {

// jinja2 rejects an unknown filter or test when it compiles the template, except inside an `if` (its
// tests and bodies, not loops or macros nested there) or a conditional expression, where the error
// waits until the filter runs; templates use that to probe for filters with `is filter`.
void check_names(const Node *n, bool soft);

void check_body(const std::vector<NodePtr> &body, bool soft) {
    for (const NodePtr &stmt : body) check_names(stmt.get(), soft);
}

void check_names(const Node *n, bool soft) {
    if (!n) return;
    if (!soft && ((n->kind == NodeKind::kFilter && !has_filter(n->text)) ||
                  (n->kind == NodeKind::kTest && !has_test(n->text)))) {
        throw SyntaxError{fmt::format("No {} named '{}'.", n->kind == NodeKind::kFilter ? "filter" : "test", n->text),
                          n->line, n->col};
    }
    const bool kids_soft = soft || n->kind == NodeKind::kIf || n->kind == NodeKind::kCondExpr;
    for (const NodePtr &k : n->kids) check_names(k.get(), kids_soft);
    for (const NodePtr &a : n->args.positional) check_names(a.get(), soft);
    for (const auto &[name, a] : n->args.keyword) check_names(a.get(), soft);
    for (const auto &body : n->bodies) check_body(body, kids_soft);
    // Loop, macro, call, with and block-set bodies run in an inner frame, which is never soft;
    // an if's else branch belongs to the if.
    check_body(n->else_body, n->kind == NodeKind::kIf ? kids_soft : false);
    check_body(n->body, false);
}

}  // namespace

std::vector<NodePtr> parse_template(std::string_view source) {
    std::vector<NodePtr> body = Parser(lex(source)).parse_all();
    check_body(body, false);
    return body;
}

}  // namespace memra::text::jinja
