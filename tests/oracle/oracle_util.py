"""Helpers shared by the oracle suites: finding memra's tools in $MEMRA_BUILD_DIR and running
the raw-binary dtype tool."""
import os
import subprocess

import numpy as np


def build_tool(name):
    """Path of an executable in the build directory CTest passes as MEMRA_BUILD_DIR."""
    build_dir = os.environ.get("MEMRA_BUILD_DIR")
    assert build_dir, f"set MEMRA_BUILD_DIR to the build directory holding {name}"
    path = os.path.join(build_dir, name)
    assert os.path.isfile(path), f"{path} not found: build target {name} first"
    return path


def run_dtype_tool(tool, tmp_path, op, data, out_dtype, *extra):
    """memra_dtype_tool OP IN OUT [extra...] on raw little-endian arrays; returns OUT as out_dtype."""
    src = tmp_path / f"{op}.in"
    dst = tmp_path / f"{op}.out"
    src.write_bytes(np.ascontiguousarray(data).tobytes())
    proc = subprocess.run([tool, op, str(src), str(dst), *map(str, extra)], capture_output=True, text=True)
    assert proc.returncode == 0, f"{op} failed ({proc.returncode}): {proc.stderr}"
    return np.frombuffer(dst.read_bytes(), dtype=out_dtype)
