// Typed JSON field access with path-naming errors (see json_fields.h).
#include "text/json_fields.h"

#include <fmt/format.h>

namespace memra::text {

std::string describe_json(const Json &value) {
    switch (value.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return value.get<bool>() ? "true" : "false";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
    case Json::value_t::number_float: return "number " + value.dump();
    case Json::value_t::string: {
        std::string s = value.get<std::string>();
        if (s.size() > 40) s = s.substr(0, 40) + "...";
        return "string \"" + s + "\"";
    }
    case Json::value_t::object: return "an object";
    case Json::value_t::array: return "an array";
    default: return "an unexpected JSON value";
    }
}

const Json *json_find(const Json &obj, std::string_view key) {
    if (!obj.is_object()) return nullptr;
    auto it = obj.find(key);
    return it == obj.end() ? nullptr : &*it;
}

std::string json_path(const std::string &parent, std::string_view key) {
    if (parent.empty() || parent.back() == ' ') return parent + std::string(key);
    return parent + "." + std::string(key);
}

std::string json_path(const std::string &parent, size_t index) { return fmt::format("{}[{}]", parent, index); }

Result<bool> json_bool(const Json &obj, std::string_view key, const std::string &path, std::optional<bool> fallback) {
    const Json *v = json_find(obj, key);
    if (v == nullptr) {
        if (fallback) return *fallback;
        return make_error("{}: missing", json_path(path, key));
    }
    if (!v->is_boolean())
        return make_error("{}: expected true or false, found {}", json_path(path, key), describe_json(*v));
    return v->get<bool>();
}

Result<std::optional<std::string>> json_string(const Json &obj, std::string_view key, const std::string &path,
                                               bool required, bool null_ok) {
    const Json *v = json_find(obj, key);
    if (v == nullptr) {
        if (required) return make_error("{}: missing", json_path(path, key));
        return std::optional<std::string>();
    }
    if (v->is_null() && null_ok) return std::optional<std::string>();
    if (!v->is_string()) return make_error("{}: expected a string, found {}", json_path(path, key), describe_json(*v));
    return std::optional<std::string>(v->get<std::string>());
}

Result<int32_t> json_id(const Json &value, const std::string &path) {
    if (!value.is_number_integer()) return make_error("{}: expected a token id, found {}", path, describe_json(value));
    const int64_t id = value.get<int64_t>();
    if (id < 0 || id > INT32_MAX) return make_error("{}: expected a token id in [0, 2^31), found {}", path, id);
    return static_cast<int32_t>(id);
}

Result<void> check_token_id(int32_t id, std::string_view token, const std::string &path) {
    if (id < kTokenIdLimit) return {};
    std::string shown(token.substr(0, 40));
    if (token.size() > 40) shown += "...";
    return make_error("{}: token \"{}\" has id {}, memra refuses ids >= {} (2^24)", path, shown, id, kTokenIdLimit);
}

Result<const Json *> json_object(const Json &obj, std::string_view key, const std::string &path) {
    const Json *v = json_find(obj, key);
    if (v == nullptr) return make_error("{}: missing", json_path(path, key));
    if (!v->is_object()) return make_error("{}: expected an object, found {}", json_path(path, key), describe_json(*v));
    return v;
}

Result<const Json *> json_array(const Json &obj, std::string_view key, const std::string &path) {
    const Json *v = json_find(obj, key);
    if (v == nullptr) return make_error("{}: missing", json_path(path, key));
    if (!v->is_array()) return make_error("{}: expected an array, found {}", json_path(path, key), describe_json(*v));
    return v;
}

}  // namespace memra::text
