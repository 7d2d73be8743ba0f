# memra's forward (memra_forward_tool, CPU backend, f32 activations) against the numpy forward written from
# STEP35.md (np_step35.py, float64, with partial NeoX RoPE, llama3 scaling, sliding windows, gates, router,
# clamps) on the tiny BF16 and FP8 checkpoints: every prompt position, then greedy decode steps through the
# KV cache. Reports the max relative error (max |diff| / max |logit|).
import json
import subprocess

import numpy as np
import pytest

from np_step35 import Step35Numpy, float32_weights, load_checkpoint
from oracle_util import build_tool, make_tiny, rel_err
from oracle_util import run_forward_tool as run_tool

SEED = 7
N_PROMPT = 40  # longer than the tiny preset's 16-token sliding window
N_DECODE = 6
TOL = 1e-4  # f32 activations vs a float64 reference


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_forward")
    return {d: make_tiny(root / d, d, SEED) for d in ("bf16", "fp8")}


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


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The small preset: three MTP layers to chain."""
    return make_tiny(tmp_path_factory.mktemp("small_forward") / "small", "bf16", SEED, preset="small")


@pytest.mark.parametrize("variant", ["bf16", "fp8", "small"])
def test_mtp_chain_matches_numpy(variant, ckpt, small, prompt, tmp_path):
    """Every MTP layer (STEP35.md 4.8), chained 45 -> 46 -> 47 as the engine runs them in one step over the
    prompt: MTP layer k over positions k .. T-2, row p taking the token at p + 1 and layer k - 1's hidden row at
    p - 1 (the trunk's at p for k = 0)."""
    model_dir = small if variant == "small" else ckpt[variant]
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = cfg["vocab_size"]
    n_mtp = cfg["num_nextn_predict_layers"]
    ours, _ = run_tool(model_dir, prompt, tmp_path, "--all-positions", "--mtp", "--threads", "2")
    rows = [N_PROMPT - 1 - k for k in range(n_mtp)]
    ours = ours.reshape(N_PROMPT + sum(rows), vocab)
    ref_model = Step35Numpy(cfg, float32_weights(load_checkpoint(model_dir)), np.float64)
    refs = ref_model.mtp_chain_logits(prompt, n_mtp)
    at = N_PROMPT
    for k, ref in enumerate(refs):
        got = ours[at:at + rows[k]]
        err = rel_err(got, ref)
        print(f"{variant}: MTP layer {k} max relative error {err:.3e} over {rows[k]} positions")
        assert err < TOL
        assert np.array_equal(got.argmax(-1), ref.argmax(-1))
        # Each MTP layer really is another function of the sequence than the trunk head.
        assert rel_err(ours[1 + k:N_PROMPT], ref) > 100 * TOL
        at += rows[k]
    if n_mtp > 1:
        # And a chained layer another function than the first (its own weights and its chained input).
        assert rel_err(ours[N_PROMPT + 1:N_PROMPT + rows[0]], refs[1]) > 100 * TOL


def test_chunked_prefill_equals_one_step(ckpt, prompt, tmp_path):
    """The prompt in steps of 7 rows (and of 1) gives every logit of the one-step prefill, bit for bit."""
    one, _ = run_tool(ckpt["bf16"], prompt, tmp_path, "--all-positions", "--kv-k", "q8_0", "--kv-v", "q5_1")
    for ubatch in ("7", "1"):
        chunked, _ = run_tool(ckpt["bf16"], prompt, tmp_path, "--all-positions", "--kv-k", "q8_0", "--kv-v", "q5_1",
                              "--ubatch", ubatch)
        assert np.array_equal(one.view("<u4"), chunked.view("<u4")), ubatch


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
    assert "token id 5000 at position 0 outside the vocabulary [0, 1024)" in proc.stderr
