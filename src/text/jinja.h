// A Jinja2 interpreter for Hugging Face chat templates: the language subset those templates use,
// with the semantics of the environment transformers renders them in (jinja2 3.1
// ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loop controls, {% generation %}, a
// json.dumps tojson, raise_exception and strftime_now). Values come from nlohmann::ordered_json and
// print as Python's str() would; strings are UTF-8 measured in code points. Parsing and rendering
// never throw and never run unbounded: nesting depth, output size and loop iterations have limits.
// Not supported (each fails with an error): include / import / extends, recursive loops, *args / **kwargs
// at call sites and varargs / kwargs in macros, integers beyond 64 bits, the filters groupby, slice,
// striptags, wordwrap, urlize, urlencode, xmlattr, pprint, random and filesizeformat. Case mapping
// covers ASCII, Latin-1, Latin Extended-A, Greek and Cyrillic (no 'ß' -> 'SS').
#pragma once

#include <cstddef>
#include <cstdint>
#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/result.h"

namespace memra::text::jinja {

struct RenderOptions {
    // The rendered text and every string built on the way (concatenation, join, `*`, block set,
    // printing a list, tojson, formatting).
    size_t max_output_bytes = size_t{64} << 20;
    // Units of work: loop iterations, the elements of every list, dict or string sequence the template
    // builds or walks (range, `+`, `*`, filters, comparisons), and one per 256 bytes of string that
    // string filters, methods and indexing walk. Bounds both time and memory.
    uint64_t max_iterations = 10'000'000;
    // Nested evaluation (macro calls, statement and expression nesting together) and the nesting of
    // values (the context's and those built). The parser separately refuses templates nested deeper
    // than 200 levels.
    int max_depth = 500;
    // What strftime_now() formats (local time, like Python's datetime.now()); the current local time
    // when empty. Tests fix it.
    std::optional<std::tm> now;
};

class Template {
public:
    // Syntax errors name the line and column (in characters): "line L:C: expected <what>, found <what>",
    // "line L:C: unknown tag 'foo'", "line L:C: No filter named 'f'.".
    static Result<Template> parse(std::string_view source);

    // Errors name the template line: "line 12: 'foo' is undefined", "line 3: <raise_exception message>",
    // "line 7: output exceeds 67108864 bytes". `context` must be an object; its keys become variables
    // (shadowing the globals range, namespace, dict, raise_exception, strftime_now). Thread-safe.
    Result<std::string> render(const nlohmann::ordered_json &context, const RenderOptions &options = {}) const;

    struct Impl;

private:
    explicit Template(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
    std::shared_ptr<const Impl> impl_;  // immutable after parse, shared by copies
};

}  // namespace memra::text::jinja
