#!/usr/bin/env bash
# The whole test suite: unit + oracle tests (CTest), the same unit tests under ASan/UBSan, and a
# bounded libFuzzer run of every parser. Works on a fresh machine (installs what it needs first).
#   MEMRA_FUZZ_SECONDS (default 60) bounds each fuzz target.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
bash scripts/setup.sh deps

echo "== sanitizer build (ASan + UBSan) =="
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DMEMRA_SANITIZE=ON -DMEMRA_BENCH=OFF \
      -DMEMRA_WERROR=ON >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan -L unit -j"$jobs" --output-on-failure --timeout 600

echo "== fuzz =="
bash scripts/fuzz.sh "${MEMRA_FUZZ_SECONDS:-60}"

echo "== release build: unit + oracle tests =="
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMRA_WERROR=ON >/dev/null
cmake --build build -j"$jobs"
ctest --test-dir build -j"$jobs" --output-on-failure --timeout 600
