# bench/vs_llamacpp.py end to end on a tiny checkpoint at tiny sizes: memra bench and llama.cpp (GGUF from
# llama.cpp's own converter) on the same tokens, threads and KV cache, printed side by side with the ratio;
# once with a bf16 cache and once with a quantized one (which turns llama.cpp's flash attention on).
# Needs torch (the converter) and llama-cpp-python (requirements-oracle.txt); skips when they are missing.
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (requirements-oracle.txt)")
pytest.importorskip("torch", reason="torch not installed (requirements-oracle.txt): llama.cpp's converter needs it")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "vs_llamacpp.py"
ROW = re.compile(r"^\| (pp16|tg4) \| ([0-9.]+) ± ([0-9.]+) \| ([0-9.]+) ± ([0-9.]+) \| ([0-9.]+) \|$")


def memra_exe():
    exe = os.environ.get("MEMRA_EXE", "")
    if not exe or not Path(exe).is_file():
        build = Path(os.environ.get("MEMRA_BUILD_DIR", REPO / "build"))
        exe = str(build / "memra")
    assert Path(exe).is_file(), f"memra CLI not found at {exe}: set MEMRA_EXE"
    return exe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "tiny"
    r = subprocess.run([memra_exe(), "make-tiny", str(out), "--seed", "3"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def run_script(tiny, cache_dir, *extra):
    env = dict(os.environ, MEMRA_EXE=memra_exe())
    r = subprocess.run([sys.executable, str(SCRIPT), str(tiny), "-p", "16", "-n", "4", "-r", "1", "-t", "1",
                        "--cache-dir", str(cache_dir), *extra], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout, r.stderr


def check_table(out):
    lines = out.splitlines()
    assert "| test | memra t/s | llama.cpp t/s | memra/llama.cpp |" in lines, out
    rows = {}
    for line in lines:
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = [float(m.group(i)) for i in range(2, 7)]
    assert sorted(rows) == ["pp16", "tg4"], out
    for test, (memra_ts, memra_sd, llama_ts, llama_sd, ratio) in rows.items():
        assert memra_ts > 0 and llama_ts > 0, (test, out)
        assert memra_sd == 0 and llama_sd == 0, (test, "one run has no spread", out)
        assert ratio == pytest.approx(memra_ts / llama_ts, abs=0.006), (test, out)
    assert re.search(r"^memra build: .*; build type \S+; .*threads 1$", out, re.M), out
    assert re.search(r"^llama.cpp build: llama-cpp-python \S+; threads 1; .*CPU", out, re.M), out
    assert re.search(r"^load average \(1/5/15 min\) before: [0-9.]+ [0-9.]+ [0-9.]+, after: ", out, re.M), out


def test_bf16_cache(tiny, cache_dir):
    out, _ = run_script(tiny, cache_dir)
    check_table(out)
    assert "KV bf16/bf16; llama.cpp flash attention off" in out, out
    assert "prompt: 16 ids from memra bench --print-tokens -s 0" in out, out


def test_quantized_cache_turns_flash_attention_on(tiny, cache_dir):
    converted = any(cache_dir.glob("*.gguf"))
    out, err = run_script(tiny, cache_dir, "-ctk", "q8_0", "-ctv", "q5_1", "-s", "9")
    check_table(out)
    assert "KV q8_0/q5_1; llama.cpp flash attention on" in out, out
    assert "prompt: 16 ids from memra bench --print-tokens -s 9" in out, out
    assert len(list(cache_dir.glob("*.gguf"))) == 1
    if converted:  # the first test's GGUF is reused
        assert "converting" not in err, err
