// UTF-8 helpers for the tokenizer: code point decoding of valid text, encoding, and the lossy
// repair of invalid bytes with the exact replacement rule of Rust's String::from_utf8_lossy
// (one U+FFFD per maximal invalid subpart), which Hugging Face tokenizers' decoders use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace memra::text {

inline constexpr char kReplacementChar[] = "\xEF\xBF\xBD";  // U+FFFD

// What starts at the front of a byte string.
enum class Utf8Kind {
    kValid,  // a complete, valid character of `len` bytes
    kInvalid,  // `len` bytes (1-3) that can never start a valid character: one U+FFFD
    kIncomplete,  // `len` bytes that are a valid prefix of a character cut off by the end of input
};

struct Utf8Step {
    Utf8Kind kind;
    size_t len;
};

// Classifies the bytes at the front of `bytes` (must not be empty).
Utf8Step utf8_step(std::string_view bytes);

// Bytes of the character starting with lead byte `b` in valid UTF-8.
inline size_t utf8_char_len(uint8_t b) { return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4; }

// Decodes the character at text[pos] of valid UTF-8 and advances pos past it.
char32_t utf8_next(std::string_view text, size_t &pos);

// Appends the UTF-8 encoding of code point `cp`.
void utf8_append(std::string &out, char32_t cp);

bool utf8_is_valid(std::string_view bytes);

// Rust's String::from_utf8_lossy: valid characters copied, each maximal invalid subpart (and a
// truncated character at the end) replaced by U+FFFD.
std::string utf8_lossy(std::string_view bytes);

}  // namespace memra::text
