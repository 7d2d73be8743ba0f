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
Result<const Json *> json_object(const Json &obj, std::string_view key, const std::string &path);
Result<const Json *> json_array(const Json &obj, std::string_view key, const std::string &path);

}  // namespace memra::text
