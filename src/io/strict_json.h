// Strict JSON parsing for file headers: nlohmann/json silently keeps one of two duplicate keys
// and recurses as deep as the input asks; file formats must refuse both. Errors are plain
// Results (no exception leaves this module); callers prefix the file they are parsing.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/result.h"

namespace memra::io {

// serde_json's default recursion limit, which the reference safetensors reader inherits.
inline constexpr size_t kMaxJsonDepth = 128;

// Parses text as one JSON value. Refuses invalid JSON (including invalid UTF-8), a key that
// appears twice in one object (naming the key and the object holding it) and nesting deeper
// than kMaxJsonDepth.
Result<nlohmann::json> parse_json_strict(std::string_view text);

// True when s is valid UTF-8 (and so can be written into a JSON string).
bool is_valid_utf8(std::string_view s);

}  // namespace memra::io
