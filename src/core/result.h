// Recoverable failures: a Result<T> is a value or an Error whose message names the thing,
// what was expected and what was found (ARCHITECTURE.md, "Errors and bad input").
#pragma once

#include <string>
#include <utility>

#include <fmt/format.h>
#include <tl/expected.hpp>

namespace memra {

struct Error {
    std::string message;  // one line: "<thing>: expected <x>, found <y>"
};

template <class T>
using Result = tl::expected<T, Error>;

// make_error("tensor {}: expected shape {}, found {}", name, a, b) -> an unexpected Error.
template <class... Args>
tl::unexpected<Error> make_error(fmt::format_string<Args...> fmt_str, Args &&...args) {
    return tl::unexpected(Error{fmt::format(fmt_str, std::forward<Args>(args)...)});
}

// Prefixes an error with context ("shard model-00002.safetensors: " + message).
inline tl::unexpected<Error> wrap_error(const std::string &context, const Error &err) {
    return tl::unexpected(Error{context + ": " + err.message});
}

}  // namespace memra
