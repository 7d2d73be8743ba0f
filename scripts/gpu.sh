#!/usr/bin/env bash
# Runs ON the GPU machine (device tool), over a copy of the tree with parts of .deps carried (scripts/gpu_deps.sh
# makes it): builds with CUDA for sm_90a, runs the GPU tests (every kernel against its CPU twin, the whole model on the
# GPU against the CPU), `memra run` / `verify` / `bench --device cuda` on the embedded default model and on the
# release-width preset (generated here) and on Step-3.5-E128 (built in memory), the product and decode-attention
# benchmarks beside PyTorch (bench/cuda, bench/cuda_peers.py), E7 and the K6 routing kernels through Nsight Compute,
# memra's all-gather beside NCCL's all-reduce, and on a machine of several GPUs `verify --tp` over NCCL and decode per
# TP degree; prints a short table last. Logs go to $OUT (or ./gpu-out).
#   device run:  bash scripts/gpu.sh            (carry: [".deps/root", ".deps/wheels"]; the carry limit of 64 MiB
#                holds the tree and two of .deps/root, .deps/wheels (the server's tests) and .deps/llama.cpp.tar.gz)
#   MEMRA_GPU_CPU=1 also runs the whole unit suite and the CPU engine benchmarks on this host's cores.
#   MEMRA_GPU_E128=0 leaves out the Step-3.5-E128 runs.
#   MEMRA_GPU_E128_CONTEXT=1 adds E128 at the E table's contexts: decode at 4K (batch 1, 32, 128) and 64K, prefill 8K,
#   MTP-3 speculation at 4K; =decode or =prefill half of them. An E128-only call within 10 minutes:
#   MEMRA_GPU_QUICK=1 MEMRA_GPU_TESTS=0 MEMRA_GPU_SERVE=0 MEMRA_GPU_E128=0 MEMRA_GPU_E128_CONTEXT=decode.
#   MEMRA_GPU_QUICK=1 leaves out verify and the benchmarks: build, GPU tests, run, the server's tests and load tests.
#   MEMRA_GPU_SERVE=0 leaves out the server's tests and load tests.
#   MEMRA_GPU_TESTS=0 leaves out the GPU tests, the CLI's device tests, the collectives and verify (a benchmark run).
#   MEMRA_GPU_LLAMA=1 adds the peer: llama.cpp's CUDA build (.deps/llama.cpp.tar.gz from scripts/gpu_deps.sh,
#   carried; minutes of compiling) on the release preset converted to GGUF, beside memra's bench of it.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
deps=$PWD/.deps/root
export CMAKE_PREFIX_PATH=$deps/usr
export LD_LIBRARY_PATH=$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
memra=build-gpu/memra
tmp=${TMPDIR:-/tmp}/memra-gpu
mkdir -p "$tmp"

t0=$(date +%s)
# NCCL: the CUDA toolkit's when it has one, else the nvidia-nccl wheel beside PyTorch (header and libnccl.so.2).
nccl=()
if [ ! -e /usr/local/cuda/include/nccl.h ]; then
    wheel=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null \
            || python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
    if [ -n "$wheel" ] && [ -e "$wheel/include/nccl.h" ] && [ -e "$wheel/lib/libnccl.so.2" ]; then
        nccl=(-DNCCL_INCLUDE_DIR="$wheel/include" -DNCCL_LIBRARY="$wheel/lib/libnccl.so.2")
    fi
fi
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMRA_WERROR=ON \
      -DMEMRA_PYTHON=/bin/false "${nccl[@]}" >"$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
grep -E "memra: (CUDA|NCCL)" "$out/configure.log"
cmake --build build-gpu -j"$(nproc)" >"$out/build.log" 2>&1 || { grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; }
t1=$(date +%s)

# The release-width preset: 4 layers (3 dense + 1 MoE), 32 experts, 1 MTP layer.
release=$tmp/release
$memra make-tiny "$release" --preset release --force >"$out/make_tiny_release.log" 2>&1
t2=$(date +%s)

tests=${MEMRA_GPU_TESTS:-1}
cuda_rc=skipped cli_rc=skipped gpu_tests=skipped
if [ "$tests" = 1 ]; then
    # Every kernel against its CPU twin, the whole model against the CPU (MEMRA_RELEASE_MODEL adds the release
    # preset).
    MEMRA_RELEASE_MODEL=$release build-gpu/memra_cuda_tests --gtest_filter='-Nccl*' >"$out/cuda_tests.log" 2>&1
    cuda_rc=$?
    # The NCCL communicator apart, under a timeout (a rank waiting for a missing peer must fail, never hang).
    timeout 180 build-gpu/memra_cuda_tests --gtest_filter='Nccl*' >>"$out/cuda_tests.log" 2>&1 || cuda_rc=1
    gpu_tests=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/cuda_tests.log" | tr '\n' ' ')
    build-gpu/memra_cli_tests --gtest_filter='*Device*' >"$out/cli_device_tests.log" 2>&1
    cli_rc=$?
    # memra's all-gather against NCCL's all-reduce of the same bytes, on 1, 2, 4, 8 GPUs as the machine has them.
    timeout 120 build-gpu/memra_bench_cuda_collectives >"$out/collectives.md" 2>"$out/collectives.log"
fi
t3=$(date +%s)
# With several GPUs: the gates over NCCL (a GPU per rank) and decode per TP degree at batch 1, 8, 64.
gpus=$(nvidia-smi -L | wc -l)
multi_tps=()
for tp in 2 4 8; do [ "$tp" -le "$gpus" ] && multi_tps+=("$tp"); done

# Generation: the GPU's greedy text beside the CPU's (reported: the tensor cores' products are near the CPU's, not
# equal, so a near tie may go another way; tests/cuda holds the logits to a tolerance).
prompt="Once upon a time"
$memra run -p "$prompt" -n 48 --temp 0 --ignore-eos --device cuda >"$out/run_cuda.txt" 2>"$out/run_cuda.log"
run_rc=$?
$memra run -p "$prompt" -n 48 --temp 0 --ignore-eos --device cpu >"$out/run_cpu.txt" 2>"$out/run_cpu.log"
cmp -s "$out/run_cuda.txt" "$out/run_cpu.txt" && run_same=yes || run_same=no
$memra run "$release" -p "$prompt" -n 16 --temp 0 --ignore-eos --device cuda >"$out/run_release.txt" 2>"$out/run_release.log"
run_release_rc=$?

verify_rc=skipped verify_release_rc=skipped verify_fp8_rc=skipped bench_rc=skipped bench64_rc=skipped
t4=$(date +%s)
if [ "${MEMRA_GPU_QUICK:-0}" != 1 ]; then
    if [ "$tests" = 1 ]; then
        # The determinism gates on the GPU (TP ranks as in-process ranks sharing it).
        timeout 300 $memra verify --device cuda --batch 64 >"$out/verify_cuda.log" 2>&1
        verify_rc=$?
        timeout 300 $memra verify "$release" --device cuda --tp 1,2,4,8 >"$out/verify_release.log" 2>&1
        verify_release_rc=$?
        # The release architecture with FP8 experts (generated in memory): the tensor-core e4m3 products (wgmma)
        # against the per-expert oracle, every batch size and slot, TP 1 and 2.
        timeout 300 $memra verify --synthetic release --synthetic-dtype fp8 --device cuda --tp 1,2 --batch 16 \
            >"$out/verify_fp8.log" 2>&1
        verify_fp8_rc=$?
    fi
    t4=$(date +%s)

    # Speed (reported, not gated): prefill and decode at batch 1, 8 and 64 on the release-width preset.
    $memra bench "$release" --device cuda -p 512 -n 64 -r 3 --parallel 8 -o json >"$out/bench_release_8.json" 2>"$out/bench_release.log"
    bench_rc=$?
    $memra bench "$release" --device cuda -p 0 -n 32 -r 2 --parallel 64 -o json >"$out/bench_release_64.json" 2>>"$out/bench_release.log"
    bench64_rc=$?
    $memra bench --device cuda -p 512 -n 64 -r 3 -o json >"$out/bench_default.json" 2>>"$out/bench_release.log"
    # The same decode issued op by op (no CUDA graphs), for the graphs' gain.
    MEMRA_CUDA_GRAPHS=0 $memra bench "$release" --device cuda -p 0 -n 64 -r 3 -o json >"$out/bench_release_eager.json" 2>>"$out/bench_release.log"
    # E7: every kernel's GPU time in the decode steps at batch 1 (Nsight Compute, clocks and caches left alone),
    # against the step.
    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv $memra bench "$release" --device cuda -p 0 -n 4 -r 1 \
        >"$out/ncu_decode.csv" 2>"$out/ncu_decode.log"
    # K1: the products at decode shapes against a copy of the same bytes, and PyTorch (cuBLAS) on the same shapes.
    build-gpu/memra_bench_cuda_products --benchmark_format=json >"$out/bench_cuda_products.json" 2>"$out/bench_cuda_products.log"
    python3 bench/cuda_peers.py >"$out/bench_cuda_peers.jsonl" 2>"$out/bench_cuda_peers.log"
    # The tensor-core bf16 product at batch 1 (the decode kernel) under Nsight Compute: where its time goes
    # (throughputs, warp stalls, occupancy).
    timeout 120 ncu --kernel-name regex:stream_bf16 --launch-skip 3 --launch-count 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats \
        build-gpu/memra_bench_cuda_products --benchmark_filter='bm_bf16_product/rows:11264/K:4096/tokens:1/' \
        >"$out/ncu_bf16_product.txt" 2>&1
    # K6: each routing kernel's own GPU time at 1 and 64 tokens (Nsight Compute, clocks and caches left alone; the
    # third launch of the fused routing's three kernels: moe_route, moe_permute, moe_combine).
    for t in 1 64; do
        timeout 90 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --launch-skip 6 \
            --launch-count 3 --csv build-gpu/memra_bench_cuda_products \
            --benchmark_filter="bm_routing/tokens:$t/fused:1/" >"$out/ncu_routing_$t.csv" 2>&1
    done
fi
# The peer: llama.cpp's CUDA build (sm_90a, llama-bench only) on the release preset converted to bf16 GGUF by
# llama.cpp's own converter; llama-bench's pp512 and tg64 with every layer on the GPU, flash attention and a bf16
# KV cache, as memra's bench above (bench_release_8: pp512, tg64, bf16 KV).
llama_rc=skipped
if [ "${MEMRA_GPU_LLAMA:-0}" = 1 ]; then
    llama_rc=1
    rm -rf "$tmp/llama.cpp"
    if tar xzf .deps/llama.cpp.tar.gz -C "$tmp" &&
        cmake -S "$tmp/llama.cpp" -B build-llama -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
            -DCMAKE_CUDA_ARCHITECTURES=90a -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
            -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF >"$out/llama_configure.log" 2>&1 &&
        cmake --build build-llama -j"$(nproc)" --target llama-bench >"$out/llama_build.log" 2>&1 &&
        python3 tests/oracle/gguf_convert.py "$tmp/llama.cpp" "$release" "$tmp/release.gguf" bf16 \
            >"$out/llama_convert.log" 2>&1; then
        build-llama/bin/llama-bench -m "$tmp/release.gguf" -p 512 -n 64 -ngl 99 -fa 1 -ctk bf16 -ctv bf16 -r 3 \
            -o json >"$out/bench_llama.json" 2>"$out/llama_bench.log"
        llama_rc=$?
    fi
fi
if [ ${#multi_tps[@]} -gt 0 ]; then
    tps=$(IFS=,; echo "1,${multi_tps[*]}")
    timeout 600 $memra verify "$release" --device cuda --tp "$tps" >"$out/verify_nccl.log" 2>&1
    echo "verify nccl rc $?" >>"$out/verify_nccl.log"
    for tp in 1 "${multi_tps[@]}"; do
        for b in 1 8 64; do
            $memra bench "$release" --device cuda --tp "$tp" -p 0 -n 32 -r 2 --parallel "$b" -o json \
                >"$out/bench_tp${tp}_b$b.json" 2>>"$out/bench_tp.log"
        done
    done
fi
# Serving on the GPU: the openai client's suite (tests/oracle/test_serve.py, from wheels carried in .deps/wheels)
# against `memra serve --device cuda` on the default model, then the load test on the release-width preset.
serve_rc=skipped serve_stop_rc=skipped
if [ "${MEMRA_GPU_SERVE:-1}" = 1 ]; then
    serve_rc=1
    if python3 -m venv --system-site-packages "$tmp/venv" >"$out/serve_venv.log" 2>&1 &&
        "$tmp/venv/bin/python" -m pip install -q --no-index --find-links .deps/wheels openai==3.57.0 \
            prometheus-client==0.26.0 pytest==9.2.0 >>"$out/serve_venv.log" 2>&1; then
        MEMRA_EXE=$memra MEMRA_SERVE_DEVICE=cuda timeout 300 "$tmp/venv/bin/python" -m pytest -q -p no:cacheprovider \
            tests/oracle/test_serve.py >"$out/serve_tests.log" 2>&1
        serve_rc=$?
    fi
    # Starts `memra serve MODEL FLAGS...` in the background (log: $out/serve_TAG.log) and waits for its port.
    serve_start() {
        local tag=$1
        shift
        $memra serve "$@" --device cuda --port 0 >/dev/null 2>"$out/serve_$tag.log" &
        serve_pid=$!
        port=""
        for _ in $(seq 600); do
            port=$(sed -n 's/.*listening on http:\/\/[^:]*:\([0-9]*\).*/\1/p' "$out/serve_$tag.log")
            [ -n "$port" ] && break
            sleep 0.2
        done
    }
    load() {  # load TAG ARGS...: bench/serve_load.py against $port, its report in $out/load_TAG.{txt,json}
        local tag=$1
        shift
        [ -n "$port" ] && timeout 240 python3 bench/serve_load.py --url "http://127.0.0.1:$port" --id-low 266 --id-high 700 \
            --json "$out/load_$tag.json" "$@" >"$out/load_$tag.txt" 2>&1
    }
    serve_stop() {
        kill -INT $serve_pid 2>/dev/null
        wait $serve_pid
    }
    # The release-width preset: 512 unique prompt tokens, then 448 shared + 64 unique (the prefix cache's workload),
    # and the shared workload again on a server without the cache.
    serve_start release "$release" -c 65536
    [ "${MEMRA_GPU_QUICK:-0}" != 1 ] && load random --num-prompts 128 --max-concurrency 64 --input-len 512 --output-len 128
    load prefix --num-prompts 128 --max-concurrency 64 --prefix-len 448 --input-len 64 --output-len 128
    serve_stop
    serve_stop_rc=$?
    serve_start release_nocache "$release" -c 65536 --no-enable-prefix-caching
    load prefix_off --num-prompts 128 --max-concurrency 64 --prefix-len 448 --input-len 64 --output-len 128
    serve_stop
    # MTP speculation on the trained default model (three MTP layers), one stream at a time: drafts 3 against none.
    serve_start spec --spec-draft 3
    load spec3 --num-prompts 8 --max-concurrency 1 --input-len 64 --output-len 256
    python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())" \
        "http://127.0.0.1:$port/metrics" 2>/dev/null | grep -E "^memra:spec_decode" >"$out/spec_metrics.txt"
    serve_stop
    serve_start nospec
    load spec0 --num-prompts 8 --max-concurrency 1 --input-len 64 --output-len 256
    serve_stop
fi
# E1 / E3 on Step-3.5-E128 (the release architecture with 128 routed experts: 102.8 GB in the official layout, FP8
# experts; too large for this disk, so built in device memory from a seed): decode at batch 1 and 32, prefill 512.
e128_rc=skipped
if [ "${MEMRA_GPU_E128:-1}" = 1 ]; then  # MEMRA_GPU_E128=0 leaves out the two E128 runs (about 150 s)
$memra bench --synthetic e128 --synthetic-dtype fp8 --device cuda -p 512 -n 32 -r 2 --parallel 32 -o json \
    >"$out/bench_e128.json" 2>"$out/bench_e128.log"
e128_rc=$?
# E128's per-op times: a 512-token context, then 32 decode steps (each op synchronised, so a separate run).
MEMRA_CUDA_PROFILE=1 $memra bench --synthetic e128 --synthetic-dtype fp8 --device cuda -p 0 -n 32 -d 512 -r 1 \
    >/dev/null 2>"$out/op_times_e128.log"
fi
# The E table's contexts (PERFORMANCE.md 8.2): E1 / E3 / E4 decode at 4K (batch 1, 32, 128) and E2 at 64K, each
# sequence's context filled with seeded rows (--fill-depth: its prefill would take minutes at today's prefill
# speed), E5, one 8K prompt prefilled, and E6, MTP-3 after a 4K prompt. MEMRA_GPU_E128_CONTEXT=1 adds them (about
# 7 minutes: four loads); =decode only E1-E4, =prefill only E5 and E6 (two loads each, for calls of 10 minutes).
context=${MEMRA_GPU_E128_CONTEXT:-0}
if [ "$context" = 1 ] || [ "$context" = decode ]; then
$memra bench --synthetic e128 --synthetic-dtype fp8 --device cuda -p 0 -n 32 -d 4096 --fill-depth -r 2 -ub 128 \
    --parallel 32,128 -o json >"$out/bench_e128_4k.json" 2>"$out/bench_e128_4k.log"
$memra bench --synthetic e128 --synthetic-dtype fp8 --device cuda -p 0 -n 32 -d 65536 --fill-depth -r 2 -o json \
    >"$out/bench_e128_64k.json" 2>"$out/bench_e128_64k.log"
fi
if [ "$context" = 1 ] || [ "$context" = prefill ]; then
$memra bench --synthetic e128 --synthetic-dtype fp8 --device cuda -p 8192 -n 0 -r 1 -o json \
    >"$out/bench_e128_8k.json" 2>"$out/bench_e128_8k.log"
# E6: MTP-3 at batch 1 after a 4K prompt (prefilled: the MTP layers need its hidden rows), drafts forced so that 2
# of 3 stand per step (3 tokens per step: the goal's mean accept length of 2.8 and more), beside plain decode.
$memra bench --synthetic e128 --synthetic-dtype fp8 --device cuda -p 0 -n 64 -d 4096 --spec-draft 3 --spec-accept 2 \
    -r 1 -o json >"$out/bench_e128_spec.json" 2>"$out/bench_e128_spec.log"
fi
# Per-op times (each op synchronised; launch + kernel), one prefill of 512 and 16 decode steps on the release preset.
MEMRA_CUDA_PROFILE=1 $memra bench "$release" --device cuda -p 512 -n 0 -r 1 >/dev/null 2>"$out/op_times_prefill.log"
MEMRA_CUDA_PROFILE=1 $memra bench "$release" --device cuda -p 0 -n 16 -r 1 >/dev/null 2>"$out/op_times_decode.log"
t5=$(date +%s)

cpu_rc=0
if [ "${MEMRA_GPU_CPU:-0}" = 1 ]; then
    ctest --test-dir build-gpu -L unit -j8 --output-on-failure >"$out/ctest.log" 2>&1 || cpu_rc=1
    # Thread scaling of the CPU engine on this host's cores (prefill and decode), the default model in both
    # numerics and the small preset in device numerics.
    $memra make-tiny "$tmp/small" --preset small --force >"$out/make_tiny_small.log" 2>&1
    for t in 1 2 4 8 16; do
        for n in device exact; do
            $memra bench --device cpu -p 512 -n 128 -r 3 -t "$t" --numerics "$n" -o json \
                >"$out/cpu_default_${n}_t$t.json" 2>>"$out/numerics_bench.log"
        done
        $memra bench "$tmp/small" --device cpu -p 512 -n 128 -r 3 -t "$t" -o json \
            >"$out/cpu_small_device_t$t.json" 2>>"$out/numerics_bench.log"
    done
    MEMRA_DEVICE=cpu bash scripts/spec_bench.sh $memra "$out/spec" 16 >"$out/spec_bench.md" 2>"$out/spec_bench.err" || cpu_rc=1
    for b in build-gpu/memra_bench_*; do
        [ -x "$b" ] && "$b" --benchmark_min_time=0.2 --benchmark_format=console >>"$out/bench.log" 2>&1
    done
fi

op_rows() {  # profile log -> the most expensive ops (products per shape, with their weight GB/s)
    grep -E '^\| [a-z_]+[ |]' "$1" | grep -v '^| op |' | head -"$3" | awk -F'|' -v w="$2" '{gsub(/^ +| +$/, "", $2); gsub(/ +$/, "", $7); printf "| op %s %s | %s calls, %s ms, %s us each (%s) %s GB/s |\n", w, $2, $3, $4, $5, $6, $7}'
}

bench_rows() {  # file -> "| bench <model> <test> | t/s |" rows
    python3 - "$1" <<'EOF' 2>/dev/null
import json, sys
for t in json.load(open(sys.argv[1])):
    roof = f", {100 * t['vs_ceiling']:.0f} % of the {t['ceiling_ts']:.0f} t/s roofline" if "ceiling_ts" in t else ""
    print(f"| bench {t['model'].split('/')[-1]} {t['test']} | {t['avg_ts']:.1f} t/s (sd {t['stddev_ts']:.1f}){roof} |")
EOF
}

echo
echo "| step | result |"
echo "| --- | --- |"
echo "| build (s) | $((t1 - t0)) |"
echo "| make-tiny release (s, rc) | $((t2 - t1)) $(tail -1 "$out/make_tiny_release.log" | cut -c1-120) |"
echo "| cuda tests (rc $cuda_rc, $((t3 - t2)) s) | $gpu_tests |"
echo "| cli --device tests (rc $cli_rc) | $(grep -E '^\[  (PASSED|FAILED) ' "$out/cli_device_tests.log" 2>/dev/null | tr '\n' ' ') |"
echo "| run default cuda (rc $run_rc) | same text as cpu: $run_same; $(grep -E 'eval time' "$out/run_cuda.log" | tail -1 | cut -c1-100) |"
echo "| run release cuda (rc $run_release_rc) | $(grep -E 'eval time' "$out/run_release.log" | tail -1 | cut -c1-100) |"
echo "| verify default cuda (rc $verify_rc) | $(tail -1 "$out/verify_cuda.log" 2>/dev/null) |"
echo "| verify release cuda (rc $verify_release_rc, $((t4 - t3)) s incl. runs) | $(tail -1 "$out/verify_release.log" 2>/dev/null) |"
echo "| verify release fp8 cuda (rc $verify_fp8_rc) | $(tail -1 "$out/verify_fp8.log" 2>/dev/null) |"
for f in bench_release_8 bench_release_64 bench_release_eager bench_default bench_e128 bench_e128_4k bench_e128_64k \
         bench_e128_8k bench_e128_spec; do
    bench_rows "$out/$f.json"
done
python3 - "$out" <<'EOF' 2>/dev/null
import csv, json, os, sys
out = sys.argv[1]
# E7: GPU idle share of a batch-1 decode step = 1 - (kernel time per step) / (step time with graphs).
rows = [r for r in csv.reader(open(os.path.join(out, "ncu_decode.csv"))) if len(r) > 10]
head = rows[0]
name, value, unit = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
scale = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0}
total = sum(float(r[value].replace(",", "")) * scale.get(r[unit], 1e-9) for r in rows[1:])
steps = sum(1 for r in rows[1:] if "sample_kernel" in r[name])
kernels = len(rows) - 1
tg = [t for t in json.load(open(os.path.join(out, "bench_release_8.json"))) if t["test"] == "tg64"][0]["avg_ts"]
if steps:
    per = total / steps
    print(f"| E7 release decode b1 | {kernels / steps:.0f} kernels, {per * 1e6:.0f} us of kernels per step, step {1e6 / tg:.0f} us: "
          f"GPU idle {100 * (1 - per * tg):.1f} % |")
# K1: memra's products next to PyTorch's on the same shapes.
peers = {}
for line in open(os.path.join(out, "bench_cuda_peers.jsonl")):
    p = json.loads(line)
    if "rows" in p:
        peers[(p["rows"], p["K"], p["tokens"])] = p
    if "attention" in p:
        print(f"| decode attention peer: {p['peer']} x{p['batch']}, {p['positions']} positions, {p['heads']} heads | "
              f"{p['us']:.1f} us, {p['KV_GB/s']:.0f} GB/s of K and V |")
    if p.get("fp8") == "dense":
        print(f"| K2 anchor: {p['peer']} [{p['rows']}, {p['K']}] x{p['tokens']} | {p['us']:.1f} us, "
              f"{p['TFLOP/s']:.0f} TFLOP/s |")
    if p.get("fp8") == "experts":
        print(f"| K3 anchor: {p['peer']}, 8 experts [{p['rows']}, {p['K']}] x{p['tokens']} rows, 8 launches | "
              f"{p['us']:.1f} us, {p['weight_GB/s']:.0f} GB/s |")
    if "prefill_attention" in p:
        print(f"| K7 peer: {p['peer']}, causal, {p['positions']} positions, {p['heads']} heads | "
              f"{p['us'] / 1e3:.2f} ms, {p['TFLOP/s']:.0f} TFLOP/s |")
for b in json.load(open(os.path.join(out, "bench_cuda_products.json")))["benchmarks"]:
    if not b["name"].startswith("bm_bf16_product") or "weight_GB/s" not in b:
        continue
    a = dict(kv.split(":") for kv in b["name"].split("/")[1:5])
    key = (int(a["rows"]), int(a["K"]), int(a["tokens"]))
    p = peers.get(key, {})
    if key[2] >= 512:  # prefill: compute-bound
        print(f"| K1 bf16 [{key[0]}, {key[1]}] x{key[2]} | memra {b['real_time']:.1f} us {b['TFLOP/s']:.0f} TFLOP/s; "
              f"torch {p.get('us', 0):.1f} us {p.get('TFLOP/s', 0):.0f} TFLOP/s |")
        continue
    print(f"| K1 bf16 [{key[0]}, {key[1]}] x{key[2]} | memra {b['real_time']:.1f} us {b['weight_GB/s']:.0f} GB/s "
          f"({100 * b['vs_copy']:.0f} % of copy); torch {p.get('us', 0):.1f} us {p.get('weight_GB/s', 0):.0f} GB/s |")
for b in json.load(open(os.path.join(out, "bench_cuda_products.json")))["benchmarks"]:
    if b["name"].startswith("bm_e4m3_grouped") and "weight_GB/s" in b:
        print(f"| K3-K5 {b['name'].split('/iter')[0]} | {b['real_time']:.1f} us {b['weight_GB/s']:.0f} GB/s "
              f"({100 * b['vs_copy']:.0f} % of copy), {b['TFLOP/s']:.1f} TFLOP/s |")
    if b["name"].startswith("bm_bf16_multi") and "weight_GB/s" in b:
        print(f"| K1 {b['name'].split('/iter')[0]} | {b['real_time']:.1f} us {b['weight_GB/s']:.0f} GB/s "
              f"({100 * b['vs_copy']:.0f} % of copy) |")
    if b["name"].startswith("bm_attention"):
        a = dict(kv.split(":") for kv in b["name"].split("/")[1:8])
        kv = "q8_0/q5_1" if a["q8q5"] == "1" else "bf16"
        if a["prefill"] == "1":
            print(f"| K7 causal prefill attention, {a['positions']} positions, {a['heads']} heads | "
                  f"{b['us'] / 1e3:.2f} ms, {b['TFLOP/s']:.1f} TFLOP/s |")
            continue
        k = "K8" if a["batch"] != "1" else "K9/K10"
        print(f"| {k} decode attention x{a['batch']}, {a['positions']} positions, {a['heads']} heads, window "
              f"{a['window']}, split {a['split']}, KV {kv} | {b['real_time']:.1f} us, {b['KV_GB/s']:.0f} GB/s of K and V |")
    if b["name"].startswith("bm_routing"):
        fused = "fused" if "fused:1" in b["name"] else "the six ops"
        print(f"| K6 routing of one E128 MoE layer x{b['name'].split('tokens:')[1].split('/')[0]} tokens, {fused} | "
              f"{b['us']:.1f} us in {b['launches']:.0f} launches |")
    if b["name"].startswith("bm_add_rms_norm"):
        print(f"| {b['name'].split('/iter')[0]} | {b['real_time']:.1f} us |")
EOF
grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issued Warp" \
    "$out/ncu_bf16_product.txt" 2>/dev/null | awk '{$1=$1; print "| ncu bf16 [11264, 4096] x1 | " $0 " |"}'
python3 - "$out" <<'EOF' 2>/dev/null
import csv, os, re, sys
for t in (1, 64):
    rows = [r for r in csv.reader(open(os.path.join(sys.argv[1], f"ncu_routing_{t}.csv"))) if len(r) > 10]
    head = rows[0]
    name, value = head.index("Kernel Name"), head.index("Metric Value")
    short = lambda k: re.sub(r"^.*?::([a-z_0-9]+)[<(].*$", r"\1", k)
    cells = [f"{short(r[name])} {float(r[value].replace(',', '')) / 1e3:.1f}" for r in rows[1:]]
    print(f"| K6 routing kernels x{t} (us, Nsight Compute) | {', '.join(cells)} |")
EOF
python3 - "$out" <<'EOF' 2>/dev/null
import json, os, sys
memra = {t["test"]: t["avg_ts"] for t in json.load(open(os.path.join(sys.argv[1], "bench_release_8.json")))}
for r in json.load(open(os.path.join(sys.argv[1], "bench_llama.json"))):
    test = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
    mine = memra.get(test, 0)
    print(f"| llama.cpp CUDA, release preset {test} | {r['avg_ts']:.1f} t/s (sd {r['stddev_ts']:.1f}); memra "
          f"{mine:.1f} t/s, {mine / r['avg_ts']:.2f}x |")
EOF
echo "| llama.cpp peer rc | $llama_rc |"
echo "| bench rc | $bench_rc $bench64_rc, e128 $e128_rc ($((t5 - t4)) s) |"
echo "| serve tests (rc $serve_rc) | $(tail -1 "$out/serve_tests.log" 2>/dev/null) |"
echo "| serve release (stop rc $serve_stop_rc) | $(grep -E 'KV cache|stopped' "$out/serve_release.log" 2>/dev/null | tr '\n' ' ' | cut -c1-300) |"
python3 - "$out" <<'EOF' 2>/dev/null
import json, os, sys
for tag, what in [("random", "release, 512 unique in, 128 out, 64 at a time"),
                  ("prefix", "release, 448 shared + 64 unique in, prefix cache on"),
                  ("prefix_off", "release, 448 shared + 64 unique in, prefix cache off"),
                  ("spec3", "default model, 1 at a time, 256 out, --spec-draft 3"),
                  ("spec0", "default model, 1 at a time, 256 out, no drafts")]:
    try:
        r = json.load(open(os.path.join(sys.argv[1], f"load_{tag}.json")))
    except OSError:
        print(f"| serve load {tag} | no result |")
        continue
    print(f"| serve load {tag} ({what}) | {r['successful_requests']} ok, {r['failed_requests']} failed; "
          f"{r['output_throughput']:.0f} out tok/s, {r['total_token_throughput']:.0f} total; TTFT mean "
          f"{r['mean_ttft_ms']:.0f} P99 {r['p99_ttft_ms']:.0f} ms; TPOT mean {r['mean_tpot_ms']:.1f} P99 "
          f"{r['p99_tpot_ms']:.1f} ms |")
EOF
echo "| serve spec metrics | $( (tr '\n' ' ' <"$out/spec_metrics.txt") 2>/dev/null) |"
grep -h -m3 -E "synthetic|generated|GB/s" "$out/bench_e128.log" 2>/dev/null | sed 's/^/| e128 load | /; s/$/ |/'
if [ "${MEMRA_GPU_CPU:-0}" = 1 ]; then
    echo "| ctest unit | $(grep -E 'tests passed|tests failed' "$out/ctest.log" | tail -1) |"
    python3 - "$out" <<'EOF' 2>/dev/null
import glob, json, os, sys
rows = {}
for f in glob.glob(os.path.join(sys.argv[1], "cpu_*_t*.json")):
    name, t = os.path.basename(f)[4:-5].rsplit("_t", 1)
    for r in json.load(open(f)):
        rows.setdefault(name, {}).setdefault(int(t), {})[r["test"]] = r["avg_ts"]
for name in sorted(rows):
    cells = ", ".join(f"t{t}: pp {v.get('pp512', 0):.0f} tg {v.get('tg128', 0):.0f}" for t, v in sorted(rows[name].items()))
    print(f"| cpu {name} t/s | {cells} |")
EOF
fi
if [ ${#multi_tps[@]} -gt 0 ]; then
    echo "| verify over NCCL (tp $tps) | $(tail -2 "$out/verify_nccl.log" | tr '\n' ' ') |"
    for f in "$out"/bench_tp*_b*.json; do bench_rows "$f" | sed "s/| bench /| $(basename "$f" .json) /"; done
fi
if [ "$tests" = 1 ]; then
    grep -h "logits differ" "$out/cuda_tests.log" | sed 's/^/| engine cpu-vs-gpu | /; s/$/ |/'
    grep -E '^\| [0-9]' "$out/collectives.md" | awk -F'|' '{printf "| collectives %s ranks, %s per rank | memra all_gather %s us (NCCL %s us); NCCL all_reduce of %s %s us; gather/reduce %s |\n", $2, $3, $4, $5, $6, $7, $8}'
    echo "| nccl | $(grep -cE '^\[       OK \] Nccl' "$out/cuda_tests.log") passed, $(grep -cE '^\[  FAILED  \] Nccl' \
        "$out/cuda_tests.log") failed, $(grep -cE '^\[  SKIPPED \] Nccl.* ms\)' "$out/cuda_tests.log") skipped ($(nvidia-smi -L | wc -l) GPU) |"
    grep -h "measured \] nccl" "$out/cuda_tests.log" | sed 's/^\[ measured \] /| nccl cost | /; s/$/ |/'
fi
op_rows "$out/op_times_prefill.log" prefill 5
op_rows "$out/op_times_decode.log" decode 12
op_rows "$out/op_times_e128.log" e128 12 2>/dev/null
grep -h -m2 -E "STEP_WORK" "$out/verify_release.log" 2>/dev/null | sed 's/^/| verify release | /; s/$/ |/'
# The device tool brings back a few files: the table, the JSON reports and one archive of every log.
(cd "$out" && tar czf logs.tgz --exclude=logs.tgz --exclude='bench_*.json' -- * 2>/dev/null &&
    find . -maxdepth 1 -type f ! -name logs.tgz ! -name 'bench_*.json' -delete)
passed() { [ "$1" = 0 ] || [ "$1" = skipped ]; }
passed "$cuda_rc" && passed "$cli_rc" && [ $run_rc -eq 0 ] && passed "$verify_rc" &&
    passed "$verify_release_rc" && passed "$verify_fp8_rc" && [ $cpu_rc -eq 0 ] && passed "$serve_rc" && passed "$serve_stop_rc"
