# Oracle for memra's safetensors module: the official `safetensors` package must read memra's
# files (single and sharded) with identical contents, memra must read files written by the
# official package with identical bytes, and both must refuse the same corrupted files.
import json
import os
import struct
import subprocess

import ml_dtypes
import numpy as np
import pytest
from safetensors import deserialize, safe_open
from safetensors.numpy import save_file

TOOL = os.path.join(os.environ["MEMRA_BUILD_DIR"], "memra_safetensors_tool")

# Mirror of sample_specs() in tests/oracle/safetensors_tool.cpp; the index is the data seed.
SAMPLE = [
    ("embed.weight", "BF16", [7, 5]),
    ("layers.0.attn.q_proj.weight", "F8_E4M3", [4, 9]),
    ("layers.0.attn.q_proj.weight_scale_inv", "F32", [1, 1]),
    ("layers.0.mlp.gate.weight", "F16", [3, 3]),
    ("layers.0.norm.weight", "F32", [7]),
    ("layers.1.f8e5m2", "F8_E5M2", [5]),
    ("layers.1.f64", "F64", [2, 3]),
    ("ints.i64", "I64", [3]),
    ("ints.i32", "I32", [2, 2]),
    ("ints.i16", "I16", [5]),
    ("ints.i8", "I8", [7]),
    ("uints.u64", "U64", [2]),
    ("uints.u32", "U32", [3]),
    ("uints.u16", "U16", [3]),
    ("uints.u8", "U8", [9]),
    ("mask", "BOOL", [2, 5]),
    ("scalar.f32", "F32", []),
    ("scalar.bf16", "BF16", []),
    ("scalar.i64", "I64", []),
    ("empty.f32", "F32", [0]),
    ("empty.bf16", "BF16", [3, 0]),
    ("empty.u8", "U8", [0, 4, 2]),
]
SAMPLE_METADATA = {"format": "pt", "producer": "memra safetensors_tool"}

NUMPY = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
SIZE = {name: np.dtype(t).itemsize for name, t in NUMPY.items()}


def sample_bytes(seed, dtype, shape):
    n = SIZE[dtype] * int(np.prod(shape, dtype=np.int64))
    if dtype == "BOOL":
        return bytes(1 if (seed + i) % 3 == 0 else 0 for i in range(n))
    return bytes((seed * 131 + i * 29 + 7) & 0xFF for i in range(n))


def fnv1a64(data):
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def run_tool(*args):
    return subprocess.run([TOOL, *map(str, args)], capture_output=True, text=True, timeout=60)


def dump(path):
    r = run_tool("dump", path)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def read_header(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, raw[8:8 + n]


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sample")
    r = run_tool("write-sample", d)
    assert r.returncode == 0, r.stderr
    return d


def check_official_contents(tensors):
    """tensors: name -> (dtype, shape, bytes) as the official reader returned them."""
    assert set(tensors) == {name for name, _, _ in SAMPLE}
    for seed, (name, dtype, shape) in enumerate(SAMPLE):
        got_dtype, got_shape, got_data = tensors[name]
        assert got_dtype == dtype, name
        assert list(got_shape) == shape, name
        assert got_data == sample_bytes(seed, dtype, shape), name


def test_official_reads_our_single_file(sample_dir):
    path = sample_dir / "single.safetensors"
    parsed = deserialize(path.read_bytes())
    check_official_contents({n: (t["dtype"], t["shape"], bytes(t["data"])) for n, t in parsed})
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == SAMPLE_METADATA
        for seed, (name, dtype, shape) in enumerate(SAMPLE):
            if dtype.startswith("F8_"):
                continue  # safetensors' numpy backend has no float8 types; covered by deserialize above
            arr = f.get_tensor(name)
            assert arr.dtype == NUMPY[dtype], name
            assert arr.shape == tuple(shape), name
            expected = np.frombuffer(sample_bytes(seed, dtype, shape), dtype=NUMPY[dtype]).reshape(shape)
            assert arr.tobytes() == expected.tobytes(), name


def test_official_reads_our_sharded_checkpoint(sample_dir):
    d = sample_dir / "sharded"
    index_text = (d / "model.safetensors.index.json").read_text()
    index = json.loads(index_text)
    # Pretty-printed exactly like huggingface's own writers: indent 2, sorted keys, final newline.
    assert index_text == json.dumps(index, indent=2, sort_keys=True) + "\n"
    assert set(index) == {"metadata", "weight_map"}
    shard_files = sorted(set(index["weight_map"].values()))
    n = len(shard_files)
    assert n >= 3
    assert shard_files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    tensors = {}
    for shard in shard_files:
        for name, t in deserialize((d / shard).read_bytes()):
            assert index["weight_map"][name] == shard, name
            assert name not in tensors
            tensors[name] = (t["dtype"], t["shape"], bytes(t["data"]))
    check_official_contents(tensors)
    assert index["metadata"] == {"total_size": sum(len(t[2]) for t in tensors.values())}
    assert sorted(os.listdir(d)) == sorted(shard_files + ["model.safetensors.index.json"])


def expected_layout(specs):
    """Our writer's documented layout: decreasing alignment (largest power of two <= 8 dividing the
    byte size), then name, with no holes. Returns name -> (begin, end)."""
    def alignment(nbytes):
        a = 8
        while a > 1 and nbytes % a:
            a //= 2
        return a

    sized = [(name, SIZE[dtype] * int(np.prod(shape, dtype=np.int64))) for name, dtype, shape in specs]
    sized.sort(key=lambda t: (-alignment(t[1]), t[0].encode()))
    offsets, pos = {}, 0
    for name, nbytes in sized:
        offsets[name] = (pos, pos + nbytes)
        pos += nbytes
    return offsets


def test_our_header_is_sorted_compact_json(sample_dir):
    n, header = read_header(sample_dir / "single.safetensors")
    assert n % 8 == 0
    offsets = expected_layout(SAMPLE)
    obj = {"__metadata__": SAMPLE_METADATA}
    for name, dtype, shape in SAMPLE:
        obj[name] = {"dtype": dtype, "shape": shape, "data_offsets": list(offsets[name])}
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    # Byte-identical: sorted keys, compact, then at most 7 spaces of padding.
    assert header == text + b" " * (n - len(text))
    assert n - len(text) < 8
    for name, dtype, _ in SAMPLE:
        begin, end = offsets[name]
        assert begin % SIZE[dtype] == 0, name
        if (end - begin) % 8 == 0:
            assert begin % 8 == 0, name
    # Every shard header follows the same rule.
    d = sample_dir / "sharded"
    index = json.loads((d / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        n, header = read_header(d / shard)
        specs = [s for s in SAMPLE if index["weight_map"][s[0]] == shard]
        offsets = expected_layout(specs)
        obj = {name: {"dtype": dt, "shape": sh, "data_offsets": list(offsets[name])} for name, dt, sh in specs}
        text = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
        assert header == text + b" " * (n - len(text)), shard


def test_our_dump_of_our_files(sample_dir):
    for path, n_shards in ((sample_dir / "single.safetensors", 1), (sample_dir / "sharded", None)):
        d = dump(path)
        if n_shards is not None:
            assert d["n_shards"] == n_shards
        else:
            assert d["n_shards"] >= 3
        assert set(d["tensors"]) == {name for name, _, _ in SAMPLE}
        for seed, (name, dtype, shape) in enumerate(SAMPLE):
            t = d["tensors"][name]
            data = sample_bytes(seed, dtype, shape)
            assert (t["dtype"], t["shape"], t["n_bytes"]) == (dtype, shape, len(data)), name
            assert t["hex"] == data.hex(), name
            assert t["fnv1a64"] == fnv1a64(data), name
    assert dump(sample_dir / "single.safetensors")["shards"][0]["metadata"] == SAMPLE_METADATA


def official_arrays():
    rng = np.random.default_rng(7)
    return {
        "f64": rng.standard_normal((3, 4)),
        "f32": rng.standard_normal((5, 3)).astype(np.float32),
        "f16": rng.standard_normal(7).astype(np.float16),
        "bf16": rng.standard_normal((2, 9)).astype(ml_dtypes.bfloat16),
        "f8_e4m3": rng.standard_normal(13).astype(ml_dtypes.float8_e4m3fn),
        "f8_e5m2": rng.standard_normal((3, 3)).astype(ml_dtypes.float8_e5m2),
        "i64": rng.integers(-2**62, 2**62, size=4, dtype=np.int64),
        "i32": rng.integers(-2**31, 2**31, size=(2, 2), dtype=np.int32),
        "i16": rng.integers(-2**15, 2**15, size=3, dtype=np.int16),
        "i8": rng.integers(-128, 128, size=11, dtype=np.int8),
        "u64": rng.integers(0, 2**63, size=2, dtype=np.uint64),
        "u32": rng.integers(0, 2**32, size=5, dtype=np.uint32),
        "u16": rng.integers(0, 2**16, size=3, dtype=np.uint16),
        "u8": rng.integers(0, 256, size=17, dtype=np.uint8),
        "bool": rng.integers(0, 2, size=(3, 3)).astype(np.bool_),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 5), dtype=np.float16),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((8, 8)).astype(ml_dtypes.bfloat16),
    }


NAME_OF = {np.dtype(t): name for name, t in NUMPY.items()}


def test_we_read_official_files(tmp_path):
    arrays = official_arrays()
    path = tmp_path / "official.safetensors"
    metadata = {"format": "np", "note": "written by safetensors.numpy"}
    save_file(arrays, str(path), metadata=metadata)
    d = dump(path)
    assert d["n_shards"] == 1
    assert d["shards"][0]["metadata"] == metadata
    assert set(d["tensors"]) == set(arrays)
    for name, arr in arrays.items():
        t = d["tensors"][name]
        assert t["dtype"] == NAME_OF[arr.dtype], name
        assert t["shape"] == list(arr.shape), name
        assert t["hex"] == arr.tobytes().hex(), name
        assert t["fnv1a64"] == fnv1a64(arr.tobytes()), name
    # Our offsets are the official header's offsets.
    _, header = read_header(path)
    official = json.loads(header)
    for name in arrays:
        assert d["tensors"][name]["data_offsets"] == official[name]["data_offsets"], name

    # A one-tensor file without metadata, through a checkpoint directory.
    single = tmp_path / "ckpt"
    single.mkdir()
    save_file({"w": arrays["bf16"]}, str(single / "model.safetensors"))
    d = dump(single)
    assert d["shards"][0]["metadata"] == {}
    assert d["tensors"]["w"]["hex"] == arrays["bf16"].tobytes().hex()


def image(header, data=b"", length=None):
    h = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# Corruptions both readers must refuse: (label, file image, fragment of memra's message).
CORRUPT = [
    ("short", b"\x01\x00", "too short for the 8-byte header length"),
    ("length past end", image("{}", length=64), "runs past the end of the file"),
    ("header too large", image("{}", length=100_000_001), "exceeds the limit"),
    ("not json", image("{nope"), "invalid JSON"),
    ("not an object", image("[]"), "expected a JSON object"),
    ("unknown dtype", image(json.dumps({"a": entry("Q4", [1], 0, 1)}), b"x"), "unknown dtype 'Q4'"),
    ("negative dim", image(json.dumps({"a": entry("U8", [-1], 0, 0)})), "expected a non-negative integer"),
    ("fractional dim", image(json.dumps({"a": entry("U8", [1.5], 0, 1)}), b"x"), "expected a non-negative integer"),
    ("size mismatch", image(json.dumps({"a": entry("F32", [2], 0, 4)}), b"abcd"), "is 8 bytes, but data_offsets"),
    ("begin > end", image(json.dumps({"a": entry("U8", [0], 2, 1)}), b"ab"), "have begin > end"),
    ("past data", image(json.dumps({"a": entry("U8", [4], 0, 4)}), b"ab"), "run past the end of the data section"),
    ("overlap", image(json.dumps({"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 1, 3)}), b"abc"), "overlap"),
    ("hole", image(json.dumps({"a": entry("U8", [1], 0, 1), "b": entry("U8", [1], 2, 3)}), b"abc"),
     "belong to no tensor"),
    ("trailing", image(json.dumps({"a": entry("U8", [1], 0, 1)}), b"ab"), "1 trailing bytes"),
    ("elements overflow", image(json.dumps({"a": entry("U8", [2**32, 2**32], 0, 0)})), "more elements than fit"),
    ("metadata value", image(json.dumps({"__metadata__": {"k": 1}})), "__metadata__: value of 'k' must be a string"),
    ("offsets arity", image(json.dumps({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0]}}), b"x"),
     "field 'data_offsets' must be [begin, end]"),
]


@pytest.mark.parametrize("label,raw,fragment", CORRUPT, ids=[c[0] for c in CORRUPT])
def test_both_refuse_corrupt_files(tmp_path, label, raw, fragment):
    with pytest.raises(Exception):
        deserialize(raw)
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    r = run_tool("dump", path)
    assert r.returncode == 1
    assert str(path) in r.stderr
    assert fragment in r.stderr


def test_duplicate_names_refused_where_official_keeps_one(tmp_path):
    # serde keeps the last of two equal keys; memra refuses the file outright.
    header = ('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
              '"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}')
    raw = image(header, b"xy")
    assert [name for name, _ in deserialize(raw)] == ["a"]
    path = tmp_path / "dup.safetensors"
    path.write_bytes(raw)
    r = run_tool("dump", path)
    assert r.returncode == 1
    assert 'duplicate key "a" at the top level' in r.stderr
