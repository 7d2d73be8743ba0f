# llama.cpp as an independent oracle of the Step-3.5 text model: a memra checkpoint converted to
# GGUF by llama.cpp's own convert_hf_to_gguf.py (the copy vendored in the installed
# llama-cpp-python's sdist, with that copy's gguf-py), loaded through llama_cpp.Llama on the CPU
# with every position's logits kept; prefill logits and greedy decoding through llama.cpp's KV
# cache, in f32 or with a quantized K/V cache. Needs torch (the converter) and llama_cpp.
import importlib.metadata
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import gguf_convert
import llama_cpp

# What is unpacked from the sdist: the converter, and llama.cpp's collection of chat templates
# (tests/oracle/test_chat_template.py renders every one; the sdist itself is deleted after unpacking).
CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/")
# The converter's runner (what it changes of the converter, and why): gguf_convert.py.
CONVERTER_RUNNER = Path(__file__).with_name("gguf_convert.py")
FALLBACK_PRE_TOKENIZER = gguf_convert.FALLBACK_PRE_TOKENIZER


def cache_dir():
    return Path(os.environ.get("MEMRA_ORACLE_CACHE", Path.home() / ".cache" / "memra-oracle"))


def llama_cpp_source():
    """Directory holding the vendored llama.cpp converter of the installed llama-cpp-python version.

    $MEMRA_LLAMA_CPP_SRC may name an unpacked llama.cpp tree; otherwise the converter files are unpacked
    once under cache_dir() from the matching sdist, which scripts/setup.sh downloads to cache_dir()/sdist."""
    if "MEMRA_LLAMA_CPP_SRC" in os.environ:
        src = Path(os.environ["MEMRA_LLAMA_CPP_SRC"])
        if not (src / "convert_hf_to_gguf.py").is_file():
            raise FileNotFoundError(f"MEMRA_LLAMA_CPP_SRC={src}: no convert_hf_to_gguf.py there")
        return src
    version = importlib.metadata.version("llama_cpp_python")
    root = cache_dir() / f"llama_cpp_python-{version}"
    src = root / "vendor" / "llama.cpp"
    if (src / "convert_hf_to_gguf.py").is_file():
        return src
    sdist_dir = cache_dir() / "sdist"
    sdist = sdist_dir / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():  # nothing is downloaded at test time: scripts/setup.sh fetches the sdist
        raise FileNotFoundError(f"{sdist} not found: run scripts/setup.sh (it keeps the llama-cpp-python "
                                f"sdist for its converter) or set MEMRA_LLAMA_CPP_SRC")
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and
                   any(m.name[len(prefix):].startswith(f) for f in CONVERTER_FILES)]
        if not any(m.name == prefix + "convert_hf_to_gguf.py" for m in members):
            raise RuntimeError(f"{sdist}: no {prefix}convert_hf_to_gguf.py")
        tmp = cache_dir() / f".unpack-{os.getpid()}"
        tar.extractall(tmp, members=members, filter="data")
    root.mkdir(parents=True, exist_ok=True)
    (tmp / f"llama_cpp_python-{version}" / "vendor").rename(root / "vendor")  # atomic publish
    tmp.joinpath(f"llama_cpp_python-{version}").rmdir()
    tmp.rmdir()
    sdist.unlink()  # 75 MB; only the converter files and the chat templates are kept
    return src


def convert_to_gguf(model_dir, out_path, outtype="f32"):
    """memra checkpoint -> GGUF with llama.cpp's converter (adds 1 to norm weights, dequantizes FP8).

    Returns the converter's log (stderr); raises RuntimeError with it on failure."""
    src = llama_cpp_source()
    r = subprocess.run([sys.executable, str(CONVERTER_RUNNER), str(src), str(model_dir), str(out_path), outtype],
                       capture_output=True, text=True)
    if r.returncode != 0 or not Path(out_path).is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir} ({r.returncode}):\n{r.stderr[-4000:]}")
    return r.stderr


KV_TYPES = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16, "bf16": 30,  # GGML_TYPE_BF16 (no constant in llama_cpp)
            "q8_0": llama_cpp.GGML_TYPE_Q8_0,
            "q5_1": llama_cpp.GGML_TYPE_Q5_1}


def load_llama(gguf_path, n_ctx=256, type_k="f32", type_v="f32", flash_attn=None, n_threads=1):
    """llama_cpp.Llama on the CPU keeping every position's logits. llama.cpp refuses a quantized V
    cache without flash attention, so flash_attn defaults to on exactly when type_v is quantized.
    One thread: on a busy 2-core machine two ggml threads spin-wait (64-token prefill 0.72 s vs
    0.08 s, 16 greedy steps 2.3 s vs 0.05 s)."""
    if flash_attn is None:
        flash_attn = type_v not in ("f32", "f16")
    return llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                           n_threads=n_threads, n_threads_batch=n_threads, n_gpu_layers=0, logits_all=True,
                           type_k=KV_TYPES[type_k], type_v=KV_TYPES[type_v], flash_attn=flash_attn, verbose=False)


def llama_logits(llm, token_ids):
    """float32 logits [T, vocab] of every position of one sequence (prefill from an empty cache)."""
    ids = list(map(int, token_ids))
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


@dataclass
class LlamaGreedy:
    tokens: list  # n greedy tokens
    logits: np.ndarray  # [n, vocab]: row i is the distribution token i was picked from


def llama_greedy(llm, prompt_ids, n):
    """n greedy tokens after prompt_ids, one llama_decode per generated token (llama.cpp's KV cache)."""
    prompt = list(map(int, prompt_ids))
    if not prompt or n < 1:
        raise ValueError(f"llama_greedy needs a non-empty prompt and n >= 1, got {len(prompt)} tokens, n={n}")
    llm.reset()
    llm.eval(prompt)
    tokens, rows = [], []
    for i in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        rows.append(row)
        tokens.append(int(row.argmax()))
        if i + 1 < n:
            llm.eval([tokens[-1]])
    return LlamaGreedy(tokens, np.stack(rows))
