#!/usr/bin/env python3
# Generates unicode_patches.cpp: for every Unicode property memra's regex translator accepts, the
# code points where PCRE2's own data (the linked libpcre2, Unicode 14 in 10.42) disagrees with the
# Oniguruma build inside Hugging Face `tokenizers` (Unicode 16), which memra must match bit for bit.
# Run from the repository root with the project venv: .venv/bin/python scripts/text/gen_unicode_patches.py
import ctypes
import ctypes.util
import subprocess
import sys

from tokenizers import Regex, pre_tokenizers

MAX_CP = 0x110000
CODE_POINTS = [c for c in range(MAX_CP) if not 0xD800 <= c < 0xE000]
TEXT = "".join(chr(c) for c in CODE_POINTS)
TEXT_UTF8 = TEXT.encode("utf-8")

# General categories: PCRE2 short name -> the names Oniguruma accepts for it.
GENERAL = ["L", "Lu", "Ll", "Lt", "Lm", "Lo", "M", "Mn", "Mc", "Me", "N", "Nd", "Nl", "No",
           "P", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "S", "Sm", "Sc", "Sk", "So",
           "Z", "Zs", "Zl", "Zp", "C", "Cc", "Cf", "Cs", "Co", "Cn"]
# Scripts Unicode added after 14.0 (PCRE2 10.42 does not know them): long name, short name.
NEW_SCRIPTS = [("Kawi", "Kawi"), ("Nag_Mundari", "Nagm"), ("Garay", "Gara"), ("Gurung_Khema", "Gukh"),
               ("Kirat_Rai", "Krai"), ("Ol_Onal", "Onao"), ("Sunuwar", "Sunu"), ("Todhri", "Todr"),
               ("Tulu_Tigalari", "Tutg")]


def perl_aliases(prop):
    code = ('use Unicode::UCD qw(prop_values prop_value_aliases);'
            'for my $v (prop_values($ARGV[0])) { print join(",", prop_value_aliases($ARGV[0], $v)), "\\n" }')
    out = subprocess.run(["perl", "-e", code, prop], check=True, capture_output=True, text=True).stdout
    return [line.split(",") for line in out.splitlines() if line]


class Pcre2:
    def __init__(self):
        lib = ctypes.CDLL(ctypes.util.find_library("pcre2-8"))
        lib.pcre2_compile_8.restype = ctypes.c_void_p
        lib.pcre2_compile_8.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint32,
                                        ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_size_t),
                                        ctypes.c_void_p]
        lib.pcre2_match_data_create_from_pattern_8.restype = ctypes.c_void_p
        lib.pcre2_match_data_create_from_pattern_8.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.pcre2_match_8.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                      ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p]
        lib.pcre2_get_ovector_pointer_8.restype = ctypes.POINTER(ctypes.c_size_t)
        lib.pcre2_get_ovector_pointer_8.argtypes = [ctypes.c_void_p]
        lib.pcre2_config_8.argtypes = [ctypes.c_uint32, ctypes.c_void_p]
        self.lib = lib
        # Byte offset -> index in CODE_POINTS.
        self.index_of = {}
        pos = 0
        for i, c in enumerate(CODE_POINTS):
            self.index_of[pos] = i
            pos += len(chr(c).encode("utf-8"))
        self.index_of[pos] = len(CODE_POINTS)

    def unicode_version(self):
        buf = ctypes.create_string_buffer(64)
        self.lib.pcre2_config_8(10, buf)  # PCRE2_CONFIG_UNICODE_VERSION
        return buf.value.decode()

    def members(self, atoms):
        """Code points matched by the PCRE2 class [atoms] (PCRE2_UTF | PCRE2_UCP)."""
        if not atoms:
            return set()
        err, off = ctypes.c_int(), ctypes.c_size_t()
        pat = ("[" + atoms + "]+").encode()
        code = self.lib.pcre2_compile_8(pat, len(pat), 0x00080000 | 0x00020000, ctypes.byref(err),
                                        ctypes.byref(off), None)
        if not code:
            raise RuntimeError(f"PCRE2 rejects [{atoms}]")
        md = self.lib.pcre2_match_data_create_from_pattern_8(code, None)
        out = set()
        start = 0
        while True:
            rc = self.lib.pcre2_match_8(code, TEXT_UTF8, len(TEXT_UTF8), start, 0, md, None)
            if rc < 0:
                break
            ov = self.lib.pcre2_get_ovector_pointer_8(md)
            a, b = ov[0], ov[1]
            out.update(CODE_POINTS[self.index_of[a]:self.index_of[b]])
            start = b
        return out


def onig_members(pattern):
    """Code points matched by Oniguruma's `pattern` (one code point per match) inside `tokenizers`."""
    pieces = pre_tokenizers.Split(Regex(f"(?:{pattern})+"), behavior="removed").pre_tokenize_str(TEXT)
    out = set(CODE_POINTS)
    for _, (a, b) in pieces:
        out.difference_update(CODE_POINTS[a:b])
    return out


def ranges(cps):
    out = []
    for c in sorted(cps):
        if out and out[-1][1] == c - 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return out


def main():
    pcre = Pcre2()
    rows = []  # (names, onig pattern, pcre2 atoms)
    for gc in GENERAL:
        names = next(a for a in perl_aliases("gc") if a[0] == gc)
        rows.append((names, f"\\p{{{gc}}}", f"\\p{{{gc}}}"))
    rows.append((["LC", "Cased_Letter"], "\\p{LC}", "\\p{L&}"))
    for short, long_name, *more in perl_aliases("sc"):
        if long_name in ("Katakana_Or_Hiragana",):
            continue  # an alias value Oniguruma does not accept
        rows.append(([short, long_name] + more, f"\\p{{{long_name}}}", f"\\p{{sc:{long_name}}}"))
    for long_name, short in NEW_SCRIPTS:
        rows.append(([short, long_name], f"\\p{{{long_name}}}", ""))
    rows.append((["Alphabetic", "Alpha"], "\\p{Alphabetic}", "\\p{Alphabetic}"))
    rows.append((["White_Space", "WSpace", "Space"], "\\p{White_Space}", "\\p{White_Space}"))
    rows.append((["Any"], "\\p{Any}", "\\p{Any}"))
    # Oniguruma's \w: Alphabetic, marks, decimal digits, connector punctuation (plus a few Latin-1
    # superscripts and fractions its table carries); \d and \s are Nd and White_Space.
    rows.append((["\\w"], "\\w", "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}"))

    lines = []
    for names, onig_pat, atoms in rows:
        want = onig_members(onig_pat)
        have = pcre.members(atoms)
        add, rem = ranges(want - have), ranges(have - want)
        lines.append((names, atoms, add, rem))
        print(f"{names[0]:24} onig {len(want):7} pcre2 {len(have):7} add {len(add):3} ranges, remove {len(rem):3}",
              file=sys.stderr)

    def fmt_array(name, rs):
        lines, line = [f"constexpr CodeRange {name}[] = {{"], "   "
        for a, b in rs:
            item = f"{{0x{a:X}, 0x{b:X}}},"
            if len(line) + 1 + len(item) > 116:
                lines.append(line)
                line = "   "
            line += " " + item
        lines += [line, "};"]
        return lines

    out = []
    out.append("// Generated by scripts/text/gen_unicode_patches.py: do not edit. For each Unicode property the regex")
    out.append("// translator accepts, the code points where PCRE2's data (Unicode "
               f"{pcre.unicode_version()}) disagrees with the Oniguruma")
    out.append("// inside Hugging Face tokenizers (Unicode 16.0): `add` ranges it lacks, `remove` ranges it has extra.")
    out.append('#include "text/unicode_patches.h"')
    out.append("")
    out.append("namespace memra::text {")
    out.append("")
    out.append("namespace {")
    out.append("")
    for i, (names, atoms, add, rem) in enumerate(lines):
        if add:
            out += fmt_array(f"kAdd{i}", add)
        if rem:
            out += fmt_array(f"kRemove{i}", rem)
    out.append("")
    out.append("constexpr PropertyPatch kPatches[] = {")
    for i, (names, atoms, add, rem) in enumerate(lines):
        cname = '"' + "|".join(names).replace("\\", "\\\\") + '"'
        catoms = '"' + atoms.replace("\\", "\\\\") + '"'
        a = f"kAdd{i}" if add else "{}"
        r = f"kRemove{i}" if rem else "{}"
        out.append(f"    {{{cname}, {catoms}, {a}, {r}}},")
    out.append("};")
    out.append("")
    out.append("}  // namespace")
    out.append("")
    out.append("std::span<const PropertyPatch> property_patches() { return kPatches; }")
    out.append("")
    out.append(f'const char *patched_pcre2_unicode_version() {{ return "{pcre.unicode_version()}"; }}')
    out.append("")
    out.append("}  // namespace memra::text")
    with open("src/text/unicode_patches.cpp", "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
