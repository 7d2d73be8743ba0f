#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/*_fuzz.cpp, see cmake/fuzz.cmake) with clang in build-fuzz
# and runs each for a bounded time on a temporary copy of its seed corpus fuzz/corpus/<name>/
# (the committed corpus never grows). Exits non-zero if any target crashes, hangs or trips a
# sanitizer; the crashing inputs are kept in build-fuzz/artifacts/.
#   scripts/fuzz.sh [SECONDS]     seconds per target (default: $MEMRA_FUZZ_SECONDS, else 60)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-${MEMRA_FUZZ_SECONDS:-60}}"
jobs="${MEMRA_JOBS:-$(nproc)}"

CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DMEMRA_FUZZ=ON >/dev/null
cmake --build build-fuzz -j"$jobs"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
artifacts="$PWD/build-fuzz/artifacts"
mkdir -p "$artifacts"
# UBSan only reports by default; make every finding fatal so it counts as a crash.
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export ASAN_OPTIONS="detect_leaks=1"

status=0
for src in fuzz/*_fuzz.cpp; do
    target="$(basename "$src" .cpp)"  # safetensors_fuzz
    name="${target%_fuzz}"            # safetensors
    corpus="$work/$name"
    mkdir -p "$corpus"
    if [ -d "fuzz/corpus/$name" ]; then
        cp -R "fuzz/corpus/$name/." "$corpus/"
    fi
    log="$work/$target.log"
    if "build-fuzz/$target" -max_total_time="$seconds" -timeout=10 -print_final_stats=1 \
        -artifact_prefix="$artifacts/$target-" "$corpus" >"$log" 2>&1; then
        execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")"
        echo "fuzz $target: ${execs:-?} executions in ${seconds}s, no crash"
    else
        echo "fuzz $target: FAILED (input kept in $artifacts)"
        tail -n 60 "$log"
        status=1
    fi
done
exit "$status"
