// Oniguruma -> PCRE2 translation and onig-style match iteration (see onig_regex.h).
// Differences handled here, each checked against the `tokenizers` package (tests/oracle):
//   - Unicode data: \p{..}, \d, \w, \s use Unicode 16 via unicode_patches (PCRE2 10.42 has 14);
//     scripts mean Script (onig), not Script_Extensions (PCRE2's plain \p{Han}).
//   - \w is Alphabetic|M|Nd|Pc (onig) rather than L|N|_ (PCRE2), plus U+00B2 U+00B3 U+00B9
//     U+00BC-U+00BE outside classes (onig's quirk); \s is White_Space (PCRE2 adds U+180E); \h is a
//     hex digit (PCRE2: horizontal space); \v is U+000B only.
//   - (?m) is dotall; ^ and $ are always line anchors; a standalone (?i) reaches to the end of the
//     enclosing group across later alternatives; {n,m}+ and {n}? are a repeat of a repeat and an
//     optional repeat, not possessive / lazy; {,n} means {0,n}; \uHHHH is a code point.
//   - refused: case-insensitive text that onig would match by multi-character case folding
//     (ß ~ ss), properties inside case-insensitive classes, nested classes, && intersections,
//     POSIX brackets, (?x), absent operators, octal escapes, \Q..\E, \X (grapheme rules of an older
//     Unicode in PCRE2) and other rarely used syntax.
//   - long runs under a repeated group: PCRE2's default JIT stack / match limits are raised on demand.
#include "text/onig_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <optional>
#include <utility>

#include <fmt/format.h>

#include "core/check.h"
#include "text/unicode_patches.h"
#include "text/utf8.h"

namespace memra::text {

struct RegexCode {
    pcre2_code *code = nullptr;
    bool jit = false;
    ~RegexCode() { pcre2_code_free(code); }
};

namespace {

// Code points whose full case folding has several characters, and the adjacent pairs inside those
// foldings: under (?i) Oniguruma matches across them (ß ~ ss, ﬁ ~ fi), PCRE2 does not.
constexpr CodeRange kMultiFoldSources[] = {
    {0xDF, 0xDF},     {0x130, 0x130},   {0x149, 0x149},   {0x1F0, 0x1F0},   {0x390, 0x390},   {0x3B0, 0x3B0},
    {0x587, 0x587},   {0x1E96, 0x1E9A}, {0x1E9E, 0x1E9E}, {0x1F50, 0x1F50}, {0x1F52, 0x1F52}, {0x1F54, 0x1F54},
    {0x1F56, 0x1F56}, {0x1F80, 0x1FAF}, {0x1FB2, 0x1FB4}, {0x1FB6, 0x1FB7}, {0x1FBC, 0x1FBC}, {0x1FC2, 0x1FC4},
    {0x1FC6, 0x1FC7}, {0x1FCC, 0x1FCC}, {0x1FD2, 0x1FD3}, {0x1FD6, 0x1FD7}, {0x1FE2, 0x1FE4}, {0x1FE6, 0x1FE7},
    {0x1FF2, 0x1FF4}, {0x1FF6, 0x1FF7}, {0x1FFC, 0x1FFC}, {0xFB00, 0xFB06}, {0xFB13, 0xFB17},
};
constexpr std::pair<char32_t, char32_t> kMultiFoldPairs[] = {
    {0x61, 0x2BE},   {0x66, 0x66},    {0x66, 0x69},    {0x66, 0x6C},    {0x68, 0x331},   {0x69, 0x307},
    {0x6A, 0x30C},   {0x73, 0x73},    {0x73, 0x74},    {0x74, 0x308},   {0x77, 0x30A},   {0x79, 0x30A},
    {0x2BC, 0x6E},   {0x308, 0x300},  {0x308, 0x301},  {0x308, 0x342},  {0x313, 0x300},  {0x313, 0x301},
    {0x313, 0x342},  {0x342, 0x3B9},  {0x3AC, 0x3B9},  {0x3AE, 0x3B9},  {0x3B1, 0x342},  {0x3B1, 0x3B9},
    {0x3B7, 0x342},  {0x3B7, 0x3B9},  {0x3B9, 0x308},  {0x3B9, 0x342},  {0x3C1, 0x313},  {0x3C5, 0x308},
    {0x3C5, 0x313},  {0x3C5, 0x342},  {0x3C9, 0x342},  {0x3C9, 0x3B9},  {0x3CE, 0x3B9},  {0x565, 0x582},
    {0x574, 0x565},  {0x574, 0x56B},  {0x574, 0x56D},  {0x574, 0x576},  {0x57E, 0x576},  {0x1F00, 0x3B9},
    {0x1F01, 0x3B9}, {0x1F02, 0x3B9}, {0x1F03, 0x3B9}, {0x1F04, 0x3B9}, {0x1F05, 0x3B9}, {0x1F06, 0x3B9},
    {0x1F07, 0x3B9}, {0x1F20, 0x3B9}, {0x1F21, 0x3B9}, {0x1F22, 0x3B9}, {0x1F23, 0x3B9}, {0x1F24, 0x3B9},
    {0x1F25, 0x3B9}, {0x1F26, 0x3B9}, {0x1F27, 0x3B9}, {0x1F60, 0x3B9}, {0x1F61, 0x3B9}, {0x1F62, 0x3B9},
    {0x1F63, 0x3B9}, {0x1F64, 0x3B9}, {0x1F65, 0x3B9}, {0x1F66, 0x3B9}, {0x1F67, 0x3B9}, {0x1F70, 0x3B9},
    {0x1F74, 0x3B9}, {0x1F7C, 0x3B9},
};

bool multi_fold_in(char32_t lo, char32_t hi) {
    for (const CodeRange &r : kMultiFoldSources) {
        if (r.first <= hi && lo <= r.last) return true;
    }
    return false;
}

char32_t ascii_lower(char32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

bool multi_fold_pair(char32_t a, char32_t b) {
    a = ascii_lower(a);
    b = ascii_lower(b);
    for (const auto &[x, y] : kMultiFoldPairs) {
        if (x == a && y == b) return true;
    }
    return false;
}

std::string hex_atom(char32_t cp) { return fmt::format("\\x{{{:X}}}", static_cast<uint32_t>(cp)); }

std::string range_atoms(std::span<const CodeRange> ranges) {
    std::string out;
    for (const CodeRange &r : ranges) {
        out += hex_atom(r.first);
        if (r.last != r.first) {
            out += '-';
            out += hex_atom(r.last);
        }
    }
    return out;
}

// Oniguruma's loose property-name matching: case, spaces, '_' and '-' do not count.
std::string loose_name(std::string_view name) {
    std::string out;
    for (char c : name) {
        if (c == ' ' || c == '_' || c == '-') continue;
        out.push_back(c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c);
    }
    return out;
}

// A set of code points as PCRE2 class atoms: everything in `atoms` except what is in `remove`.
struct CharSet {
    std::string atoms;
    std::string remove;
};

std::optional<CharSet> find_property(std::string_view name) {
    const std::string key = loose_name(name);
    for (const PropertyPatch &patch : property_patches()) {
        std::string_view names = patch.names;
        while (!names.empty()) {
            const size_t bar = names.find('|');
            const std::string_view one = names.substr(0, bar);
            if (loose_name(one) == key) {
                return CharSet{std::string(patch.atoms) + range_atoms(patch.add), range_atoms(patch.remove)};
            }
            names = bar == std::string_view::npos ? std::string_view() : names.substr(bar + 1);
        }
    }
    return std::nullopt;
}

// Oniguruma's \w inside a class lacks the Latin-1 superscripts and fractions (U+00B2, U+00B3,
// U+00B9, U+00BC-U+00BE) that its bare \w matches.
CharSet word_in_class() {
    for (const PropertyPatch &patch : property_patches()) {
        if (std::string_view(patch.names) != "\\w") continue;
        std::vector<CodeRange> add;
        for (const CodeRange &r : patch.add) {
            for (char32_t c = r.first; c <= r.last && c < 0x100; ++c) {
                const bool latin1_quirk = c == 0xB2 || c == 0xB3 || c == 0xB9 || (c >= 0xBC && c <= 0xBE);
                if (!latin1_quirk) add.push_back(CodeRange{c, c});
            }
            if (r.last >= 0x100) add.push_back(CodeRange{std::max<uint32_t>(r.first, 0x100), r.last});
        }
        return CharSet{std::string(patch.atoms) + range_atoms(add), range_atoms(patch.remove)};
    }
    MEMRA_CHECK(false, "unicode_patches.cpp lacks \\w");
    return {};
}

CharSet must_find(std::string_view name) {
    auto set = find_property(name);
    MEMRA_CHECK(set.has_value(), "unicode_patches.cpp lacks property {}", name);
    return *set;
}

// One-character expression for a set, or its complement.
std::string set_expr(const CharSet &set, bool negated) {
    if (!negated) {
        if (set.remove.empty()) return "[" + set.atoms + "]";
        return "(?:(?![" + set.remove + "])[" + set.atoms + "])";
    }
    if (set.remove.empty()) return "[^" + set.atoms + "]";
    return "(?:[^" + set.atoms + "]|[" + set.remove + "])";
}

struct Flags {
    bool caseless = false;
    bool dotall = false;
};

struct GroupFrame {
    size_t out_start;  // where the group's text starts in the output
    Flags saved;  // flags to restore when it closes
    int implicit = 0;  // "(?flags:" groups opened by standalone (?flags) inside it
};

// What one item of a character class is: a character, or a set (class escape).
struct ClassItem {
    bool is_set = false;
    char32_t cp = 0;
    CharSet set;
    bool negated = false;
};

class Translator {
public:
    explicit Translator(std::string_view pattern) : p_(pattern) {}

    Result<std::string> run() {
        if (!utf8_is_valid(p_)) return fail("pattern is not valid UTF-8");
        groups_.push_back(GroupFrame{0, flags_});
        while (pos_ < p_.size()) {
            auto ok = step();
            if (!ok) return tl::unexpected(ok.error());
        }
        if (groups_.size() != 1) return fail("unclosed group");
        out_.append(static_cast<size_t>(groups_.back().implicit), ')');
        return out_;
    }

private:
    tl::unexpected<Error> fail(std::string_view what) const {
        return make_error("regex \"{}\": offset {}: {}", p_, pos_, what);
    }

    bool at(char c) const { return pos_ < p_.size() && p_[pos_] == c; }

    Result<void> step() {
        const char c = p_[pos_];
        switch (c) {
        case '(': return open_group();
        case ')': return close_group();
        case '|':
            out_ += '|';
            ++pos_;
            prev_literal_ = 0;
            return {};
        case '[': {
            const size_t start = out_.size();
            auto ok = parse_class();
            if (!ok) return ok;
            return quantifiers(start);
        }
        case '\\': return escape();
        case '^':
        case '$':
            out_ += c;
            ++pos_;
            prev_literal_ = 0;
            return {};
        case '.': {
            const size_t start = out_.size();
            out_ += '.';
            ++pos_;
            prev_literal_ = 0;
            return quantifiers(start);
        }
        case '*':
        case '+':
        case '?': return fail("quantifier without a target");
        case '{': {
            const size_t save = pos_;
            std::string q;
            bool fixed = false;
            auto interval = parse_interval(q, fixed);
            if (!interval) return tl::unexpected(interval.error());
            if (*interval) {
                pos_ = save;
                return fail("quantifier without a target");
            }
            break;  // a literal '{'
        }
        default: break;
        }
        const size_t start = out_.size();
        const char32_t cp = utf8_next(p_, pos_);
        auto ok = literal(cp);
        if (!ok) return ok;
        return quantifiers(start);
    }

    // A literal character: written as \x{..}, checked for multi-character case folding.
    Result<void> literal(char32_t cp) {
        if (flags_.caseless) {
            if (multi_fold_in(cp, cp)) {
                return fail(fmt::format("case-insensitive U+{:04X} matches several characters in Oniguruma",
                                        static_cast<uint32_t>(cp)));
            }
            if (prev_literal_ != 0 && multi_fold_pair(prev_literal_, cp)) {
                return fail(fmt::format("case-insensitive U+{:04X} U+{:04X} matches one character in Oniguruma",
                                        static_cast<uint32_t>(prev_literal_), static_cast<uint32_t>(cp)));
            }
        }
        out_ += hex_atom(cp);
        prev_literal_ = cp;
        return {};
    }

    // Parses {n}, {n,}, {n,m} or {,m} at pos_; false (pos_ unchanged) when the text is a literal '{'.
    Result<bool> parse_interval(std::string &q, bool &fixed) {
        size_t i = pos_ + 1;
        auto digits = [&](std::string &d) {
            while (i < p_.size() && p_[i] >= '0' && p_[i] <= '9') d += p_[i++];
        };
        std::string lo, hi;
        digits(lo);
        bool comma = false;
        if (i < p_.size() && p_[i] == ',') {
            comma = true;
            ++i;
            digits(hi);
        }
        if (i >= p_.size() || p_[i] != '}' || (lo.empty() && hi.empty())) return false;
        if (lo.size() > 6 || hi.size() > 6) return fail("repeat count too large");
        if (!lo.empty() && !hi.empty() && std::stoul(lo) > std::stoul(hi)) return fail("repeat range {n,m} with n > m");
        q = fmt::format("{{{}{}{}}}", lo.empty() ? std::string("0") : lo, comma ? "," : "", hi);
        fixed = !comma;
        pos_ = i + 1;
        return true;
    }

    // Quantifiers after the atom that starts at out_[start]. Oniguruma (Ruby syntax) allows a
    // repeat of a repeat; PCRE2 needs the inner one wrapped in a group.
    Result<void> quantifiers(size_t start) {
        int count = 0;
        for (;;) {
            std::string q;
            if (at('*') || at('+') || at('?')) {
                q = p_[pos_++];
                if (at('?') || at('+')) q += p_[pos_++];  // lazy / possessive
            } else if (at('{')) {
                bool fixed = false;
                auto interval = parse_interval(q, fixed);
                if (!interval) return tl::unexpected(interval.error());
                if (!*interval) break;
                // {n,m}? is lazy; {n}? is an optional {n} (next round); {n,m}+ is a repeat of it.
                if (!fixed && at('?')) q += p_[pos_++];
            } else {
                break;
            }
            if (count > 0) {
                out_.insert(start, "(?:");
                out_ += ')';
            }
            out_ += q;
            ++count;
            prev_literal_ = 0;
        }
        return {};
    }

    Result<void> open_group() {
        const size_t start = out_.size();
        ++pos_;
        prev_literal_ = 0;
        if (!at('?')) {
            out_ += '(';
            groups_.push_back(GroupFrame{start, flags_});
            return {};
        }
        ++pos_;
        if (pos_ >= p_.size()) return fail("unterminated group");
        const char c = p_[pos_];
        auto push = [&](std::string_view text) {
            out_ += text;
            groups_.push_back(GroupFrame{start, flags_});
        };
        if (c == '#') {
            const size_t end = p_.find(')', pos_);
            if (end == std::string_view::npos) return fail("unterminated comment");
            pos_ = end + 1;
            return {};
        }
        if (c == ':' || c == '=' || c == '!' || c == '>') {
            ++pos_;
            push(std::string("(?") + c);
            return {};
        }
        if (c == '<' && pos_ + 1 < p_.size() && (p_[pos_ + 1] == '=' || p_[pos_ + 1] == '!')) {
            push(std::string("(?<") + p_[pos_ + 1]);
            pos_ += 2;
            return {};
        }
        if (c == '<' || c == '\'') {
            const char close = c == '<' ? '>' : '\'';
            const size_t end = p_.find(close, pos_ + 1);
            if (end == std::string_view::npos) return fail("unterminated group name");
            const std::string_view name = p_.substr(pos_ + 1, end - pos_ - 1);
            for (char n : name) {
                const bool ok = (n >= 'a' && n <= 'z') || (n >= 'A' && n <= 'Z') || (n >= '0' && n <= '9') || n == '_';
                if (!ok) return fail("group names other than [A-Za-z0-9_] are not supported");
            }
            pos_ = end + 1;
            push("(?<" + std::string(name) + ">");
            return {};
        }
        // Option settings: (?imx-imx) or (?imx-imx:...).
        std::string on, off;
        bool negative = false;
        Flags flags = flags_;
        while (pos_ < p_.size() && p_[pos_] != ')' && p_[pos_] != ':') {
            const char o = p_[pos_];
            if (o == '-') {
                if (negative) return fail("option '-' given twice");
                negative = true;
            } else if (o == 'i' || o == 'm') {
                // Oniguruma's (?m) is dot-matches-newline, PCRE2's (?s).
                const char mapped = o == 'i' ? 'i' : 's';
                (negative ? off : on) += mapped;
                (o == 'i' ? flags.caseless : flags.dotall) = !negative;
            } else if (o == 'x') {
                return fail("extended mode (?x) is not supported");
            } else {
                return fail(fmt::format("unsupported group syntax (?{}", o));
            }
            ++pos_;
        }
        if (pos_ >= p_.size()) return fail("unterminated group");
        const std::string opts = "(?" + on + (off.empty() ? "" : "-" + off) + ":";
        if (p_[pos_] == ':') {
            ++pos_;
            push(opts);
            flags_ = flags;
            return {};
        }
        // Standalone (?i): Oniguruma applies it to the rest of the enclosing group, later
        // alternatives included ("a(?i)b|c" is "a(?i:b|c)"), so it opens a group closed there.
        ++pos_;
        out_ += opts;
        ++groups_.back().implicit;
        flags_ = flags;
        return {};
    }

    Result<void> close_group() {
        if (groups_.size() == 1) return fail("unmatched ')'");
        const GroupFrame frame = groups_.back();
        groups_.pop_back();
        out_.append(static_cast<size_t>(frame.implicit), ')');
        out_ += ')';
        ++pos_;
        flags_ = frame.saved;
        prev_literal_ = 0;
        return quantifiers(frame.out_start);
    }

    // Set escapes shared by both contexts: \d \D \w \W \s \S \h \H \p{..} \P{..}; pos_ is on the
    // letter. Returns nullopt when the escape is not one of them.
    Result<std::optional<ClassItem>> set_escape(bool in_class) {
        const char c = p_[pos_];
        ClassItem item;
        item.is_set = true;
        switch (c) {
        case 'd':
        case 'D':
            item.set = must_find("Nd");
            item.negated = c == 'D';
            ++pos_;
            return item;
        case 'w':
        case 'W':
            item.set = in_class ? word_in_class() : must_find("\\w");
            item.negated = c == 'W';
            ++pos_;
            return item;
        case 's':
        case 'S':
            item.set = must_find("White_Space");
            item.negated = c == 'S';
            ++pos_;
            return item;
        case 'h':
        case 'H':
            item.set = CharSet{"0-9A-Fa-f", ""};
            item.negated = c == 'H';
            ++pos_;
            return item;
        case 'p':
        case 'P': {
            item.negated = c == 'P';
            if (pos_ + 1 >= p_.size() || p_[pos_ + 1] != '{') return fail("\\p without braces is not supported");
            const size_t end = p_.find('}', pos_ + 2);
            if (end == std::string_view::npos) return fail("unterminated \\p{");
            std::string_view name = p_.substr(pos_ + 2, end - pos_ - 2);
            if (!name.empty() && name[0] == '^') {
                item.negated = !item.negated;
                name.remove_prefix(1);
            }
            auto set = find_property(name);
            if (!set) return fail(fmt::format("unsupported property \\p{{{}}}", name));
            item.set = *set;
            pos_ = end + 1;
            return item;
        }
        default: return std::optional<ClassItem>();
        }
    }

    // \xHH, \x{H..}, \uHHHH with pos_ on 'x' or 'u'.
    Result<char32_t> hex_escape() {
        const char kind = p_[pos_++];
        auto hexval = [](char h) -> int {
            if (h >= '0' && h <= '9') return h - '0';
            if (h >= 'a' && h <= 'f') return h - 'a' + 10;
            if (h >= 'A' && h <= 'F') return h - 'A' + 10;
            return -1;
        };
        uint32_t value = 0;
        size_t n = 0;
        if (kind == 'x' && at('{')) {
            ++pos_;
            while (pos_ < p_.size() && hexval(p_[pos_]) >= 0 && n < 8) {
                value = value * 16 + static_cast<uint32_t>(hexval(p_[pos_++]));
                ++n;
            }
            if (n == 0 || !at('}')) return fail("malformed \\x{...}");
            ++pos_;
        } else {
            const size_t max = kind == 'x' ? 2 : 4;
            while (pos_ < p_.size() && n < max && hexval(p_[pos_]) >= 0) {
                value = value * 16 + static_cast<uint32_t>(hexval(p_[pos_++]));
                ++n;
            }
            if (n == 0 || (kind == 'u' && n != 4)) return fail(fmt::format("malformed \\{} escape", kind));
        }
        if (value > 0x10FFFF || (value >= 0xD800 && value < 0xE000)) return fail("escape is not a Unicode scalar");
        return static_cast<char32_t>(value);
    }

    // An escaped single character (\n, \x41, \., ...) with pos_ on the character after '\'.
    Result<char32_t> char_escape(bool in_class) {
        const char c = p_[pos_];
        switch (c) {
        case 't': ++pos_; return U'\t';
        case 'n': ++pos_; return U'\n';
        case 'r': ++pos_; return U'\r';
        case 'f': ++pos_; return U'\f';
        case 'v': ++pos_; return U'\v';
        case 'a': ++pos_; return U'\a';
        case 'e': ++pos_; return char32_t{0x1B};
        case 'x':
        case 'u': return hex_escape();
        default: break;
        }
        if (in_class && c == 'b') {
            ++pos_;
            return U'\b';
        }
        const bool alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
        if (alnum) return fail(fmt::format("unsupported escape \\{}", c));
        return utf8_next(p_, pos_);
    }

    Result<void> escape() {
        const size_t start = out_.size();
        ++pos_;
        if (pos_ >= p_.size()) return fail("trailing backslash");
        const char c = p_[pos_];
        auto set = set_escape(false);
        if (!set) return tl::unexpected(set.error());
        if (set->has_value()) {
            out_ += set_expr((*set)->set, (*set)->negated);
            prev_literal_ = 0;
            return quantifiers(start);
        }
        prev_literal_ = 0;
        switch (c) {
        case 'b':
        case 'B': {
            const std::string w = set_expr(must_find("\\w"), false);
            if (c == 'b') {
                out_ += "(?:(?<=" + w + ")(?!" + w + ")|(?<!" + w + ")(?=" + w + "))";
            } else {
                out_ += "(?:(?<=" + w + ")(?=" + w + ")|(?<!" + w + ")(?!" + w + "))";
            }
            ++pos_;
            return {};
        }
        case 'A':
        case 'z':
        case 'Z':
        case 'G':
        case 'K':
            out_ += '\\';
            out_ += c;
            ++pos_;
            return {};
        case 'X': return fail("\\X is not supported (PCRE2's grapheme rules are older Unicode than Oniguruma's)");
        case 'R':
        case 'N':
            out_ += '\\';
            out_ += c;
            ++pos_;
            return quantifiers(start);
        case 'O':
            out_ += "(?s:.)";
            ++pos_;
            return quantifiers(start);
        case 'k':
        case 'g': {
            // \k<name> back-reference, \g<name> subroutine call: same syntax in PCRE2.
            if (pos_ + 1 >= p_.size() || (p_[pos_ + 1] != '<' && p_[pos_ + 1] != '\'')) {
                return fail(fmt::format("malformed \\{}", c));
            }
            const char close = p_[pos_ + 1] == '<' ? '>' : '\'';
            const size_t end = p_.find(close, pos_ + 2);
            if (end == std::string_view::npos) return fail(fmt::format("unterminated \\{}<", c));
            out_ += fmt::format("\\{}<{}>", c, p_.substr(pos_ + 2, end - pos_ - 2));
            pos_ = end + 1;
            return quantifiers(start);
        }
        case 'Q': return fail("\\Q...\\E quoting is not supported (Oniguruma's syntax here has none)");
        default: break;
        }
        if (c >= '1' && c <= '9') {
            if (pos_ + 1 < p_.size() && p_[pos_ + 1] >= '0' && p_[pos_ + 1] <= '9') {
                return fail("multi-digit back-references and octal escapes are not supported");
            }
            out_ += '\\';
            out_ += c;
            ++pos_;
            return quantifiers(start);
        }
        auto cp = char_escape(false);
        if (!cp) return tl::unexpected(cp.error());
        auto ok = literal(*cp);
        if (!ok) return ok;
        return quantifiers(start);
    }

    Result<ClassItem> class_item() {
        if (p_[pos_] != '\\') return ClassItem{false, utf8_next(p_, pos_), {}, false};
        ++pos_;
        if (pos_ >= p_.size()) return fail("trailing backslash");
        auto set = set_escape(true);
        if (!set) return tl::unexpected(set.error());
        if (set->has_value()) return **set;
        auto cp = char_escape(true);
        if (!cp) return tl::unexpected(cp.error());
        return ClassItem{false, *cp, {}, false};
    }

    // [..]: positive atoms gathered in one PCRE2 class; sets with removals or complemented
    // patched sets cannot live inside one class and become alternatives / lookaheads.
    Result<void> parse_class() {
        ++pos_;
        bool negated = false;
        if (at('^')) {
            negated = true;
            ++pos_;
        }
        std::string atoms;
        std::vector<std::string> complements;  // items "not in [x]"
        std::vector<std::pair<std::string, std::string>> diffs;  // items "in [a] but not in [r]"
        bool first = true;
        for (;;) {
            if (pos_ >= p_.size()) return fail("unterminated character class");
            const char c = p_[pos_];
            if (c == ']' && !first) {
                ++pos_;
                break;
            }
            if (c == '[') return fail("nested character classes and POSIX brackets are not supported");
            if (c == '&' && pos_ + 1 < p_.size() && p_[pos_ + 1] == '&') {
                return fail("character class intersection && is not supported");
            }
            first = false;
            auto item = class_item();
            if (!item) return tl::unexpected(item.error());
            const bool dash_next = at('-') && pos_ + 1 < p_.size() && p_[pos_ + 1] != ']';
            if (item->is_set) {
                if (flags_.caseless) return fail("class escapes inside case-insensitive classes are not supported");
                if (dash_next) return fail("range from a class escape");
                const CharSet &set = item->set;
                if (!item->negated) {
                    if (set.remove.empty()) {
                        atoms += set.atoms;
                    } else {
                        diffs.emplace_back(set.atoms, set.remove);
                    }
                } else {
                    complements.push_back(set.atoms);
                    atoms += set.remove;
                }
                continue;
            }
            char32_t lo = item->cp;
            if (dash_next) {
                ++pos_;
                auto hi_item = class_item();
                if (!hi_item) return tl::unexpected(hi_item.error());
                if (hi_item->is_set) return fail("range to a class escape");
                const char32_t hi = hi_item->cp;
                if (hi < lo) return fail("character class range out of order");
                if (flags_.caseless && multi_fold_in(lo, hi)) {
                    return fail("case-insensitive class with characters Oniguruma folds to several characters");
                }
                atoms += hex_atom(lo) + "-" + hex_atom(hi);
                continue;
            }
            if (flags_.caseless && multi_fold_in(lo, lo)) {
                return fail("case-insensitive class with characters Oniguruma folds to several characters");
            }
            atoms += hex_atom(lo);
        }
        prev_literal_ = 0;
        if (!negated) {
            std::vector<std::string> alts;
            if (!atoms.empty()) alts.push_back("[" + atoms + "]");
            for (const auto &s : complements) alts.push_back("[^" + s + "]");
            for (const auto &[a, r] : diffs) alts.push_back("(?![" + r + "])[" + a + "]");
            if (alts.size() == 1 && diffs.empty()) {
                out_ += alts[0];
                return {};
            }
            out_ += "(?:";
            for (size_t i = 0; i < alts.size(); ++i) out_ += (i ? "|" : "") + alts[i];
            out_ += ")";
            return {};
        }
        if (complements.empty() && diffs.empty()) {
            out_ += "[^" + atoms + "]";
            return {};
        }
        // not (A or not S or (D minus R)) = not A, and S, and (not D or R); then one character.
        out_ += "(?:";
        if (!atoms.empty()) out_ += "(?![" + atoms + "])";
        for (const auto &s : complements) out_ += "(?=[" + s + "])";
        for (const auto &[a, r] : diffs) out_ += "(?=[^" + a + "]|[" + r + "])";
        out_ += "(?s:.))";
        return {};
    }

    std::string_view p_;
    size_t pos_ = 0;
    std::string out_;
    Flags flags_;
    std::vector<GroupFrame> groups_;
    char32_t prev_literal_ = 0;
};

std::string short_pattern(const std::string &pattern) {
    return pattern.size() <= 120 ? pattern : pattern.substr(0, 120) + "...";
}

std::string pcre2_message(int code) {
    PCRE2_UCHAR buffer[256];
    pcre2_get_error_message(code, buffer, sizeof buffer);
    return reinterpret_cast<const char *>(buffer);
}

// `options`: PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE for translated patterns, PCRE2_UTF | PCRE2_LITERAL
// for literal text (PCRE2 allows no other options with PCRE2_LITERAL).
Result<std::shared_ptr<const RegexCode>> compile_pcre2(const std::string &pattern, uint32_t options) {
    pcre2_compile_context *ctx = pcre2_compile_context_create(nullptr);
    MEMRA_CHECK(ctx != nullptr, "pcre2_compile_context_create failed");
    pcre2_set_newline(ctx, PCRE2_NEWLINE_LF);
    pcre2_set_bsr(ctx, PCRE2_BSR_UNICODE);
    int err = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code *code =
        pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &err, &offset, ctx);
    pcre2_compile_context_free(ctx);
    if (code == nullptr) {
        return make_error("PCRE2 rejects translated pattern \"{}\" at offset {}: {}", short_pattern(pattern), offset,
                          pcre2_message(err));
    }
    auto out = std::make_shared<RegexCode>();
    out->code = code;
    // The interpreter is the fallback where PCRE2 was built without JIT or the platform lacks it.
    out->jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
    return std::shared_ptr<const RegexCode>(std::move(out));
}

}  // namespace

Result<std::string> translate_onig_pattern(std::string_view pattern) { return Translator(pattern).run(); }

Result<Regex> Regex::compile(std::string_view onig_pattern) {
    auto translated = translate_onig_pattern(onig_pattern);
    if (!translated) return tl::unexpected(translated.error());
    auto code = compile_pcre2(*translated, PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE);
    if (!code) return tl::unexpected(code.error());
    Regex re;
    re.code_ = std::move(*code);
    re.pattern_ = std::move(*translated);
    return re;
}

Result<Regex> Regex::literal(std::string_view text) {
    if (!utf8_is_valid(text)) return make_error("split string \"{}\" is not valid UTF-8", text);
    auto code = compile_pcre2(std::string(text), PCRE2_UTF | PCRE2_LITERAL);
    if (!code) return tl::unexpected(code.error());
    Regex re;
    re.code_ = std::move(*code);
    re.pattern_ = std::string(text);
    return re;
}

bool Regex::jit() const { return code_->jit; }

namespace {

// Resources for a search that outgrew PCRE2's defaults (32 KiB JIT stack, 10M match steps): long
// runs under a repeated group need more, and Oniguruma has no such limits.
struct LargeLimits {
    pcre2_match_context *ctx = nullptr;
    pcre2_jit_stack *stack = nullptr;
    LargeLimits() {
        ctx = pcre2_match_context_create(nullptr);
        MEMRA_CHECK(ctx != nullptr, "pcre2_match_context_create failed");
        pcre2_set_match_limit(ctx, UINT32_MAX);
        pcre2_set_depth_limit(ctx, UINT32_MAX);
        pcre2_set_heap_limit(ctx, 4u << 20);  // KiB: 4 GiB
        stack = pcre2_jit_stack_create(1u << 16, 1u << 28, nullptr);
        MEMRA_CHECK(stack != nullptr, "pcre2_jit_stack_create failed");
        pcre2_jit_stack_assign(ctx, nullptr, stack);
    }
    ~LargeLimits() {
        pcre2_jit_stack_free(stack);
        pcre2_match_context_free(ctx);
    }
    LargeLimits(const LargeLimits &) = delete;
    LargeLimits &operator=(const LargeLimits &) = delete;
};

bool is_limit_error(int rc) {
    return rc == PCRE2_ERROR_JIT_STACKLIMIT || rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT ||
           rc == PCRE2_ERROR_HEAPLIMIT;
}

}  // namespace

Result<std::vector<RegexMatch>> Regex::find_all(std::string_view text) const {
    MEMRA_CHECK(code_ != nullptr, "find_all on a Regex that was never compiled");
    std::vector<RegexMatch> out;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(code_->code, nullptr);
    MEMRA_CHECK(md != nullptr, "pcre2_match_data_create_from_pattern failed");
    std::unique_ptr<LargeLimits> large;
    const auto *subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t search_from = 0;
    std::optional<size_t> last_match_end;
    while (search_from <= text.size()) {
        int rc = pcre2_match(code_->code, subject, text.size(), search_from, PCRE2_NO_UTF_CHECK, md,
                             large ? large->ctx : nullptr);
        if (is_limit_error(rc) && !large) {
            large = std::make_unique<LargeLimits>();
            continue;
        }
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            pcre2_match_data_free(md);
            return make_error("regex \"{}\": matching failed: {}", short_pattern(pattern_), pcre2_message(rc));
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        const size_t start = ov[0], end = ov[1];
        if (end < start) {
            pcre2_match_data_free(md);
            return make_error("regex \"{}\": \\K produced a match that ends before it starts", short_pattern(pattern_));
        }
        if (start == end && last_match_end == end) {
            // onig crate: step over one character (one byte at the very end, which ends the loop).
            search_from += search_from < text.size() ? utf8_char_len(static_cast<uint8_t>(text[search_from])) : 1;
            continue;
        }
        search_from = end;
        last_match_end = end;
        out.push_back(RegexMatch{start, end});
    }
    pcre2_match_data_free(md);
    return out;
}

}  // namespace memra::text
