# scripts/gpu_ab_table.py, the table of scripts/gpu_ab.sh: each tree's best time over the rounds' Google Benchmark
# JSON files, in microseconds whatever unit a run reported, runs that failed left out, and each tree's ratio to the
# first (the baseline).
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_ab_table.py"


def write_round(path, runs):
    rows = []
    for name, time, unit, *error in runs:
        row = {"name": f"{name}/iterations:1/manual_time", "run_type": "iteration", "real_time": time,
               "time_unit": unit}
        if error:
            row["error_occurred"] = True
        rows.append(row)
    path.write_text(json.dumps({"context": {}, "benchmarks": rows}))


def run_table(out, *trees):
    return subprocess.run([sys.executable, str(SCRIPT), str(out), *trees], capture_output=True, text=True,
                          timeout=60)


def table_rows(stdout):
    rows = {}
    for line in stdout.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_best_of_rounds_in_microseconds_with_ratios(tmp_path):
    write_round(tmp_path / "main.bench1.json", [("bm_a/x:1", 10.0, "us"), ("bm_b", 2000.0, "ns"),
                                                ("bm_skipped", 1.0, "us", True)])
    write_round(tmp_path / "main.bench2.json", [("bm_a/x:1", 9.5, "us"), ("bm_b", 2100.0, "ns")])
    write_round(tmp_path / "tree.bench1.json", [("bm_a/x:1", 7.6, "us"), ("bm_b", 0.0025, "ms"),
                                                ("bm_only_tree", 3.0, "us")])
    (tmp_path / "tree.bench2.json").write_text("{cut short")  # a round killed mid-write: reported, not fatal
    r = run_table(tmp_path, "main", "tree")
    assert r.returncode == 0, r.stderr
    assert "tree.bench2.json" in r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "| benchmark | main us | tree us | tree / main |"
    rows = table_rows(r.stdout)
    assert rows["bm_a/x:1"] == ["9.5", "7.6", "0.800"]
    assert rows["bm_b"] == ["2.0", "2.5", "1.250"]
    assert rows["bm_only_tree"] == ["-", "3.0", "-"]
    assert "bm_skipped" not in rows


def test_nothing_measured_says_so(tmp_path):
    write_round(tmp_path / "main.bench1.json", [("bm_a", 1.0, "us", True)])
    r = run_table(tmp_path, "main", "tree")
    assert r.returncode == 0, r.stderr
    assert "no benchmark times" in r.stdout


def test_usage_without_trees(tmp_path):
    r = run_table(tmp_path)
    assert r.returncode == 2
    assert "usage" in r.stderr
