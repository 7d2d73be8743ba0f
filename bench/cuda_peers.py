#!/usr/bin/env python3
"""The peer of bench/cuda/products.cpp: the same bf16 products in PyTorch (cuBLAS), timed the same way.

For each shape (rows, K) and token count: y = x @ W^T with bf16 x and W (torch.nn.functional.linear), 20 launches
back to back after 3 warm-ups between two CUDA events, the weight in copies that exceed the L2 taking turns;
prints one JSON object per line with the mean time per launch, the weight bytes streamed per second and the
TFLOP/s. Runs on the GPU machine (PyTorch is there); exits 0 with a note when there is no GPU.
"""
import json
import sys


def main() -> int:
    try:
        import torch
    except ImportError:
        print(json.dumps({"note": "no torch"}))
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"note": "no GPU"}))
        return 0
    shapes = [(4096, 4096), (11264, 4096), (128896, 4096), (4096, 12288)]
    for tokens in (1, 8, 64, 512):
        for rows, k in shapes:
            # Copies of the weight that exceed the 60 MB L2 twice, used in turn (as the memra benchmark does).
            copies = max(1, -(-(120 << 20) // (rows * k * 2)))
            ws = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            for i in range(3):
                torch.nn.functional.linear(x, ws[i % copies])
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            for i in range(20):
                torch.nn.functional.linear(x, ws[i % copies])
            b.record()
            b.synchronize()
            seconds = a.elapsed_time(b) * 1e-3 / 20
            print(json.dumps({"peer": "torch " + torch.__version__, "rows": rows, "K": k, "tokens": tokens,
                              "us": seconds * 1e6, "weight_GB/s": rows * k * 2 / seconds * 1e-9,
                              "TFLOP/s": 2 * rows * k * tokens / seconds * 1e-12}))
            del ws, x
    return 0


if __name__ == "__main__":
    sys.exit(main())
