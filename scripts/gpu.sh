#!/usr/bin/env bash
# Runs ON the GPU machine (device tool), over a copy of the tree with .deps carried
# (scripts/gpu_deps.sh makes it): builds with CUDA for sm_90a, runs every test (GPU tests included)
# and the benchmarks (`memra verify` and `memra bench` on this host's CPU cores included), and prints
# a short table last. Logs go to $OUT (or ./gpu-out).
#   device run:  bash scripts/gpu.sh      (carry: [".deps"])
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
deps=$PWD/.deps/root
export CMAKE_PREFIX_PATH=$deps/usr
export LD_LIBRARY_PATH=$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"

t0=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMRA_WERROR=ON \
      -DMEMRA_PYTHON=/bin/false >"$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
cmake --build build-gpu -j"$(nproc)" >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
t1=$(date +%s)

# Unit tests only: the Python oracles need the project's venv, which lives on the CPU machines.
ctest --test-dir build-gpu -L unit -j8 --output-on-failure >"$out/ctest.log" 2>&1
ctest_rc=$?
gpu_tests=$(build-gpu/memra_cuda_tests --gtest_brief=1 2>&1 | tee "$out/cuda_tests.log" | tail -3)
skipped=$(grep -c "SKIPPED" "$out/cuda_tests.log")

# The engine on this host's cores: the determinism gates with every thread (on the default model, whose heads
# plan at TP 1 and 2, and on make-tiny's tiny preset, which plans at TP 1, 2, 4 and 8), and llama-bench speed.
build-gpu/memra verify >"$out/verify.log" 2>&1
verify_rc=$?
build-gpu/memra make-tiny "$out/tiny-model" --force >/dev/null &&
    build-gpu/memra verify "$out/tiny-model" >"$out/verify_tiny.log" 2>&1
verify_tiny_rc=$?
rm -rf "$out/tiny-model"
build-gpu/memra bench -p 512 -n 64 -r 3 >"$out/engine_bench.log" 2>&1
# Numerics side by side, thread scaling on this host's cores (default model): device (this CPU's instruction
# path) and exact, one invocation each per thread count.
grep -o -w -E 'avx512_bf16|amx_bf16|avx512f|avx2' /proc/cpuinfo | sort | uniq -c >"$out/cpu_flags.txt"
lscpu | grep -E 'Model name|^CPU\(s\)' >>"$out/cpu_flags.txt"
for t in 1 2 4 8 16; do
    for n in device exact; do
        build-gpu/memra bench -p 512 -n 128 -r 3 -t "$t" --numerics "$n" >>"$out/numerics_bench.log" 2>/dev/null
    done
done
# Speculative decoding side by side (this host's cores): real text, bench tg, forced acceptance.
bash scripts/spec_bench.sh build-gpu/memra "$out/spec" 16 >"$out/spec_bench.md" 2>"$out/spec_bench.err"
spec_rc=$?

for b in build-gpu/memra_bench_*; do
    [ -x "$b" ] && "$b" --benchmark_min_time=0.2 --benchmark_format=console >>"$out/bench.log" 2>&1
done

echo
echo "| step | result |"
echo "| --- | --- |"
echo "| build (s) | $((t1 - t0)) |"
echo "| ctest unit | $(grep -E 'tests passed|tests failed' "$out/ctest.log" | tail -1) |"
echo "| cuda tests | $(echo "$gpu_tests" | grep -E 'PASSED|FAILED' | tr '\n' ' ') skipped lines: $skipped |"
echo "| memra verify (rc $verify_rc) | $(tail -1 "$out/verify.log") |"
echo "| memra verify tiny (rc $verify_tiny_rc) | $(tail -1 "$out/verify_tiny.log") |"
grep -E '\| (pp|tg)[0-9]+ ' "$out/engine_bench.log" | awk -F'|' '{for (i = 1; i <= NF; i++) gsub(/^ +| +$/, "", $i); printf "| memra bench %s, -t %s | %s t/s, peak %s MiB |\n", $8, $6, $9, $10}'
grep -iE '^bm_' "$out/bench.log" |
    awk '{x=""; for (i = 4; i <= NF; i++) if ($i ~ /bytes_per_second|vs_memcpy/) x = x " " $i;
          printf "| %s | %s %s%s |\n", $1, $2, $3, x}'
echo "| cpu | $(tr '\n' ' ' <"$out/cpu_flags.txt") |"
grep -E '\| (pp|tg)[0-9]+ ' "$out/numerics_bench.log" | awk -F'|' '{for (i = 1; i <= NF; i++) gsub(/^ +| +$/, "", $i); printf "| numerics %s %s -t %s | %s t/s |\n", $11, $8, $6, $9}'
echo "| spec bench (rc $spec_rc) | table below |"
echo
cat "$out/spec_bench.md"
[ $ctest_rc -eq 0 ] && [ $verify_rc -eq 0 ] && [ $verify_tiny_rc -eq 0 ] && [ $spec_rc -eq 0 ]
