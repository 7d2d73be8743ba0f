// String formatting for the Jinja interpreter as Python does it: the format-spec mini-language of
// format() and str.format (mapped onto fmt, whose syntax follows Python's), str.format's replacement
// fields, and printf-style `str % args` (also the `format` filter).
#include <algorithm>
#include <cctype>
#include <cmath>

#include <fmt/format.h>

#include "text/jinja_impl.h"

namespace memra::text::jinja {
namespace {

bool is_type_char(char c) { return std::string_view("bcdeEfFgGnosxX%").find(c) != std::string_view::npos; }

std::string run_fmt(std::string_view spec, const auto &value) {
    try {
        return fmt::format(fmt::runtime(fmt::format("{{:{}}}", spec)), value);
    } catch (const fmt::format_error &) {
        fail(fmt::format("invalid format specifier '{}'", spec));
    }
}

// Every number in a spec (width, precision) must stay within `limit`: fmt would build the padding first.
void check_spec_numbers(std::string_view spec, size_t limit) {
    size_t value = 0;
    for (char c : spec) {
        if (!std::isdigit(static_cast<unsigned char>(c))) {
            value = 0;
            continue;
        }
        if (value > limit / 10) fail(fmt::format("output exceeds {} bytes", limit));
        value = value * 10 + static_cast<size_t>(c - '0');
    }
}

}  // namespace

std::string format_spec(const Value &v, std::string_view spec, size_t limit) {
    if (spec.empty()) return to_str(v, limit);
    if (spec.find_first_of("{}") != std::string_view::npos) fail("nested format fields are not supported");
    check_spec_numbers(spec, limit);
    const char type = is_type_char(spec.back()) ? spec.back() : 0;
    if (v.is_string() || v.kind == Kind::kNone || v.is_undefined() || (v.kind == Kind::kBool && !type)) {
        if (type && type != 's') {
            fail(fmt::format("unknown format code '{}' for object of type '{}'", type, type_name(v)));
        }
        return run_fmt(spec, to_str(v, limit));
    }
    if (!v.is_number()) fail(fmt::format("unsupported format string passed to {}.__format__", type_name(v)));
    if (type == '%') {
        std::string body(spec.substr(0, spec.size() - 1));
        if (body.find('.') == std::string::npos) body += ".6";
        return run_fmt(body + "f", v.as_float() * 100) + "%";
    }
    if (v.is_int() && (type == 0 || std::string_view("bcdoxXn").find(type) != std::string_view::npos)) {
        std::string s(spec);
        if (type == 'n') s.back() = 'd';
        return run_fmt(s, v.as_int());
    }
    if (type == 0) {
        // Python's float format without a type: repr digits (with precision: like 'g', keeping a '.0').
        if (spec.find('.') == std::string_view::npos) {
            if (!v.is_int() && !std::isfinite(v.f)) return run_fmt(spec, v.f);
            return run_fmt(spec, format_float(v.as_float()));
        }
        return run_fmt(std::string(spec) + "g", v.as_float());
    }
    if (std::string_view("eEfFgG").find(type) == std::string_view::npos) {
        fail(fmt::format("unknown format code '{}' for object of type '{}'", type, type_name(v)));
    }
    return run_fmt(spec, v.as_float());
}

std::string str_format(const std::string &format, const CallArgs &args, size_t limit) {
    std::string out;
    size_t auto_index = 0;
    bool manual = false, automatic = false;
    for (size_t p = 0; p < format.size(); ++p) {
        const char c = format[p];
        if (c == '}') {
            if (p + 1 < format.size() && format[p + 1] == '}') {
                out += '}';
                ++p;
                continue;
            }
            fail("Single '}' encountered in format string");
        }
        if (c != '{') {
            out += c;
            continue;
        }
        if (p + 1 < format.size() && format[p + 1] == '{') {
            out += '{';
            ++p;
            continue;
        }
        const size_t close = format.find('}', p);
        if (close == std::string::npos) fail("Single '{' encountered in format string");
        std::string field = format.substr(p + 1, close - p - 1);
        p = close;
        std::string spec, conversion;
        if (const size_t colon = field.find(':'); colon != std::string::npos) {
            spec = field.substr(colon + 1);
            field.resize(colon);
        }
        if (const size_t bang = field.find('!'); bang != std::string::npos) {
            conversion = field.substr(bang + 1);
            field.resize(bang);
        }
        const size_t name_end = std::min(field.find('.'), field.find('['));
        const std::string name = field.substr(0, name_end);
        Value v;
        if (name.empty() || std::all_of(name.begin(), name.end(), [](char d) { return std::isdigit(d); })) {
            size_t index;
            if (name.empty()) {
                if (manual) fail("cannot switch from manual field specification to automatic field numbering");
                automatic = true;
                index = auto_index++;
            } else {
                if (automatic) fail("cannot switch from automatic field numbering to manual field specification");
                manual = true;
                index = name.size() > 9 ? SIZE_MAX : std::stoul(name);
            }
            if (index >= args.positional.size()) {
                fail(fmt::format("Replacement index {} out of range for positional args tuple", index));
            }
            v = args.positional[index];
        } else {
            const Value *kw = args.get(SIZE_MAX, name);
            if (!kw) fail(fmt::format("KeyError: '{}'", name));
            v = *kw;
        }
        // .attr and [key] lookups after the name.
        for (size_t q = name_end; q < field.size();) {
            if (field[q] == '.') {
                const size_t end = std::min(field.find('.', q + 1), field.find('[', q + 1));
                v = get_attribute(v, field.substr(q + 1, end - q - 1));
                q = end;
            } else if (field[q] == '[') {
                const size_t end = field.find(']', q);
                if (end == std::string::npos) fail("Missing ']' in format string");
                const std::string key = field.substr(q + 1, end - q - 1);
                const bool numeric = !key.empty() && key.size() < 19 &&
                                     std::all_of(key.begin(), key.end(), [](char d) { return std::isdigit(d); });
                v = get_item(v, numeric ? Value::integer(std::stoll(key)) : Value::string(key));
                q = end + 1;
            } else {
                fail("Only '.' or '[' may follow ']' in format field specifier");
            }
            if (v.is_undefined()) fail_undefined(v);
        }
        if (conversion == "r" || conversion == "a") v = Value::string(repr(v, limit));
        else if (conversion == "s") v = Value::string(to_str(v, limit));
        else if (!conversion.empty()) fail(fmt::format("Unknown conversion specifier {}", conversion));
        out += format_spec(v, spec, limit);
        if (out.size() > limit) fail(fmt::format("output exceeds {} bytes", limit));
    }
    return out;
}

std::string percent_format(const std::string &format, const Value &args, size_t limit) {
    const bool is_tuple = args.kind == Kind::kTuple;
    const std::vector<Value> single{args};
    const std::vector<Value> &values = is_tuple ? args.items() : single;
    size_t next = 0;
    bool used_mapping = false;
    std::string out;
    for (size_t p = 0; p < format.size(); ++p) {
        if (format[p] != '%') {
            out += format[p];
            continue;
        }
        if (++p >= format.size()) fail("incomplete format");
        const Value *value = nullptr;
        Value mapped;
        if (format[p] == '(') {
            const size_t close = format.find(')', p);
            if (close == std::string::npos) fail("incomplete format key");
            if (args.kind != Kind::kDict) fail("format requires a mapping");
            const Value *found = args.dict().find(std::string_view(format).substr(p + 1, close - p - 1));
            if (!found) fail(fmt::format("KeyError: '{}'", format.substr(p + 1, close - p - 1)));
            mapped = *found;
            value = &mapped;
            used_mapping = true;
            p = close + 1;
        }
        std::string flags;
        while (p < format.size() && std::string_view("-+ #0").find(format[p]) != std::string_view::npos) {
            flags += format[p++];
        }
        std::string width, precision;
        while (p < format.size() && std::isdigit(static_cast<unsigned char>(format[p]))) width += format[p++];
        if (p < format.size() && format[p] == '.') {
            precision = ".";
            ++p;
            while (p < format.size() && std::isdigit(static_cast<unsigned char>(format[p]))) precision += format[p++];
            if (precision == ".") precision = ".0";
        }
        while (p < format.size() && (format[p] == 'h' || format[p] == 'l' || format[p] == 'L')) ++p;
        if (p >= format.size()) fail("incomplete format");
        if (width.size() > 6 || precision.size() > 7) fail("format width or precision too large");
        char conv = format[p];
        if (conv == '%') {
            out += '%';
            continue;
        }
        if (!value) {
            if (next >= values.size()) fail("not enough arguments for format string");
            value = &values[next++];
        }
        std::string spec;
        if (flags.find('-') != std::string::npos) spec += '<';
        else if (conv == 's' || conv == 'r' || conv == 'a') spec += '>';
        if (flags.find('+') != std::string::npos) spec += '+';
        else if (flags.find(' ') != std::string::npos) spec += ' ';
        if (flags.find('#') != std::string::npos) spec += '#';
        const bool left = flags.find('-') != std::string::npos;
        if (flags.find('0') != std::string::npos && !left && conv != 's' && conv != 'r') {
            spec += '0';
        }
        spec += width;
        switch (conv) {
        case 's':
        case 'r':
        case 'a': {
            std::string s = conv == 's' ? to_str(*value, limit) : repr(*value, limit);
            out += format_spec(Value::string(std::move(s)), spec + precision, limit);
            break;
        }
        case 'd':
        case 'i':
        case 'u':
            if (!value->is_number()) {
                fail(fmt::format("%{} format: a real number is required, not {}", conv, type_name(*value)));
            }
            if (value->kind == Kind::kFloat && !std::isfinite(value->f)) fail("cannot convert float to integer");
            out += format_spec(Value::integer(value->kind == Kind::kFloat ? static_cast<int64_t>(value->f)
                                                                          : value->as_int()),
                               spec + "d", limit);
            break;
        case 'x':
        case 'X':
        case 'o':
        case 'c':
            if (!value->is_int()) {
                fail(fmt::format("%{} format: an integer is required, not {}", conv, type_name(*value)));
            }
            out += format_spec(Value::integer(value->as_int()), spec + conv, limit);
            break;
        case 'f':
        case 'F':
        case 'e':
        case 'E':
        case 'g':
        case 'G':
            if (!value->is_number()) fail(fmt::format("must be real number, not {}", type_name(*value)));
            out += format_spec(Value::number(value->as_float()), spec + (precision.empty() ? ".6" : precision) + conv,
                               limit);
            break;
        default: fail(fmt::format("unsupported format character '{}'", conv));
        }
        if (out.size() > limit) fail(fmt::format("output exceeds {} bytes", limit));
    }
    if (is_tuple && next < values.size()) fail("not all arguments converted during string formatting");
    if (!is_tuple && !used_mapping && next == 0 && args.kind != Kind::kDict) {
        fail("not all arguments converted during string formatting");
    }
    return out;
}

}  // namespace memra::text::jinja
