"""The default model's trainer (tools/train) against the oracles: a few CPU steps of tools/train/train.py on
seeded ids, exported, must compute what its PyTorch model computes. The export's logits and every chained MTP
layer's are compared with the numpy forward of STEP35.md (an independent reading of the checkpoint) and with
memra's engine (memra_forward_tool); the FP8 experts must dequantize to BF16 exactly (power-of-two block
scales), so the BF16 form derived from the FP8 file is the same model."""
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from np_step35 import Step35Numpy, float32_weights, load_checkpoint  # noqa: E402
from oracle_util import rel_err, run_forward_tool  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "train"))
import step35_torch  # noqa: E402
import train  # noqa: E402

# Measured on the 2-core machine: numpy vs PyTorch float32 ~1e-6, memra vs PyTorch ~1e-6 (relative to the
# largest logit). The bound leaves room for summation order only; a wrong formula is off by O(1).
TOL = 1e-4


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    out = tmp_path_factory.mktemp("model")
    rng = np.random.default_rng(0)
    # Ids with structure (a repeated random phrase) so a few steps move the weights off their init.
    phrase = rng.integers(2, 1000, size=97)
    ids = np.concatenate([phrase] * 40 + [rng.integers(2, 1000, size=500)]).astype("<u2")
    ids.tofile(data / "train.u16")
    ids[:2000].tofile(data / "heldout.u16")
    tok_dir = Path(__file__).resolve().parents[2] / "models" / "default"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (data / name).write_bytes((tok_dir / name).read_bytes())
    train.main([str(data), str(out), "--device", "cpu", "--max-steps", "3", "--batch", "2", "--seq", "64",
                "--eval-windows", "2", "--final-windows", "2", "--eval-every", "1e9", "--qat", "0.5"])
    return out


def torch_model(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    from safetensors.torch import load_file
    model = step35_torch.Step35(cfg).eval()
    step35_torch.load_exported(model, load_file(str(model_dir / "model.safetensors")))
    return cfg, model


def test_fp8_experts_dequantize_exactly_to_bf16(exported):
    tensors = load_checkpoint(exported)
    w = float32_weights(tensors)
    n_fp8 = 0
    for name, (dtype, _, arr, _) in tensors.items():
        if dtype == "F8_E4M3":
            n_fp8 += 1
            scales = tensors[name + "_scale_inv"][2]
            assert np.all(np.log2(scales) == np.round(np.log2(scales))), f"{name}: scales not powers of two"
            assert np.array_equal(w[name].astype(ml_dtypes.bfloat16).astype(np.float32), w[name]), name
    assert n_fp8 == 9


def test_export_matches_numpy_and_memra(exported, tmp_path):
    cfg, model = torch_model(exported)
    ids = np.random.default_rng(1).integers(2, 1000, size=70)
    with torch.no_grad():
        logits, mtp = model(torch.from_numpy(ids)[None])
    logits = logits[0].numpy()
    ref = Step35Numpy(cfg, float32_weights(load_checkpoint(exported)))
    assert rel_err(ref.logits(ids), logits) < TOL
    n_mtp = cfg["num_nextn_predict_layers"]
    assert n_mtp == 3
    for k, lg in enumerate(ref.mtp_chain_logits(ids, n_mtp)):
        assert rel_err(lg, mtp[k][0].numpy()) < TOL, f"MTP layer {k}"
    ours, _ = run_forward_tool(exported, ids, tmp_path, "--all-positions", "--mtp", "--threads", "2")
    v = cfg["vocab_size"]
    ours = ours.reshape(-1, v)
    assert rel_err(ours[: len(ids)], logits) < TOL
    row = len(ids)
    for k in range(n_mtp):
        rows = len(ids) - 1 - k
        assert rel_err(ours[row: row + rows], mtp[k][0].numpy()) < TOL, f"memra MTP layer {k}"
        row += rows
