"""The table of scripts/gpu_ab.sh: each benchmark's best time per tree (microseconds) over the rounds' JSON files
(OUT/<tree>.bench<i>.json, Google Benchmark's format) and each tree's ratio to the first (the baseline).

usage: python3 scripts/gpu_ab_table.py OUT TREE [TREE ...]
"""

import glob
import json
import os
import sys

_TO_US = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


def best_times(out: str, tree: str) -> dict[str, float]:
    """Benchmark name -> the least time any round of the tree measured (runs that failed or were skipped leave
    nothing)."""
    best: dict[str, float] = {}
    for path in sorted(glob.glob(os.path.join(out, f"{tree}.bench*.json"))):
        try:
            with open(path, encoding="utf-8") as f:
                runs = json.load(f).get("benchmarks", [])
        except (OSError, ValueError) as e:
            print(f"gpu_ab_table: {path}: {e}", file=sys.stderr)
            continue
        for b in runs:
            if b.get("error_occurred") or b.get("run_type") == "aggregate" or "real_time" not in b:
                continue
            us = float(b["real_time"]) * _TO_US.get(b.get("time_unit", "ns"), 1e-3)
            name = b["name"].removesuffix("/iterations:1/manual_time").removesuffix("/manual_time")
            best[name] = min(us, best.get(name, us))
    return best


def table(out: str, trees: list[str]) -> str:
    times = {t: best_times(out, t) for t in trees}
    names: list[str] = []
    for t in trees:
        names += [n for n in times[t] if n not in names]
    if not names:
        return "gpu_ab_table: no benchmark times (no GPU, or every build failed)\n"
    base = trees[0]
    head = "| benchmark | " + " | ".join(f"{t} us" for t in trees) + " | " + " | ".join(
        f"{t} / {base}" for t in trees[1:]) + " |"
    rows = [head, "| --- " * (len(trees) * 2) + "|"]
    for n in names:
        cells = [f"{times[t][n]:.1f}" if n in times[t] else "-" for t in trees]
        ratios = [f"{times[t][n] / times[base][n]:.3f}" if n in times[t] and n in times[base] else "-"
                  for t in trees[1:]]
        rows.append(f"| {n} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(rows) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    sys.stdout.write(table(argv[1], argv[2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
