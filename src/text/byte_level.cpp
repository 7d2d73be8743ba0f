// The byte <-> code point bijection of byte_level.h, computed arithmetically: bytes 0x21-0x7E,
// 0xA1-0xAC and 0xAE-0xFF are "printable" and stand for themselves; the remaining 68 bytes, in
// increasing order, take U+0100, U+0101, ...
#include "text/byte_level.h"

#include "text/utf8.h"

namespace memra::text {

namespace {

bool is_printable(uint32_t b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

// Index of byte b among the non-printable bytes (0x00-0x20: 0-32, 0x7F-0xA0: 33-66, 0xAD: 67).
uint32_t shifted_index(uint32_t b) {
    if (b <= 0x20) return b;
    if (b <= 0xA0) return 33 + (b - 0x7F);
    return 67;
}

}  // namespace

char32_t byte_level_char(uint8_t b) {
    if (is_printable(b)) return b;
    return 0x100 + shifted_index(b);
}

std::optional<uint8_t> byte_level_byte(char32_t cp) {
    if (cp < 0x100) {
        if (is_printable(cp)) return static_cast<uint8_t>(cp);
        return std::nullopt;
    }
    const uint32_t i = cp - 0x100;
    if (i <= 32) return static_cast<uint8_t>(i);
    if (i <= 66) return static_cast<uint8_t>(0x7F + (i - 33));
    if (i == 67) return static_cast<uint8_t>(0xAD);
    return std::nullopt;
}

std::string byte_level_encode(std::string_view bytes) {
    std::string out;
    out.reserve(bytes.size() * 2);
    for (char c : bytes) utf8_append(out, byte_level_char(static_cast<uint8_t>(c)));
    return out;
}

std::optional<std::string> byte_level_decode(std::string_view token) {
    std::string out;
    out.reserve(token.size());
    size_t pos = 0;
    while (pos < token.size()) {
        const auto b = byte_level_byte(utf8_next(token, pos));
        if (!b) return std::nullopt;
        out.push_back(static_cast<char>(*b));
    }
    return out;
}

}  // namespace memra::text
