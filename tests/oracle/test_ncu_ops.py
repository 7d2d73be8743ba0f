# scripts/ncu_ops.py, the per-kernel table of an Nsight Compute CSV: both of ncu's CSV pages, units converted to
# microseconds and bytes, kernels grouped by function and template arguments (namespaces, return type and
# parameters dropped), the per-unit column, and clear refusals.
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "ncu_ops.py"

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
        '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
STREAM = "void memra::cuda::(anonymous namespace)::stream_bf16_kernel<(memra::cuda::Op)0, true>(memra::cuda::ProductParams)"
ROUTE = "void memra::cuda::(anonymous namespace)::moe_route_kernel<(memra::DType)0>(memra::cuda::RouteParams)"


def details_row(kid, kernel, metric, unit, value):
    return (f'"{kid}","1","memra","h","{kernel}","1","13","(256, 1, 1)","(264, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


def run(path, *args):
    return subprocess.run([sys.executable, str(SCRIPT), str(path), *args], capture_output=True, text=True, timeout=60)


def rows(stdout):
    out = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells and cells[0] not in ("kernel", "---"):
            out[cells[0]] = cells[1:]
    return out


def test_details_page_groups_kernels_and_converts_units(tmp_path):
    csv = tmp_path / "ncu.csv"
    csv.write_text("\n".join([
        "==PROF== Connected to process 1",
        HEAD,
        details_row(0, STREAM, "dram__bytes.sum", "Mbyte", "33.55"),
        details_row(0, STREAM, "gpu__time_duration.sum", "usecond", "14.00"),
        details_row(1, ROUTE, "dram__bytes.sum", "Kbyte", "2,100.00"),
        details_row(1, ROUTE, "gpu__time_duration.sum", "nsecond", "21,000"),
        details_row(2, STREAM, "dram__bytes.sum", "Gbyte", "0.06710"),
        details_row(2, STREAM, "gpu__time_duration.sum", "msecond", "0.026"),
    ]) + "\n")
    r = run(csv, "--per", "2")
    assert r.returncode == 0, r.stderr
    t = rows(r.stdout)
    stream = t["`stream_bf16_kernel<(memra::cuda::Op)0, true>`"]
    assert stream[:3] == ["2", "40.0", "20.00"]  # 14 us + 26 us
    assert stream[3] == "65.6 %"  # 40 of 61 us
    assert stream[4] == "2516"  # (33.55 + 67.10) MB in 40 us
    assert stream[5] == "20.0"  # per unit of 2
    route = t["`moe_route_kernel<(memra::DType)0>`"]
    assert route[:3] == ["1", "21.0", "21.00"]
    assert route[4] == "100"  # 2.1 MB in 21 us
    assert t["total"][:2] == ["3", "61.0"]


def test_raw_page_and_a_kernel_without_bytes(tmp_path):
    csv = tmp_path / "raw.csv"
    csv.write_text("\n".join([
        '"ID","Kernel Name","dram__bytes.sum","gpu__time_duration.sum"',
        '"","","byte","usecond"',
        f'"0","{ROUTE}","2100000","21.5"',
        f'"1","{ROUTE}","2100000","20.5"',
    ]) + "\n")
    r = run(csv)
    assert r.returncode == 0, r.stderr
    route = rows(r.stdout)["`moe_route_kernel<(memra::DType)0>`"]
    assert route[:4] == ["2", "42.0", "21.00", "100.0 %"]
    assert route[4] == "100"
    only_time = tmp_path / "time.csv"
    only_time.write_text(HEAD + "\n" + details_row(0, ROUTE, "gpu__time_duration.sum", "usecond", "3") + "\n")
    r = run(only_time)
    assert r.returncode == 0, r.stderr
    assert rows(r.stdout)["`moe_route_kernel<(memra::DType)0>`"][4] == ""  # no bytes, no rate


def test_refusals_name_the_problem(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("==PROF== nothing profiled\n")
    r = run(empty)
    assert r.returncode == 1 and "no CSV rows" in r.stderr
    unit = tmp_path / "unit.csv"
    unit.write_text(HEAD + "\n" + details_row(0, ROUTE, "gpu__time_duration.sum", "fortnight", "3") + "\n")
    r = run(unit)
    assert r.returncode == 1 and "gpu__time_duration.sum in unit 'fortnight'" in r.stderr
    no_time = tmp_path / "no_time.csv"
    no_time.write_text(HEAD + "\n" + details_row(0, ROUTE, "dram__bytes.sum", "byte", "3") + "\n")
    r = run(no_time)
    assert r.returncode == 1 and "1 kernels without gpu__time_duration.sum" in r.stderr
    r = run(no_time, "--per", "0")
    assert r.returncode == 2 and "--per is 0" in r.stderr
    r = run(tmp_path / "missing.csv")
    assert r.returncode == 1 and "missing.csv" in r.stderr
