"""memra's float conversions (src/core/float_formats.h) against ml_dtypes (bfloat16, float8_e4m3fn)
and numpy (float16), compared as raw bits, through memra_dtype_tool from $MEMRA_BUILD_DIR.

Decoding is checked on every code; encoding on every representable value, every midpoint between
neighbours (ties), one float32 ulp either side of each midpoint, the overflow midpoints, both signs,
and 1M random float32 bit patterns (all exponents, subnormals, Inf, NaN payloads)."""
import subprocess

import ml_dtypes
import numpy as np
import pytest

from oracle_util import build_tool, run_dtype_tool

# name -> (oracle dtype, code dtype, decode op, encode op)
FORMATS = {
    "bf16": (ml_dtypes.bfloat16, np.uint16, "bf16_to_f32", "f32_to_bf16"),
    "f16": (np.float16, np.uint16, "f16_to_f32", "f32_to_f16"),
    "fp8": (ml_dtypes.float8_e4m3fn, np.uint8, "fp8_to_f32", "f32_to_fp8"),
}


@pytest.fixture(scope="module")
def tool():
    return build_tool("memra_dtype_tool")


def assert_same_bits(got, want, inputs, what):
    assert got.shape == want.shape, f"{what}: {got.shape} values, expected {want.shape}"
    bad = np.flatnonzero(got != want)
    if bad.size:
        rows = [f"  in=0x{int(inputs.view(np.uint32 if inputs.dtype.itemsize == 4 else inputs.dtype)[i]):x} "
                f"got=0x{int(got[i]):x} want=0x{int(want[i]):x}" for i in bad[:8]]
        pytest.fail(f"{what}: {bad.size} of {got.size} differ\n" + "\n".join(rows))


def all_codes(code_dtype):
    return np.arange(np.iinfo(code_dtype).max + 1, dtype=np.int64).astype(code_dtype)


def encode_inputs(name):
    """float32 values that probe every rounding decision of the format, both signs."""
    oracle, code_dtype, _, _ = FORMATS[name]
    values = all_codes(code_dtype).view(oracle).astype(np.float32)  # all representable, plus Inf/NaN
    finite = np.unique(values[np.isfinite(values) & (values >= 0)]).astype(np.float64)
    mids = (finite[:-1] + finite[1:]) / 2  # exact in float32 for these formats
    top = finite[-1] + (finite[-1] - finite[-2]) / 2  # the overflow midpoint: 0x7f7f8000, 65520, 464
    mids = np.append(mids, top).astype(np.float32)
    assert np.all(mids.astype(np.float64) == np.append((finite[:-1] + finite[1:]) / 2, top))
    mid_bits = mids.view(np.uint32)
    around = np.concatenate([mid_bits - 1, mid_bits + 1]).view(np.float32)
    probes = np.concatenate([values, mids, around]).astype(np.float32)
    probes = np.concatenate([probes, -probes])
    rng = np.random.default_rng(1234)
    random_bits = rng.integers(0, 2**32, size=1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([probes, random_bits])


@pytest.mark.parametrize("name", list(FORMATS))
def test_decode_every_code(tool, tmp_path, name):
    oracle, code_dtype, decode_op, _ = FORMATS[name]
    codes = all_codes(code_dtype)
    want = codes.view(oracle).astype(np.float32).view(np.uint32)
    got = run_dtype_tool(tool, tmp_path, decode_op, codes, np.uint32)
    assert_same_bits(got, want, codes, f"{decode_op} vs {oracle.__name__}")


@pytest.mark.parametrize("name", list(FORMATS))
def test_encode_matches_oracle(tool, tmp_path, name):
    oracle, code_dtype, _, encode_op = FORMATS[name]
    x = encode_inputs(name)
    with np.errstate(all="ignore"):
        want = x.astype(oracle).view(code_dtype)
    got = run_dtype_tool(tool, tmp_path, encode_op, x, code_dtype)
    assert_same_bits(got, want, x, f"{encode_op} vs {oracle.__name__}")


def test_encode_fp8_saturating(tool, tmp_path):
    # Saturation = clamp to +-448 first (NaN stays NaN, -0 stays -0), then ml_dtypes' cast.
    x = encode_inputs("fp8")
    with np.errstate(all="ignore"):
        want = np.clip(x, np.float32(-448), np.float32(448)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    got = run_dtype_tool(tool, tmp_path, "f32_to_fp8_sat", x, np.uint8)
    assert_same_bits(got, want, x, "f32_to_fp8_sat vs clip + ml_dtypes")
    # The two modes must really differ where the contract says they do.
    specials = np.array([np.inf, -np.inf, 465.0, -1e30, 464.0], dtype=np.float32)
    assert list(run_dtype_tool(tool, tmp_path, "f32_to_fp8_sat", specials, np.uint8)) == [0x7E, 0xFE, 0x7E, 0xFE, 0x7E]
    assert list(run_dtype_tool(tool, tmp_path, "f32_to_fp8", specials, np.uint8)) == [0x7F, 0xFF, 0x7F, 0xFF, 0x7E]


@pytest.mark.parametrize(
    "args, fragment",
    [
        ([], "expected OP IN OUT"),
        (["f32_to_bf17", "IN", "OUT"], "unknown OP 'f32_to_bf17'"),
        (["f32_to_bf16", "IN"], "expected OP IN OUT"),
        (["f32_to_bf16", "IN", "OUT", "7"], "takes IN OUT, found 3"),
        (["fp8_block_quant", "IN", "OUT", "2"], "takes IN OUT ROWS COLS"),
        (["fp8_block_quant", "IN", "OUT", "2", "x3"], "COLS must be an integer"),
        (["fp8_block_quant", "IN", "OUT", "-1", "3"], "ROWS must be an integer"),
    ],
)
def test_tool_usage_errors(tool, tmp_path, args, fragment):
    (tmp_path / "IN").write_bytes(b"\0" * 8)
    args = [str(tmp_path / a) if a in ("IN", "OUT") else a for a in args]
    proc = subprocess.run([tool, *args], capture_output=True, text=True)
    assert proc.returncode == 2
    assert fragment in proc.stderr
    assert "usage: memra_dtype_tool" in proc.stderr


@pytest.mark.parametrize(
    "op, size, extra, fragment",
    [
        ("f32_to_bf16", 7, [], "multiple of 4 bytes"),
        ("bf16_to_f32", 3, [], "multiple of 2 bytes"),
        ("quantize_q8_0", 4 * 31, [], "multiple of 32 f32 values"),
        ("dequantize_q5_1", 25, [], "multiple of 24 bytes"),
        ("fp8_block_quant", 4 * 5, [2, 3], "f32 [2, 3] = 24 bytes, found 20"),
        ("fp8_block_dequant", 6, [2, 3], "= 10 bytes, found 6"),
    ],
)
def test_tool_rejects_malformed_input(tool, tmp_path, op, size, extra, fragment):
    (tmp_path / "in").write_bytes(b"\0" * size)
    proc = subprocess.run([tool, op, str(tmp_path / "in"), str(tmp_path / "out"), *map(str, extra)],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr
    assert not (tmp_path / "out").exists()


def test_tool_missing_input_file(tool, tmp_path):
    proc = subprocess.run([tool, "f32_to_bf16", str(tmp_path / "absent"), str(tmp_path / "out")],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert "absent: cannot open" in proc.stderr
