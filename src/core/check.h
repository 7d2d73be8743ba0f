// Broken invariants (programming errors, never bad input): MEMRA_CHECK prints file:line, the
// condition and a formatted message, then aborts. Bad input goes through Result<T> instead.
#pragma once

#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>

namespace memra::detail {

[[noreturn]] inline void check_failed(const char *file, int line, const char *cond, const std::string &msg) {
    std::fprintf(stderr, "memra: invariant violated at %s:%d: %s %s\n", file, line, cond, msg.c_str());
    std::fflush(stderr);
    std::abort();
}

}  // namespace memra::detail

#define MEMRA_CHECK(cond, ...)                                                                 \
    do {                                                                                       \
        if (!(cond)) [[unlikely]] {                                                            \
            ::memra::detail::check_failed(__FILE__, __LINE__, #cond, ::fmt::format(__VA_ARGS__)); \
        }                                                                                      \
    } while (0)
