#!/usr/bin/env bash
# The whole test suite: unit + oracle tests (CTest), the same unit tests under ASan/UBSan, and a
# bounded libFuzzer run of every parser. Works on a fresh machine (installs what it needs first).
#   MEMRA_FUZZ_SECONDS (default 60) bounds each fuzz target.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
stage() { echo "== $1 (at ${SECONDS}s) =="; }
bash scripts/setup.sh base

# The model oracles (torch, transformers, llama-cpp-python: minutes of downloading and compiling on a
# fresh machine) install in the background while the sanitizer build and the fuzzers run; the release
# tests below need them.
mkdir -p build-logs
bash scripts/setup.sh oracles > build-logs/oracles.log 2>&1 &
oracles_pid=$!
trap 'kill "$oracles_pid" 2>/dev/null || true' EXIT

stage "sanitizer build (ASan + UBSan)"
# -Og -g1: optimized enough that the unit tests run nearly as fast as at -O1 (291 s of test time on a 2-core
# machine, against 260 s at -O1 and 1649 s at -O0), and it compiles much faster: 12 minutes on an idle 2-core
# machine, where -O1 -g took 25 in the last CI run (beside the oracle install). The sanitizers catch the same errors.
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-Og -g1" -DMEMRA_SANITIZE=ON \
      -DMEMRA_BENCH=OFF -DMEMRA_WERROR=ON >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan -L unit -j"$jobs" --output-on-failure --timeout 600

stage fuzz
bash scripts/fuzz.sh "${MEMRA_FUZZ_SECONDS:-60}"

stage "model oracles (requirements-oracle.txt)"
if ! wait "$oracles_pid"; then
    tail -n 40 build-logs/oracles.log
    echo "test: installing the model oracles failed (log: build-logs/oracles.log)" >&2
    exit 1
fi
trap - EXIT
cat build-logs/oracles.log

stage "release build: unit + oracle tests"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMRA_WERROR=ON -DMEMRA_REQUIRE_ORACLES=ON >/dev/null
cmake --build build -j"$jobs"
ctest --test-dir build -j"$jobs" --output-on-failure --timeout 600
stage "done"
