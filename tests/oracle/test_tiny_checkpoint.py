# The tiny checkpoint seen by the reference tools: every shard through the official `safetensors`
# package (names, shapes, dtypes against the official Step-3.5 layout), FP8 dequantization with
# ml_dtypes against the BF16 variant of the same seed, tokenizer.json through HF `tokenizers`
# (exact round trips, special tokens, a reference BPE), and a float32 numpy forward pass showing
# that activations stay in a realistic range and that the router bias and the clamps matter
# (the forward pass itself lives in np_step35.py, shared with the HF and llama.cpp oracles).
import json
import os
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from np_step35 import Step35Numpy, load_checkpoint, rms_norm

MEMRA_EXE = os.environ.get("MEMRA_EXE", "")
SEED = 7

GENERATOR_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "model.safetensors.index.json"}


def generator_command():
    """`memra make-tiny`, the generator's CLI."""
    assert MEMRA_EXE and Path(MEMRA_EXE).exists(), "MEMRA_EXE must name the memra CLI"
    return [MEMRA_EXE, "make-tiny"]


def make_tiny(cmd, out_dir, dtype, seed=SEED, preset="tiny"):
    r = subprocess.run(cmd + [str(out_dir), "--preset", preset, "--dtype", dtype, "--seed", str(seed)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return out_dir


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    cmd = generator_command()
    return {"bf16": make_tiny(cmd, root / "bf16", "bf16"), "fp8": make_tiny(cmd, root / "fp8", "fp8")}


@pytest.fixture(scope="module")
def bf16(ckpts):
    return load_checkpoint(ckpts["bf16"])


@pytest.fixture(scope="module")
def fp8(ckpts):
    return load_checkpoint(ckpts["fp8"])


@pytest.fixture(scope="module")
def config(ckpts):
    return json.loads((ckpts["bf16"] / "config.json").read_text())


@pytest.fixture(scope="module")
def tok(ckpts):
    return Tokenizer.from_file(str(ckpts["bf16"] / "tokenizer.json"))


def expected_layout(cfg, quantized):
    """The official tensor names, dtypes and shapes (STEP35.md 5.1-5.3), derived from config.json."""
    d, hd, kv = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_groups"]
    vocab, n_layers = cfg["vocab_size"], cfg["num_hidden_layers"]
    n_total = n_layers + cfg["num_nextn_predict_layers"]
    moe = {int(x) for x in cfg["moe_layers_enum"].split(",")}
    n_exp, d_exp, d_sh, d_ff = (cfg["moe_num_experts"], cfg["moe_intermediate_size"], cfg["share_expert_dim"],
                                cfg["intermediate_size"])
    exp = {"model.embed_tokens.weight": ("BF16", [vocab, d]), "lm_head.weight": ("BF16", [vocab, d]),
           "model.norm.weight": ("BF16", [d])}
    for layer in range(n_total):
        p = f"model.layers.{layer}."
        full = cfg["layer_types"][layer] == "full_attention"
        hq = cfg["num_attention_heads"] if full else cfg["attention_other_setting"]["num_attention_heads"]
        bf = lambda *shape: ("BF16", list(shape))  # noqa: E731
        exp.update({p + "input_layernorm.weight": bf(d), p + "post_attention_layernorm.weight": bf(d),
                    p + "self_attn.q_proj.weight": bf(hq * hd, d), p + "self_attn.k_proj.weight": bf(kv * hd, d),
                    p + "self_attn.v_proj.weight": bf(kv * hd, d), p + "self_attn.o_proj.weight": bf(d, hq * hd),
                    p + "self_attn.g_proj.weight": bf(hq, d), p + "self_attn.q_norm.weight": bf(hd),
                    p + "self_attn.k_norm.weight": bf(hd)})
        if layer in moe:
            exp.update({p + "moe.gate.weight": bf(n_exp, d), p + "moe.router_bias": ("F32", [n_exp]),
                        p + "share_expert.gate_proj.weight": bf(d_sh, d),
                        p + "share_expert.up_proj.weight": bf(d_sh, d),
                        p + "share_expert.down_proj.weight": bf(d, d_sh)})
            for proj, (rows, cols) in {"gate_proj": (d_exp, d), "up_proj": (d_exp, d),
                                       "down_proj": (d, d_exp)}.items():
                name = p + f"moe.{proj}.weight"
                if quantized:
                    exp[name] = ("F8_E4M3", [n_exp, rows, cols])
                    exp[name + "_scale_inv"] = ("F32", [n_exp, -(-rows // 128), -(-cols // 128)])
                else:
                    exp[name] = bf(n_exp, rows, cols)
        else:
            exp.update({p + "mlp.gate_proj.weight": bf(d_ff, d), p + "mlp.up_proj.weight": bf(d_ff, d),
                        p + "mlp.down_proj.weight": bf(d, d_ff)})
        if layer >= n_layers:
            exp.update({p + "enorm.weight": bf(d), p + "hnorm.weight": bf(d), p + "eh_proj.weight": bf(d, 2 * d),
                        p + "transformer.shared_head.norm.weight": bf(d),
                        p + "transformer.shared_head.output.weight": bf(vocab, d)})
    return exp


# ---- files, config, layout ----

def test_files_and_config(ckpts, config, tok):
    for dtype, d in ckpts.items():
        names = {p.name for p in d.iterdir()}
        shards = {n for n in names if n.endswith(".safetensors")}
        assert names == GENERATOR_FILES | shards, dtype
        assert len(shards) >= 3, dtype
    c = config
    assert c["architectures"] == ["Step3p5ForCausalLM"] and c["model_type"] == "step3p5"
    assert (c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_attention_groups"]) == (256, 32, 8, 2)
    assert c["attention_other_setting"] == {"attention_type": "sliding_attention", "num_attention_heads": 16,
                                            "num_attention_groups": 2, "head_dim": 32, "true_head_dim": 32}
    assert (c["num_hidden_layers"], c["num_nextn_predict_layers"], c["sliding_window"]) == (6, 1, 16)
    assert c["layer_types"] == ["full_attention" if i % 4 == 0 and i < 6 else "sliding_attention" for i in range(7)]
    assert c["rope_theta"] == [5000000.0 if i in (0, 4) else 10000.0 for i in range(7)]
    assert c["partial_rotary_factors"] == [0.5 if i in (0, 4) else 1.0 for i in range(7)]
    assert c["swiglu_limits"] == [0.0, 0.0, 0.0, 0.0, 1.5, 1.5, 0.0]
    assert c["swiglu_limits_shared"] == [0.0, 2.5, 0.0, 0.0, 0.0, 2.5, 0.0]
    assert c["rope_scaling"] == {"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 131072,
                                 "low_freq_factor": 1.0, "high_freq_factor": 32.0}
    assert c["rms_norm_eps"] == 1e-5 and c["moe_router_scaling_factor"] == 3.0
    assert (c["moe_layers_enum"], c["moe_num_experts"], c["moe_top_k"]) == ("2,3,4,5", 16, 8)
    assert (c["vocab_size"], c["bos_token_id"], c["pad_token_id"]) == (1024, 0, 1)
    assert c["eos_token_id"] == [1, tok.token_to_id("<|im_end|>")]
    assert tok.get_vocab_size() < c["vocab_size"]  # padding rows remain
    gen = json.loads((ckpts["bf16"] / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 0, "eos_token_id": c["eos_token_id"], "pad_token_id": 1}
    q = json.loads((ckpts["fp8"] / "config.json").read_text())
    assert q.pop("quantization_config") == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                            "weight_block_size": [128, 128]}
    assert q == c


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_layout_matches_official_names(variant, ckpts, config, bf16, fp8):
    tensors = bf16 if variant == "bf16" else fp8
    expected = expected_layout(config, variant == "fp8")
    assert set(tensors) == set(expected)
    for name, (dtype, shape) in expected.items():
        assert tensors[name][:2] == (dtype, shape), name
    index = json.loads((ckpts[variant] / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {n: t[3] for n, t in tensors.items()}
    assert index["metadata"]["total_size"] == sum(t[2].nbytes for t in tensors.values())


def test_fp8_dequantizes_to_the_bf16_weights(bf16, fp8):
    n_checked = 0
    for name, (dtype, shape, q, _) in fp8.items():
        if dtype != "F8_E4M3":
            if not name.endswith("_scale_inv"):
                assert np.array_equal(q.view(np.uint8), bf16[name][2].view(np.uint8)), name
            continue
        scale = fp8[name + "_scale_inv"][2]
        n_exp, rows, cols = shape
        # Both full and partial 128x128 blocks occur (96 = partial, 256 = two full blocks).
        assert scale.shape == (n_exp, -(-rows // 128), -(-cols // 128))
        s_full = np.repeat(np.repeat(scale, 128, axis=1), 128, axis=2)[:, :rows, :cols]
        deq = q.astype(np.float32) * s_full
        w = bf16[name][2].astype(np.float32)
        err = np.abs(deq - w)
        bound = np.maximum(np.abs(w) * 2.0 ** -4, s_full * 2.0 ** -10)  # half an e4m3 ulp
        assert np.all(err <= bound), name
        assert np.all(scale > 0), name
        # Each block's largest weight lands on +-448 (scale = amax / 448).
        for e in range(n_exp):
            for rb in range(scale.shape[1]):
                for cb in range(scale.shape[2]):
                    blk = q[e, rb * 128:(rb + 1) * 128, cb * 128:(cb + 1) * 128].astype(np.float32)
                    assert np.abs(blk).max() == 448.0, (name, e, rb, cb)
        rel = np.linalg.norm(deq - w) / np.linalg.norm(w)
        assert 0.005 < rel < 0.05, (name, rel)  # real quantization error, not a copy
        n_checked += 1
    assert n_checked == 12


# ---- tokenizer ----

def roundtrip_strings():
    fixed = [
        "", "a", " ", "  ", "\n", "\t", "Hello, world!", "The lighthouse keeper counted the ships every evening.",
        "  leading spaces", "trailing spaces   ", "a  b   c    d", "line one\nline two\r\nline three\n\n\n",
        "\ttab\tseparated\tvalues\t", "x = 1;   y = 2;    z = x + y;", "def f(x):\n    return x * x\n",
        "for (int i = 0; i < n; ++i) { sum += v[i]; }", "#include <vector>\nint main() { return 0; }",
        '{"key": [1, 2, 3], "nested": {"a": null}}', "SELECT * FROM t WHERE id = 42;",
        "0", "7", "42", "123", "1234", "12345678901234567890", "3.14159", "-0.001", "1e-5", "1,000,000",
        "2024-03-15 12:45:07", "$19.99 and 99.9%", "v1.2.3-rc4", "0x7FFF_FFFF",
        "灯塔守望者每天晚上数着来往的船只。", "我们今天学习中文和日文。", "灯台の番人は毎晩、船の数を数えていました。",
        "カタカナとひらがな", "中文English混合123", "한국어 텍스트", "Привет, мир!", "مرحبا بالعالم", "नमस्ते दुनिया",
        "café naïve façade über señor crème brûlée", "Ångström déjà vu", "ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ",
        "🙂", "🚀🚀🚀", "👨‍👩‍👧‍👦 family", "👍🏽 skin tone", "🇫🇷🇯🇵 flags", "❤️ with selector", "a🙂b🙂c",
        "math: ∑ ∞ ≈ ≠ ≤ ≥ → ←", "© ® ™ ° ± × ÷ € £ ¥", "\u00ad soft hyphen", "zero\u200bwidth",
        "\x00\x01\x02 control \x7f bytes", "\r\r\n\n  \t \u3000 mixed whitespace", "'quoted' \"double\" `back`",
        "<not a special token>", "<|im_start", "im_end|>", "< think >", "</ think>", "<tool_call",
    ]
    pools = {
        "word": ["the", "ship", "harbor", "keeper", "lamp", "Wind", "QUIET", "notebook", "tokenizer", "x", "I'm",
                 "don't", "it's", "e.g.", "snake_case", "CamelCase", "kebab-case"],
        "code": ["if (a > b)", "return total;", "x += 1", "print(f'{v}')", "std::vector<int>", "a->b", "i++",
                 "#define N 8", "// comment", "/* block */", "=>", "!=", "&&", "||", "::"],
        "num": ["0", "9", "10", "256", "1024", "65536", "3.5", "-17", "+4", "1e9", "007", "2718281828"],
        "cjk": ["数字", "标点符号", "计算机", "文本", "ありがとう", "トークン", "プログラム", "春夏秋冬", "。", "、"],
        "emoji": ["🙂", "😀", "🌊", "🌟", "🎉", "🐢", "🍞", "☕", "⛵", "🧪"],
        "space": [" ", "  ", "   ", "\t", "\n", "\n\n", " \n ", "\r\n", "    ", "\t\t"],
    }
    rng = random.Random(20240315)
    generated = []
    kinds = list(pools)
    for _ in range(200 - len(fixed)):
        parts = []
        for _ in range(rng.randint(1, 12)):
            kind = rng.choice(kinds)
            parts.append(rng.choice(pools[kind]))
            if kind != "space" and rng.random() < 0.6:
                parts.append(rng.choice([" ", "", ", ", ".", "\n", "  "]))
        generated.append("".join(parts))
    strings = fixed + generated
    assert len(strings) == 200
    return strings


def reference_bpe_ids(tok, text):
    """Plain BPE by merge rank on the pre-tokenized pieces: what the merges list means."""
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    ranks = {tuple(m): i for i, m in enumerate(model["merges"])}
    ids = []
    for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text):
        symbols = list(piece)
        while len(symbols) > 1:
            pairs = [(ranks.get((a, b), len(ranks)), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))]
            rank, i = min(pairs)
            if rank == len(ranks):
                break
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        ids.extend(vocab[s] for s in symbols)
    return ids


def test_tokenizer_round_trips_exactly(tok, config):
    n_real = tok.get_vocab_size()
    merged = 0
    for s in roundtrip_strings():
        enc = tok.encode(s)
        assert enc.ids[0] == 0, repr(s)  # add_bos_token: BOS prepended by the post-processor
        assert all(2 <= i < n_real for i in enc.ids[1:]), repr(s)
        assert tok.decode(enc.ids, skip_special_tokens=True) == s, repr(s)
        assert tok.decode(enc.ids, skip_special_tokens=False) == "<｜begin▁of▁sentence｜>" + s, repr(s)
        assert enc.ids[1:] == reference_bpe_ids(tok, s), repr(s)
        merged += sum(1 for i in enc.ids[1:] if i >= 258)
    assert merged > 500  # the learned merges are used, not just the byte tokens


def test_special_tokens_are_recognized(ckpts, tok, config):
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<|im_start|>", "<|im_end|>", "<think>",
                "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
    ids = [tok.token_to_id(s) for s in specials]
    assert ids[:2] == [0, 1]
    n = tok.get_vocab_size()
    assert ids[2:] == list(range(n - 8, n))  # the chat specials follow the learned tokens
    for s, i in zip(specials, ids):
        assert tok.encode(s, add_special_tokens=False).ids == [i], s
        assert tok.id_to_token(i) == s
    text = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\nHello<|im_end|>"
    enc = tok.encode(text)
    for s in ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]:
        assert tok.token_to_id(s) in enc.ids, s
    assert tok.decode(enc.ids, skip_special_tokens=False) == "<｜begin▁of▁sentence｜>" + text
    assert tok.decode(enc.ids) == "user\nHi there\nassistant\n\nhm\n\nHello"
    cfg = json.loads((ckpts["bf16"] / "tokenizer_config.json").read_text())
    assert cfg["add_bos_token"] is True and cfg["add_eos_token"] is False
    assert cfg["bos_token"] == specials[0] and cfg["pad_token"] == specials[1] and cfg["eos_token"] == "<|im_end|>"
    assert tok.token_to_id(cfg["eos_token"]) in config["eos_token_id"]
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["model_max_length"] == 4096
    assert "<|im_start|>" in cfg["chat_template"] and "add_generation_prompt" in cfg["chat_template"]


def test_merges_are_a_valid_bpe(tok):
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    assert len(vocab) == tok.get_vocab_size() == len(set(vocab.values()))
    assert sorted(vocab.values()) == list(range(len(vocab)))
    for rank, (a, b) in enumerate(model["merges"]):
        assert vocab[a + b] == 258 + rank
        assert vocab[a] < vocab[a + b] and vocab[b] < vocab[a + b]


# ---- forward pass ----

def residual_rms(x):
    return float(np.sqrt((x * x).mean()))


def test_activations_stay_realistic(bf16, config, tok):
    text = ("The lighthouse keeper counted 12 ships; 灯塔守望者 wrote 🙂 in her notebook:\n"
            "    def f(x): return x * 2  # and the gulls were louder than the engines.")
    ids = tok.encode(text).ids
    assert len(ids) >= 24
    ids = np.array(ids[:32])
    fwd = Step35Numpy(config, bf16)
    w, eps = fwd.w, fwd.eps
    x = w["model.embed_tokens.weight"][ids]
    rms = [residual_rms(x)]
    for layer in range(config["num_hidden_layers"]):
        x = fwd.block(x, layer)
        rms.append(residual_rms(x))
    logits = rms_norm(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T
    # MTP layer (index 6): [enorm(embed(next token)) | hnorm(trunk pre-norm hidden)] -> eh_proj -> block -> head.
    mtp_logits, h_mtp, u = fwd.mtp_logits(ids, x)
    rms += [residual_rms(u), residual_rms(h_mtp)]

    assert all(0.1 <= r <= 50.0 for r in rms), rms
    for lg in (logits, mtp_logits):
        assert np.all(np.isfinite(lg))
        assert 0.1 < lg.std() < 100.0, lg.std()
        assert len(set(lg.argmax(-1).tolist())) > 1  # not collapsed onto one token
    # The router bias changes the top-8 set for some tokens, but not for all.
    assert 0 < fwd.bias_changed < fwd.selections, (fwd.bias_changed, fwd.selections)
    # The clamps cut values where configured (routed 4, 5; shared/dense 1, 5) and nowhere else.
    assert set(fwd.clamped) == {("routed", 4), ("routed", 5), ("shared", 1), ("shared", 5)}
    assert all(n > 0 for n in fwd.clamped.values()), fwd.clamped

