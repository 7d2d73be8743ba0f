# memra's forward (memra_forward_tool, CPU backend, f32 activations) against the numpy forward written from
# STEP35.md (np_step35.py, float64, with partial NeoX RoPE, llama3 scaling, sliding windows, gates, router,
# clamps) on the tiny BF16 and FP8 checkpoints: every prompt position, then greedy decode steps through the
# KV cache. Reports the max relative error (max |diff| / max |logit|).
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from np_step35 import Step35Numpy, float32_weights, load_checkpoint
from oracle_util import build_tool

SEED = 7
N_PROMPT = 40  # longer than the tiny preset's 16-token sliding window
N_DECODE = 6
TOL = 1e-4  # f32 activations vs a float64 reference


def make_tiny(out_dir, dtype):
    exe = os.environ.get("MEMRA_EXE") or str(Path(os.environ.get("MEMRA_BUILD_DIR", "build")) / "memra")
    assert Path(exe).is_file(), f"memra CLI not found at {exe}: set MEMRA_EXE"
    r = subprocess.run([exe, "make-tiny", str(out_dir), "--preset", "tiny", "--dtype", dtype, "--seed", str(SEED)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return out_dir


def run_tool(model_dir, ids, tmp_path, *flags):
    ids_file, out_file = tmp_path / "ids.bin", tmp_path / "logits.bin"
    ids_file.write_bytes(np.asarray(ids, dtype="<i4").tobytes())
    proc = subprocess.run([build_tool("memra_forward_tool"), str(model_dir), str(ids_file), str(out_file), *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return np.frombuffer(out_file.read_bytes(), dtype="<f4"), proc.stdout


def rel_err(a, ref):
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_forward")
    return {d: make_tiny(root / d, d) for d in ("bf16", "fp8")}


@pytest.fixture(scope="module")
def prompt():
    return [int(t) for t in np.random.default_rng(SEED).integers(0, 1024, N_PROMPT)]


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_prefill_matches_numpy(variant, ckpt, prompt, tmp_path):
    cfg = json.loads((ckpt[variant] / "config.json").read_text())
    vocab = cfg["vocab_size"]
    ours, _ = run_tool(ckpt[variant], prompt, tmp_path, "--all-positions", "--threads", "2")
    ours = ours.reshape(N_PROMPT, vocab)
    ref = Step35Numpy(cfg, float32_weights(load_checkpoint(ckpt[variant])), np.float64).logits(prompt)
    err = rel_err(ours, ref)
    print(f"{variant}: prefill max relative error {err:.3e} over {N_PROMPT} positions")
    assert err < TOL
    assert np.array_equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_decode_matches_numpy(variant, ckpt, prompt, tmp_path):
    cfg = json.loads((ckpt[variant] / "config.json").read_text())
    vocab = cfg["vocab_size"]
    ours, out = run_tool(ckpt[variant], prompt, tmp_path, "--decode", str(N_DECODE))
    ours = ours.reshape(1 + N_DECODE, vocab)
    generated = [int(t) for t in ours.argmax(-1)[:N_DECODE]]
    assert f"decoded [{', '.join(map(str, generated))}]" in out
    ref = Step35Numpy(cfg, float32_weights(load_checkpoint(ckpt[variant])), np.float64).logits(prompt + generated)
    err = rel_err(ours, ref[N_PROMPT - 1:])
    print(f"{variant}: decode max relative error {err:.3e} over {N_DECODE} steps")
    assert err < TOL


def test_tool_is_thread_invariant_and_comparison_can_fail(ckpt, prompt, tmp_path):
    a, _ = run_tool(ckpt["bf16"], prompt, tmp_path, "--all-positions", "--threads", "1")
    b, _ = run_tool(ckpt["bf16"], prompt, tmp_path, "--all-positions", "--threads", "3")
    assert np.array_equal(a.view("<u4"), b.view("<u4"))
    # The numpy reference of another prompt is far outside the tolerance.
    cfg = json.loads((ckpt["bf16"] / "config.json").read_text())
    other = prompt[:]
    other[3] = (other[3] + 1) % cfg["vocab_size"]
    ref = Step35Numpy(cfg, float32_weights(load_checkpoint(ckpt["bf16"])), np.float64).logits(other)
    assert rel_err(a.reshape(N_PROMPT, -1), ref) > TOL


def test_tool_refuses_bad_input(ckpt, tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x01\x02\x03")
    proc = subprocess.run([build_tool("memra_forward_tool"), str(ckpt["bf16"]), str(bad), str(tmp_path / "o.bin")],
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "expected a non-empty multiple of 4 bytes (int32 ids), found 3 bytes" in proc.stderr
    ids = tmp_path / "ids.bin"
    ids.write_bytes(np.asarray([5000], dtype="<i4").tobytes())
    proc = subprocess.run([build_tool("memra_forward_tool"), str(ckpt["bf16"]), str(ids), str(tmp_path / "o.bin")],
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "token id 5000 at row 0 outside the vocabulary [0, 1024)" in proc.stderr
