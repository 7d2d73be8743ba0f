// GPT-2 byte-level alphabet: every byte maps to one printable code point (printable Latin-1
// bytes to themselves, the other 68 bytes to U+0100.. in byte order), so BPE works on text
// while covering arbitrary bytes. Used by the ByteLevel pre-tokenizer and decoder.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace memra::text {

// Code point that stands for byte `b`.
char32_t byte_level_char(uint8_t b);

// Byte that code point `cp` stands for; nullopt for code points outside the alphabet.
std::optional<uint8_t> byte_level_byte(char32_t cp);

// Maps each byte of `bytes` to its alphabet character (UTF-8 output).
std::string byte_level_encode(std::string_view bytes);

// The bytes a token of valid UTF-8 stands for, when every character of it is in the alphabet
// (what Hugging Face's ByteLevel decoder does per token); nullopt otherwise.
std::optional<std::string> byte_level_decode(std::string_view token);

}  // namespace memra::text
