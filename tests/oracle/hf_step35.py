# Hugging Face transformers as an independent oracle of the Step-3.5 text model: memra's
# checkpoint (official HF layout, BF16 or FP8) mapped onto transformers' own Step-3.5 text model
# (`transformers.models.step3p7.Step3p7TextModel`, model_type "step3p5") in float32 on CPU, plus
# the untied LM head. Prefill logits and greedy decoding through the model's own KV cache.
# Needs torch and transformers (requirements-oracle.txt); the numpy side lives in np_step35.py.
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache
from transformers.models.step3p7 import Step3p7TextConfig, Step3p7TextModel

from np_step35 import float32_weights, load_checkpoint

# Decode through the KV cache must reproduce a full prefill to float32 rounding.
DECODE_RECHECK_TOL = 1e-5


def check_config_supported(cfg):
    """Raise ValueError naming the key when memra's config asks for something transformers does not model.

    transformers' Step-3.5 config keeps one RoPE setting per layer *type* (taken from the first layer
    of that type), scales RoPE on full-attention layers only, uses one KV-head count for all layers,
    and always applies q/k norm, the head-wise gate, the biased sigmoid router and renormalisation."""
    def need(cond, key, expected, found):
        if not cond:
            raise ValueError(f"config.json {key}: transformers' Step-3.5 model needs {expected}, found {found!r}")

    need(cfg.get("model_type") == "step3p5", "model_type", "'step3p5'", cfg.get("model_type"))
    n = cfg["num_hidden_layers"]
    types = cfg["layer_types"][:n]
    for key in ("rope_theta", "partial_rotary_factors"):
        values = cfg.get(key)
        if isinstance(values, list):
            per_type = {}
            for t, v in zip(types, values[:n]):
                per_type.setdefault(t, set()).add(float(v))
            need(all(len(s) == 1 for s in per_type.values()), key, "one value per layer type", values)
    if cfg.get("rope_scaling"):
        need(cfg.get("yarn_only_types") == ["full_attention"], "yarn_only_types", "['full_attention']",
             cfg.get("yarn_only_types"))
    other = cfg.get("attention_other_setting") or {}
    need(other.get("num_attention_groups", cfg["num_attention_groups"]) == cfg["num_attention_groups"],
         "attention_other_setting.num_attention_groups", f"the same KV-head count as num_attention_groups "
         f"({cfg['num_attention_groups']})", other.get("num_attention_groups"))
    for key in ("head_dim", "true_head_dim"):
        need(other.get(key, cfg["head_dim"]) == cfg["head_dim"], f"attention_other_setting.{key}",
             f"head_dim {cfg['head_dim']}", other.get(key))
    for key in ("use_qk_norm", "use_head_wise_attn_gate", "use_moe_router_bias", "norm_expert_weight"):
        need(cfg.get(key, True) is True, key, "true", cfg.get(key))
    need(cfg.get("moe_router_activation", "sigmoid") == "sigmoid", "moe_router_activation", "'sigmoid'",
         cfg.get("moe_router_activation"))
    need("moe_layers_enum" in cfg, "moe_layers_enum", "a comma-separated MoE layer list", None)
    need(cfg.get("tie_word_embeddings", False) is False, "tie_word_embeddings", "false", cfg.get("tie_word_embeddings"))
    if "use_rope_layers" in cfg:
        need(not cfg["use_rope_layers"] or all(cfg["use_rope_layers"][:n]), "use_rope_layers",
             "RoPE on every layer", cfg["use_rope_layers"])


def hf_config(cfg):
    """Step3p7TextConfig from memra's config.json dict (float32, eager attention).

    Keys transformers does not read (att_impl_type, max_seq_len, use_moe, moe_every_n_layer,
    need_fp32_gate, ...) stay on the config object unused; check_config_supported guards the ones
    whose non-release values it would silently ignore."""
    check_config_supported(cfg)
    kwargs = {k: v for k, v in cfg.items() if k not in ("quantization_config", "torch_dtype", "dtype")}
    config = Step3p7TextConfig(**kwargs)
    config.dtype = torch.float32
    config._attn_implementation = "eager"
    return config


def hf_state_dict(cfg, weights):
    """Checkpoint names (float32 arrays) -> (transformers' text-model state dict, lm_head weight, MTP names)."""
    n_layers = cfg["num_hidden_layers"]
    t = lambda name: torch.from_numpy(np.ascontiguousarray(weights[name]))  # noqa: E731
    state = {"embed_tokens.weight": t("model.embed_tokens.weight"), "norm.weight": t("model.norm.weight")}
    used = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    mtp = []
    for name in weights:
        if not name.startswith("model.layers."):
            continue
        layer_str, rest = name[len("model.layers."):].split(".", 1)
        layer = int(layer_str)
        if layer >= n_layers:
            mtp.append(name)  # transformers does not model the MTP layers
            used.add(name)
            continue
        p = f"layers.{layer}."
        if rest.startswith("moe.gate_proj.") or rest.startswith("moe.up_proj."):
            continue  # packed below with its partner
        renames = {"moe.gate.weight": "mlp.gate.weight", "moe.router_bias": "mlp.gate.e_score_correction_bias",
                   "moe.down_proj.weight": "mlp.experts.down_proj"}
        if rest in renames:
            target = renames[rest]
        elif rest.startswith("share_expert."):
            target = "mlp.shared_experts." + rest[len("share_expert."):]
        else:
            target = rest  # attention, norms and dense MLP keep their names
        state[p + target] = t(name)
        used.add(name)
    for layer in range(n_layers):
        g, u = f"model.layers.{layer}.moe.gate_proj.weight", f"model.layers.{layer}.moe.up_proj.weight"
        if g in weights:
            # [E, I, H] gate rows first, then [E, I, H] up rows: transformers' [E, 2I, H] gate_up_proj.
            state[f"layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([t(g), t(u)], dim=1)
            used.update((g, u))
    unused = sorted(set(weights) - used)
    if unused:
        raise ValueError(f"checkpoint tensors not mapped onto transformers' model: {unused}")
    return state, t("lm_head.weight"), sorted(mtp)


class Step35HF(torch.nn.Module):
    """transformers' Step-3.5 text model (ends with the final norm) followed by the untied LM head."""

    def __init__(self, config, lm_head_weight):
        super().__init__()
        self.config = config
        self.text = Step3p7TextModel(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_weight)

    def forward(self, input_ids, cache=None, use_cache=False):
        out = self.text(input_ids=input_ids, cache=cache, use_cache=use_cache)
        return self.lm_head(out.last_hidden_state)


def load_hf_model(model_dir, n_threads=1):
    """memra tiny checkpoint directory -> Step35HF in float32 on CPU, eval mode.

    FP8 routed experts are dequantized with ml_dtypes (float8_e4m3fn x 128x128 `_scale_inv` block).
    Sets torch's process-wide thread count: the tiny models run fastest on one thread, and on a
    busy 2-core machine two OpenMP threads spin-wait (0.2 s vs 2-8 s for a 40-token prefill)."""
    torch.set_num_threads(n_threads)
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    config = hf_config(cfg)
    weights = float32_weights(load_checkpoint(model_dir))
    state, lm_head, mtp = hf_state_dict(cfg, weights)
    with torch.device("cpu"):
        model = Step35HF(config, lm_head).float()
    missing, unexpected = model.text.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{model_dir}: transformers parameters without a checkpoint tensor: {missing}; "
                         f"mapped names transformers does not have: {unexpected}")
    model.skipped_mtp = mtp
    return model.eval()


@torch.no_grad()
def hf_logits(model, token_ids):
    """float32 logits [T, vocab] for every position of one sequence (prefill, no cache)."""
    ids = torch.tensor([list(map(int, token_ids))], dtype=torch.long)
    return model(ids).float()[0].numpy()


@dataclass
class GreedyResult:
    tokens: list  # n greedy tokens
    logits: np.ndarray  # [n, vocab] float32: row i is the distribution token i was picked from
    recheck_max_abs: float  # decode-with-cache vs full re-prefill, max |diff| over the n rows
    recheck_max_rel: float  # the same divided by max |logit|


@torch.no_grad()
def hf_greedy(model, prompt_ids, n, recheck=True):
    """n greedy tokens after prompt_ids, decoding one token at a time through transformers' DynamicCache.

    With recheck, the n rows are compared with a full prefill of prompt + tokens[:-1]; a relative
    difference above DECODE_RECHECK_TOL raises AssertionError (the harness would be unsound)."""
    prompt = list(map(int, prompt_ids))
    if not prompt or n < 1:
        raise ValueError(f"hf_greedy needs a non-empty prompt and n >= 1, got {len(prompt)} tokens, n={n}")
    cache = DynamicCache(config=model.config)
    step = model(torch.tensor([prompt], dtype=torch.long), cache=cache, use_cache=True)[0, -1]
    tokens, rows = [], []
    for i in range(n):
        rows.append(step.float().numpy().copy())
        tokens.append(int(torch.argmax(step)))
        if i + 1 < n:
            step = model(torch.tensor([[tokens[-1]]], dtype=torch.long), cache=cache, use_cache=True)[0, -1]
    logits = np.stack(rows)
    abs_err = rel_err = float("nan")
    if recheck:
        full = hf_logits(model, prompt + tokens[:-1])[len(prompt) - 1:]
        abs_err = float(np.abs(full - logits).max())
        rel_err = abs_err / float(np.abs(full).max())
        if not rel_err <= DECODE_RECHECK_TOL:
            raise AssertionError(f"decode with cache differs from a full prefill: max abs {abs_err:.3g}, "
                                 f"relative {rel_err:.3g} > {DECODE_RECHECK_TOL}")
    return GreedyResult(tokens, logits, abs_err, rel_err)
