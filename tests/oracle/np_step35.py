# A numpy reference of the Step-3.5 text model written from STEP35.md section 4 (no torch): the
# checkpoint reader (raw safetensors bytes viewed through ml_dtypes, FP8 routed experts dequantized
# with their 128x128 block scales) and a prefill forward pass with partial NeoX RoPE, llama3
# scaling on full-attention layers, sliding windows, head-wise gates, the biased sigmoid router,
# the SwiGLU clamps and the MTP head. Shared by the checkpoint tests and the HF / llama.cpp oracles.
# Two numerics (ENGINE.md section 4): `exact` (float32 or float64 everywhere, weights widened) and `device` (what
# tensor cores compute: bf16 activations into bf16-weight products, W8A8 FP8 routed experts, and the canonical
# blocked attention order of CUDA.md section 3.2), the reference for memra's own device mode.
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors
from safetensors import safe_open

NP_DTYPES = {"BF16": ml_dtypes.bfloat16, "F32": np.float32, "F8_E4M3": ml_dtypes.float8_e4m3fn}
FP8_BLOCK = 128
E4M3_MAX = 448.0
ATTN_BLOCK = 128  # positions per attention block (CUDA.md 3.2), aligned to position 0
ATTN_SPLIT = 512  # positions per attention split, aligned the same way
NUMERICS = ("exact", "device")


def load_checkpoint(model_dir):
    """name -> (dtype string, shape, numpy array, shard file name) for every tensor of every shard."""
    tensors = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(shard), framework="numpy") as f:
            specs = {n: (f.get_slice(n).get_dtype(), list(f.get_slice(n).get_shape())) for n in f.keys()}
        # numpy has no bf16/fp8: take the raw bytes from the package's own parser, view them with ml_dtypes.
        for name, t in safetensors.deserialize(shard.read_bytes()):
            assert name not in tensors, f"{name} in two shards"
            assert specs[name] == (t["dtype"], list(t["shape"])), name
            arr = np.frombuffer(bytes(t["data"]), dtype=NP_DTYPES[t["dtype"]]).reshape(t["shape"])
            tensors[name] = (t["dtype"], list(t["shape"]), arr, shard.name)
    return tensors


def dequantize_fp8(q, scale_inv):
    """[E, rows, cols] float8_e4m3fn times its [E, ceil(rows/128), ceil(cols/128)] block multipliers."""
    n_exp, rows, cols = q.shape
    expected = (n_exp, -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if scale_inv.shape != expected:
        raise ValueError(f"scale_inv shape {scale_inv.shape} does not match weight {q.shape}: expected {expected}")
    full = np.repeat(np.repeat(scale_inv.astype(np.float32), FP8_BLOCK, axis=1), FP8_BLOCK, axis=2)
    return q.astype(np.float32) * full[:, :rows, :cols]


def float32_weights(tensors):
    """Checkpoint name -> float32 array; FP8 tensors dequantized, their `_scale_inv` companions dropped."""
    out = {}
    for name, (dtype, _, arr, _) in tensors.items():
        if name.endswith("_scale_inv"):
            if name[:-len("_scale_inv")] not in tensors:
                raise ValueError(f"{name} has no weight tensor")
            continue
        if dtype == "F8_E4M3":
            scale_name = name + "_scale_inv"
            if scale_name not in tensors:
                raise ValueError(f"FP8 tensor {name} has no {scale_name}")
            out[name] = dequantize_fp8(arr, tensors[scale_name][2])
        else:
            out[name] = arr.astype(np.float32)
    return out


def bf16_round(x):
    """x as float32, rounded to the nearest bfloat16 (ties to even; NaN stays NaN, overflow goes to inf)."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def quantize_e4m3_groups(x, group=FP8_BLOCK):
    """Dynamic FP8 activation quantization of x [rows, K] (ENGINE.md section 4): groups of `group` consecutive K
    values from K = 0 (the last may be partial), scale = amax / 448 as a float32 division (1 for an all-zero group;
    2^-149 when amax / 448 underflows, as memra's FP8 weight quantizer does), codes = x / scale in float32,
    saturated to +-448 and rounded to nearest even. Returns (codes float8_e4m3fn [rows, K], scales float32
    [rows, ceil(K / group)])."""
    x = np.asarray(x, np.float32)
    rows, k = x.shape
    n_groups = -(-k // group)
    g = np.pad(x, ((0, 0), (0, n_groups * group - k))).reshape(rows, n_groups, group)  # zero padding: amax unchanged
    amax = np.abs(g).max(-1)
    scale = amax / np.float32(E4M3_MAX)
    scale = np.where(amax == 0, np.float32(1), np.where(scale == 0, np.float32(2.0 ** -149), scale)).astype(np.float32)
    codes = np.clip(g / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    return codes.reshape(rows, n_groups * group)[:, :k], scale


class Fp8Weight:
    """An F8_E4M3 weight kept as its codes (the e4m3 values as float64: exact, ready for w8a8_matmul's exact chunk
    sums) and its 128x128 block multipliers: [rows, cols] with scale_inv [ceil(rows/128), ceil(cols/128)], or a
    stack [E, rows, cols] with [E, ...] scales, indexed by expert."""

    def __init__(self, codes, scale_inv):
        expected = codes.shape[:-2] + (-(-codes.shape[-2] // FP8_BLOCK), -(-codes.shape[-1] // FP8_BLOCK))
        if scale_inv.shape != expected:
            raise ValueError(f"scale_inv shape {scale_inv.shape} does not match weight {codes.shape}: "
                             f"expected {expected}")
        self.codes = np.asarray(codes, np.float64)
        self.scale_inv = np.asarray(scale_inv, np.float32)
        self.shape = codes.shape

    def __getitem__(self, e):
        return Fp8Weight(self.codes[e], self.scale_inv[e])


def w8a8_matmul(x, w):
    """x [M, K] float32 times the transposed Fp8Weight w [N, K], as an FP8 tensor-core GEMM computes it (ENGINE.md
    section 3 and 4): x quantized by quantize_e4m3_groups, then per output n, over the 128-wide K chunks c in order,
    acc = fma(p_c, scale_x[c] * scale_w[n // 128, c], acc) with p_c = sum_k code_x[k] * code_w[n, k].
    p_c is summed in float64, where it is exact (every product of two e4m3 values is a multiple of 2^-18 below
    2^18, so a 128-term sum needs < 44 bits), and rounded to float32 once; the scale product is a float32
    multiplication; the fma is p_c * s exactly in float64 plus acc, rounded to float64 and then to float32 (a
    double rounding a true fma does not have: differs in the last bit in rare cases). The engine sums p_c in fp32
    (Hopper: its own FP8 accumulator), so it agrees up to the summation order."""
    codes_x, scale_x = quantize_e4m3_groups(x)
    cx, cw = codes_x.astype(np.float64), w.codes
    n_out, k = cw.shape
    if x.shape[1] != k:
        raise ValueError(f"activation width {x.shape[1]} does not match weight {w.shape}")
    scale_w = np.repeat(w.scale_inv, FP8_BLOCK, axis=0)[:n_out]  # [N, K chunks]: row block of each output
    acc = np.zeros((x.shape[0], n_out), np.float32)
    for c in range(scale_x.shape[1]):
        ks = slice(c * FP8_BLOCK, min(k, (c + 1) * FP8_BLOCK))
        part = (cx[:, ks] @ cw[:, ks].T).astype(np.float32)
        s = scale_x[:, c:c + 1] * scale_w[None, :, c]  # float32 [M, N]
        acc = (part.astype(np.float64) * s.astype(np.float64) + acc).astype(np.float32)
    return acc


def device_weights(weights):
    """Checkpoint name -> weight for `device` numerics: F8_E4M3 tensors (load_checkpoint tuples or plain
    float8_e4m3fn arrays) as Fp8Weight with their `_scale_inv` companions, everything else widened to float32.
    Already dequantized FP8 weights (float32_weights) are plain float32 weights here, taking the bf16 path."""
    arrays = {n: (t[2] if isinstance(t, tuple) else t) for n, t in weights.items()}
    out = {}
    for name, arr in arrays.items():
        if name.endswith("_scale_inv"):
            if name[:-len("_scale_inv")] not in arrays:
                raise ValueError(f"{name} has no weight tensor")
            continue
        if arr.dtype == ml_dtypes.float8_e4m3fn:
            if name + "_scale_inv" not in arrays:
                raise ValueError(f"FP8 tensor {name} has no {name}_scale_inv")
            out[name] = Fp8Weight(arr, arrays[name + "_scale_inv"])
        else:
            out[name] = arr.astype(np.float32)
    return out


def blocked_attention(q, k, v, q_pos, k_pos, window=None, block=ATTN_BLOCK, split=ATTN_SPLIT, origin=0,
                      round_p=True):
    """Causal softmax attention in the canonical order of CUDA.md 3.2, all float32: q [Tq, H, hd] at positions
    q_pos, k and v [Tk, H, hd] at k_pos, as the attention consumes them (the caller rounds them to bf16). The row at
    position P sees the keys in [lo, P], lo = max(0, P - window + 1) (0 without a window). Scores (q . k) * float32(1
    / sqrt(hd)); keys in blocks of `block` positions inside splits of `split` positions, both aligned to position 0;
    per split from a fresh state, per block in order: m' = max(m, block max), alpha = exp(m - m') (0 while m =
    -inf), e = exp(s - m'), l = l * alpha + sum(e), acc = acc * alpha + bf16(e) . V; splits merged left to right
    (M' = max(M, m), L = L e^(M - M') + l e^(m - M'), same for the accumulator); out = ACC / L. A block or split
    with no visible key of a row leaves that row's state as it is. `origin` (block boundaries at origin + j * block)
    and round_p = False exist to show in tests that each rounding point matters. Returns [Tq, H, hd]."""
    q, k, v = (np.asarray(t, np.float32) for t in (q, k, v))
    q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
    n_heads, n_q, hd = q.shape[1], q.shape[0], q.shape[2]
    scale = np.float32(1.0 / np.sqrt(np.float64(hd)))
    lo = np.zeros_like(q_pos) if window is None else np.maximum(0, q_pos - window + 1)
    visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= lo[:, None])
    s = np.where(visible[None], np.einsum("qhd,khd->hqk", q, k) * scale, np.float32(-np.inf))
    split_of, block_of = k_pos // split, (k_pos - origin) // block
    big_m = np.full((n_heads, n_q), -np.inf, np.float32)
    big_l = np.zeros((n_heads, n_q), np.float32)
    big_acc = np.zeros((n_heads, n_q, hd), np.float32)
    for sp in np.unique(split_of):
        m = np.full((n_heads, n_q), -np.inf, np.float32)
        lsum = np.zeros((n_heads, n_q), np.float32)
        acc = np.zeros((n_heads, n_q, hd), np.float32)
        for b in np.unique(block_of[split_of == sp]):
            cols = np.flatnonzero((split_of == sp) & (block_of == b))
            sb = s[:, :, cols]
            m_new = np.maximum(m, sb.max(-1))
            m_sub = np.where(m_new == -np.inf, np.float32(0), m_new)  # no visible key yet: e = 0, alpha = 0
            alpha = np.exp(m - m_sub)
            e = np.exp(sb - m_sub[..., None])
            p = bf16_round(e) if round_p else e
            lsum = lsum * alpha + e.sum(-1)
            acc = acc * alpha[..., None] + np.einsum("hqk,khd->hqd", p, v[cols])
            m = m_new
        # Merging into the empty state (M = -inf: a = 0, b = 1) gives a row's first non-empty split exactly.
        m_new = np.maximum(big_m, m)
        m_sub = np.where(m_new == -np.inf, np.float32(0), m_new)
        a, b = np.exp(big_m - m_sub), np.exp(m - m_sub)
        big_l = big_l * a + lsum * b
        big_acc = big_acc * a[..., None] + acc * b[..., None]
        big_m = m_new
    return (big_acc / big_l[..., None]).transpose(1, 0, 2)


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def rope_inv_freq(cfg, layer):
    """float64 inverse frequencies of the rotated slice of `layer` (section 4.3 steps 3-4)."""
    rot = int(cfg["head_dim"] * cfg["partial_rotary_factors"][layer])
    theta = float(cfg["rope_theta"][layer])
    inv = theta ** (-np.arange(0, rot, 2, dtype=np.float64) / rot)
    scaling = cfg.get("rope_scaling")
    if scaling and cfg["layer_types"][layer] in cfg.get("yarn_only_types", []):
        if scaling["rope_type"] != "llama3":
            raise ValueError(f"rope_scaling.rope_type {scaling['rope_type']!r}: only llama3 is modelled")
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * np.pi / inv
        smooth = (ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = np.where(wavelen < ctx / high, inv, np.where(wavelen > ctx / low, inv / factor, mid))
    return inv


def apply_rope(x, positions, inv_freq):
    """NeoX rotate-half on dims [0, R) of x [T, heads, head_dim]; dims [R, head_dim) pass through."""
    half = inv_freq.shape[0]
    ang = positions[:, None].astype(np.float64) * inv_freq[None, :]  # [T, R/2]
    cos, sin = np.cos(ang)[:, None, :].astype(x.dtype), np.sin(ang)[:, None, :].astype(x.dtype)
    a, b, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, rest], axis=-1)


def _f16(x):
    return x.astype(np.float16).astype(np.float32)


def ggml_q8_0_round(x):
    """x rounded through ggml's q8_0 (blocks of 32 along the last dim: d = amax/127 kept as f16, q = roundf(x/d))."""
    b = x.reshape(-1, 32).astype(np.float32)
    d = np.abs(b).max(1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    y = b * inv
    q = np.sign(y) * np.floor(np.abs(y) + np.float32(0.5))  # roundf: half away from zero
    return (q * _f16(d)).reshape(x.shape).astype(x.dtype)


def ggml_q5_1_round(x):
    """x rounded through ggml's q5_1 (blocks of 32: d = (max-min)/31 and m = min kept as f16)."""
    b = x.reshape(-1, 32).astype(np.float32)
    lo, hi = b.min(1, keepdims=True), b.max(1, keepdims=True)
    d = (hi - lo) / np.float32(31)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.minimum(np.floor((b - lo) * inv + np.float32(0.5)), 31)
    return (q * _f16(d) + _f16(lo)).reshape(x.shape).astype(x.dtype)


def llama_cpp_kv_round(k_round, v_round):
    """attn_round for Step35Numpy reproducing llama.cpp's CPU attention over a quantized KV cache: K and V
    rounded to their cache types, and Q rounded like K because ggml's CPU dot product converts the
    f32 operand to the quantized operand's vec_dot type (q8_0 for a q8_0 K cache)."""
    def attn_round(q, k, v):
        return k_round(q), k_round(k), v_round(v)
    attn_round.quantized_qk = True  # device numerics: q and k meet as the cache's blocks, not rounded to bf16
    return attn_round


class Step35Numpy:
    """Prefill of one sequence through the Step-3.5 blocks, recording router and clamp statistics.

    `weights` maps checkpoint names to arrays (load_checkpoint tuples or plain arrays); every weight
    is converted to `dtype` (float32 by default, float64 for a tighter reference). `attn_round`, if
    given, maps (q, k, v) [T, heads, head_dim] after RoPE to what the attention actually consumes
    (e.g. llama_cpp_kv_round for a quantized KV cache).

    numerics="exact" computes everything in `dtype` with plain softmax attention. numerics="device" (float32
    only) is ENGINE.md section 4's device mode: activations rounded to bf16 before every product with a non-FP8
    weight (q/k/v/g/o, dense and shared-expert MLPs, BF16 routed experts, eh_proj, lm_head and the MTP heads);
    F8_E4M3 routed experts as W8A8 (w8a8_matmul; pass the raw FP8 tensors with their `_scale_inv`, e.g.
    load_checkpoint's tuples: dequantized float32 experts take the bf16 path); the router in float32; attention in
    blocked_attention's order with q and k rounded to bf16 (kept as attn_round returns them when it has a true
    `quantized_qk` attribute, as llama_cpp_kv_round's has) and v rounded to bf16. Everything else stays float32."""

    def __init__(self, cfg, weights, dtype=np.float32, attn_round=None, numerics="exact"):
        if numerics not in NUMERICS:
            raise ValueError(f"numerics {numerics!r}: expected one of {', '.join(NUMERICS)}")
        if numerics == "device" and np.dtype(dtype) != np.float32:
            raise ValueError(f"numerics 'device' runs in float32, not {np.dtype(dtype)}")
        self.cfg = cfg
        self.dtype = dtype
        self.attn_round = attn_round
        self.device = numerics == "device"
        if self.device:
            self.w = device_weights(weights)
        else:
            self.w = {n: (t[2] if isinstance(t, tuple) else t).astype(dtype) for n, t in weights.items()
                      if not n.endswith("_scale_inv")}
        self.eps = cfg["rms_norm_eps"]
        self.moe = {int(x) for x in cfg["moe_layers_enum"].split(",")}
        self.inv_freq = [rope_inv_freq(cfg, i) for i in range(len(cfg["layer_types"]))]
        self.bias_changed = 0
        self.selections = 0
        self.clamped = {}
        self.routes = {}  # MoE layer -> [T, top_k] experts chosen by its last block call, in slot order

    def mm(self, x, w):
        """x [T, K] times the transposed weight w [N, K]: x @ w.T in exact numerics; in device numerics x rounded
        to bf16 first, or W8A8 for an FP8 weight."""
        if isinstance(w, Fp8Weight):
            return w8a8_matmul(x, w)
        if self.device:
            return bf16_round(x) @ w.T
        return x @ w.T

    def swiglu(self, h, gate_w, up_w, down_w, limit, key):
        act, up = silu(self.mm(h, gate_w)), self.mm(h, up_w)
        if limit > 0:
            self.clamped[key] = self.clamped.get(key, 0) + int((act > limit).sum() + (np.abs(up) > limit).sum())
            act, up = np.minimum(act, limit), np.clip(up, -limit, limit)
        return self.mm(act * up, down_w)

    def device_attention(self, q, k, v, pos, window):
        """Attention of device numerics on q [T, n_q, hd] and k, v [T, n_kv, hd] after RoPE and attn_round."""
        if not getattr(self.attn_round, "quantized_qk", False):
            q, k = bf16_round(q), bf16_round(k)
        v = bf16_round(v)
        group = q.shape[1] // k.shape[1]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # q head h -> kv head h // group
        return blocked_attention(q, k, v, pos, pos, window)

    def block(self, x, layer, positions=None):
        """One decoder block on x [T, hidden] at absolute `positions` (default 0..T-1)."""
        cfg, w, p = self.cfg, self.w, f"model.layers.{layer}."
        n_tok, hd, n_kv = x.shape[0], cfg["head_dim"], cfg["num_attention_groups"]
        pos = np.arange(n_tok) if positions is None else np.asarray(positions)
        full = cfg["layer_types"][layer] == "full_attention"
        n_q = cfg["num_attention_heads"] if full else cfg["attention_other_setting"]["num_attention_heads"]
        a = rms_norm(x, w[p + "input_layernorm.weight"], self.eps)
        q = self.mm(a, w[p + "self_attn.q_proj.weight"]).reshape(n_tok, n_q, hd)
        k = self.mm(a, w[p + "self_attn.k_proj.weight"]).reshape(n_tok, n_kv, hd)
        q = rms_norm(q, w[p + "self_attn.q_norm.weight"], self.eps)  # per head, over head_dim
        k = rms_norm(k, w[p + "self_attn.k_norm.weight"], self.eps)
        q, k = apply_rope(q, pos, self.inv_freq[layer]), apply_rope(k, pos, self.inv_freq[layer])
        v = self.mm(a, w[p + "self_attn.v_proj.weight"]).reshape(n_tok, n_kv, hd)
        if self.attn_round is not None:
            q, k, v = self.attn_round(q, k, v)
        if self.device:
            attn = self.device_attention(q, k, v, pos, None if full else cfg["sliding_window"])
        else:
            # q head h -> kv head h // group
            k, v = np.repeat(k, n_q // n_kv, axis=1), np.repeat(v, n_q // n_kv, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd).astype(self.dtype)
            visible = pos[None, :] <= pos[:, None]
            if not full:
                visible &= pos[None, :] > pos[:, None] - cfg["sliding_window"]
            scores = np.where(visible[None], scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", probs, v)
        attn = attn * sigmoid(self.mm(a, w[p + "self_attn.g_proj.weight"]))[:, :, None]
        x = x + self.mm(attn.reshape(n_tok, n_q * hd), w[p + "self_attn.o_proj.weight"])
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], self.eps)
        shared_limit = cfg["swiglu_limits_shared"][layer]
        if layer not in self.moe:
            return x + self.swiglu(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"],
                                   w[p + "mlp.down_proj.weight"], shared_limit, ("shared", layer))
        prob = sigmoid(h @ w[p + "moe.gate.weight"].T)  # router in the reference dtype (>= fp32)
        top_k = cfg["moe_top_k"]
        chosen = np.argsort(-(prob + w[p + "moe.router_bias"]), axis=1, kind="stable")[:, :top_k]
        unbiased = np.argsort(-prob, axis=1, kind="stable")[:, :top_k]
        self.routes[layer] = chosen
        if self.device:
            self.selections += n_tok
            self.bias_changed += sum(set(chosen[t]) != set(unbiased[t]) for t in range(n_tok))
            routed = self.routed_device(h, prob, chosen, layer)
        else:
            routed = np.zeros_like(x)
            for t in range(n_tok):
                self.selections += 1
                self.bias_changed += set(chosen[t]) != set(unbiased[t])
                weights = prob[t, chosen[t]]
                weights = weights / weights.sum() * cfg["moe_router_scaling_factor"]
                for wk, e in zip(weights, chosen[t]):
                    routed[t] += wk * self.swiglu(h[t:t + 1], w[p + "moe.gate_proj.weight"][e],
                                                  w[p + "moe.up_proj.weight"][e], w[p + "moe.down_proj.weight"][e],
                                                  cfg["swiglu_limits"][layer], ("routed", layer))[0]
        shared = self.swiglu(h, w[p + "share_expert.gate_proj.weight"], w[p + "share_expert.up_proj.weight"],
                             w[p + "share_expert.down_proj.weight"], shared_limit, ("shared", layer))
        return x + routed + shared

    def routed_device(self, h, prob, chosen, layer):
        """The routed experts of device numerics: each expert on all its rows at once (row results do not depend
        on the other rows), combined per token in slot order, as the exact loop does."""
        cfg, w, p = self.cfg, self.w, f"model.layers.{layer}."
        n_tok, top_k = chosen.shape
        out = np.zeros((n_tok, top_k, h.shape[1]), np.float32)
        for e in np.unique(chosen):
            rows, slots = np.nonzero(chosen == e)
            out[rows, slots] = self.swiglu(h[rows], w[p + "moe.gate_proj.weight"][e], w[p + "moe.up_proj.weight"][e],
                                           w[p + "moe.down_proj.weight"][e], cfg["swiglu_limits"][layer],
                                           ("routed", layer))
        routed = np.zeros((n_tok, h.shape[1]), np.float32)
        for t in range(n_tok):
            weights = prob[t, chosen[t]]
            weights = weights / weights.sum() * cfg["moe_router_scaling_factor"]
            for j, wk in enumerate(weights):
                routed[t] += wk * out[t, j]
        return routed

    def embed(self, ids):
        """Embedding rows [T, hidden] of the token ids."""
        return self.w["model.embed_tokens.weight"][np.asarray(ids)]

    def layer_outputs(self, x_inputs, first_layer=0, positions=None):
        """Teacher-forced blocks: x_inputs[i] [T, hidden] is layer first_layer + i's input (e.g. another engine's);
        returns each layer's output, so layers can be compared one by one."""
        return [self.block(x, first_layer + i, positions) for i, x in enumerate(x_inputs)]

    def trunk_states(self, ids):
        """The embedding and every trunk layer's output: num_hidden_layers + 1 arrays [T, hidden], the input of
        layer i at index i and the trunk's pre-norm output last."""
        states = [self.embed(ids)]
        for layer in range(self.cfg["num_hidden_layers"]):
            states.append(self.block(states[-1], layer))
        return states

    def trunk(self, ids):
        """Pre-norm hidden state [T, hidden] after the last trunk layer."""
        x = self.embed(ids)
        for layer in range(self.cfg["num_hidden_layers"]):
            x = self.block(x, layer)
        return x

    def final_logits(self, h):
        """[T, vocab] logits of trunk output rows h (final norm, then lm_head)."""
        return self.mm(rms_norm(h, self.w["model.norm.weight"], self.eps), self.w["lm_head.weight"])

    def logits(self, ids):
        """[T, vocab] logits of every position of one sequence (section 4.6)."""
        return self.final_logits(self.trunk(ids))

    def mtp_logits(self, ids, h, mtp_index=0, positions=None):
        """MTP layer `num_hidden_layers + mtp_index` (section 4.8): row i takes the token ids[i + 1] and the
        hidden row h[i] at position positions[i] (default 0..T-2). Returns (logits [T-1, vocab], pre-norm MTP
        hidden [T-1, hidden], eh_proj output)."""
        cfg, w, eps = self.cfg, self.w, self.eps
        layer = cfg["num_hidden_layers"] + mtp_index
        m = f"model.layers.{layer}."
        ids = np.asarray(ids)
        e = rms_norm(self.embed(ids[1:]), w[m + "enorm.weight"], eps)
        hh = rms_norm(h[:-1], w[m + "hnorm.weight"], eps)
        u = self.mm(np.concatenate([e, hh], axis=-1), w[m + "eh_proj.weight"])
        h_mtp = self.block(u, layer, positions)
        lg = self.mm(rms_norm(h_mtp, w[m + "transformer.shared_head.norm.weight"], eps),
                     w[m + "transformer.shared_head.output.weight"])
        return lg, h_mtp, u

    def mtp_chain_logits(self, ids, n_layers):
        """Every MTP layer chained over a teacher-forced sequence of T tokens: MTP layer k has rows at positions
        k .. T-2, row p taking the token at p + 1 and MTP layer k - 1's hidden row at p - 1 (the trunk's at p for
        k = 0). Returns one logits array per layer ([T-1-k, vocab])."""
        h = self.trunk(ids)
        toks = list(ids)
        out = []
        for k in range(n_layers):
            lg, h, _ = self.mtp_logits(toks, h, k, np.arange(k, len(ids) - 1))
            out.append(lg)
            toks = toks[1:]
        return out
