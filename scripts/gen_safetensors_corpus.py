#!/usr/bin/env python3
# Writes the seed corpus of fuzz/safetensors_fuzz.cpp (fuzz/corpus/safetensors/): a few small
# valid files (every dtype, scalars, empty tensors, metadata, reference-style key order) and one
# file per class of malformed input. Standard library only; the output is deterministic.
import json
import os
import struct
import sys

SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
         "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}


def image(header, data=b"", length=None, pad=True):
    h = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def packed(tensors, metadata=None):
    """tensors: [(name, dtype, shape)] laid out contiguously in the given order."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for i, (name, dtype, shape) in enumerate(tensors):
        n = SIZES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + n]}
        data += bytes((i * 37 + k * 11) & (1 if dtype == "BOOL" else 0xFF) for k in range(n))
    return header, data


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    files = {}
    files["valid_basic"] = image(*packed([("w", "F32", [2, 2]), ("b", "U8", [3])], {"format": "pt"}))
    files["valid_every_dtype"] = image(*packed([(f"t.{d}", d, [2]) for d in SIZES]))
    files["valid_scalar_empty"] = image(*packed([("s", "BF16", []), ("e", "F32", [0, 3]), ("z", "I8", [0])]))
    files["valid_no_tensors"] = image({})
    files["valid_unpadded_ws"] = image(b'  {"a":{"dtype":"F8_E4M3","shape":[3],"data_offsets":[0,3]}}  ',
                                       b"\x01\x02\x7f", pad=False)
    header, data = packed([("x", "U8", [4]), ("y", "U8", [4])])
    header["y"]["data_offsets"] = [2, 6]
    files["bad_overlap"] = image(header, data[:6])
    header, data = packed([("x", "U8", [2]), ("y", "U8", [2])])
    header["y"]["data_offsets"] = [3, 5]
    files["bad_hole"] = image(header, data + b"\x00")
    files["bad_trailing"] = image(*packed([("x", "U16", [2])])[:1], b"\x00" * 6)
    files["bad_duplicate"] = image(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                                   b'"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"ab")
    files["bad_json"] = image(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]', b"a")
    files["bad_length"] = image({}, length=1 << 40)
    files["bad_dtype"] = image({"a": {"dtype": "F4", "shape": [1], "data_offsets": [0, 1]}}, b"a")
    files["bad_shape"] = image({"a": {"dtype": "U8", "shape": [1.5, -2], "data_offsets": [0, 1]}}, b"a")
    files["bad_overflow"] = image({"a": {"dtype": "F64", "shape": [2**40, 2**40], "data_offsets": [0, 0]}})
    files["bad_metadata"] = image({"__metadata__": {"k": 1}})
    files["bad_nesting"] = image(b'{"__metadata__":' + b"[" * 150 + b"]" * 150 + b"}")
    for name, raw in sorted(files.items()):
        with open(os.path.join(out_dir, name + ".safetensors"), "wb") as f:
            f.write(raw)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "fuzz", "corpus",
                                                            "safetensors"))
