// Typed field access on nlohmann::json for the tokenizer loaders: each accessor names the JSON
// path it reads ("tokenizer.json: model.vocab") in its error, with what was expected and found.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/result.h"

namespace memra::text {

using Json = nlohmann::json;

// "null", "true", "number 3", "string \"abc\"", "an object", "an array" (strings shortened).
std::string describe_json(const Json &value);

// obj[key] or nullptr when absent; obj must be an object.
const Json *json_find(const Json &obj, std::string_view key);

// Child path: "a.b" + "c" -> "a.b.c"; index: "a.b" + 3 -> "a.b[3]".
std::string json_path(const std::string &parent, std::string_view key);
std::string json_path(const std::string &parent, size_t index);

Result<bool> json_bool(const Json &obj, std::string_view key, const std::string &path, std::optional<bool> fallback);
// A string field; `fallback` applies when absent (a null value is an error unless `null_ok`).
Result<std::optional<std::string>> json_string(const Json &obj, std::string_view key, const std::string &path,
                                               bool required, bool null_ok);
Result<int32_t> json_id(const Json &value, const std::string &path);

// Token ids must be below 2^24. The largest id sizes the per-id tables (the vocabulary's id -> string
// table, Tokenizer::n_tokens), so a hostile id near 2^31 would make loading allocate tens of GiB before
// anything else could refuse it; real vocabularies stay far below (Step-3.5: 128896 ids).
inline constexpr int32_t kTokenIdLimit = int32_t{1} << 24;
// Refuses `id` of `token` at or above kTokenIdLimit: "<path>: token \"<token>\" has id <id>, memra
// refuses ids >= 16777216 (2^24)".
Result<void> check_token_id(int32_t id, std::string_view token, const std::string &path);

Result<const Json *> json_object(const Json &obj, std::string_view key, const std::string &path);
Result<const Json *> json_array(const Json &obj, std::string_view key, const std::string &path);

}  // namespace memra::text
