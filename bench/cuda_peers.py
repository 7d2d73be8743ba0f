#!/usr/bin/env python3
"""The peer of bench/cuda/products.cpp: the same bf16 products and decode attention in PyTorch, timed the same way.

For each shape (rows, K) and token count: y = x @ W^T with bf16 x and W (torch.nn.functional.linear, cuBLAS). For
each decode-attention case of products.cpp (K8, K9, K10: batch, positions, query heads; 8 KV heads of 128, bf16 K
and V, dense per sequence): scaled_dot_product_attention on each backend that takes it (cuDNN, flash, memory
efficient), the 8 query heads of a KV head as 8 query rows of one head, which is GQA decode without copying K or V.
Each: 20 launches back to back after 3 warm-ups between two CUDA events, the weight (or K and V) in copies that
exceed the L2 taking turns; one JSON object per line with the mean time per launch and the bytes streamed per
second (and the products' TFLOP/s). Runs on the GPU machine (PyTorch is there); exits 0 with a note when there is
no GPU.
"""
import json
import sys


def seconds_per_launch(torch, launch) -> float:
    """Mean seconds of launch(i) over 20 back-to-back launches after 3 warm-ups, between two CUDA events."""
    for i in range(3):
        launch(i)
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    for i in range(20):
        launch(i)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e-3 / 20


def attention_peers(torch) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kv_heads, head_dim = 8, 128
    for batch, positions, heads in ((1, 8192, 64), (1, 512, 96), (32, 4096, 64), (128, 4096, 64)):
        kv_bytes = 2 * batch * kv_heads * positions * head_dim * 2
        copies = max(1, -(-(120 << 20) // kv_bytes))
        kvs = [tuple(torch.randn(batch, kv_heads, positions, head_dim, device="cuda", dtype=torch.bfloat16)
                     for _ in range(2)) for _ in range(copies)]
        q = torch.randn(batch, kv_heads, heads // kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel([backend]):
                    seconds = seconds_per_launch(
                        torch, lambda i: torch.nn.functional.scaled_dot_product_attention(q, *kvs[i % copies]))
            except RuntimeError as e:
                print(json.dumps({"peer": f"torch sdpa {backend.name}", "batch": batch, "positions": positions,
                                  "note": str(e).splitlines()[0][:200]}))
                continue
            print(json.dumps({"peer": f"torch {torch.__version__} sdpa {backend.name}", "attention": True,
                              "batch": batch, "positions": positions, "heads": heads, "us": seconds * 1e6,
                              "KV_GB/s": kv_bytes / seconds * 1e-9}))
        del kvs, q


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
            seconds = seconds_per_launch(torch, lambda i: torch.nn.functional.linear(x, ws[i % copies]))
            print(json.dumps({"peer": "torch " + torch.__version__, "rows": rows, "K": k, "tokens": tokens,
                              "us": seconds * 1e6, "weight_GB/s": rows * k * 2 / seconds * 1e-9,
                              "TFLOP/s": 2 * rows * k * tokens / seconds * 1e-12}))
            del ws, x
    attention_peers(torch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
