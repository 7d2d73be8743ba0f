// The Jinja lexer: splits a template into text and tag tokens the way jinja2's lexer does in the
// transformers environment (trim_blocks, lstrip_blocks, keep_trailing_newline off): newlines are
// normalized to \n, one trailing newline is dropped, `-` strips whitespace beside a tag, `+` keeps it,
// comments vanish and {% raw %} bodies become text.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

#include "text/jinja_impl.h"
#include "text/utf8.h"

namespace memra::text::jinja {
namespace {

// \r\n and \r become \n; a single trailing newline goes.
std::string normalize_newlines(std::string_view source) {
    std::string out;
    out.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
        if (source[i] == '\r') {
            out += '\n';
            if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
        } else {
            out += source[i];
        }
    }
    if (!out.empty() && out.back() == '\n') out.pop_back();
    return out;
}

bool is_ident_start(unsigned char c) { return std::isalpha(c) || c == '_' || c >= 0x80; }
bool is_ident_char(unsigned char c) { return std::isalnum(c) || c == '_' || c >= 0x80; }

class Lexer {
public:
    explicit Lexer(std::string_view source) : src_(normalize_newlines(source)) {}

    std::vector<Token> run() {
        while (pos_ < src_.size()) lex_text();
        push(TokenKind::kEnd, "", pos_);
        return std::move(tokens_);
    }

private:
    [[noreturn]] void error(size_t at, std::string message) const {
        throw SyntaxError{std::move(message), line_at(at), col_at(at)};
    }

    // Line and column (in characters) of byte offset `at`. Tokens come in source order, so a cursor
    // moves forward; an earlier offset (an error at a tag start) restarts it.
    int line_at(size_t at) const {
        seek(at);
        return cursor_line_;
    }
    int col_at(size_t at) const {
        seek(at);
        const std::string_view line = std::string_view(src_).substr(cursor_line_start_, at - cursor_line_start_);
        return 1 + static_cast<int>(utf8_length(line));
    }
    void seek(size_t at) const {
        if (at < cursor_) cursor_ = 0, cursor_line_ = 1, cursor_line_start_ = 0;
        for (; cursor_ < at && cursor_ < src_.size(); ++cursor_) {
            if (src_[cursor_] == '\n') ++cursor_line_, cursor_line_start_ = cursor_ + 1;
        }
    }

    void push(TokenKind kind, std::string text, size_t at) {
        Token t;
        t.kind = kind;
        t.text = std::move(text);
        t.line = line_at(at);
        t.col = col_at(at);
        tokens_.push_back(std::move(t));
    }

    // Bytes of Python whitespace (\s) in `s` from `at` (0 if none).
    static size_t space_len_in(std::string_view s, size_t at) {
        size_t p = at;
        while (p < s.size()) {
            char32_t cp;
            const size_t n = utf8_decode(s, p, cp);
            if (!py_isspace(cp)) break;
            p += n;
        }
        return p - at;
    }
    size_t space_len(size_t at) const { return space_len_in(src_, at); }

    // Strips trailing Python-whitespace of `text`.
    static void rstrip(std::string &text) {
        size_t end = text.size();
        while (end > 0) {
            size_t start = end - 1;
            while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80 && end - start < 4) --start;
            char32_t cp;
            if (utf8_decode(text, start, cp) != end - start || !py_isspace(cp)) break;
            end = start;
        }
        text.resize(end);
    }

    // Text up to the next tag, then the tag.
    void lex_text() {
        size_t tag = pos_;
        while (true) {
            tag = src_.find('{', tag);
            if (tag == std::string::npos || tag + 1 >= src_.size()) {
                tag = std::string::npos;
                break;
            }
            const char c = src_[tag + 1];
            if (c == '{' || c == '%' || c == '#') break;
            ++tag;
        }
        if (tag == std::string::npos) {
            push_text(src_.substr(pos_), pos_);
            pos_ = src_.size();
            return;
        }
        const char kind = src_[tag + 1];
        const char sign = tag + 2 < src_.size() && (src_[tag + 2] == '-' || src_[tag + 2] == '+') ? src_[tag + 2] : 0;
        std::string text = src_.substr(pos_, tag - pos_);
        if (sign == '-') {
            rstrip(text);
        } else if (sign != '+' && kind != '{') {
            // lstrip_blocks: whitespace between the line start and a block or comment tag goes.
            const size_t nl = text.rfind('\n');
            const size_t line_start = nl == std::string::npos ? 0 : nl + 1;
            if ((line_start > 0 || line_starting_) && line_start < text.size() &&
                space_len_in(text, line_start) == text.size() - line_start) {
                text.resize(line_start);
            }
        }
        push_text(std::move(text), pos_);
        size_t p = tag + 2 + (sign ? 1 : 0);
        if (kind == '#') {
            lex_comment(tag, p);
        } else if (kind == '%' && try_raw(tag, p)) {
            // raw body emitted as text
        } else {
            lex_tag(kind == '{' ? TokenKind::kVarBegin : TokenKind::kBlockBegin, tag, p);
        }
    }

    void push_text(std::string text, size_t at) {
        if (!text.empty()) push(TokenKind::kText, std::move(text), at);
    }

    // After a block or comment end at `p` (just past the closing "}"): `-` strips all whitespace,
    // plain trims one newline (trim_blocks), `+` keeps everything.
    size_t after_block_end(size_t p, char sign) {
        if (sign == '-') p += space_len(p);
        else if (sign != '+' && p < src_.size() && src_[p] == '\n') ++p;
        line_starting_ = p > 0 && src_[p - 1] == '\n';
        return p;
    }

    void lex_comment(size_t tag, size_t p) {
        const size_t end = src_.find("#}", p);
        if (end == std::string::npos) error(tag, "missing end of comment tag");
        const char sign = end > p && (src_[end - 1] == '-' || src_[end - 1] == '+') ? src_[end - 1] : 0;
        pos_ = after_block_end(end + 2, sign);
    }

    // {% raw %}...{% endraw %}: the body is text, with the whitespace rules of the endraw tag.
    bool try_raw(size_t tag, size_t p) {
        p += space_len(p);
        if (src_.compare(p, 3, "raw") != 0) return false;
        p += 3;
        p += space_len(p);
        char sign = 0;
        if (p < src_.size() && src_[p] == '-') sign = '-', ++p;
        if (src_.compare(p, 2, "%}") != 0) return false;
        p += 2;
        if (sign == '-') p += space_len(p);
        // The closing tag: {%[-+]? \s* endraw \s* [-+]?%}
        size_t search = p;
        while (true) {
            const size_t open = src_.find("{%", search);
            if (open == std::string::npos) error(tag, "missing end of raw directive");
            size_t q = open + 2;
            const char open_sign = q < src_.size() && (src_[q] == '-' || src_[q] == '+') ? src_[q] : 0;
            if (open_sign) ++q;
            q += space_len(q);
            if (src_.compare(q, 6, "endraw") != 0) {
                search = open + 2;
                continue;
            }
            q += 6;
            q += space_len(q);
            const char close_sign = q < src_.size() && (src_[q] == '-' || src_[q] == '+') ? src_[q] : 0;
            if (close_sign) ++q;
            if (src_.compare(q, 2, "%}") != 0) {
                search = open + 2;
                continue;
            }
            std::string body = src_.substr(p, open - p);
            if (open_sign == '-') {
                rstrip(body);
            } else if (open_sign != '+') {
                const size_t nl = body.rfind('\n');
                const size_t line_start = nl == std::string::npos ? 0 : nl + 1;
                if (line_start > 0 && line_start < body.size() &&
                    space_len_in(body, line_start) == body.size() - line_start) {
                    body.resize(line_start);
                }
            }
            push_text(std::move(body), p);
            pos_ = after_block_end(q + 2, close_sign);
            return true;
        }
    }

    void lex_tag(TokenKind begin, size_t tag, size_t p) {
        const bool is_var = begin == TokenKind::kVarBegin;
        push(begin, "", tag);
        std::vector<char> balance;  // closing brackets expected
        while (true) {
            p += space_len(p);
            if (p >= src_.size()) error(tag, is_var ? "unexpected end of template, expected '}}'"
                                                    : "unexpected end of template, expected '%}'");
            if (balance.empty()) {
                const char *end = is_var ? "}}" : "%}";
                char sign = 0;
                size_t q = p;
                if (src_[q] == '-' || (!is_var && src_[q] == '+')) sign = src_[q], ++q;
                if (src_.compare(q, 2, end) == 0) {
                    push(is_var ? TokenKind::kVarEnd : TokenKind::kBlockEnd, "", p);
                    q += 2;
                    if (is_var) {
                        if (sign == '-') q += space_len(q);
                        line_starting_ = q > 0 && src_[q - 1] == '\n';
                        pos_ = q;
                    } else {
                        pos_ = after_block_end(q, sign);
                    }
                    return;
                }
            }
            p = lex_operand(p, balance);
        }
    }

    // One token inside a tag at `p`; returns the position after it.
    size_t lex_operand(size_t p, std::vector<char> &balance) {
        const unsigned char c = static_cast<unsigned char>(src_[p]);
        if (std::isdigit(c)) return lex_number(p);
        if (is_ident_start(c)) {
            // Names are ASCII words plus any non-ASCII character other than whitespace (Python's
            // identifiers, approximately).
            size_t q = p;
            while (q < src_.size() && is_ident_char(static_cast<unsigned char>(src_[q]))) {
                char32_t cp;
                const size_t n = utf8_decode(src_, q, cp);
                if (py_isspace(cp)) break;
                q += n;
            }
            push(TokenKind::kName, src_.substr(p, q - p), p);
            return q;
        }
        if (c == '\'' || c == '"') return lex_string(p);
        static constexpr std::string_view kTwo[] = {"//", "**", "==", "!=", "<=", ">="};
        for (std::string_view op : kTwo) {
            if (src_.compare(p, 2, op) == 0) {
                push(TokenKind::kOperator, std::string(op), p);
                return p + 2;
            }
        }
        if (std::string_view("+-/*%~[](){}><=.:|,;").find(static_cast<char>(c)) == std::string_view::npos) {
            char32_t cp;
            utf8_decode(src_, p, cp);
            std::string shown;
            utf8_append(shown, cp < 0x110000 ? cp : 0xFFFD);
            error(p, fmt::format("unexpected char '{}'", shown));
        }
        if (c == '(' || c == '[' || c == '{') balance.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
        if (c == ')' || c == ']' || c == '}') {
            if (balance.empty()) error(p, fmt::format("unexpected '{}'", static_cast<char>(c)));
            if (balance.back() != static_cast<char>(c)) {
                error(p, fmt::format("unexpected '{}', expected '{}'", static_cast<char>(c), balance.back()));
            }
            balance.pop_back();
        }
        push(TokenKind::kOperator, std::string(1, static_cast<char>(c)), p);
        return p + 1;
    }

    // Digits with single '_' separators starting at p; returns the end (p if none).
    size_t digits(size_t p, int base = 10) const {
        const auto ok = [&](char ch) {
            const int d = std::isdigit(static_cast<unsigned char>(ch)) ? ch - '0'
                          : std::isxdigit(static_cast<unsigned char>(ch)) ? std::tolower(ch) - 'a' + 10 : 99;
            return d < base;
        };
        size_t q = p;
        while (q < src_.size()) {
            if (ok(src_[q])) ++q;
            else if (src_[q] == '_' && q > p && q + 1 < src_.size() && ok(src_[q + 1])) ++q;
            else break;
        }
        return q;
    }

    size_t lex_number(size_t p) {
        const size_t int_end = digits(p);
        size_t q = int_end;
        bool is_float = false;
        // A float never follows a '.' (so `a.0.1` is two subscripts).
        if (p == 0 || src_[p - 1] != '.') {
            if (q + 1 < src_.size() && src_[q] == '.' && std::isdigit(static_cast<unsigned char>(src_[q + 1]))) {
                q = digits(q + 1);
                is_float = true;
            }
            if (q < src_.size() && (src_[q] == 'e' || src_[q] == 'E')) {
                size_t e = q + 1;
                if (e < src_.size() && (src_[e] == '+' || src_[e] == '-')) ++e;
                const size_t e_end = digits(e);
                if (e_end > e) {
                    q = e_end;
                    is_float = true;
                }
            }
        }
        std::string text;
        if (is_float) {
            for (size_t k = p; k < q; ++k) if (src_[k] != '_') text += src_[k];
            push(TokenKind::kFloat, text, p);
            tokens_.back().float_value = std::strtod(text.c_str(), nullptr);
            return q;
        }
        int base = 10;
        size_t start = p;
        if (src_[p] == '0' && p + 1 < src_.size()) {
            const char x = static_cast<char>(std::tolower(src_[p + 1]));
            base = x == 'b' ? 2 : x == 'o' ? 8 : x == 'x' ? 16 : 10;
            if (base != 10) {
                start = p + 2;
                if (start < src_.size() && src_[start] == '_') ++start;
                q = digits(start, base);
                if (q == start) error(p, "invalid number literal");
            } else {
                q = p + 1;  // "0" then zeros only: 0_0 is zero, 012 is 0 followed by 12
                while (q < src_.size() &&
                       (src_[q] == '0' || (src_[q] == '_' && q + 1 < src_.size() && src_[q + 1] == '0'))) {
                    ++q;
                }
            }
        }
        for (size_t k = start; k < q; ++k) if (src_[k] != '_') text += src_[k];
        push(TokenKind::kInt, src_.substr(p, q - p), p);
        uint64_t value = 0;
        const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value, base);
        (void)ptr;
        if (ec != std::errc() || value > static_cast<uint64_t>(INT64_MAX)) error(p, "integer literal too large");
        tokens_.back().int_value = static_cast<int64_t>(value);
        return q;
    }

    size_t lex_string(size_t p) {
        const char quote = src_[p];
        size_t q = p + 1;
        std::string value;
        while (true) {
            if (q >= src_.size()) error(p, fmt::format("unexpected char '{}'", quote));
            const char ch = src_[q];
            if (ch == quote) break;
            if (ch != '\\') {
                value += ch;
                ++q;
                continue;
            }
            if (q + 1 >= src_.size()) error(p, fmt::format("unexpected char '{}'", quote));
            q = unescape(q, value);
        }
        push(TokenKind::kString, std::move(value), p);
        return q + 1;
    }

    // Python's unicode-escape decoding of the escape at src_[q] == '\\'; returns the position after it.
    size_t unescape(size_t q, std::string &value) const {
        const char e = src_[q + 1];
        const auto hex = [&](size_t at, int n, const char *what) {
            uint32_t cp = 0;
            for (int k = 0; k < n; ++k) {
                const size_t i = at + static_cast<size_t>(k);
                if (i >= src_.size() || !std::isxdigit(static_cast<unsigned char>(src_[i]))) {
                    error(q, fmt::format("truncated {} escape", what));
                }
                const char d = static_cast<char>(std::tolower(src_[i]));
                const int digit = std::isdigit(static_cast<unsigned char>(d)) ? d - '0' : d - 'a' + 10;
                cp = cp * 16 + static_cast<uint32_t>(digit);
            }
            return cp;
        };
        const auto put = [&](uint32_t cp) {
            if (cp > 0x10FFFF) error(q, "illegal Unicode character");
            utf8_append(value, (cp >= 0xD800 && cp < 0xE000) ? 0xFFFD : static_cast<char32_t>(cp));
        };
        switch (e) {
        case '\n': return q + 2;
        case '\\': value += '\\'; return q + 2;
        case '\'': value += '\''; return q + 2;
        case '"': value += '"'; return q + 2;
        case 'a': value += '\a'; return q + 2;
        case 'b': value += '\b'; return q + 2;
        case 'f': value += '\f'; return q + 2;
        case 'n': value += '\n'; return q + 2;
        case 'r': value += '\r'; return q + 2;
        case 't': value += '\t'; return q + 2;
        case 'v': value += '\v'; return q + 2;
        case 'x': put(hex(q + 2, 2, "\\xXX")); return q + 4;
        case 'u': put(hex(q + 2, 4, "\\uXXXX")); return q + 6;
        case 'U': put(hex(q + 2, 8, "\\UXXXXXXXX")); return q + 10;
        case 'N': error(q, "named Unicode escapes (\\N{...}) are not supported");
        default: break;
        }
        if (e >= '0' && e <= '7') {
            uint32_t cp = 0;
            size_t k = q + 1;
            for (int n = 0; n < 3 && k < src_.size() && src_[k] >= '0' && src_[k] <= '7'; ++n, ++k) {
                cp = cp * 8 + static_cast<uint32_t>(src_[k] - '0');
            }
            put(cp);
            return k;
        }
        value += '\\';  // unknown escapes stay as written
        return q + 1;
    }

    std::string src_;
    size_t pos_ = 0;
    bool line_starting_ = true;  // the previous tag ended with a newline (or nothing came yet)
    mutable size_t cursor_ = 0, cursor_line_start_ = 0;
    mutable int cursor_line_ = 1;
    std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> lex(std::string_view source) { return Lexer(source).run(); }

}  // namespace memra::text::jinja
