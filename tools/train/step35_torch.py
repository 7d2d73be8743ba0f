"""A trainable PyTorch Step-3.5 model (STEP35.md section 4) with the chained MTP layers of section 4.8, and
its export to the official Hugging Face layout (section 5; routed experts as 128x128 block-scaled e4m3).

The forward is the reference semantics the engine implements: zero-centred RMSNorm everywhere, per-head
q/k norm, NeoX RoPE on the first rotary_dim dims with llama3 scaling on full-attention layers, a sliding
window that includes the current token, the head-wise sigmoid gate, SwiGLU with the upper clamp on silu(gate)
and the symmetric clamp on up, the sigmoid router whose selection bias only selects, renormalised top-k
weights times the scaling factor, an always-on shared expert, and MTP layer k at position p taking the token
at p + 1 and the previous layer's (the trunk's for k = 0) pre-norm hidden row, predicting the token at p + 2.
Routed experts are computed densely (every expert on every row, weighted by zero when unselected): the same
function, simpler and fast at these sizes.
"""
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

FP8_MAX = 448.0  # largest finite e4m3 value
FP8_BLOCK = 128


def rms_norm(x, w, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())
    return y.to(x.dtype)


def fp8_block_quantize(w):
    """[E, rows, cols] float -> (e4m3 codes, float32 scales [E, ceil(rows/128), ceil(cols/128)]). Each block's
    scale is the smallest power of two with amax / scale <= 448, so code * scale is exact in bfloat16 and the
    BF16 form derived from the FP8 file equals these values bit for bit."""
    e, rows, cols = w.shape
    rb, cb = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    pad = torch.zeros(e, rb * FP8_BLOCK, cb * FP8_BLOCK, dtype=torch.float32, device=w.device)
    pad[:, :rows, :cols] = w.float()
    blocks = pad.view(e, rb, FP8_BLOCK, cb, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(2, 4)).clamp_min(2.0 ** -100)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    codes = (blocks / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    codes = codes.view(e, rb * FP8_BLOCK, cb * FP8_BLOCK)[:, :rows, :cols].contiguous()
    return codes, scale


def fp8_block_dequantize(codes, scale):
    e, rows, cols = codes.shape
    full = scale.repeat_interleave(FP8_BLOCK, 1).repeat_interleave(FP8_BLOCK, 2)[:, :rows, :cols]
    return codes.float() * full


class FakeFp8(torch.autograd.Function):
    """Quantize-dequantize in the forward, identity in the backward (straight-through)."""

    @staticmethod
    def forward(ctx, w):
        return fp8_block_dequantize(*fp8_block_quantize(w)).to(w.dtype)

    @staticmethod
    def backward(ctx, g):
        return g


def rope_inv_freq(cfg, layer):
    full = cfg["layer_types"][layer] == "full_attention"
    rot = int(cfg["head_dim"] * cfg["partial_rotary_factors"][layer])
    theta = cfg["rope_theta"][layer]
    inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    rs = cfg.get("rope_scaling")
    if full and rs and rs.get("rope_type") == "llama3":
        factor, lo, hi, l0 = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], \
            rs["original_max_position_embeddings"]
        low_wl, high_wl = l0 / lo, l0 / hi
        out = []
        for f in inv.tolist():
            wl = 2 * math.pi / f
            if wl < high_wl:
                out.append(f)
            elif wl > low_wl:
                out.append(f / factor)
            else:
                s = (l0 / wl - lo) / (hi - lo)
                out.append((1 - s) * f / factor + s * f)
        inv = torch.tensor(out, dtype=torch.float64)
    return inv.float(), rot


def apply_rope(x, pos, inv_freq, rot):
    """x [B, T, H, D]; NeoX pairing (j with j + rot/2) on the first rot dims."""
    ang = pos.float()[:, :, None] * inv_freq[None, None, :]  # [B, T, rot/2]
    cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
    xf = x.float()
    a, b, rest = xf[..., : rot // 2], xf[..., rot // 2: rot], xf[..., rot:]
    out = torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)
    return out.to(x.dtype)


def swiglu(gate, up, limit):
    act = F.silu(gate)
    if limit > 0:
        act = act.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return act * up


class Block(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        d, hd = cfg["hidden_size"], cfg["head_dim"]
        self.full = cfg["layer_types"][layer] == "full_attention"
        other = cfg["attention_other_setting"]
        self.hq = cfg["num_attention_heads"] if self.full else other["num_attention_heads"]
        self.hkv = cfg["num_attention_groups"]
        self.window = None if self.full else cfg["sliding_window"]
        self.eps = cfg["rms_norm_eps"]
        self.input_layernorm = nn.Parameter(torch.zeros(d))
        self.post_attention_layernorm = nn.Parameter(torch.zeros(d))
        self.q_proj = nn.Linear(d, self.hq * hd, bias=False)
        self.k_proj = nn.Linear(d, self.hkv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.hkv * hd, bias=False)
        self.g_proj = nn.Linear(d, self.hq, bias=False)
        self.o_proj = nn.Linear(self.hq * hd, d, bias=False)
        self.q_norm = nn.Parameter(torch.zeros(hd))
        self.k_norm = nn.Parameter(torch.zeros(hd))
        inv, self.rot = rope_inv_freq(cfg, layer)
        self.register_buffer("inv_freq", inv, persistent=False)
        moe = [int(x) for x in cfg["moe_layers_enum"].split(",") if x]
        self.moe = layer in moe
        self.limit_routed = float(cfg["swiglu_limits"][layer] or 0)
        self.limit_shared = float(cfg["swiglu_limits_shared"][layer] or 0)
        if self.moe:
            e, de, ds = cfg["moe_num_experts"], cfg["moe_intermediate_size"], cfg["share_expert_dim"]
            self.router = nn.Parameter(torch.empty(e, d))
            self.register_buffer("router_bias", torch.zeros(e))
            self.gate_proj = nn.Parameter(torch.empty(e, de, d))
            self.up_proj = nn.Parameter(torch.empty(e, de, d))
            self.down_proj = nn.Parameter(torch.empty(e, d, de))
            self.sh_gate = nn.Linear(d, ds, bias=False)
            self.sh_up = nn.Linear(d, ds, bias=False)
            self.sh_down = nn.Linear(ds, d, bias=False)
        else:
            ff = cfg["intermediate_size"]
            self.mlp_gate = nn.Linear(d, ff, bias=False)
            self.mlp_up = nn.Linear(d, ff, bias=False)
            self.mlp_down = nn.Linear(ff, d, bias=False)
        self.fake_fp8 = False
        self.last_load = None

    def attention(self, a, pos):
        bsz, t, _ = a.shape
        hd = self.cfg["head_dim"]
        q = self.q_proj(a).view(bsz, t, self.hq, hd)
        k = self.k_proj(a).view(bsz, t, self.hkv, hd)
        v = self.v_proj(a).view(bsz, t, self.hkv, hd)
        q = apply_rope(rms_norm(q, self.q_norm, self.eps), pos, self.inv_freq, self.rot)
        k = apply_rope(rms_norm(k, self.k_norm, self.eps), pos, self.inv_freq, self.rot)
        qi = torch.arange(t, device=a.device)
        mask = qi[None, :] <= qi[:, None]
        if self.window is not None:
            mask &= qi[None, :] > qi[:, None] - self.window
        rep = self.hq // self.hkv
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=1.0 / math.sqrt(hd)).transpose(1, 2)
        g = torch.sigmoid(self.g_proj(a))
        o = o * g[..., None].to(o.dtype)
        return self.o_proj(o.reshape(bsz, t, self.hq * hd))

    def expert_weights(self):
        ws = (self.gate_proj, self.up_proj, self.down_proj)
        return tuple(FakeFp8.apply(w) for w in ws) if self.fake_fp8 else ws

    def ffn(self, a):
        if not self.moe:
            return self.mlp_down(swiglu(self.mlp_gate(a), self.mlp_up(a), self.limit_shared))
        cfg = self.cfg
        x = a.reshape(-1, a.shape[-1])
        with torch.autocast(device_type=x.device.type, enabled=False):  # the router is FP32 (need_fp32_gate)
            p = torch.sigmoid(x.float() @ self.router.float().t())
            idx = torch.topk(p + self.router_bias, cfg["moe_top_k"], dim=-1).indices
            w = p.gather(-1, idx)
            w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg["moe_router_scaling_factor"]
            dense_w = torch.zeros_like(p).scatter(-1, idx, w)  # [N, E]
        self.last_load = torch.zeros_like(p).scatter(-1, idx, 1.0).sum(0).detach()
        wg, wu, wd = self.expert_weights()
        gate = torch.einsum("nd,efd->enf", x, wg.to(x.dtype))
        up = torch.einsum("nd,efd->enf", x, wu.to(x.dtype))
        y = torch.einsum("enf,edf->end", swiglu(gate, up, self.limit_routed), wd.to(x.dtype))
        routed = torch.einsum("end,ne->nd", y.float(), dense_w).to(x.dtype)
        shared = self.sh_down(swiglu(self.sh_gate(x), self.sh_up(x), self.limit_shared))
        return (routed + shared).view_as(a)

    def forward(self, x, pos, dropout):
        h = x + F.dropout(self.attention(rms_norm(x, self.input_layernorm, self.eps), pos), dropout, self.training)
        return h + F.dropout(self.ffn(rms_norm(h, self.post_attention_layernorm, self.eps)), dropout, self.training)


class MtpLayer(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        d = cfg["hidden_size"]
        self.eps = cfg["rms_norm_eps"]
        self.enorm = nn.Parameter(torch.zeros(d))
        self.hnorm = nn.Parameter(torch.zeros(d))
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = Block(cfg, layer)
        self.head_norm = nn.Parameter(torch.zeros(d))
        self.head = nn.Linear(d, cfg["vocab_size"], bias=False)


class Step35(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
        self.eps = cfg["rms_norm_eps"]
        self.embed = nn.Embedding(v, d)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(n))
        self.mtp = nn.ModuleList(MtpLayer(cfg, n + k) for k in range(cfg["num_nextn_predict_layers"]))
        self.norm = nn.Parameter(torch.zeros(d))
        self.lm_head = nn.Linear(d, v, bias=False)
        self.init_weights()

    def init_weights(self):
        std = 0.02
        n_res = 2 * (len(self.layers) + 1)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            out_proj = name.endswith(("o_proj.weight", "down_proj", "mlp_down.weight", "sh_down.weight"))
            nn.init.normal_(p, std=std / math.sqrt(n_res) if out_proj else std)

    def moe_blocks(self):
        return [b for b in list(self.layers) + [m.block for m in self.mtp] if b.moe]

    def set_fake_fp8(self, on):
        for b in self.moe_blocks():
            b.fake_fp8 = on

    def forward(self, ids, dropout=0.0, mtp=True):
        """ids [B, T]. Returns (trunk logits [B, T, V], [MTP layer k logits [B, T - 1 - k, V]])."""
        bsz, t = ids.shape
        pos = torch.arange(t, device=ids.device)[None, :].expand(bsz, t)
        h = self.embed(ids)
        for blk in self.layers:
            h = blk(h, pos, dropout)
        logits = self.lm_head(rms_norm(h, self.norm, self.eps))
        outs = []
        if mtp:
            toks = ids
            for k, m in enumerate(self.mtp):
                # Row i sits at position i + k, takes toks[i + 1] and the previous stream's row i.
                e = rms_norm(self.embed(toks[:, 1:]), m.enorm, self.eps)
                hh = rms_norm(h[:, :-1], m.hnorm, self.eps)
                u = m.eh_proj(torch.cat([e, hh], dim=-1))
                h = m.block(u, pos[:, k: t - 1], dropout)
                outs.append(m.head(rms_norm(h, m.head_norm, self.eps)))
                toks = toks[:, 1:]
        return logits, outs


def make_config(shape):
    """config.json of the model (the release's keys, STEP35.md section 2), from a shape dict."""
    n, n_mtp = shape["num_hidden_layers"], shape["num_nextn_predict_layers"]
    total = n + n_mtp
    types = ["full_attention" if i < n and i % 4 == 0 else "sliding_attention" for i in range(total)]
    limits = [0.0] * total
    limits_shared = [0.0] * total
    for i, v in shape["swiglu_limits"].items():
        limits[int(i)] = float(v)
    for i, v in shape["swiglu_limits_shared"].items():
        limits_shared[int(i)] = float(v)
    cfg = {
        "architectures": ["Step3p5ForCausalLM"],
        "model_type": "step3p5",
        "torch_dtype": "bfloat16",
        "hidden_size": shape["hidden_size"],
        "head_dim": shape["head_dim"],
        "num_attention_heads": shape["heads_full"],
        "num_attention_groups": shape["kv_heads"],
        "attention_other_setting": {"attention_type": "sliding_attention",
                                    "num_attention_heads": shape["heads_sliding"],
                                    "num_attention_groups": shape["kv_heads"],
                                    "head_dim": shape["head_dim"], "true_head_dim": shape["head_dim"]},
        "att_impl_type": "GQA",
        "num_hidden_layers": n,
        "num_nextn_predict_layers": n_mtp,
        "layer_types": types,
        "sliding_window": shape["sliding_window"],
        "rope_theta": [5000000.0 if t == "full_attention" else 10000.0 for t in types],
        "partial_rotary_factors": [0.5 if t == "full_attention" else 1.0 for t in types],
        "rope_scaling": {"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 131072,
                         "low_freq_factor": 1.0, "high_freq_factor": 32.0},
        "yarn_only_types": ["full_attention"],
        "max_seq_len": shape["max_seq_len"],
        "max_position_embeddings": shape["max_seq_len"],
        "intermediate_size": shape["intermediate_size"],
        "moe_layers_enum": ",".join(str(i) for i in shape["moe_layers"]),
        "moe_num_experts": shape["experts"],
        "moe_top_k": shape["top_k"],
        "moe_intermediate_size": shape["expert_dim"],
        "share_expert_dim": shape["shared_dim"],
        "moe_router_activation": "sigmoid",
        "use_moe_router_bias": True,
        "moe_router_scaling_factor": shape["router_scale"],
        "norm_expert_weight": True,
        "need_fp32_gate": True,
        "swiglu_limits": limits,
        "swiglu_limits_shared": limits_shared,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "use_qk_norm": True,
        "use_head_wise_attn_gate": True,
        "vocab_size": shape["vocab_size"],
        "bos_token_id": 0,
        "eos_token_id": [1, shape["im_end_id"]],
        "pad_token_id": 1,
        "use_moe": True,
        "moe_layer_offset": 0,
        "moe_every_n_layer": 1,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [FP8_BLOCK, FP8_BLOCK]},
    }
    return cfg


def export_tensors(model):
    """The checkpoint's tensors by official name: BF16, the router bias F32, routed experts F8_E4M3 with F32
    `_scale_inv` block scales."""
    out = {}

    def bf16(name, t):
        out[name] = t.detach().to(torch.bfloat16).cpu().contiguous()

    def block(pre, b):
        bf16(pre + "input_layernorm.weight", b.input_layernorm)
        for n in ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj"):
            bf16(pre + f"self_attn.{n}.weight", getattr(b, n).weight)
        bf16(pre + "self_attn.q_norm.weight", b.q_norm)
        bf16(pre + "self_attn.k_norm.weight", b.k_norm)
        bf16(pre + "post_attention_layernorm.weight", b.post_attention_layernorm)
        if b.moe:
            bf16(pre + "moe.gate.weight", b.router)
            out[pre + "moe.router_bias"] = b.router_bias.detach().float().cpu().contiguous()
            for n in ("gate_proj", "up_proj", "down_proj"):
                codes, scale = fp8_block_quantize(getattr(b, n).detach().float())
                out[pre + f"moe.{n}.weight"] = codes.cpu().contiguous()
                out[pre + f"moe.{n}.weight_scale_inv"] = scale.float().cpu().contiguous()
            bf16(pre + "share_expert.gate_proj.weight", b.sh_gate.weight)
            bf16(pre + "share_expert.up_proj.weight", b.sh_up.weight)
            bf16(pre + "share_expert.down_proj.weight", b.sh_down.weight)
        else:
            bf16(pre + "mlp.gate_proj.weight", b.mlp_gate.weight)
            bf16(pre + "mlp.up_proj.weight", b.mlp_up.weight)
            bf16(pre + "mlp.down_proj.weight", b.mlp_down.weight)

    bf16("model.embed_tokens.weight", model.embed.weight)
    for i, b in enumerate(model.layers):
        block(f"model.layers.{i}.", b)
    n = len(model.layers)
    for k, m in enumerate(model.mtp):
        pre = f"model.layers.{n + k}."
        bf16(pre + "enorm.weight", m.enorm)
        bf16(pre + "hnorm.weight", m.hnorm)
        bf16(pre + "eh_proj.weight", m.eh_proj.weight)
        block(pre, m.block)
        bf16(pre + "transformer.shared_head.norm.weight", m.head_norm)
        bf16(pre + "transformer.shared_head.output.weight", m.head.weight)
    bf16("model.norm.weight", model.norm)
    bf16("lm_head.weight", model.lm_head.weight)
    return out


def load_exported(model, tensors):
    """Sets the model's weights from exported tensors (experts dequantized): the model then computes what the
    checkpoint holds. Used to check the export against the oracles."""
    def p(dst, name):
        src = tensors[name]
        dst.data.copy_(src.float().view_as(dst))

    def block(pre, b):
        p(b.input_layernorm, pre + "input_layernorm.weight")
        for n in ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj"):
            p(getattr(b, n).weight, pre + f"self_attn.{n}.weight")
        p(b.q_norm, pre + "self_attn.q_norm.weight")
        p(b.k_norm, pre + "self_attn.k_norm.weight")
        p(b.post_attention_layernorm, pre + "post_attention_layernorm.weight")
        if b.moe:
            p(b.router, pre + "moe.gate.weight")
            b.router_bias.copy_(tensors[pre + "moe.router_bias"].float())
            for n in ("gate_proj", "up_proj", "down_proj"):
                w = fp8_block_dequantize(tensors[pre + f"moe.{n}.weight"], tensors[pre + f"moe.{n}.weight_scale_inv"])
                getattr(b, n).data.copy_(w)
            p(b.sh_gate.weight, pre + "share_expert.gate_proj.weight")
            p(b.sh_up.weight, pre + "share_expert.up_proj.weight")
            p(b.sh_down.weight, pre + "share_expert.down_proj.weight")
        else:
            p(b.mlp_gate.weight, pre + "mlp.gate_proj.weight")
            p(b.mlp_up.weight, pre + "mlp.up_proj.weight")
            p(b.mlp_down.weight, pre + "mlp.down_proj.weight")

    with torch.no_grad():
        p(model.embed.weight, "model.embed_tokens.weight")
        for i, b in enumerate(model.layers):
            block(f"model.layers.{i}.", b)
        n = len(model.layers)
        for k, m in enumerate(model.mtp):
            pre = f"model.layers.{n + k}."
            p(m.enorm, pre + "enorm.weight")
            p(m.hnorm, pre + "hnorm.weight")
            p(m.eh_proj.weight, pre + "eh_proj.weight")
            block(pre, m.block)
            p(m.head_norm, pre + "transformer.shared_head.norm.weight")
            p(m.head.weight, pre + "transformer.shared_head.output.weight")
        p(model.norm, "model.norm.weight")
        p(model.lm_head.weight, "lm_head.weight")


def config_json(cfg):
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"
