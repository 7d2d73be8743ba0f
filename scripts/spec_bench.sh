#!/usr/bin/env bash
# Speculative decoding side by side (issue 11's measurements), on the CPU engine:
#   1. the default model on real text: `memra run` on a Python-docs prompt, greedy, without drafts and with
#      K = 1, 2, 3 drafts per step, five interleaved rounds (the same text each time; the median eval tokens/s
#      and the acceptance per draft position);
#   2. the default model, `memra bench` tgN without and with drafts (the MTP layers' own);
#   3. a random tiny checkpoint with three MTP layers, drafts forced to 0 .. K accepted (bench --spec-accept),
#      K = 1 and 3.
# Prints one Markdown table. Usage: scripts/spec_bench.sh [MEMRA] [OUT_DIR] [THREADS]
set -euo pipefail
memra=${1:-build/memra}
out=${2:-spec-bench-out}
threads=${3:-$(nproc)}
mkdir -p "$out"
rm -f "$out"/run_k*.rates
prompt="A list is a mutable sequence, typically used to store collections of homogeneous items. Lists may be \
constructed in several ways: using a pair of square brackets to denote the empty list, using square brackets, \
separating items with commas, using a list comprehension, or using the type constructor."

echo "| model | test | K | t/s | accept/pos | tok/step | same text |"
echo "| --- | --- | -: | -: | --- | -: | --- |"
# Five rounds, K = 0..3 interleaved in each: the median of the five eval rates per K.
for round in 1 2 3 4 5; do
    for k in 0 1 2 3; do
        "$memra" run -p "$prompt" -n 256 --temp 0 --ignore-eos -t "$threads" --spec-draft $k \
            >"$out/run_k$k.txt" 2>"$out/run_k${k}_$round.err"
        grep "       eval time" "$out/run_k${k}_$round.err" |
            sed -E 's/.*, +([0-9.]+) tokens per second.*/\1/' >>"$out/run_k$k.rates"
    done
done
for k in 0 1 2 3; do
    ts=$(sort -n "$out/run_k$k.rates" | sed -n 3p)
    all=$(tr '\n' ' ' <"$out/run_k$k.rates")
    acc=$(grep "speculation" "$out/run_k${k}_1.err" | sed -E 's/.*acceptance (.*) per draft position, ([0-9.]+) tokens per step.*/\1|\2/' || true)
    same=$(cmp -s "$out/run_k0.txt" "$out/run_k$k.txt" && echo yes || echo NO)
    echo "| default | run -n 256 (Python docs prompt), median of 5 ($all) | $k | $ts | ${acc%%|*} | ${acc##*|} | $same |"
done
for k in 1 2 3; do
    "$memra" bench -p 0 -n 128 -r 5 -t "$threads" --spec-draft $k >"$out/bench_k$k.md" 2>"$out/bench_k$k.err"
    grep -E '\| +tg' "$out/bench_k$k.md" | awk -F'|' -v k=$k '{for (i = 1; i <= NF; i++) gsub(/^ +| +$/, "", $i);
        printf "| default | bench %s | %s | %s | %s | %s | yes |\n", $8, ($8 ~ /spec/ ? k : 0), $9, $11, $12}'
done
"$memra" make-tiny "$out/tiny3" --mtp-layers 3 --force >/dev/null
for ka in 1:0 1:1 3:0 3:1 3:2 3:3; do
    k=${ka%%:*}
    a=${ka##*:}
    "$memra" bench "$out/tiny3" -p 0 -n 128 -r 5 -t "$threads" --spec-draft $k --spec-accept $a \
        >"$out/tiny_k${k}_a$a.md" 2>"$out/tiny_k${k}_a$a.err"
    grep -E '\| +tg' "$out/tiny_k${k}_a$a.md" | awk -F'|' -v k=$k '{for (i = 1; i <= NF; i++) gsub(/^ +| +$/, "", $i);
        printf "| tiny (random) | bench %s | %s | %s | %s | %s | yes |\n", $8, ($8 ~ /spec/ ? k : 0), $9, $11, $12}'
done
rm -rf "$out/tiny3"
