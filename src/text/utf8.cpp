// UTF-8 classification and lossy repair (see utf8.h). The second-byte ranges follow the Unicode
// "well-formed byte sequences" table, so overlong forms, surrogates and values above U+10FFFF are
// invalid at the byte where they stop being a possible prefix.
#include "text/utf8.h"

namespace memra::text {

namespace {

bool is_cont(uint8_t b) { return (b & 0xC0) == 0x80; }

}  // namespace

Utf8Step utf8_step(std::string_view bytes) {
    const auto b0 = static_cast<uint8_t>(bytes[0]);
    if (b0 < 0x80) return {Utf8Kind::kValid, 1};
    size_t need = 0;
    uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (b0 >= 0xC2 && b0 <= 0xDF) {
        need = 2;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
        need = 3;
        if (b0 == 0xE0) lo = 0xA0;
        if (b0 == 0xED) hi = 0x9F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
        need = 4;
        if (b0 == 0xF0) lo = 0x90;
        if (b0 == 0xF4) hi = 0x8F;
    } else {
        return {Utf8Kind::kInvalid, 1};
    }
    for (size_t i = 1; i < need; ++i) {
        if (i >= bytes.size()) return {Utf8Kind::kIncomplete, i};
        const auto b = static_cast<uint8_t>(bytes[i]);
        const bool ok = i == 1 ? (b >= lo && b <= hi) : is_cont(b);
        if (!ok) return {Utf8Kind::kInvalid, i};
    }
    return {Utf8Kind::kValid, need};
}

char32_t utf8_next(std::string_view text, size_t &pos) {
    const auto b0 = static_cast<uint8_t>(text[pos]);
    const size_t n = utf8_char_len(b0);
    char32_t cp = n == 1 ? b0 : n == 2 ? (b0 & 0x1F) : n == 3 ? (b0 & 0x0F) : (b0 & 0x07);
    for (size_t i = 1; i < n; ++i) cp = (cp << 6) | (static_cast<uint8_t>(text[pos + i]) & 0x3F);
    pos += n;
    return cp;
}

void utf8_append(std::string &out, char32_t cp) {
    if (cp < 0x80) {
        out.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
        out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
        out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
        out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
        out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
        out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
        out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
        out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
        out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
}

bool utf8_is_valid(std::string_view bytes) {
    size_t pos = 0;
    while (pos < bytes.size()) {
        if (static_cast<uint8_t>(bytes[pos]) < 0x80) {
            ++pos;
            continue;
        }
        const Utf8Step step = utf8_step(bytes.substr(pos));
        if (step.kind != Utf8Kind::kValid) return false;
        pos += step.len;
    }
    return true;
}

std::string utf8_lossy(std::string_view bytes) {
    std::string out;
    out.reserve(bytes.size());
    size_t pos = 0;
    while (pos < bytes.size()) {
        if (static_cast<uint8_t>(bytes[pos]) < 0x80) {
            out.push_back(bytes[pos++]);
            continue;
        }
        const Utf8Step step = utf8_step(bytes.substr(pos));
        if (step.kind == Utf8Kind::kValid) {
            out.append(bytes.substr(pos, step.len));
        } else {
            out.append(kReplacementChar);
        }
        pos += step.len;
    }
    return out;
}

}  // namespace memra::text
