"""Derives the BF16 form of an FP8 checkpoint (routed experts F8_E4M3 with 128x128 block scales, the release's
FP8 layout) by dequantizing the experts to BF16, exactly: every code x scale must be a BF16 value (the default
model's scales are powers of two), else it refuses. The other tensors are copied bit for bit; config.json loses
its quantization_config; the other files are copied.

    python tools/train/dequant.py FP8_DIR OUT_DIR
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "oracle"))
from np_step35 import dequantize_fp8, load_checkpoint  # noqa: E402


def dequantize_checkpoint(src, dst):
    src, dst = Path(src), Path(dst)
    tensors = load_checkpoint(src)
    out = {}
    for name, (dtype, _, arr, _) in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if dtype == "F8_E4M3":
            w = dequantize_fp8(arr, tensors[name + "_scale_inv"][2])
            b = w.astype(ml_dtypes.bfloat16)
            if not np.array_equal(b.astype(np.float32), w):
                raise SystemExit(f"dequant: {name}: code x scale is not exact in BF16 (scales not powers of two?)")
            out[name] = b
        else:
            out[name] = arr
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json",
                                                                                   "model.safetensors.index.json"):
            shutil.copyfile(f, dst / f.name)
    return dst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    args = ap.parse_args(argv)
    dequantize_checkpoint(args.src, args.dst)
    print(f"dequant: wrote {args.dst}", file=sys.stderr)


if __name__ == "__main__":
    main()
