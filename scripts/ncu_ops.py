"""Per-kernel times of a step from Nsight Compute, each kernel timed alone (its own replay): what MEMRA_CUDA_PROFILE
cannot give, since it times every op on the host through a synchronisation (about 10 us of wake-up on each, which
swamps the small ops). Reads the CSV `ncu --csv --log-file F --metrics gpu__time_duration.sum,dram__bytes.sum` writes
(the default details page: a row per kernel and metric; or --page raw: a row per kernel, units in the second row)
and prints a Markdown table per kernel name (the function with its template arguments): launches, total and mean
microseconds, share of the total, and the DRAM bytes over the time (GB/s); with --per N, the microseconds per unit
of N (for example the tokens the profiled steps decoded).

usage: python3 scripts/ncu_ops.py NCU_CSV [--per N]
  on the GPU machine, e.g.: ncu --graph-profiling node --csv --log-file ncu.csv \
      --metrics gpu__time_duration.sum,dram__bytes.sum build-gpu/memra bench --device cuda ...
"""

import argparse
import csv
import sys

_TIME = "gpu__time_duration.sum"
_BYTES = "dram__bytes.sum"
_TIME_UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6,
               "s": 1e6}
_BYTE_UNITS = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "KB": 1e3, "MB": 1e6,
               "GB": 1e9}


def kernel_name(full: str) -> str:
    """The kernel's function with its template arguments: no return type, namespaces or parameter list."""
    name = full.strip().replace("(anonymous namespace)::", "")
    if name.startswith("void "):
        name = name[5:]
    depth = 0  # the parameter list is the first '(' outside template brackets
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            name = name[:i]
            break
    # Namespaces: the last '::' outside template brackets.
    depth, cut = 0, 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == ":" and depth == 0 and name[i + 1:i + 2] == ":":
            cut = i + 2
    return name[cut:]


def scaled(value: str, unit: str, units: dict[str, float], metric: str) -> float:
    """value (ncu prints thousands separators) in unit, converted by units; a clear error for an unknown unit."""
    if unit not in units:
        raise ValueError(f"{metric} in unit '{unit}', expected one of {', '.join(units)}")
    return float(value.replace(",", "")) * units[unit]


def read_kernels(path: str) -> list[tuple[str, float, float | None]]:
    """(name, microseconds, DRAM bytes or None) per profiled kernel, in profile order."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages start with ==PROF== or the like
    rows = list(csv.reader(lines))
    if not rows:
        raise ValueError(f"{path}: no CSV rows (was ncu run with --csv?)")
    head = rows[0]
    col = {h: i for i, h in enumerate(head)}
    if "Metric Name" in head:  # details page
        for need in ("ID", "Kernel Name", "Metric Unit", "Metric Value"):
            if need not in col:
                raise ValueError(f"{path}: a details page without the column '{need}'")
        kernels: dict[str, list] = {}
        order: list[str] = []
        for r in rows[1:]:
            if len(r) < len(head):
                continue
            kid = r[col["ID"]]
            if kid not in kernels:
                kernels[kid] = [kernel_name(r[col["Kernel Name"]]), None, None]
                order.append(kid)
            metric, unit, value = r[col["Metric Name"]], r[col["Metric Unit"]], r[col["Metric Value"]]
            if metric == _TIME:
                kernels[kid][1] = scaled(value, unit, _TIME_UNITS, metric)
            elif metric == _BYTES:
                kernels[kid][2] = scaled(value, unit, _BYTE_UNITS, metric)
        out = [tuple(kernels[k]) for k in order]
    else:  # raw page: metrics as columns, their units in the second row
        if _TIME not in col or "Kernel Name" not in col or len(rows) < 2:
            raise ValueError(f"{path}: neither a details nor a raw page with {_TIME}")
        units = rows[1]
        out = []
        for r in rows[2:]:
            if len(r) < len(head):
                continue
            us = scaled(r[col[_TIME]], units[col[_TIME]], _TIME_UNITS, _TIME)
            b = scaled(r[col[_BYTES]], units[col[_BYTES]], _BYTE_UNITS, _BYTES) if _BYTES in col else None
            out.append((kernel_name(r[col["Kernel Name"]]), us, b))
    missing = [k for k in out if k[1] is None]
    if missing:
        raise ValueError(f"{path}: {len(missing)} kernels without {_TIME}")
    return out


def table(kernels: list[tuple[str, float, float | None]], per: int | None) -> str:
    agg: dict[str, list] = {}
    for name, us, b in kernels:
        a = agg.setdefault(name, [0, 0.0, 0.0, True])
        a[0] += 1
        a[1] += us
        if b is None:
            a[3] = False
        else:
            a[2] += b
    total = sum(a[1] for a in agg.values())
    head = "| kernel | launches | total us | mean us | share | DRAM GB/s |" + (f" us per {per} |" if per else "")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for name, (n, us, b, has_b) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        row = (f"| `{name}` | {n} | {us:.1f} | {us / n:.2f} | {100 * us / total:.1f} % | "
               + (f"{b / (us * 1e-6) * 1e-9:.0f} |" if has_b and us > 0 else " |"))
        if per:
            row += f" {us / per:.1f} |"
        lines.append(row)
    lines.append(f"| total | {len(kernels)} | {total:.1f} | | 100 % | |" + (f" {total / per:.1f} |" if per else ""))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--per", type=int, default=None, help="report microseconds per this many units as well")
    args = ap.parse_args(argv)
    if args.per is not None and args.per < 1:
        print(f"ncu_ops: --per is {args.per}, expected a count >= 1", file=sys.stderr)
        return 2
    try:
        kernels = read_kernels(args.csv)
    except (OSError, ValueError) as e:
        print(f"ncu_ops: {e}", file=sys.stderr)
        return 1
    print(table(kernels, args.per))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
