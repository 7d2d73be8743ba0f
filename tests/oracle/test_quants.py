"""memra's GGML block quantizers (src/core/quant_blocks.h) against the gguf package's reference
quantizers (gguf.quants), and memra's FP8 128x128 block quantization (src/core/fp8_block.h) against a
numpy + ml_dtypes implementation of the same convention; all compared as raw bytes / bits through
memra_dtype_tool from $MEMRA_BUILD_DIR. gguf has no q8_1 quantizer, so q8_1 is checked against GGML's
documented reference (q8_0's d and codes, plus s = fp16(sum(q) * d))."""

import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from oracle_util import build_tool, run_dtype_tool

QK = 32
# name -> (gguf type, bytes per block)
GGUF_FORMATS = {
    "q8_0": (GGMLQuantizationType.Q8_0, 34),
    "q5_1": (GGMLQuantizationType.Q5_1, 24),
    "q4_0": (GGMLQuantizationType.Q4_0, 18),
}


@pytest.fixture(scope="module")
def tool():
    return build_tool("memra_dtype_tool")


def assert_equal_arrays(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    bad = np.flatnonzero(got.ravel() != want.ravel())
    if bad.size:
        pytest.fail(f"{what}: {bad.size} of {got.size} differ, first at {bad[:8].tolist()}: "
                    f"got {got.ravel()[bad[:4]].tolist()} want {want.ravel()[bad[:4]].tolist()}")


def block_datasets():
    """name -> float32 [n_blocks * 32]: the value regimes each quantizer must reproduce."""
    rng = np.random.default_rng(20240607)
    scales = np.float32(10.0) ** rng.uniform(-4, 4, size=(512, 1)).astype(np.float32)
    normal = (rng.standard_normal((512, QK)).astype(np.float32) * scales).astype(np.float32)

    single = np.zeros((64, QK), np.float32)
    single[np.arange(64), np.arange(64) % QK] = rng.standard_normal(64).astype(np.float32) * 3
    single[::2] *= -1

    equal = np.repeat(np.array([1.0, -1.0, 0.5, -3.25, 1e-3, 7.0, 65504.0, -1e-20], np.float32)[:, None], QK, 1)

    denormal = rng.uniform(-1, 1, size=(32, QK)).astype(np.float32)
    denormal *= np.float32(10.0) ** rng.integers(-45, -36, size=(32, 1)).astype(np.float32)
    denormal[0] = 0
    denormal[0, 5] = np.float32(1e-45)  # one smallest-subnormal in a zero block
    denormal[1, :] = np.float32(3e-39)  # all-equal subnormal

    huge = rng.standard_normal((16, QK)).astype(np.float32)
    huge[0, 3] = 1e30
    huge[1, 7] = -3e38
    huge[2, :] = 3e38
    huge[3, ::2] = 3e38
    huge[3, 1::2] = -3e38
    huge[4, 0] = np.finfo(np.float32).max
    huge[5] = np.float32(1e30) * np.sign(huge[5])
    huge[6, 9] = 70000.0  # d just past fp16 range for q4_0 (mx / -8 < 65504 though)
    huge[7, 1] = 65504.0 * 127

    mixed = rng.uniform(-1, 1, size=(128, QK)).astype(np.float32)
    # Scales of exactly 1, so codes land on rounding ties: q8_0 (amax 127), q5_1 (min 0, max 31),
    # q4_0 (largest magnitude -8).
    ties = np.stack([
        np.array([127.0, -127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5] * 4, np.float32),
        np.concatenate([[0.0, 31.0], np.arange(30, dtype=np.float32) + 0.5]).astype(np.float32),
        np.concatenate([[-8.0], np.arange(-7.5, 8.0, 0.5, dtype=np.float32)]).astype(np.float32),
        np.concatenate([[-8.0, 7.5, 7.49, 7.51], np.full(28, -7.5, np.float32)]).astype(np.float32),
    ])

    return {
        "normal": normal, "zeros": np.zeros((8, QK), np.float32), "single_nonzero": single,
        "all_equal": equal, "denormal": denormal, "huge": huge, "mixed_signs": mixed, "ties": ties,
    }


DATASETS = block_datasets()


def gguf_quantize(x, qtype):
    with np.errstate(all="ignore"):
        return quants.quantize(x.reshape(-1, QK), qtype).reshape(-1)


@pytest.mark.parametrize("dataset", list(DATASETS))
@pytest.mark.parametrize("fmt", list(GGUF_FORMATS))
def test_quantize_matches_gguf(tool, tmp_path, fmt, dataset):
    qtype, block_bytes = GGUF_FORMATS[fmt]
    x = DATASETS[dataset].reshape(-1)
    want = gguf_quantize(x, qtype)
    got = run_dtype_tool(tool, tmp_path, f"quantize_{fmt}", x, np.uint8)
    assert got.size == x.size // QK * block_bytes
    assert_equal_arrays(got, want, f"quantize_{fmt} on {dataset}")


@pytest.mark.parametrize("fmt", list(GGUF_FORMATS))
def test_dequantize_matches_gguf(tool, tmp_path, fmt):
    qtype, block_bytes = GGUF_FORMATS[fmt]
    # Blocks gguf wrote for every dataset, plus random bytes: every code, and scales that are
    # subnormal, huge, Inf or NaN in fp16.
    blocks = [gguf_quantize(x.reshape(-1), qtype) for x in DATASETS.values()]
    rng = np.random.default_rng(7)
    blocks.append(rng.integers(0, 256, size=4096 * block_bytes, dtype=np.uint16).astype(np.uint8))
    data = np.concatenate(blocks)
    with np.errstate(all="ignore"):
        want = quants.dequantize(data.reshape(-1, block_bytes), qtype).reshape(-1).astype(np.float32)
    got = run_dtype_tool(tool, tmp_path, f"dequantize_{fmt}", data, np.float32)
    assert_equal_arrays(got.view(np.uint32), want.view(np.uint32), f"dequantize_{fmt} bits")


def q8_1_reference(x):
    """GGML's quantize_row_q8_1_ref: q8_0's fp16 d and codes, then s = fp16(float(sum(q)) * d) with the
    unrounded f32 d. gguf's Q8_0 is documented bit-exact with GGML's q8_0 reference."""
    blocks = x.reshape(-1, QK)
    q8_0 = gguf_quantize(x, GGMLQuantizationType.Q8_0).reshape(-1, 34)
    with np.errstate(all="ignore"):
        d = np.abs(blocks).max(axis=1) / np.float32(127)
        s = (q8_0[:, 2:].view(np.int8).sum(axis=1, dtype=np.int32).astype(np.float32) * d).astype(np.float16)
    return np.concatenate([q8_0[:, :2], s.view(np.uint8).reshape(-1, 2), q8_0[:, 2:]], axis=1).reshape(-1)


@pytest.mark.parametrize("dataset", list(DATASETS))
def test_quantize_q8_1_matches_ggml_reference(tool, tmp_path, dataset):
    x = DATASETS[dataset].reshape(-1)
    got = run_dtype_tool(tool, tmp_path, "quantize_q8_1", x, np.uint8)
    assert_equal_arrays(got, q8_1_reference(x), f"quantize_q8_1 on {dataset}")
    # d * q, as q8_0 dequantizes its identical d and codes.
    deq = run_dtype_tool(tool, tmp_path, "dequantize_q8_1", got, np.float32)
    blocks = got.reshape(-1, 36)
    with np.errstate(all="ignore"):
        want = (blocks[:, 4:].view(np.int8).astype(np.float32) *
                blocks[:, :2].copy().view(np.float16).astype(np.float32)).reshape(-1)
    assert_equal_arrays(deq.view(np.uint32), want.view(np.uint32), f"dequantize_q8_1 on {dataset}")


# ---------------------------------------------------------------------------------------------
# FP8 128x128 block scales.

FP8 = ml_dtypes.float8_e4m3fn
B = 128


def fp8_block_quant_reference(w):
    rows, cols = w.shape
    sr, sc = -(-rows // B), -(-cols // B)
    q = np.zeros((rows, cols), np.uint8)
    scale = np.zeros((sr, sc), np.float32)
    for br in range(sr):
        for bc in range(sc):
            blk = w[br * B:(br + 1) * B, bc * B:(bc + 1) * B]
            amax = np.abs(blk).max()
            s = np.float32(amax / np.float32(448))
            if amax == 0:
                s = np.float32(1)
            elif s == 0:
                s = np.uint32(1).view(np.float32)  # 2^-149
            scale[br, bc] = s
            with np.errstate(all="ignore"):
                scaled = np.clip(blk / s, np.float32(-448), np.float32(448))
            q[br * B:(br + 1) * B, bc * B:(bc + 1) * B] = scaled.astype(FP8).view(np.uint8)
    return q, scale


def fp8_block_dequant_reference(q, scale):
    rows, cols = q.shape
    full = np.repeat(np.repeat(scale, B, axis=0), B, axis=1)[:rows, :cols]
    return q.view(FP8).astype(np.float32) * full


def fp8_weight(rows, cols, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    # A different magnitude per block, so scales matter.
    mags = np.float32(10.0) ** rng.uniform(-6, 3, size=(-(-rows // B), -(-cols // B))).astype(np.float32)
    w *= np.repeat(np.repeat(mags, B, axis=0), B, axis=1)[:rows, :cols]
    if rows > B and cols > B:
        w[B:2 * B, :B] = 0  # an all-zero block
    if cols > 2 * B:
        # Subnormal block, multiples of 2^-149: amax / 448 underflows, so scale_inv becomes 2^-149.
        shape = w[:B, 2 * B:3 * B].shape
        ulps = rng.integers(0, 21, size=shape).astype(np.uint32).view(np.float32)
        w[:B, 2 * B:3 * B] = ulps * rng.choice(np.array([-1, 1], np.float32), size=shape)
    w[0, 0] = 3e38 if rows * cols > 1 else w[0, 0]  # a huge value, still finite after / (amax / 448)
    return w


@pytest.mark.parametrize("rows, cols", [(200, 300), (128, 128), (1, 1), (129, 257), (256, 384), (3, 130)])
def test_fp8_block_matches_reference(tool, tmp_path, rows, cols):
    w = fp8_weight(rows, cols, seed=rows * 1000 + cols)
    q_want, s_want = fp8_block_quant_reference(w)
    packed = run_dtype_tool(tool, tmp_path, "fp8_block_quant", w, np.uint8, rows, cols)
    assert packed.size == rows * cols + 4 * s_want.size
    q_got = packed[:rows * cols].reshape(rows, cols)
    s_got = packed[rows * cols:].view(np.float32).reshape(s_want.shape)
    assert_equal_arrays(s_got.view(np.uint32), s_want.view(np.uint32), "fp8 block scale_inv bits")
    assert_equal_arrays(q_got, q_want, "fp8 block codes")

    # Dequantize every code against every scale position, including partial edge blocks.
    rng = np.random.default_rng(rows + cols)
    q_any = rng.integers(0, 256, size=(rows, cols), dtype=np.uint16).astype(np.uint8)
    for q in (q_want, q_any):
        packed_in = np.concatenate([q.reshape(-1), s_want.reshape(-1).view(np.uint8)])
        got = run_dtype_tool(tool, tmp_path, "fp8_block_dequant", packed_in, np.float32, rows, cols)
        want = fp8_block_dequant_reference(q, s_want).reshape(-1)
        assert_equal_arrays(got.view(np.uint32), want.view(np.uint32), "fp8 block dequant bits")

    # The convention's promise: each block's amax lands on +-448, and the round trip is within fp8 precision.
    deq = fp8_block_dequant_reference(q_want, s_want)
    for br in range(s_want.shape[0]):
        for bc in range(s_want.shape[1]):
            blk = q_want[br * B:(br + 1) * B, bc * B:(bc + 1) * B].view(FP8).astype(np.float32)
            w_amax = np.abs(w[br * B:(br + 1) * B, bc * B:(bc + 1) * B]).max()
            if w_amax > 0 and s_want[br, bc] >= np.finfo(np.float32).tiny:  # not a zero or underflow block
                assert np.abs(blk).max() == 448, f"block ({br}, {bc}) amax code {np.abs(blk).max()}"
    assert any(s == np.uint32(1).view(np.float32) for s in s_want.ravel()) == (cols > 2 * B)
    assert any(s == 1 for s in s_want.ravel()) == (rows > B and cols > B)
    normal = np.abs(w) > s_want.repeat(B, 0).repeat(B, 1)[:rows, :cols] * 2.0**-6
    assert np.all(np.abs(deq - w)[normal] <= np.abs(w)[normal] * 2.0**-4 * 1.0001)
