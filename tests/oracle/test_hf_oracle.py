# The independent oracles checked against each other before memra's engine is compared with them:
# transformers' Step-3.5 text model (hf_step35.py) against the numpy forward written from
# STEP35.md (np_step35.py) on tiny BF16 and FP8 checkpoints, its KV-cache decode against full
# prefills, and llama.cpp (llamacpp_step35.py: GGUF from llama.cpp's own converter) against
# transformers, with an f32 and a quantized (q8_0 K / q5_1 V) KV cache.
# Needs the oracle packages of requirements-oracle.txt; skips when they are not installed.
import copy
import json

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch not installed (requirements-oracle.txt)")
pytest.importorskip("transformers.models.step3p7",
                    reason="transformers with the Step-3.5 text model (step3p7) not installed "
                           "(requirements-oracle.txt)")

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from oracle_util import make_tiny, rel_err  # noqa: E402
from hf_step35 import hf_greedy, hf_logits, load_hf_model  # noqa: E402
from np_step35 import (Step35Numpy, dequantize_fp8, float32_weights, ggml_q5_1_round, ggml_q8_0_round,  # noqa: E402
                       llama_cpp_kv_round, load_checkpoint, rope_inv_freq)

SEED = 7
HF_VS_NUMPY_TOL = 1e-4  # max |diff| / max |logit|; measured ~1e-6 (float32 rounding)
LLAMA_F32_TOL = 1e-4  # llama.cpp with f32 weights and f32 KV cache against transformers; measured ~1.5e-6
# llama.cpp's quantized-cache attention runs with flash attention, whose CPU kernel rounds through f16
# (2e-4 even with an f32 cache); measured 5e-4 against the rounding-aware numpy reference.
LLAMA_QUANT_KV_TOL = 3e-3
TEXT = ("The lighthouse keeper counted 12 ships; 灯塔守望者 wrote 🙂 in her notebook:\n"
        "    def f(x): return x * 2  # and the gulls were louder than the engines.")
N_GREEDY = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {d: make_tiny(root / d, d, SEED) for d in ("bf16", "fp8")}


@pytest.fixture(scope="module")
def config(ckpt):
    return json.loads((ckpt["bf16"] / "config.json").read_text())


@pytest.fixture(scope="module")
def prompt(ckpt):
    """64 real token ids: longer than the 16-token sliding window, so windows and RoPE positions matter."""
    ids = Tokenizer.from_file(str(ckpt["bf16"] / "tokenizer.json")).encode(TEXT).ids
    return (ids * 3)[:64]


@pytest.fixture(scope="module")
def hf(ckpt):
    return {d: load_hf_model(ckpt[d]) for d in ckpt}


@pytest.fixture(scope="module")
def weights(ckpt):
    return {d: float32_weights(load_checkpoint(ckpt[d])) for d in ckpt}


@pytest.fixture(scope="module")
def hf_prefill(hf, prompt):
    return {d: hf_logits(hf[d], prompt) for d in hf}


# ---- transformers against the numpy reference ----

@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_hf_matches_numpy(variant, hf_prefill, weights, config, prompt):
    ref = Step35Numpy(config, weights[variant], np.float64).logits(prompt)
    got = hf_prefill[variant]
    err = rel_err(got, ref)
    print(f"\n{variant}: HF vs numpy float64 max relative logit error {err:.3g} over {len(prompt)} positions")
    assert err < HF_VS_NUMPY_TOL, err
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))


def test_comparison_sees_every_feature(hf_prefill, weights, config, prompt):
    """Dropping any one Step-3.5 feature from the numpy reference moves it well outside the tolerance,
    so the agreement above is not blind to it on this prompt."""
    w = weights["bf16"]
    variants = {}
    c = copy.deepcopy(config)
    del c["rope_scaling"]
    variants["no llama3 scaling"] = (c, w)
    c = copy.deepcopy(config)
    c["partial_rotary_factors"] = [1.0] * len(c["layer_types"])
    variants["full rotary on full layers"] = (c, w)
    c = copy.deepcopy(config)
    c["sliding_window"] = 1 << 20
    variants["no sliding window"] = (c, w)
    c = copy.deepcopy(config)
    c["swiglu_limits"] = c["swiglu_limits_shared"] = [0.0] * len(c["layer_types"])
    variants["no clamps"] = (c, w)
    variants["no router bias"] = (config, {n: (np.zeros_like(a) if n.endswith("router_bias") else a)
                                           for n, a in w.items()})
    c = copy.deepcopy(config)
    c["moe_router_scaling_factor"] = 1.0
    variants["no routed scaling"] = (c, w)
    for name, (cfg, wts) in variants.items():
        err = rel_err(hf_prefill["bf16"], Step35Numpy(cfg, wts, np.float64).logits(prompt))
        print(f"\n{name}: {err:.3g}")
        assert err > 3 * HF_VS_NUMPY_TOL, name


def test_rope_frequencies_match(hf, config):
    rotary = hf["bf16"].text.rotary_emb
    for layer, kind in ((0, "full_attention"), (1, "sliding_attention")):
        hf_inv = getattr(rotary, f"{kind}_inv_freq").double().numpy()
        ref = rope_inv_freq(config, layer)
        assert hf_inv.shape == ref.shape == (int(config["head_dim"] * config["partial_rotary_factors"][layer]) // 2,)
        assert np.allclose(hf_inv, ref, rtol=1e-6, atol=0), kind
    assert not np.allclose(rope_inv_freq(config, 0), 5e6 ** (-np.arange(0, 16, 2) / 16))  # llama3 scaled


def test_fp8_dequantization_matches_torch(ckpt):
    """ml_dtypes' float8_e4m3fn decode times the block multipliers equals torch's own float8 decode."""
    tensors = load_checkpoint(ckpt["fp8"])
    n = 0
    for name, (dtype, _, q, _) in tensors.items():
        if dtype != "F8_E4M3":
            continue
        scale = tensors[name + "_scale_inv"][2]
        t = torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn).float()
        s = torch.from_numpy(scale.copy()).repeat_interleave(128, 1).repeat_interleave(128, 2)
        expected = (t * s[:, :q.shape[1], :q.shape[2]]).numpy()
        assert np.array_equal(dequantize_fp8(q, scale), expected), name
        n += 1
    assert n == 12


def test_fp8_model_differs_from_bf16_by_quantization_noise(hf_prefill):
    err = rel_err(hf_prefill["fp8"], hf_prefill["bf16"])
    print(f"\nHF fp8 vs bf16: {err:.3g}")
    assert 1e-3 < err < 0.5, err


# ---- decode through the KV cache ----

@pytest.fixture(scope="module")
def hf_greedy_bf16(hf, prompt):
    return hf_greedy(hf["bf16"], prompt[:20], N_GREEDY)  # 20 + 16 tokens: crosses the 16-token window


def test_hf_decode_matches_prefill(hf_greedy_bf16, weights, config, prompt):
    g = hf_greedy_bf16
    print(f"\nHF decode vs re-prefill: max abs {g.recheck_max_abs:.3g}, relative {g.recheck_max_rel:.3g}")
    assert g.recheck_max_rel <= 1e-5
    assert len(g.tokens) == N_GREEDY and g.logits.shape == (N_GREEDY, config["vocab_size"])
    assert len(set(g.tokens)) > 1
    # The decode rows also agree with the numpy reference's prefill of the same sequence.
    ref = Step35Numpy(config, weights["bf16"], np.float64).logits(prompt[:20] + g.tokens[:-1])[19:]
    assert rel_err(g.logits, ref) < HF_VS_NUMPY_TOL
    assert g.tokens == ref.argmax(-1).tolist()


# ---- llama.cpp against transformers ----

@pytest.fixture(scope="module")
def llama_mod():
    pytest.importorskip("llama_cpp", reason="llama_cpp (llama-cpp-python) not installed (requirements-oracle.txt)")
    import llamacpp_step35
    return llamacpp_step35


@pytest.fixture(scope="module")
def gguf(llama_mod, ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf")
    paths = {}
    for d in ckpt:
        paths[d] = out / f"tiny-{d}.gguf"
        log = llama_mod.convert_to_gguf(ckpt[d], paths[d])
        assert f"using {llama_mod.FALLBACK_PRE_TOKENIZER!r}" in log  # the tiny vocab's hash is unknown
    return paths


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_llama_cpp_matches_hf(variant, llama_mod, gguf, hf, hf_prefill, prompt):
    llm = llama_mod.load_llama(gguf[variant])
    err = rel_err(llama_mod.llama_logits(llm, prompt), hf_prefill[variant])
    g = llama_mod.llama_greedy(llm, prompt[:20], N_GREEDY)
    h = hf_greedy(hf[variant], prompt[:20], N_GREEDY, recheck=False)
    step_err = rel_err(g.logits, h.logits)
    agree = sum(a == b for a, b in zip(g.tokens, h.tokens))
    print(f"\n{variant}: llama.cpp (f32 KV) vs HF prefill {err:.3g}, greedy steps {step_err:.3g}, "
          f"tokens agree {agree}/{N_GREEDY}")
    assert err < LLAMA_F32_TOL, err
    assert step_err < LLAMA_F32_TOL, step_err
    assert g.tokens == h.tokens


def test_llama_cpp_quantized_kv_cache(llama_mod, gguf, hf, hf_prefill, weights, config, prompt):
    """q8_0 K / q5_1 V: llama.cpp agrees with the numpy reference rounding Q, K and V the way ggml does,
    while both sit far from the unquantized model (the tiny random model amplifies cache rounding:
    near-tied top-8-of-16 routing flips)."""
    llm = llama_mod.load_llama(gguf["bf16"], type_k="q8_0", type_v="q5_1")  # flash attention on
    got = llama_mod.llama_logits(llm, prompt)
    sim = Step35Numpy(config, weights["bf16"], np.float64,
                      attn_round=llama_cpp_kv_round(ggml_q8_0_round, ggml_q5_1_round)).logits(prompt)
    err_sim, err_hf = rel_err(got, sim), rel_err(got, hf_prefill["bf16"])
    g = llama_mod.llama_greedy(llm, prompt[:20], N_GREEDY)
    h = hf_greedy(hf["bf16"], prompt[:20], N_GREEDY, recheck=False)
    agree = sum(a == b for a, b in zip(g.tokens, h.tokens))
    print(f"\nllama.cpp q8_0 K / q5_1 V: vs numpy with the same rounding {err_sim:.3g}, vs unquantized HF "
          f"{err_hf:.3g}; greedy tokens agree with HF {agree}/{N_GREEDY}")
    assert err_sim < LLAMA_QUANT_KV_TOL, err_sim
    assert np.array_equal(got.argmax(-1), sim.argmax(-1))
    assert err_hf > 10 * err_sim  # the cache really is quantized, and the simulation is what explains it


def test_llama_cpp_quantized_v_cache_needs_flash_attention(llama_mod, gguf):
    with pytest.raises(ValueError):
        llama_mod.load_llama(gguf["bf16"], type_k="q8_0", type_v="q5_1", flash_attn=False)
