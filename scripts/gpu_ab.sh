#!/usr/bin/env bash
# A/B on the GPU machine in one device call: the working tree ("tree") beside other commits, each built from its
# own sources, the same benchmarks run on each in turn (so every row of the table is one GPU, one call), the
# working tree's GPU tests first. Speed claims compare trees only this way (README: benchmarks side by side).
#   here:   bash scripts/gpu_ab.sh pack main [REF ...]   writes .deps/ab/<ref>.tar.gz (git archive of each REF,
#           the embedded model left out) and prints the carry list
#   there:  bash scripts/gpu_ab.sh run                   (carry: [".deps/root", ".deps/ab"])
# What `run` does (environment):
#   MEMRA_AB_TESTS   gtest filter of memra_cuda_tests run on the working tree first ('' skips; default
#                    'CudaMatmul*:CudaMoe*:CudaRouter*:CudaEngine*')
#   MEMRA_AB_BENCH   --benchmark_filter of memra_bench_cuda_products for every tree (default: the decode products)
#   MEMRA_AB_RUNS    rounds over the trees (default 2); the table keeps each tree's best
#   MEMRA_AB_MEMRA   arguments of `memra bench` run once per tree after the rounds, e.g. '--synthetic e128
#                    --synthetic-dtype fp8 --synthetic-layers 20 -p 0 -n 32 -d 4096 --fill-depth -r 2' (default none)
# The table (microseconds, and each tree's ratio to the first packed REF) is printed last and kept as table.md in
# $OUT (or ./gpu-out), beside gpu.txt; every log and benchmark file goes into one archive there, ab-logs.tgz (the
# device tool returns only a few files of a call).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ab=.deps/ab

# A tree's binary: the working tree's in build-gpu, a packed tree's in its b.
bin() { if [ "$1" = "$PWD" ]; then echo "$1/build-gpu/$2"; else echo "$1/b/$2"; fi; }

pack() {
    [ $# -ge 1 ] || { echo "gpu_ab.sh pack: give at least one git ref (the baseline first)" >&2; exit 2; }
    mkdir -p "$ab"
    rm -f "$ab"/*.tar.gz "$ab/order"
    for ref in "$@"; do
        git rev-parse --verify --quiet "$ref^{commit}" >/dev/null || { echo "gpu_ab.sh pack: '$ref' is not a commit" >&2; exit 2; }
        name=$(printf '%s' "$ref" | tr -c 'A-Za-z0-9._-' '_')
        [ "$name" != tree ] || name=ref_tree  # "tree" is the working tree's column
        if grep -qx "$name" "$ab/order" 2>/dev/null; then
            echo "gpu_ab.sh pack: '$ref' is named $name like a ref before it; give each ref once" >&2
            exit 2
        fi
        git archive --format=tar.gz -o "$ab/$name.tar.gz" "$ref" -- . ':!models/default/model.safetensors' || exit 1
        echo "$name" >>"$ab/order"
        echo "packed $ref ($(git rev-parse --short "$ref")) as $ab/$name.tar.gz"
    done
    echo 'carry: [".deps/root", ".deps/ab"]'
}

run() {
    [ -s "$ab/order" ] || { echo "gpu_ab.sh run: nothing packed in $ab (run 'gpu_ab.sh pack REF' here first)" >&2; exit 2; }
    local runs=${MEMRA_AB_RUNS:-2}
    [[ $runs =~ ^[1-9][0-9]?$ ]] || { echo "gpu_ab.sh run: MEMRA_AB_RUNS is '$runs', expected rounds from 1 to 99" >&2; exit 2; }
    local out=${OUT:-gpu-out} tmp=${TMPDIR:-/tmp}/memra-ab
    mkdir -p "$out" "$tmp"
    out=$(cd "$out" && pwd)
    local deps=$PWD/.deps/root
    export CMAKE_PREFIX_PATH=$deps/usr
    export LD_LIBRARY_PATH=$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
    local t0 names=() dirs=() jobs
    t0=$(date +%s)
    mapfile -t names <"$ab/order"
    jobs=$(( $(nproc) / (${#names[@]} + 1) ))
    [ "$jobs" -ge 1 ] || jobs=1
    # Every tree builds at once, cores split evenly; the packed ones only what the rounds run.
    for name in "${names[@]}"; do
        rm -rf "${tmp:?}/$name" && mkdir -p "$tmp/$name" && tar xzf "$ab/$name.tar.gz" -C "$tmp/$name" || exit 1
        dirs+=("$tmp/$name")
        (cd "$tmp/$name" && cmake -S . -B b -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMRA_PYTHON=/bin/false \
            >"$out/$name.configure.log" 2>&1 && cmake --build b -j"$jobs" --target memra memra_bench_cuda_products \
            >"$out/$name.build.log" 2>&1 || echo "$name: build failed (see $out/$name.build.log)") &
    done
    if ! cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMRA_WERROR=ON -DMEMRA_PYTHON=/bin/false \
        >"$out/tree.configure.log" 2>&1; then
        echo "tree: configure failed (see $out/tree.configure.log)"
    elif ! cmake --build build-gpu -j"$jobs" --target memra memra_cuda_tests memra_bench_cuda_products default_model \
        >"$out/tree.build.log" 2>&1; then
        grep -E "error|FAILED" "$out/tree.build.log" | head -20
        echo "tree: build failed"
    fi
    wait
    names+=(tree)
    dirs+=("$PWD")
    echo "built in $(( $(date +%s) - t0 )) s"

    local filter=${MEMRA_AB_TESTS-'CudaMatmul*:CudaMoe*:CudaRouter*:CudaEngine*'}
    if [ -n "$filter" ]; then
        build-gpu/memra_cuda_tests --gtest_filter="$filter" >"$out/tree.tests.log" 2>&1
        echo "tree tests ($filter): rc $?"
        grep -E "^\[  (PASSED|FAILED)|FAILED  \]" "$out/tree.tests.log" | head -12
    fi
    local bench=${MEMRA_AB_BENCH:-'bm_bf16_product/.*/tokens:(1|8)/|bm_bf16_multi|bm_e4m3_grouped/.*/pairs:(8|256)/|bm_routing'}
    local i j
    for ((i = 1; i <= runs; ++i)); do
        for j in "${!names[@]}"; do
            local b
            b=$(bin "${dirs[$j]}" memra_bench_cuda_products)
            [ -x "$b" ] || continue
            "$b" --benchmark_filter="$bench" --benchmark_format=json >"$out/${names[$j]}.bench$i.json" \
                2>"$out/${names[$j]}.bench$i.log"
        done
    done
    if [ -n "${MEMRA_AB_MEMRA:-}" ]; then
        for j in "${!names[@]}"; do
            local m
            m=$(bin "${dirs[$j]}" memra)
            [ -x "$m" ] || continue
            # shellcheck disable=SC2086  # the arguments are meant to split
            "$m" bench --device cuda $MEMRA_AB_MEMRA -o md >"$out/${names[$j]}.memra_bench.md" 2>"$out/${names[$j]}.memra_bench.log"
            echo "== memra bench, ${names[$j]} (rc $?)"
            cat "$out/${names[$j]}.memra_bench.md"
        done
    fi
    echo "total $(( $(date +%s) - t0 )) s"
    python3 scripts/gpu_ab_table.py "$out" "${names[@]}" | tee "$out/table.md"
    local logs=() f
    for f in "$out"/*; do
        case ${f##*/} in gpu.txt | table.md | ab-logs.tgz) ;; *) [ -f "$f" ] && logs+=("${f##*/}") ;; esac
    done
    if [ ${#logs[@]} -gt 0 ]; then
        tar czf "$out/ab-logs.tgz" -C "$out" "${logs[@]}" && (cd "$out" && rm -f -- "${logs[@]}")
    fi
}

case "${1:-}" in
    pack) shift; pack "$@" ;;
    run) run ;;
    *) echo "usage: bash scripts/gpu_ab.sh pack REF [REF ...] | run" >&2; exit 2 ;;
esac
