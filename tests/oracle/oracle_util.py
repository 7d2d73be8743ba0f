"""Helpers shared by the oracle suites: finding memra's tools in $MEMRA_BUILD_DIR, generating tiny
checkpoints with `memra make-tiny`, running the raw-binary dtype and forward tools, and the relative
error every model comparison reports."""
import os
import subprocess
from pathlib import Path


def build_tool(name):
    """Path of an executable in the build directory CTest passes as MEMRA_BUILD_DIR."""
    build_dir = os.environ.get("MEMRA_BUILD_DIR")
    assert build_dir, f"set MEMRA_BUILD_DIR to the build directory holding {name}"
    path = os.path.join(build_dir, name)
    assert os.path.isfile(path), f"{path} not found: build target {name} first"
    return path


def run_dtype_tool(tool, tmp_path, op, data, out_dtype, *extra):
    """memra_dtype_tool OP IN OUT [extra...] on raw little-endian arrays; returns OUT as out_dtype."""
    import numpy as np  # imported where used: the server suite runs on hosts without numpy (scripts/gpu.sh)
    src = tmp_path / f"{op}.in"
    dst = tmp_path / f"{op}.out"
    src.write_bytes(np.ascontiguousarray(data).tobytes())
    proc = subprocess.run([tool, op, str(src), str(dst), *map(str, extra)], capture_output=True, text=True)
    assert proc.returncode == 0, f"{op} failed ({proc.returncode}): {proc.stderr}"
    return np.frombuffer(dst.read_bytes(), dtype=out_dtype)


def memra_exe():
    """The memra CLI: $MEMRA_EXE, else memra in $MEMRA_BUILD_DIR (default ./build)."""
    exe = os.environ.get("MEMRA_EXE") or str(Path(os.environ.get("MEMRA_BUILD_DIR", "build")) / "memra")
    assert Path(exe).is_file(), f"memra CLI not found at {exe}: set MEMRA_EXE"
    return exe


def make_tiny(out_dir, dtype, seed, preset="tiny"):
    """`memra make-tiny OUT_DIR --preset P --dtype D --seed S`; returns out_dir."""
    r = subprocess.run([memra_exe(), "make-tiny", str(out_dir), "--preset", preset, "--dtype", dtype,
                        "--seed", str(seed)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return out_dir


def run_forward_tool(model_dir, ids, tmp_path, *flags):
    """memra_forward_tool on raw int32 ids; returns (float32 logits, flat, and the tool's stdout)."""
    import numpy as np
    ids_file, out_file = tmp_path / "ids.bin", tmp_path / "logits.bin"
    ids_file.write_bytes(np.asarray(ids, dtype="<i4").tobytes())
    proc = subprocess.run([build_tool("memra_forward_tool"), str(model_dir), str(ids_file), str(out_file),
                           *map(str, flags)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return np.frombuffer(out_file.read_bytes(), dtype="<f4"), proc.stdout


def decoded_ids(stdout):
    """The ids memra_forward_tool reports after --decode N ("decoded [a, b, ...]")."""
    inner = stdout.split("decoded [", 1)[1].split("]", 1)[0]
    return [int(t) for t in inner.split(",")] if inner.strip() else []


def rel_err(a, ref):
    """max |a - ref| / max |ref|: the relative logit error every model comparison reports."""
    import numpy as np
    return float(np.abs(a - ref).max() / np.abs(ref).max())
