// Python's str methods for the Jinja interpreter, on UTF-8 text indexed in code points: case mapping
// (ASCII, Latin-1, Latin Extended-A, Greek and Cyrillic; other scripts are left as they are), strip,
// split, replace, find, count, str.format and the format-spec mini-language.
#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "text/jinja_impl.h"
#include "text/utf8.h"

namespace memra::text::jinja {

char32_t cp_upper(char32_t c) {
    if (c < 0x80) return c >= 'a' && c <= 'z' ? c - 32 : c;
    if (c == 0xB5) return 0x39C;
    if ((c >= 0xE0 && c <= 0xFE && c != 0xF7)) return c - 0x20;
    if (c == 0xFF) return 0x178;
    if (c >= 0x100 && c <= 0x17F) {
        if (c == 0x131) return 'I';
        if (c == 0x17F) return 'S';
        const bool odd_lower = (c < 0x138) || (c >= 0x14A && c < 0x178);
        if (odd_lower) return (c & 1) ? c - 1 : c;
        if (c >= 0x139 && c <= 0x148) return (c & 1) ? c : c - 1;
        if (c >= 0x179 && c <= 0x17E) return (c & 1) ? c : c - 1;
        return c;
    }
    if (c >= 0x3B1 && c <= 0x3C9 && c != 0x3C2) return c - 0x20;
    if (c == 0x3C2) return 0x3A3;
    if (c == 0x3AC) return 0x386;
    if (c >= 0x3AD && c <= 0x3AF) return c - 0x25;
    if (c == 0x3CC) return 0x38C;
    if (c == 0x3CD || c == 0x3CE) return c - 0x3F;
    if (c >= 0x430 && c <= 0x44F) return c - 0x20;
    if (c >= 0x450 && c <= 0x45F) return c - 0x50;
    return c;
}

char32_t cp_lower(char32_t c) {
    if (c < 0x80) return c >= 'A' && c <= 'Z' ? c + 32 : c;
    if (c >= 0xC0 && c <= 0xDE && c != 0xD7) return c + 0x20;
    if (c == 0x178) return 0xFF;
    if (c >= 0x100 && c <= 0x17F) {
        if (c == 0x130) return 'i';
        const bool even_upper = (c < 0x138) || (c >= 0x14A && c < 0x178);
        if (even_upper) return (c & 1) ? c : c + 1;
        if (c >= 0x139 && c <= 0x148) return (c & 1) ? c + 1 : c;
        if (c >= 0x179 && c <= 0x17E) return (c & 1) ? c + 1 : c;
        return c;
    }
    if (c >= 0x391 && c <= 0x3A9 && c != 0x3A2) return c + 0x20;
    if (c == 0x386) return 0x3AC;
    if (c >= 0x388 && c <= 0x38A) return c + 0x25;
    if (c == 0x38C) return 0x3CC;
    if (c == 0x38E || c == 0x38F) return c + 0x3F;
    if (c >= 0x410 && c <= 0x42F) return c + 0x20;
    if (c >= 0x400 && c <= 0x40F) return c + 0x50;
    return c;
}

namespace {

bool is_cased(char32_t c) { return cp_upper(c) != c || cp_lower(c) != c || (c >= 'A' && c <= 'Z'); }

// Maps each code point of `s`; `f(cp, index_in_word_state)` returns the replacement.
template <class F>
std::string map_chars(std::string_view s, F f) {
    std::string out;
    out.reserve(s.size());
    for (size_t p = 0; p < s.size();) {
        char32_t c;
        const size_t n = utf8_decode(s, p, c);
        if (c == 0xFFFD && n == 1 && static_cast<unsigned char>(s[p]) >= 0x80) out += s[p];
        else utf8_append(out, f(c));
        p += n;
    }
    return out;
}

std::vector<char32_t> code_points(std::string_view s) {
    std::vector<char32_t> out;
    for (size_t p = 0; p < s.size();) {
        char32_t c;
        p += utf8_decode(s, p, c);
        out.push_back(c);
    }
    return out;
}

}  // namespace

std::string str_upper(std::string_view s) { return map_chars(s, cp_upper); }
std::string str_lower(std::string_view s) { return map_chars(s, cp_lower); }

std::string str_capitalize(std::string_view s) {
    bool first = true;
    return map_chars(s, [&](char32_t c) {
        const char32_t r = first ? cp_upper(c) : cp_lower(c);
        first = false;
        return r;
    });
}

std::string str_title(std::string_view s) {
    bool previous_cased = false;
    return map_chars(s, [&](char32_t c) {
        const char32_t r = previous_cased ? cp_lower(c) : cp_upper(c);
        previous_cased = is_cased(c);
        return r;
    });
}

std::string str_strip(std::string_view s, const Value &chars, bool left, bool right) {
    const bool whitespace = chars.kind == Kind::kNone || chars.is_undefined();
    if (!whitespace && !chars.is_string()) {
        fail(fmt::format("strip arg must be None or str, not {}", type_name(chars)));
    }
    const std::vector<char32_t> set = whitespace ? std::vector<char32_t>{} : code_points(chars.str());
    const auto strip = [&](char32_t c) {
        return whitespace ? py_isspace(c) : std::find(set.begin(), set.end(), c) != set.end();
    };
    const std::vector<size_t> offsets = utf8_offsets(s);
    size_t a = 0, b = offsets.size() - 1;
    char32_t c;
    while (left && a < b && (utf8_decode(s, offsets[a], c), strip(c))) ++a;
    while (right && b > a && (utf8_decode(s, offsets[b - 1], c), strip(c))) --b;
    return std::string(s.substr(offsets[a], offsets[b] - offsets[a]));
}

std::vector<std::string> str_split(std::string_view s, const Value &sep, int64_t maxsplit, bool from_right) {
    std::vector<std::string> parts;
    if (sep.kind == Kind::kNone || sep.is_undefined()) {
        // Runs of whitespace separate; leading and trailing whitespace gives no empty parts.
        std::vector<std::pair<size_t, size_t>> words;  // byte ranges
        const std::vector<size_t> offsets = utf8_offsets(s);
        size_t k = 0;
        const size_t n = offsets.size() - 1;
        char32_t c;
        while (k < n) {
            while (k < n && (utf8_decode(s, offsets[k], c), py_isspace(c))) ++k;
            if (k == n) break;
            const size_t start = k;
            while (k < n && !(utf8_decode(s, offsets[k], c), py_isspace(c))) ++k;
            words.emplace_back(offsets[start], offsets[k]);
        }
        if (maxsplit < 0 || static_cast<size_t>(maxsplit) + 1 >= words.size()) {
            for (const auto &[a, b] : words) parts.emplace_back(s.substr(a, b - a));
            return parts;
        }
        const auto m = static_cast<size_t>(maxsplit);
        if (!from_right) {
            for (size_t w = 0; w < m; ++w) {
                parts.emplace_back(s.substr(words[w].first, words[w].second - words[w].first));
            }
            parts.emplace_back(s.substr(words[m].first));  // the rest, trailing whitespace included
        } else {
            const size_t first_kept = words.size() - m;
            parts.emplace_back(s.substr(0, words[first_kept - 1].second));  // leading whitespace included
            for (size_t w = first_kept; w < words.size(); ++w) {
                parts.emplace_back(s.substr(words[w].first, words[w].second - words[w].first));
            }
        }
        return parts;
    }
    if (!sep.is_string()) fail(fmt::format("must be str or None, not {}", type_name(sep)));
    const std::string &d = sep.str();
    if (d.empty()) fail("empty separator");
    std::vector<size_t> cuts;  // byte offsets of separators
    if (!from_right) {
        for (size_t p = s.find(d); p != std::string_view::npos; p = s.find(d, p + d.size())) {
            if (maxsplit >= 0 && cuts.size() >= static_cast<size_t>(maxsplit)) break;
            cuts.push_back(p);
        }
    } else {
        size_t end = s.size();
        while (end >= d.size()) {
            const size_t p = s.rfind(d, end - d.size());
            if (p == std::string_view::npos) break;
            if (maxsplit >= 0 && cuts.size() >= static_cast<size_t>(maxsplit)) break;
            cuts.push_back(p);
            end = p;
        }
        std::reverse(cuts.begin(), cuts.end());
    }
    size_t prev = 0;
    for (size_t c : cuts) {
        parts.emplace_back(s.substr(prev, c - prev));
        prev = c + d.size();
    }
    parts.emplace_back(s.substr(prev));
    return parts;
}

std::string str_replace(std::string_view s, std::string_view old, std::string_view replacement, int64_t count) {
    std::string out;
    if (old.empty()) {  // Python inserts the replacement before every character and at the end
        const std::vector<size_t> offsets = utf8_offsets(s);
        int64_t done = 0;
        for (size_t k = 0; k + 1 < offsets.size(); ++k) {
            if (count < 0 || done < count) out += replacement, ++done;
            out.append(s.substr(offsets[k], offsets[k + 1] - offsets[k]));
        }
        if (count < 0 || done < count) out += replacement;
        return out;
    }
    size_t prev = 0;
    int64_t done = 0;
    for (size_t p = s.find(old); p != std::string_view::npos && (count < 0 || done < count);
         p = s.find(old, prev), ++done) {
        out.append(s.substr(prev, p - prev));
        out.append(replacement);
        prev = p + old.size();
    }
    out.append(s.substr(prev));
    return out;
}

int64_t str_find(std::string_view s, std::string_view sub, bool reverse) {
    const size_t p = reverse ? s.rfind(sub) : s.find(sub);
    if (p == std::string_view::npos) return -1;
    return static_cast<int64_t>(utf8_length(s.substr(0, p)));
}

int64_t str_count(std::string_view s, std::string_view sub) {
    if (sub.empty()) return static_cast<int64_t>(utf8_length(s)) + 1;
    int64_t n = 0;
    for (size_t p = s.find(sub); p != std::string_view::npos; p = s.find(sub, p + sub.size())) ++n;
    return n;
}

}  // namespace memra::text::jinja
