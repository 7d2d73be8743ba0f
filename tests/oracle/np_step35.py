# A numpy reference of the Step-3.5 text model written from STEP35.md section 4 (no torch): the
# checkpoint reader (raw safetensors bytes viewed through ml_dtypes, FP8 routed experts dequantized
# with their 128x128 block scales) and a prefill forward pass with partial NeoX RoPE, llama3
# scaling on full-attention layers, sliding windows, head-wise gates, the biased sigmoid router,
# the SwiGLU clamps and the MTP head. Shared by the checkpoint tests and the HF / llama.cpp oracles.
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors
from safetensors import safe_open

NP_DTYPES = {"BF16": ml_dtypes.bfloat16, "F32": np.float32, "F8_E4M3": ml_dtypes.float8_e4m3fn}
FP8_BLOCK = 128


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
    return attn_round


class Step35Numpy:
    """Prefill of one sequence through the Step-3.5 blocks, recording router and clamp statistics.

    `weights` maps checkpoint names to arrays (load_checkpoint tuples or plain arrays); every weight
    is converted to `dtype` (float32 by default, float64 for a tighter reference). `attn_round`, if
    given, maps (q, k, v) [T, heads, head_dim] after RoPE to what the attention actually consumes
    (e.g. llama_cpp_kv_round for a quantized KV cache)."""

    def __init__(self, cfg, weights, dtype=np.float32, attn_round=None):
        self.cfg = cfg
        self.dtype = dtype
        self.attn_round = attn_round
        self.w = {n: (t[2] if isinstance(t, tuple) else t).astype(dtype) for n, t in weights.items()
                  if not n.endswith("_scale_inv")}
        self.eps = cfg["rms_norm_eps"]
        self.moe = {int(x) for x in cfg["moe_layers_enum"].split(",")}
        self.inv_freq = [rope_inv_freq(cfg, i) for i in range(len(cfg["layer_types"]))]
        self.bias_changed = 0
        self.selections = 0
        self.clamped = {}

    def swiglu(self, h, gate_w, up_w, down_w, limit, key):
        act, up = silu(h @ gate_w.T), h @ up_w.T
        if limit > 0:
            self.clamped[key] = self.clamped.get(key, 0) + int((act > limit).sum() + (np.abs(up) > limit).sum())
            act, up = np.minimum(act, limit), np.clip(up, -limit, limit)
        return (act * up) @ down_w.T

    def block(self, x, layer, positions=None):
        """One decoder block on x [T, hidden] at absolute `positions` (default 0..T-1)."""
        cfg, w, p = self.cfg, self.w, f"model.layers.{layer}."
        n_tok, hd, n_kv = x.shape[0], cfg["head_dim"], cfg["num_attention_groups"]
        pos = np.arange(n_tok) if positions is None else np.asarray(positions)
        full = cfg["layer_types"][layer] == "full_attention"
        n_q = cfg["num_attention_heads"] if full else cfg["attention_other_setting"]["num_attention_heads"]
        a = rms_norm(x, w[p + "input_layernorm.weight"], self.eps)
        q = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(n_tok, n_q, hd)
        k = (a @ w[p + "self_attn.k_proj.weight"].T).reshape(n_tok, n_kv, hd)
        q = rms_norm(q, w[p + "self_attn.q_norm.weight"], self.eps)  # per head, over head_dim
        k = rms_norm(k, w[p + "self_attn.k_norm.weight"], self.eps)
        q, k = apply_rope(q, pos, self.inv_freq[layer]), apply_rope(k, pos, self.inv_freq[layer])
        v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(n_tok, n_kv, hd)
        if self.attn_round is not None:
            q, k, v = self.attn_round(q, k, v)
        k, v = np.repeat(k, n_q // n_kv, axis=1), np.repeat(v, n_q // n_kv, axis=1)  # q head h -> kv head h // group
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd).astype(self.dtype)
        visible = pos[None, :] <= pos[:, None]
        if not full:
            visible &= pos[None, :] > pos[:, None] - cfg["sliding_window"]
        scores = np.where(visible[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v) * sigmoid(a @ w[p + "self_attn.g_proj.weight"].T)[:, :, None]
        x = x + attn.reshape(n_tok, n_q * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], self.eps)
        shared_limit = cfg["swiglu_limits_shared"][layer]
        if layer not in self.moe:
            return x + self.swiglu(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"],
                                   w[p + "mlp.down_proj.weight"], shared_limit, ("shared", layer))
        prob = sigmoid(h @ w[p + "moe.gate.weight"].T)  # router in the reference dtype (>= fp32)
        top_k = cfg["moe_top_k"]
        chosen = np.argsort(-(prob + w[p + "moe.router_bias"]), axis=1, kind="stable")[:, :top_k]
        unbiased = np.argsort(-prob, axis=1, kind="stable")[:, :top_k]
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

    def trunk(self, ids):
        """Pre-norm hidden state [T, hidden] after the last trunk layer."""
        x = self.w["model.embed_tokens.weight"][np.asarray(ids)]
        for layer in range(self.cfg["num_hidden_layers"]):
            x = self.block(x, layer)
        return x

    def logits(self, ids):
        """[T, vocab] logits of every position of one sequence (section 4.6)."""
        h = self.trunk(ids)
        return rms_norm(h, self.w["model.norm.weight"], self.eps) @ self.w["lm_head.weight"].T

    def mtp_logits(self, ids, h, mtp_index=0, positions=None):
        """MTP layer `num_hidden_layers + mtp_index` (section 4.8): row i takes the token ids[i + 1] and the
        hidden row h[i] at position positions[i] (default 0..T-2). Returns (logits [T-1, vocab], pre-norm MTP
        hidden [T-1, hidden], eh_proj output)."""
        cfg, w, eps = self.cfg, self.w, self.eps
        layer = cfg["num_hidden_layers"] + mtp_index
        m = f"model.layers.{layer}."
        ids = np.asarray(ids)
        e = rms_norm(w["model.embed_tokens.weight"][ids[1:]], w[m + "enorm.weight"], eps)
        hh = rms_norm(h[:-1], w[m + "hnorm.weight"], eps)
        u = np.concatenate([e, hh], axis=-1) @ w[m + "eh_proj.weight"].T
        h_mtp = self.block(u, layer, positions)
        lg = rms_norm(h_mtp, w[m + "transformer.shared_head.norm.weight"], eps) @ \
            w[m + "transformer.shared_head.output.weight"].T
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
