// Regexes with Oniguruma semantics on PCRE2: Hugging Face tokenizers compiles tokenizer.json
// patterns with Oniguruma (Ruby syntax, Unicode 16 data); memra translates each pattern into an
// equivalent PCRE2 pattern (property data patched, onig-only syntax rewritten, constructs whose
// meaning differs and cannot be rewritten refused) and iterates matches like the onig crate.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"

namespace memra::text {

// Translates an Oniguruma pattern into PCRE2 syntax (to be compiled with UTF, UCP, MULTILINE).
Result<std::string> translate_onig_pattern(std::string_view pattern);

struct RegexMatch {
    size_t start;
    size_t end;  // byte offsets, end exclusive
};

struct RegexCode;  // compiled PCRE2 pattern (onig_regex.cpp)

class Regex {
public:
    // Compiles an Oniguruma pattern (translated first) with JIT when the platform has it.
    static Result<Regex> compile(std::string_view onig_pattern);
    // A pattern matching `text` literally.
    static Result<Regex> literal(std::string_view text);

    // All matches in valid UTF-8 `text`, left to right, as the Rust onig crate's find_iter yields
    // them: each search starts where the previous match ended, and an empty match right at that
    // point is skipped by moving one character on.
    Result<std::vector<RegexMatch>> find_all(std::string_view text) const;

    const std::string &pcre2_pattern() const { return pattern_; }
    bool jit() const;

private:
    std::shared_ptr<const RegexCode> code_;
    std::string pattern_;
};

}  // namespace memra::text
