// Unicode property corrections for the regex translator (onig_regex.cpp): PCRE2 carries older
// Unicode data than the Oniguruma inside Hugging Face tokenizers, so each property PCRE2 evaluates
// is widened (`add`) or narrowed (`remove`) to Oniguruma's code points. Data: unicode_patches.cpp.
#pragma once

#include <cstdint>
#include <span>

namespace memra::text {

struct CodeRange {
    uint32_t first;
    uint32_t last;  // inclusive
};

struct PropertyPatch {
    const char *names;  // '|'-separated names Oniguruma accepts ("L|Letter"); "\\w" for the word class
    const char *atoms;  // PCRE2 class atoms for the property ("\\p{L}"); empty: PCRE2 lacks it entirely
    std::span<const CodeRange> add;
    std::span<const CodeRange> remove;
};

std::span<const PropertyPatch> property_patches();
// Code points Hugging Face's normalizers (older Unicode tables than utf8proc's) leave alone, as if
// unassigned: memra normalizes the text between them. Data: normalization_barriers.cpp.
std::span<const CodeRange> normalization_barriers();

// The PCRE2 Unicode version the patches were computed against (PCRE2_CONFIG_UNICODE_VERSION).
const char *patched_pcre2_unicode_version();

}  // namespace memra::text
