#!/usr/bin/env python3
"""The peer of bench/cuda/products.cpp: the same bf16 products and decode attention in PyTorch, timed the same way.

For each shape (rows, K) and token count: y = x @ W^T with bf16 x and W (torch.nn.functional.linear, cuBLAS). For
each decode-attention case of products.cpp (K8, K9, K10: batch, positions, query heads; 8 KV heads of 128, bf16 K
and V, dense per sequence): scaled_dot_product_attention on each backend that takes it (cuDNN, flash, memory
efficient), the 8 query heads of a KV head as 8 query rows of one head, which is GQA decode without copying K or V.
K7: causal prefill attention of one sequence at 512, 2048 and 8192 positions on the same backends. K2-K4 anchors:
FP8 products through torch._scaled_mm (per-tensor scales; fp8_peers says how they differ from memra's).
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


def prefill_attention_peers(torch) -> None:
    """K7's peer: causal scaled_dot_product_attention of one sequence (64 query heads over 8 KV heads of 128, bf16)
    on each backend that takes it, GQA through enable_gqa; TFLOP/s over the causal products."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv_heads, head_dim = 64, 8, 128
    for positions in (512, 2048, 8192):
        q = torch.randn(1, heads, positions, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, kv_heads, positions, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        flops = 4 * head_dim * heads * positions * (positions + 1) / 2
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel([backend]):
                    seconds = seconds_per_launch(torch, lambda i: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=True, enable_gqa=True))
            except (RuntimeError, TypeError) as e:
                print(json.dumps({"peer": f"torch sdpa {backend.name}", "positions": positions,
                                  "note": str(e).splitlines()[0][:200]}))
                continue
            print(json.dumps({"peer": f"torch {torch.__version__} sdpa {backend.name}", "prefill_attention": True,
                              "positions": positions, "heads": heads, "us": seconds * 1e6,
                              "TFLOP/s": flops / seconds * 1e-12}))
        del q, k, v


def fp8_peers(torch) -> None:
    """Anchors for K2-K4: torch._scaled_mm (cuBLASLt FP8, e4m3 x e4m3, per-tensor scales, bf16 out). K2: dense
    [rows, 4096] weights at 4096 rows of x. K3/K4: 8 experts of [1280, 4096] (a gate or up projection) as 8 launches,
    each over 16 rows of x (its smallest M), the experts drawn in turn from 128 so that the weights stream from HBM.
    memra's own products use 128x128 block scales; per-tensor scaling is the cheaper operation, so this is the
    bound such a product can reach, not the same work."""
    if not hasattr(torch, "_scaled_mm"):
        print(json.dumps({"note": "torch has no _scaled_mm"}))
        return
    e4m3 = torch.float8_e4m3fn
    one = torch.tensor(1.0, device="cuda")
    scaled = torch._scaled_mm
    for rows, k, m in ((4096, 4096, 4096), (11264, 4096, 4096)):
        w = (torch.randn(rows, k, device="cuda") / 4).to(e4m3)
        x = (torch.randn(m, k, device="cuda") / 4).to(e4m3)
        try:
            seconds = seconds_per_launch(
                torch, lambda i: scaled(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        except RuntimeError as e:
            print(json.dumps({"peer": "torch _scaled_mm", "rows": rows, "note": str(e).splitlines()[0][:200]}))
            continue
        print(json.dumps({"peer": f"torch {torch.__version__} _scaled_mm per-tensor", "fp8": "dense", "rows": rows,
                          "K": k, "tokens": m, "us": seconds * 1e6,
                          "TFLOP/s": 2 * rows * k * m / seconds * 1e-12}))
        del w, x
    experts, rows, k, m = 128, 1280, 4096, 16
    ws = [(torch.randn(rows, k, device="cuda") / 4).to(e4m3) for _ in range(experts)]
    x = (torch.randn(m, k, device="cuda") / 4).to(e4m3)

    def eight(i: int) -> None:
        for j in range(8):
            scaled(x, ws[(8 * i + j) % experts].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    try:
        seconds = seconds_per_launch(torch, eight)
    except RuntimeError as e:
        print(json.dumps({"peer": "torch _scaled_mm experts", "note": str(e).splitlines()[0][:200]}))
        return
    print(json.dumps({"peer": f"torch {torch.__version__} _scaled_mm per-tensor", "fp8": "experts", "experts": 8,
                      "rows": rows, "K": k, "tokens": m, "us": seconds * 1e6,
                      "weight_GB/s": 8 * rows * k / seconds * 1e-9}))


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
    prefill_attention_peers(torch)
    fp8_peers(torch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
