"""The `device` numerics of the numpy forward (np_step35.py, ENGINE.md section 4), with no C++ tool: the bf16
rounding and the e4m3 group quantizer against hand-written bit-level / scalar implementations, the W8A8 product
against its formula, the blocked attention order (CUDA.md 3.2) against float64 softmax attention and a per-row
scalar version of the order (and each rounding point shown to matter), and the whole forward on a random tiny
checkpoint built here (BF16 and FP8 experts): device against exact mode (the measured distances are printed, to
size the engine's tolerances) and teacher-forced layers. (Exact mode stays pinned by test_forward_np.py and
test_hf_oracle.py: memra's exact engine and transformers against it.)"""
import bisect
import os
from fractions import Fraction

# Thousands of tiny products: BLAS worker threads only add wake-up latency, which on a busy machine outweighs the
# products (measured with a compile on both cores: 45 s with OpenBLAS's default threads, 12 s with one). Takes
# effect when this module is the first to import numpy, as under CTest (one suite per process).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import np_step35  # noqa: E402
from np_step35 import (  # noqa: E402
    Fp8Weight, Step35Numpy, bf16_round, blocked_attention, float32_weights, ggml_q5_1_round, ggml_q8_0_round,
    llama_cpp_kv_round, quantize_e4m3_groups, w8a8_matmul)
from oracle_util import rel_err  # noqa: E402

E4M3 = ml_dtypes.float8_e4m3fn


# ---------------------------------------------------------------------------------------------------------------
# Hand-written roundings, independent of ml_dtypes.

def e4m3_table():
    """Every non-negative finite e4m3 value in code order (codes 0x00..0x7e), decoded from the bit layout:
    subnormals m * 2^-9, normals (1 + m/8) * 2^(e - 7); 0x7f is NaN."""
    return [(m * 2.0 ** -9) if e == 0 else (1 + m / 8) * 2.0 ** (e - 7) for e in range(16) for m in range(8)][:0x7f]


E4M3_VALUES = e4m3_table()


def e4m3_rne(x):
    """float x rounded to nearest e4m3 value, ties to the even code, saturated to +-448."""
    a = abs(float(x))
    if a >= 448.0:
        r = 448.0
    else:
        i = bisect.bisect_right(E4M3_VALUES, a) - 1
        below, above = Fraction(a) - Fraction(E4M3_VALUES[i]), Fraction(E4M3_VALUES[i + 1]) - Fraction(a)
        if below < above or (below == above and i % 2 == 0):
            r = E4M3_VALUES[i]
        else:
            r = E4M3_VALUES[i + 1]
    return -r if np.signbit(x) else r


def bf16_rne_bits(x):
    """float32 array x rounded to bfloat16 by integer arithmetic on its bits (NaN left out: the caller checks
    those), returned as float32."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def quantize_groups_scalar(row):
    """quantize_e4m3_groups for one row, element by element with float32 scalars and e4m3_rne; an amax / 448 that
    underflows to 0 becomes 2^-149, as in the checkpoint's weight quantizer."""
    codes, scales = [], []
    for g0 in range(0, len(row), 128):
        group = [np.float32(v) for v in row[g0:g0 + 128]]
        amax = np.float32(0)
        for v in group:
            amax = max(amax, np.float32(abs(v)))
        scale = np.float32(1) if amax == 0 else np.float32(amax / np.float32(448))
        if amax > 0 and scale == 0:
            scale = np.float32(2.0 ** -149)
        scales.append(scale)
        codes += [e4m3_rne(np.float32(v / scale)) for v in group]
    return np.array(codes), np.array(scales, np.float32)


# ---------------------------------------------------------------------------------------------------------------
# Roundings.

def test_ml_dtypes_rounds_e4m3_to_nearest_even():
    """The float32 -> float8_e4m3fn cast the quantizer uses is RNE: random values over the whole range, every
    midpoint between neighbours (ties) and one float32 ulp either side, subnormals (step 2^-9) and values near
    448, both signs, against e4m3_rne."""
    rng = np.random.default_rng(1)
    mags = 2.0 ** rng.uniform(-12, np.log2(448), 300)
    mids = [(a + b) / 2 for a, b in zip(E4M3_VALUES, E4M3_VALUES[1:])]
    near = [np.nextafter(np.float32(m), np.float32(d)) for m in mids for d in (0, 1000)]
    edge = [0.0, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -9, 7 * 2.0 ** -9, 2.0 ** -11, 2.0 ** -6, 416, 420, 432, 440,
            447.9, 448]
    x = np.concatenate([mags, mids, near, edge, E4M3_VALUES]).astype(np.float32)
    x = np.concatenate([x, -x])
    assert np.abs(x).max() <= 448
    got = x.astype(E4M3).astype(np.float64)
    want = np.array([e4m3_rne(v) for v in x])
    assert np.array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))
    # The ties went both ways: to the even code, which is sometimes the lower and sometimes the upper neighbour.
    tie_up = [e4m3_rne(m) > m for m in mids]
    assert any(tie_up) and not all(tie_up)
    assert e4m3_rne(432.0) == 448.0 and e4m3_rne(2.0 ** -10) == 0.0 and e4m3_rne(3 * 2.0 ** -10) == 2.0 ** -8


def test_bf16_round_is_rne():
    """bf16_round against ml_dtypes and against integer rounding of the bits: random bit patterns (every exponent,
    subnormals), exact ties with an even and an odd kept bit, ulp neighbours of ties, +-0, +-inf, the overflow to
    inf past the largest bf16, and NaNs (quiet and signalling payloads) staying NaN."""
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 2 ** 32, 20000, dtype=np.uint64).astype(np.uint32)
    hi = rng.integers(0, 2 ** 16, 2000, dtype=np.uint64).astype(np.uint32) << 16
    ties = np.concatenate([hi | 0x8000, hi | 0x7FFF, hi | 0x8001])
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000,
                        0x7F7F8001, 0x00000001, 0x00008000, 0x00018000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF],
                       np.uint32)
    x = np.concatenate([bits, ties, special]).view(np.float32)
    with np.errstate(invalid="ignore"):  # the NaNs
        got = bf16_round(x)
    nan = np.isnan(x)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), bf16_rne_bits(x[~nan]).view(np.uint32))
    assert np.array_equal(got[~nan].view(np.uint32), x[~nan].astype(ml_dtypes.bfloat16).astype(np.float32)
                          .view(np.uint32))
    assert bf16_round(x[~nan]).dtype == np.float32
    # The largest bf16 stays, the tie above it (odd kept bit) overflows to inf, as does float32's largest value.
    top = np.array([0x7F7F0000, 0x7F7F8000, 0x7F7FFFFF], np.uint32).view(np.float32)
    assert bf16_round(top)[0] == top[0] and np.isinf(bf16_round(top)[1:]).all()
    # Ties: 1 + 2^-8 (kept bit even) rounds down, 1 + 3 * 2^-8 (odd) rounds up.
    assert bf16_round(np.float32(1 + 2 ** -8)) == 1 and bf16_round(np.float32(1 + 3 * 2 ** -8)) == 1 + 2 ** -6


def test_group_quantizer_matches_scalar():
    """quantize_e4m3_groups against quantize_groups_scalar: rows over many magnitudes, K = 300 (two full groups
    and a partial one of 44), an all-zero group (scale 1, zero codes), groups whose largest value lands exactly on
    +448 / -448, and a group of tiny values (subnormal codes)."""
    rng = np.random.default_rng(3)
    k = 300
    x = (rng.standard_normal((12, k)) * (10.0 ** rng.uniform(-6, 4, (12, 1)))).astype(np.float32)
    x[1, :128] = 0  # all-zero group
    x[2, 128:256] = np.clip(x[2, 128:256], -6.9, 6.9)
    x[2, 200] = 7.0  # scale 7 / 448 = 2^-6 exactly: code +448
    x[3, 256:] = np.clip(x[3, 256:], -2.9, 2.9)
    x[3, 260] = -3.0  # partial group, code -448
    x[4, :128] = rng.uniform(-1, 1, 128) * 2.0 ** -100  # small but normal: ordinary codes
    x[5, :] = 0
    x[6, :128] = 1.0  # every code 448
    x[7, :128] = rng.uniform(-1, 1, 128).astype(np.float32) * 0.01
    x[7, 5] = 4.48  # scale 0.01: values below 0.01 * 2^-6 get subnormal codes
    x[8, :128] = 0
    x[8, :3] = np.float32(2.0 ** -149) * np.float32([1, -2, -1])  # amax / 448 underflows to 0
    codes, scales = quantize_e4m3_groups(x)
    assert codes.dtype == E4M3 and codes.shape == (12, k) and scales.dtype == np.float32 and scales.shape == (12, 3)
    for r in range(x.shape[0]):
        want_codes, want_scales = quantize_groups_scalar(x[r])
        assert np.array_equal(scales[r].view(np.uint32), want_scales.view(np.uint32)), r
        assert np.array_equal(codes[r].astype(np.float64), want_codes), r
    assert scales[1, 0] == 1 and not codes[1, :128].astype(np.float32).any()
    assert np.array_equal(scales[5], np.ones(3, np.float32)) and not codes[5].astype(np.float32).any()
    assert scales[2, 1] == 2.0 ** -6 and codes[2, 200].astype(np.float32) == 448
    assert codes[3, 260].astype(np.float32) == -448
    assert scales[8, 0] == np.float32(2.0 ** -149) and np.array_equal(codes[8, :4].astype(np.float32), [1, -2, -1, 0])
    assert np.all(codes[6, :128].astype(np.float32) == 448)
    for r in range(x.shape[0]):  # every group's largest magnitude maps to a code of magnitude 448 (but row 8's)
        for g in range(3):
            grp = x[r, g * 128:(g + 1) * 128]
            if np.abs(grp).max() > 0 and (r, g) != (8, 0):
                assert np.abs(codes[r, g * 128 + np.abs(grp).argmax()].astype(np.float32)) == 448
    tiny_codes = np.abs(codes[7, :128].astype(np.float32))
    assert ((tiny_codes > 0) & (tiny_codes < 2.0 ** -6)).any()  # subnormal codes in use


def quantize_fp8_blocks(w):
    """A stacked weight [E, rows, cols] as e4m3 codes with 128x128 block scale_inv (amax / 448), as the official
    FP8 checkpoint stores routed experts."""
    n_exp, rows, cols = w.shape
    rb, cb = -(-rows // 128), -(-cols // 128)
    padded = np.zeros((n_exp, rb * 128, cb * 128), np.float32)
    padded[:, :rows, :cols] = w
    blocks = padded.reshape(n_exp, rb, 128, cb, 128)
    amax = np.abs(blocks).max((2, 4))
    scale = np.where(amax == 0, np.float32(1), amax / np.float32(448)).astype(np.float32)
    codes = np.clip(blocks / scale[:, :, None, :, None], -448, 448).astype(E4M3)
    return codes.reshape(n_exp, rb * 128, cb * 128)[:, :rows, :cols], scale


def test_w8a8_matmul_follows_its_formula():
    """w8a8_matmul against the formula written out per output element (chunk sums of code products, promoted by
    the two scales in chunk order), with K = 300 (a partial last chunk) and N = 200 (a partial row block); and
    close to the float64 product of the dequantized operands, while the unquantized activation is further off."""
    rng = np.random.default_rng(4)
    m, n, k = 5, 200, 300
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
    x[2, 128:256] = 0
    codes_w, scale_w = quantize_fp8_blocks((rng.standard_normal((1, n, k)) / np.sqrt(k)).astype(np.float32))
    w = Fp8Weight(codes_w, scale_w)[0]
    got = w8a8_matmul(x, w)
    assert got.dtype == np.float32 and got.shape == (m, n)
    cx, sx = quantize_e4m3_groups(x)
    cxf, cwf = cx.astype(np.float64), codes_w[0].astype(np.float64)
    for i in range(m):
        for j in range(0, n, 7):
            acc = np.float32(0)
            for c in range(3):
                ks = slice(c * 128, min(k, c * 128 + 128))
                p = np.float32(np.dot(cxf[i, ks], cwf[j, ks]))
                s = np.float32(sx[i, c] * scale_w[0, j // 128, c])
                acc = np.float32(np.float64(p) * np.float64(s) + np.float64(acc))
            assert got[i, j] == acc, (i, j)
    deq_x = cxf * np.repeat(sx, 128, axis=1)[:, :k]
    deq_w = np_step35.dequantize_fp8(codes_w, scale_w)[0].astype(np.float64)
    exact = deq_x @ deq_w.T
    assert rel_err(got, exact) < 1e-6
    assert rel_err(x.astype(np.float64) @ deq_w.T, exact) > 1e-3  # the activation quantization is visible


# ---------------------------------------------------------------------------------------------------------------
# Blocked attention.

def softmax_attention_f64(q, k, v, q_pos, k_pos, window=None):
    """Plain causal softmax attention in float64 on the same inputs."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    lo = np.zeros_like(q_pos) if window is None else np.maximum(0, q_pos - window + 1)
    visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= lo[:, None])
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    s = np.where(visible[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)


def blocked_row_scalar(q, k, v, pos, lo):
    """One query row [H, hd] at position pos seeing positions [lo, pos] of k, v [T, H, hd] (key i at position i),
    in CUDA.md 3.2's order written from its definition: splits [512 j, 512 j + 511] and blocks [128 i, 128 i + 127]
    intersected with [lo, pos], only non-empty ones, online softmax per split, splits merged left to right."""
    scale = np.float32(1.0 / np.sqrt(np.float64(q.shape[-1])))
    state = None
    for s0 in range(0, pos + 1, 512):
        a0, a1 = max(s0, lo), min(s0 + 511, pos)
        if a0 > a1:
            continue
        m, lsum, acc = None, np.float32(0), np.zeros(q.shape, np.float32)
        for b0 in range(s0, s0 + 512, 128):
            c0, c1 = max(b0, a0), min(b0 + 127, a1)
            if c0 > c1:
                continue
            s = np.einsum("hd,khd->hk", q, k[c0:c1 + 1]) * scale
            m_new = s.max(-1) if m is None else np.maximum(m, s.max(-1))
            alpha = np.float32(0) if m is None else np.exp(m - m_new)
            e = np.exp(s - m_new[:, None])
            lsum = lsum * alpha + e.sum(-1)
            acc = acc * np.atleast_1d(alpha)[:, None] + np.einsum("hk,khd->hd", bf16_round(e), v[c0:c1 + 1])
            m = m_new
        if state is None:
            state = (m, lsum, acc)
        else:
            big_m, big_l, big_acc = state
            m_new = np.maximum(big_m, m)
            a, b = np.exp(big_m - m_new), np.exp(m - m_new)
            state = (m_new, big_l * a + lsum * b, big_acc * a[:, None] + acc * b[:, None])
    return state[2] / state[1][:, None]


@pytest.fixture(scope="module")
def attn_inputs():
    """700 positions (crossing 128 and 512) of 2 heads of 32 dims, q scaled so the softmax is peaky; q, k, v
    rounded to bf16 as device mode feeds them, plus the unrounded v."""
    rng = np.random.default_rng(5)
    t, h, hd = 700, 2, 32
    q = (rng.standard_normal((t, h, hd)) * 2.5).astype(np.float32)
    k = rng.standard_normal((t, h, hd)).astype(np.float32)
    v = rng.standard_normal((t, h, hd)).astype(np.float32)
    return bf16_round(q), bf16_round(k), bf16_round(v), v, np.arange(t)


@pytest.mark.parametrize("window", [None, 200, 37, 600])
def test_blocked_attention_matches_softmax(attn_inputs, window):
    """Within bf16-level tolerance of float64 softmax attention on every row, full or sliding (windows 200 and 37:
    rows from position 200 / 37 on start mid-block and mid-split; 600: a row sees up to two splits and six blocks);
    and to float32 level the per-row scalar version of the order, for rows around the block and split
    boundaries."""
    q, k, v, _, pos = attn_inputs
    got = blocked_attention(q, k, v, pos, pos, window)
    assert got.dtype == np.float32 and got.shape == q.shape
    ref = softmax_attention_f64(q, k, v, pos, pos, window)
    err = np.abs(got - ref).max()
    assert err < 2.0 ** -8, err
    for p in (0, 1, 127, 128, 129, 300, 511, 512, 513, 640, 699):
        lo = 0 if window is None else max(0, p - window + 1)
        want = blocked_row_scalar(q[p], k, v, p, lo)
        assert np.abs(got[p] - want).max() < 2e-6, (p, np.abs(got[p] - want).max())


def test_blocked_attention_query_rows_at_any_positions(attn_inputs):
    """Query rows given at scattered positions (decode and verify rows) against the same scalar order."""
    q, k, v, _, pos = attn_inputs
    rows = np.array([699, 5, 512, 128, 383, 640])
    got = blocked_attention(q[rows], k, v, rows, pos, 200)
    for i, p in enumerate(rows):
        assert np.abs(got[i] - blocked_row_scalar(q[p], k, v, p, max(0, p - 199))).max() < 2e-6


def test_each_attention_rounding_point_matters(attn_inputs):
    """Leaving out one point of the order changes the result (within the softmax tolerance still): P not rounded
    to bf16, V not rounded, one split for the whole context instead of 512-position splits, blocks not aligned to
    position 0. The split change leaves rows before 512 bit for bit as they were (one split either way)."""
    q, k, v_bf16, v, pos = attn_inputs
    base = blocked_attention(q, k, v_bf16, pos, pos)
    ref = softmax_attention_f64(q, k, v_bf16, pos, pos)
    variants = {
        "P not rounded": blocked_attention(q, k, v_bf16, pos, pos, round_p=False),
        "V not rounded": blocked_attention(q, k, v, pos, pos),
        "one split": blocked_attention(q, k, v_bf16, pos, pos, split=1 << 30),
        "blocks at 64 + 128 j": blocked_attention(q, k, v_bf16, pos, pos, origin=64),
    }
    print(f"\nblocked attention vs float64 softmax: max |diff| {np.abs(base - ref).max():.3g}")
    for name, out in variants.items():
        diff = np.abs(out - base).max()
        print(f"blocked attention with {name}: max |diff| {diff:.3g} from the canonical order")
        assert diff > 0, name
        own_ref = softmax_attention_f64(q, k, v, pos, pos) if name == "V not rounded" else ref
        assert np.abs(out - own_ref).max() < 2.0 ** -8, name
    one_split = variants["one split"]
    assert np.array_equal(one_split[:512], base[:512])
    assert not np.array_equal(one_split[512:], base[512:])
    # The P rounding is far above float32 noise: the scalar version of the order is 100 times closer.
    p = 650
    scalar = blocked_row_scalar(q[p], k, v_bf16, p, 0)
    assert np.abs(variants["P not rounded"][p] - base[p]).max() > 100 * np.abs(base[p] - scalar).max()


# ---------------------------------------------------------------------------------------------------------------
# The whole forward on a random tiny checkpoint.

CFG = {
    "hidden_size": 256, "head_dim": 32, "num_attention_heads": 4, "num_attention_groups": 2,
    "attention_other_setting": {"attention_type": "sliding_attention", "num_attention_heads": 8,
                                "num_attention_groups": 2, "head_dim": 32, "true_head_dim": 32},
    "num_hidden_layers": 4, "num_nextn_predict_layers": 1,
    "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention",
                    "sliding_attention"],
    "sliding_window": 160, "rope_theta": [5000000.0, 10000.0, 10000.0, 10000.0, 10000.0],
    "partial_rotary_factors": [0.5, 1.0, 1.0, 1.0, 1.0],
    "rope_scaling": {"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 131072,
                     "low_freq_factor": 1.0, "high_freq_factor": 32.0},
    "yarn_only_types": ["full_attention"],
    "intermediate_size": 384, "moe_layers_enum": "2,3", "moe_num_experts": 8, "moe_top_k": 4,
    "moe_intermediate_size": 160,  # not a multiple of 128: a partial K chunk (down) and row block (gate/up)
    "share_expert_dim": 64, "moe_router_scaling_factor": 3.0,
    "swiglu_limits": [0.0, 0.0, 0.0, 1.5, 0.0], "swiglu_limits_shared": [0.0, 2.5, 0.0, 2.5, 0.0],
    "rms_norm_eps": 1e-5, "vocab_size": 512,
}
N_TOK = 600  # past 512: two attention splits on the full layer


def random_checkpoint(cfg, fp8, seed=11):
    """load_checkpoint-style tuples (dtype, shape, array, shard) of a random Step-3.5 checkpoint with cfg's shapes,
    scaled as `memra make-tiny` scales (linear weights std 1/sqrt(fan_in), embeddings std 1, norm weights in
    (-0.1, 0.1), router bias in (-0.03, 0.03)); BF16 everywhere, routed experts F8_E4M3 with 128x128 scale_inv
    when fp8."""
    rng = np.random.default_rng(seed)
    d, hd, kv, vocab = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_groups"], cfg["vocab_size"]
    n_exp, d_exp, d_sh = cfg["moe_num_experts"], cfg["moe_intermediate_size"], cfg["share_expert_dim"]
    moe = {int(x) for x in cfg["moe_layers_enum"].split(",")}
    out = {}

    def bf16(name, shape, amp):
        arr = rng.uniform(-amp, amp, shape).astype(np.float32).astype(ml_dtypes.bfloat16)
        out[name] = ("BF16", list(shape), arr, "model.safetensors")

    def linear(name, shape, expert=False):
        amp = np.sqrt(3.0 / shape[-1])
        if expert and fp8:
            w = rng.uniform(-amp, amp, shape).astype(np.float32)
            codes, scale = quantize_fp8_blocks(bf16_round(w))
            out[name] = ("F8_E4M3", list(shape), codes, "model.safetensors")
            out[name + "_scale_inv"] = ("F32", list(scale.shape), scale, "model.safetensors")
        else:
            bf16(name, shape, amp)

    bf16("model.embed_tokens.weight", (vocab, d), np.sqrt(3.0))
    n_layers = cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]
    for layer in range(n_layers):
        p = f"model.layers.{layer}."
        full = cfg["layer_types"][layer] == "full_attention"
        n_q = cfg["num_attention_heads"] if full else cfg["attention_other_setting"]["num_attention_heads"]
        if layer >= cfg["num_hidden_layers"]:
            bf16(p + "enorm.weight", (d,), 0.1)
            bf16(p + "hnorm.weight", (d,), 0.1)
            linear(p + "eh_proj.weight", (d, 2 * d))
            bf16(p + "transformer.shared_head.norm.weight", (d,), 0.1)
            linear(p + "transformer.shared_head.output.weight", (vocab, d))
        bf16(p + "input_layernorm.weight", (d,), 0.1)
        bf16(p + "post_attention_layernorm.weight", (d,), 0.1)
        linear(p + "self_attn.q_proj.weight", (n_q * hd, d))
        linear(p + "self_attn.k_proj.weight", (kv * hd, d))
        linear(p + "self_attn.v_proj.weight", (kv * hd, d))
        linear(p + "self_attn.g_proj.weight", (n_q, d))
        linear(p + "self_attn.o_proj.weight", (d, n_q * hd))
        bf16(p + "self_attn.q_norm.weight", (hd,), 0.1)
        bf16(p + "self_attn.k_norm.weight", (hd,), 0.1)
        if layer in moe:
            linear(p + "moe.gate.weight", (n_exp, d))
            bias = rng.uniform(-0.03, 0.03, n_exp).astype(np.float32)
            out[p + "moe.router_bias"] = ("F32", [n_exp], bias, "model.safetensors")
            linear(p + "moe.gate_proj.weight", (n_exp, d_exp, d), expert=True)
            linear(p + "moe.up_proj.weight", (n_exp, d_exp, d), expert=True)
            linear(p + "moe.down_proj.weight", (n_exp, d, d_exp), expert=True)
            linear(p + "share_expert.gate_proj.weight", (d_sh, d))
            linear(p + "share_expert.up_proj.weight", (d_sh, d))
            linear(p + "share_expert.down_proj.weight", (d, d_sh))
        else:
            linear(p + "mlp.gate_proj.weight", (cfg["intermediate_size"], d))
            linear(p + "mlp.up_proj.weight", (cfg["intermediate_size"], d))
            linear(p + "mlp.down_proj.weight", (d, cfg["intermediate_size"]))
    bf16("model.norm.weight", (d,), 0.1)
    linear("lm_head.weight", (vocab, d))
    return out


@pytest.fixture(scope="module")
def ckpt():
    return {v: random_checkpoint(CFG, v == "fp8") for v in ("bf16", "fp8")}


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(12).integers(0, CFG["vocab_size"], N_TOK)


def distances(a, ref):
    return float(np.abs(a - ref).max()), rel_err(a, ref)


def flipped_tokens(a, b, layer):
    """Tokens whose expert set differs between the last block calls of layer on models a and b."""
    if layer not in a.routes:
        return np.zeros(0, int)
    ra, rb = np.sort(a.routes[layer], 1), np.sort(b.routes[layer], 1)
    return np.flatnonzero((ra != rb).any(1))


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_device_forward_against_exact(variant, ckpt, ids):
    """Device mode (raw checkpoint: W8A8 experts for fp8) against float32 exact mode (dequantized weights) over
    600 positions: the hidden states and logits end to end, each layer teacher-forced (fed exact mode's input),
    the MTP logits. A token whose expert set flips (router scores near a tie) moves by O(1), so the distances
    also leave those tokens out and count them. The distances are printed to size the engine's tolerances; they
    must be far above float32 noise (exact float32 vs float64) and still small."""
    w32 = float32_weights(ckpt[variant])
    exact = Step35Numpy(CFG, w32)
    device = Step35Numpy(CFG, ckpt[variant], numerics="device")
    ex_states, dev_states = exact.trunk_states(ids), device.trunk_states(ids)
    e2e_flips = sorted(set().union(*(flipped_tokens(device, exact, layer) for layer in exact.routes)))
    keep = np.setdiff1d(np.arange(N_TOK), e2e_flips)
    print(f"\n{variant}, device vs exact float32, {N_TOK} positions (max |diff|, max |diff| / max |exact|):")
    for layer in range(CFG["num_hidden_layers"]):
        e2e, e2e_keep = distances(dev_states[layer + 1], ex_states[layer + 1]), \
            distances(dev_states[layer + 1][keep], ex_states[layer + 1][keep])
        print(f"  layer {layer} end to end: {e2e[0]:.3g} / {e2e[1]:.3g}; without the {len(e2e_flips)} tokens with "
              f"flipped experts {e2e_keep[0]:.3g} / {e2e_keep[1]:.3g}")
    for layer in range(CFG["num_hidden_layers"]):
        got = device.block(ex_states[layer], layer)  # exact.routes are those of this same input
        flips = flipped_tokens(device, exact, layer)
        rest = np.setdiff1d(np.arange(N_TOK), flips)
        tf = distances(got[rest], ex_states[layer + 1][rest])
        print(f"  layer {layer} teacher-forced: {tf[0]:.3g} / {tf[1]:.3g}, {len(flips)} tokens with flipped experts "
              f"left out" + (f" (their max |diff| {np.abs(got - ex_states[layer + 1])[flips].max():.3g})"
                             if len(flips) else ""))
        # e4m3 keeps 3 mantissa bits: W8A8 experts move the MoE layers several times more than bf16 does.
        assert 1e-4 < tf[1] < (5e-2 if variant == "fp8" and layer in exact.routes else 1e-2), (layer, tf)
        assert len(flips) <= N_TOK // 50
    ex_logits, dev_logits = exact.final_logits(ex_states[-1]), device.final_logits(dev_states[-1])
    lg, lg_keep = distances(dev_logits, ex_logits), distances(dev_logits[keep], ex_logits[keep])
    lg_tf = distances(device.final_logits(ex_states[-1]), ex_logits)
    agree = float((dev_logits.argmax(-1) == ex_logits.argmax(-1)).mean())
    print(f"  logits end to end: {lg[0]:.3g} / {lg[1]:.3g}; without flipped tokens {lg_keep[0]:.3g} / "
          f"{lg_keep[1]:.3g} (max |logit| {np.abs(ex_logits).max():.3g}, argmax agrees on {agree:.1%})")
    print(f"  lm_head teacher-forced: {lg_tf[0]:.3g} / {lg_tf[1]:.3g}")
    ex_mtp, dev_mtp = exact.mtp_logits(ids, ex_states[-1])[0], device.mtp_logits(ids, dev_states[-1])[0]
    mtp_tf = distances(device.mtp_logits(ids, ex_states[-1])[0], ex_mtp)
    mtp = distances(dev_mtp, ex_mtp)
    print(f"  MTP logits end to end {mtp[0]:.3g} / {mtp[1]:.3g}; fed exact mode's trunk output {mtp_tf[0]:.3g} / "
          f"{mtp_tf[1]:.3g}")
    n_f64 = 128  # a float64 prefix is enough (causal) and cheaper
    f64 = distances(ex_logits[:n_f64], Step35Numpy(CFG, w32, np.float64).logits(ids[:n_f64]))
    print(f"  for scale: exact float32 vs float64 logits over the first {n_f64} positions {f64[0]:.3g} / "
          f"{f64[1]:.3g}")
    assert 100 * f64[1] < lg_tf[1] < 1e-2
    assert lg_keep[1] < 1e-1 and mtp_tf[1] < 1e-2
    assert agree > 0.85


def test_fp8_experts_take_the_w8a8_path(ckpt, ids):
    """Device mode on the raw FP8 checkpoint quantizes the routed experts' activations to e4m3; on the same
    experts dequantized to float32 it rounds them to bf16 instead: the MoE layers differ, the dense ones not."""
    raw = Step35Numpy(CFG, ckpt["fp8"], numerics="device")
    deq = Step35Numpy(CFG, float32_weights(ckpt["fp8"]), numerics="device")
    assert isinstance(raw.w["model.layers.2.moe.down_proj.weight"], Fp8Weight)
    assert not isinstance(deq.w["model.layers.2.moe.down_proj.weight"], Fp8Weight)
    states = raw.trunk_states(ids[:64])
    a, b = raw.layer_outputs(states[:-1]), deq.layer_outputs(states[:-1])
    for layer in (0, 1):
        assert np.array_equal(a[layer], b[layer])
    for layer in (2, 3):
        print(f"\nlayer {layer}: W8A8 vs bf16-activation experts {rel_err(a[layer], b[layer]):.3g}")
        assert 1e-3 < rel_err(a[layer], b[layer]) < 5e-2


def test_teacher_forced_layers_reproduce_the_forward(ckpt, ids):
    """layer_outputs fed the forward's own layer inputs gives its layer outputs bit for bit, final_logits of the
    trunk output its logits; the router and clamp statistics are kept in device mode too."""
    device = Step35Numpy(CFG, ckpt["fp8"], numerics="device")
    states = device.trunk_states(ids[:200])
    outs = device.layer_outputs(states[:-1])
    for layer, out in enumerate(outs):
        assert np.array_equal(out, states[layer + 1]), layer
        assert out.dtype == np.float32
    assert np.array_equal(device.final_logits(states[-1]), device.logits(ids[:200]))
    assert np.array_equal(device.embed(ids[:5]), states[0][:5])
    assert device.selections == 3 * 2 * 200
    assert device.bias_changed > 0
    assert device.clamped[("routed", 3)] > 0 and device.clamped[("shared", 1)] > 0
    # Rows at other absolute positions (a chunk from 450 on: its sliding windows cross the split at 512).
    pos = np.arange(450, 650)
    exact = Step35Numpy(CFG, float32_weights(ckpt["fp8"]))
    assert rel_err(device.block(states[1], 1, pos), exact.block(states[1], 1, pos)) < 1e-2


def test_device_mode_refusals(ckpt):
    """Device mode refuses float64 and an FP8 tensor without its scales; an unknown numerics is refused."""
    with pytest.raises(ValueError, match="float32"):
        Step35Numpy(CFG, ckpt["bf16"], np.float64, numerics="device")
    with pytest.raises(ValueError, match="numerics 'fast'"):
        Step35Numpy(CFG, ckpt["bf16"], numerics="fast")
    missing = {n: t for n, t in ckpt["fp8"].items() if n != "model.layers.2.moe.up_proj.weight_scale_inv"}
    with pytest.raises(ValueError, match="has no model.layers.2.moe.up_proj.weight_scale_inv"):
        Step35Numpy(CFG, missing, numerics="device")


def test_quantized_kv_keeps_q_and_k(ckpt, ids):
    """With llama_cpp_kv_round (a q8_0 / q5_1 cache) device mode uses q and k as the cache rounding returns them:
    the same rounding without the quantized_qk mark (so q and k go through bf16 as well) gives other values."""
    kv_round = llama_cpp_kv_round(ggml_q8_0_round, ggml_q5_1_round)
    plain = lambda q, k, v: kv_round(q, k, v)  # noqa: E731
    x = Step35Numpy(CFG, ckpt["bf16"], numerics="device").embed(ids[:48])
    a = Step35Numpy(CFG, ckpt["bf16"], attn_round=kv_round, numerics="device").block(x, 0)
    b = Step35Numpy(CFG, ckpt["bf16"], attn_round=plain, numerics="device").block(x, 0)
    assert not np.array_equal(a, b)
    assert rel_err(a, b) < 1e-2
