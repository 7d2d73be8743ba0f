// jinja2's string filters (trim, case, replace, indent, escape, format, truncate, ...): each applies to
// str(value) and, like jinja2's soft_str, keeps Markup as Markup.
#include <algorithm>

#include <fmt/format.h>

#include "text/jinja_impl.h"
#include "text/utf8.h"

namespace memra::text::jinja {

std::string html_escape(std::string_view s) {
    std::string out;
    for (char c : s) {
        switch (c) {
        case '&': out += "&amp;"; break;
        case '<': out += "&lt;"; break;
        case '>': out += "&gt;"; break;
        case '"': out += "&#34;"; break;
        case '\'': out += "&#39;"; break;
        default: out += c;
        }
    }
    return out;
}

namespace {

// Python's str.splitlines() boundaries.
std::vector<std::string> split_lines(std::string_view s) {
    std::vector<std::string> lines;
    size_t start = 0;
    for (size_t p = 0; p < s.size();) {
        char32_t c;
        const size_t n = utf8_decode(s, p, c);
        const bool boundary = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || (c >= 0x1C && c <= 0x1E) ||
                              c == 0x85 || c == 0x2028 || c == 0x2029;
        if (!boundary) {
            p += n;
            continue;
        }
        lines.emplace_back(s.substr(start, p - start));
        p += n;
        if (c == '\r' && p < s.size() && s[p] == '\n') ++p;
        start = p;
    }
    if (start < s.size()) lines.emplace_back(s.substr(start));
    return lines;
}

// String filters keep Markup as Markup (jinja2 applies them to soft_str(value), which keeps the type).
Value like(const Value &v, std::string text) {
    return v.is_markup() ? Value::markup(std::move(text)) : Value::string(std::move(text));
}

Value f_trim(Renderer &r, const Value &v, const CallArgs &a) {
    std::string tmp;
    return like(v, str_strip(str_of(r, v, tmp), param(a, 0, "chars"), true, true));
}

Value f_upper(Renderer &r, const Value &v, const CallArgs &) {
    std::string tmp;
    return like(v, str_upper(str_of(r, v, tmp)));
}

Value f_lower(Renderer &r, const Value &v, const CallArgs &) {
    std::string tmp;
    return like(v, str_lower(str_of(r, v, tmp)));
}

Value f_capitalize(Renderer &r, const Value &v, const CallArgs &) {
    std::string tmp;
    return like(v, str_capitalize(str_of(r, v, tmp)));
}

// jinja2's title: each piece after a run of [-\s({[<] is capitalized (not Python's str.title).
Value f_title(Renderer &r, const Value &v, const CallArgs &) {
    std::string tmp;
    const std::string_view s = str_of(r, v, tmp);
    std::string out;
    bool word_start = true;
    for (size_t p = 0; p < s.size();) {
        char32_t c;
        const size_t n = utf8_decode(s, p, c);
        const bool separator = py_isspace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
        if (separator) out.append(s.substr(p, n));
        else utf8_append(out, word_start ? cp_upper(c) : cp_lower(c));
        word_start = separator;
        p += n;
    }
    return like(v, std::move(out));
}

Value f_replace(Renderer &r, const Value &v, const CallArgs &a) {
    std::string tmp, old_tmp, new_tmp;
    const std::string_view s = str_of(r, v, tmp);
    const std::string_view old = str_of(r, param(a, 0, "old"), old_tmp);
    const std::string_view repl = str_of(r, param(a, 1, "new"), new_tmp);
    const int64_t count = int_param(a, 2, "count", -1);
    const size_t n = old.empty() ? utf8_length(s) + 1 : static_cast<size_t>(str_count(s, old));
    if (repl.size() > old.size()) r.check_size(s.size() + n * (repl.size() - old.size()));
    return Value::string(str_replace(s, old, repl, count));
}

Value f_string(Renderer &r, const Value &v, const CallArgs &) {
    return v.is_markup() ? v : Value::string(to_str(v, r.options().max_output_bytes));
}

Value f_indent(Renderer &r, const Value &v, const CallArgs &a) {
    const Value width = param(a, 0, "width", Value::integer(4));
    const bool first = truthy(param(a, 1, "first", Value::boolean(false)));
    const bool blank = truthy(param(a, 2, "blank", Value::boolean(false)));
    std::string indention;
    if (width.is_string()) indention = width.str();
    else if (width.is_int()) indention.assign(static_cast<size_t>(std::clamp<int64_t>(width.as_int(), 0, 65536)), ' ');
    else fail(fmt::format("indent: width must be an int or a str, not {}", type_name(width)));
    std::string tmp;
    std::string s(str_of(r, v, tmp));
    s += '\n';  // jinja2 appends a newline so that splitlines keeps a trailing empty line
    const std::vector<std::string> lines = split_lines(s);
    r.check_size(s.size() + lines.size() * indention.size());
    std::string out;
    for (size_t k = 0; k < lines.size(); ++k) {
        if (k > 0) {
            out += '\n';
            if (blank || !lines[k].empty()) out += indention;
        }
        out += lines[k];
    }
    if (first) out = indention + out;
    return Value::string(std::move(out));
}

Value f_safe(Renderer &r, const Value &v, const CallArgs &) {
    return Value::markup(to_str(v, r.options().max_output_bytes));
}

Value f_escape(Renderer &r, const Value &v, const CallArgs &) {
    if (v.is_markup()) return v;
    std::string tmp;
    return Value::markup(html_escape(str_of(r, v, tmp)));
}

Value f_forceescape(Renderer &r, const Value &v, const CallArgs &) {
    std::string tmp;
    return Value::markup(html_escape(str_of(r, v, tmp)));
}

Value f_wordcount(Renderer &r, const Value &v, const CallArgs &) {
    std::string tmp;
    const std::string_view s = str_of(r, v, tmp);
    int64_t words = 0;
    bool in_word = false;
    for (size_t p = 0; p < s.size();) {
        char32_t c;
        p += utf8_decode(s, p, c);
        const bool word_char = c == '_' || (c >= '0' && c <= '9') || is_letter(c);
        if (word_char && !in_word) ++words;
        in_word = word_char;
    }
    return Value::integer(words);
}

Value f_center(Renderer &r, const Value &v, const CallArgs &a) {
    std::string tmp;
    const std::string s(str_of(r, v, tmp));
    const int64_t width = int_param(a, 0, "width", 80);
    const auto len = static_cast<int64_t>(utf8_length(s));
    if (width <= len) return Value::string(s);
    r.check_size(static_cast<size_t>(width));
    const int64_t total = width - len;
    const int64_t left = total / 2 + (total & width & 1);
    return Value::string(std::string(static_cast<size_t>(left), ' ') + s +
                         std::string(static_cast<size_t>(total - left), ' '));
}

Value f_format(Renderer &r, const Value &v, const CallArgs &a) {
    if (!a.positional.empty() && !a.keyword.empty()) {
        fail("can't handle positional and keyword arguments at the same time");
    }
    Value args;
    if (!a.keyword.empty()) {
        DictObj d;
        for (const auto &[k, x] : a.keyword) d.set(Value::string(k), x);
        args = make_dict(std::move(d));
    } else {
        args = Value::list(a.positional, Kind::kTuple);
    }
    std::string out = percent_format(to_str(v, r.options().max_output_bytes), args, r.options().max_output_bytes);
    r.check_size(out.size());
    return Value::string(std::move(out));
}

Value f_truncate(Renderer &r, const Value &v, const CallArgs &a) {
    std::string tmp;
    const std::string s(str_of(r, v, tmp));
    const int64_t length = int_param(a, 0, "length", 255);
    const bool killwords = truthy(param(a, 1, "killwords", Value::boolean(false)));
    const std::string end = to_str(param(a, 2, "end", Value::string("...")), r.options().max_output_bytes);
    const int64_t leeway = int_param(a, 3, "leeway", 5);
    const std::vector<size_t> offsets = utf8_offsets(s);
    const auto n = static_cast<int64_t>(offsets.size() - 1);
    const auto end_len = static_cast<int64_t>(utf8_length(end));
    if (length < end_len) fail("expected length >= end length");
    if (leeway < 0) fail("expected leeway >= 0");
    if (n <= length + leeway) return Value::string(s);
    std::string head = s.substr(0, offsets[static_cast<size_t>(length - end_len)]);
    if (!killwords) {
        const size_t space = head.rfind(' ');
        if (space != std::string::npos) head.resize(space);
    }
    return Value::string(head + end);
}

}  // namespace

const std::unordered_map<std::string_view, FilterFn> &text_filters() {
    static const std::unordered_map<std::string_view, FilterFn> table = {
        {"trim", f_trim},       {"upper", f_upper},         {"lower", f_lower},   {"capitalize", f_capitalize},
        {"title", f_title},     {"replace", f_replace},     {"string", f_string}, {"indent", f_indent},
        {"safe", f_safe},       {"escape", f_escape},       {"e", f_escape},      {"forceescape", f_forceescape},
        {"wordcount", f_wordcount}, {"center", f_center},   {"format", f_format}, {"truncate", f_truncate},
    };
    return table;
}

}  // namespace memra::text::jinja
