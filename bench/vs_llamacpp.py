#!/usr/bin/env python3
"""memra's CPU engine against llama.cpp on the same model, threads, prompt and KV cache type, in one run.

    .venv/bin/python bench/vs_llamacpp.py [MODEL_DIR] [-p 512] [-n 128] [-r 5] [-t THREADS] [--outtype bf16]

Both engines run llama-bench's two tests: ppN (N prompt tokens prefilled from an empty KV cache in one
batch, last logits only) and tgN (N tokens from an empty cache, one per decode call, each feeding the
argmax of the previous logits), one untimed warm-up then REPS timed runs, reported as mean +- sample
stddev of each run's tokens/s, then side by side with the ratio memra / llama.cpp.

- memra: `memra bench -o json` in a subprocess (times only its forward steps).
- llama.cpp: the checkpoint converted to GGUF by llama.cpp's own converter (tests/oracle/llamacpp_step35.py,
  cached under --cache-dir), run through llama-cpp-python's low-level API (llama_decode on one context).
  Timing: llama.cpp's own counters, llama_perf_context (pp: t_p_eval_ms over n_p_eval; tg: t_eval_ms over
  n_eval), reset with llama_perf_context_reset before each run. They clock from llama_decode's start to the
  synchronization in llama_get_logits_ith, so the Python loop, the ctypes calls into llama_decode and the
  argmax are outside the clock, as memra's argmax is outside its own.
- Same tokens: the prompt ids and tg's first token come from `memra bench --print-tokens` (Philox draws from
  --seed over the tokenizer's real tokens), so both engines see identical ids.
- Same KV cache: f32, bf16, q8_0, q5_1 map to the GGML types of the same names. llama.cpp refuses a quantized
  V cache without flash attention, so --flash-attn auto turns it on exactly then. Its sliding-window layers
  keep only the window (swa_full off), as memra's ring does, and one ubatch holds the whole prompt.
"""
import argparse
import ctypes
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "oracle"))

import llama_cpp  # noqa: E402

from llamacpp_step35 import KV_TYPES, convert_to_gguf  # noqa: E402

# The KV cache formats memra has (kv/kv_format.h), as GGML types of the same names.
GGML_TYPES = {name: KV_TYPES[name] for name in ("f32", "bf16", "q8_0", "q5_1")}
GGML_LOG_LEVEL_ERROR = 4


def memra_exe():
    exe = os.environ.get("MEMRA_EXE") or str(REPO / "build" / "memra")
    if not Path(exe).is_file():
        sys.exit(f"error: memra executable not found at {exe}: build it or set MEMRA_EXE")
    return Path(exe)


def run_memra(exe, *args):
    r = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"error: memra {' '.join(map(str, args))} exited {r.returncode}:\n{r.stderr}")
    return r.stdout


def memra_build_facts(exe):
    """Version, build type and C++ flags from the CMakeCache.txt beside the executable."""
    facts = {"version": run_memra(exe, "--version").strip()}
    cache = exe.parent / "CMakeCache.txt"
    entries = {}
    if cache.is_file():
        for line in cache.read_text().splitlines():
            if ":" in line and "=" in line and not line.startswith(("#", "//")):
                key, value = line.split("=", 1)
                entries[key.split(":", 1)[0]] = value
    build_type = entries.get("CMAKE_BUILD_TYPE", "") or "(none)"
    facts["build type"] = build_type
    flags = f"{entries.get('CMAKE_CXX_FLAGS', '')} {entries.get(f'CMAKE_CXX_FLAGS_{build_type.upper()}', '')}".strip()
    facts["C++ flags"] = flags or "(none)"
    facts["compiler"] = entries.get("CMAKE_CXX_COMPILER", "?")
    return facts


def cached_gguf(model_dir, outtype, cache_root):
    """The GGUF of model_dir, converted once per (checkpoint files, outtype, llama-cpp-python version)."""
    h = hashlib.sha256()
    h.update(f"{importlib.metadata.version('llama_cpp_python')} {outtype}\n".encode())
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name} {st.st_size} {st.st_mtime_ns}\n".encode())
    out = cache_root / f"{model_dir.name}-{h.hexdigest()[:16]}-{outtype}.gguf"
    if not out.is_file():
        cache_root.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        print(f"converting {model_dir} to GGUF ({outtype}) with llama.cpp's convert_hf_to_gguf.py ...",
              file=sys.stderr)
        convert_to_gguf(model_dir, tmp, outtype)
        tmp.rename(out)
    return out


class LlamaCppBench:
    """One llama.cpp model and context on the CPU, sized for the two tests."""

    def __init__(self, gguf, n_prompt, n_gen, threads, type_k, type_v, flash_attn):
        self._log_cb = llama_cpp.llama_log_callback(self._log)  # kept alive as long as llama.cpp may call it
        llama_cpp.llama_log_set(self._log_cb, ctypes.c_void_p())
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = max(n_prompt, n_gen)
        cparams.n_batch = cparams.n_ubatch = max(n_prompt, 1)  # the whole prompt in one ubatch, as memra
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.type_k = GGML_TYPES[type_k]
        cparams.type_v = GGML_TYPES[type_v]
        cparams.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                   else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        cparams.swa_full = False
        cparams.no_perf = False
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not create a context (type_k {type_k}, type_v {type_v}, "
                               f"flash attention {flash_attn})")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.n_params = llama_cpp.llama_model_n_params(self.model)

    @staticmethod
    def _log(level, text, _user_data):
        if level == GGML_LOG_LEVEL_ERROR:
            sys.stderr.write(text.decode(errors="replace"))

    def close(self):
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def _decode(self, ids):
        arr = (llama_cpp.llama_token * len(ids))(*ids)
        rc = llama_cpp.llama_decode(self.ctx, llama_cpp.llama_batch_get_one(arr, len(ids)))
        if rc != 0:
            raise RuntimeError(f"llama_decode of {len(ids)} tokens failed ({rc})")
        # Synchronizes (this closes llama.cpp's clock for the batch) and returns the last position's logits.
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))

    def _run(self, body, batched):
        """Milliseconds and tokens llama.cpp counted for body() on an empty KV cache. It books a decode of
        several tokens as prompt eval (t_p_eval_ms, n_p_eval) and one of a single token as eval (t_eval_ms,
        n_eval), and reports a count of 0 as 1; so only the counter of the kind body() runs is read, and
        the other kind's time must be 0."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        llama_cpp.llama_perf_context_reset(self.ctx)
        body()
        perf = llama_cpp.llama_perf_context(self.ctx)
        ms, n, other_ms = ((perf.t_p_eval_ms, perf.n_p_eval, perf.t_eval_ms) if batched
                           else (perf.t_eval_ms, perf.n_eval, perf.t_p_eval_ms))
        if other_ms != 0.0:
            raise RuntimeError(f"llama.cpp booked {other_ms} ms as {'eval' if batched else 'prompt eval'} too")
        return ms, n

    def prompt(self, ids):
        return self._run(lambda: self._decode(ids), len(ids) > 1)

    def generation(self, first, n_gen):
        def body():
            token = first
            for _ in range(n_gen):
                token = int(self._decode([token]).argmax())
        return self._run(body, False)


def stats(n_tokens, samples_ms):
    ts = np.array([1000.0 * n_tokens / ms for ms in samples_ms])
    return float(ts.mean()), float(ts.std(ddof=1)) if len(ts) > 1 else 0.0


def bench_llama(llm, name, run, n_tokens, reps):
    run()  # warm-up
    samples = []
    for _ in range(reps):
        ms, counted = run()
        if counted != n_tokens:
            raise RuntimeError(f"llama.cpp {name}: its counters saw {counted} tokens, expected {n_tokens}")
        samples.append(ms)
    avg, sd = stats(n_tokens, samples)
    return {"test": name, "samples_ms": samples, "avg_ts": avg, "stddev_ts": sd}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", nargs="?", help="Step-3.5 checkpoint (default: memra's embedded model)")
    ap.add_argument("-p", "--n-prompt", type=int, default=512, help="ppN test size (0 = skip); default 512")
    ap.add_argument("-n", "--n-gen", type=int, default=128, help="tgN test size (0 = skip); default 128")
    ap.add_argument("-r", "--repetitions", type=int, default=5, help="timed runs per test; default 5")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1, help="CPU threads of both engines")
    ap.add_argument("-ctk", "--kv-k", choices=sorted(GGML_TYPES), default="bf16", help="KV cache keys; default bf16")
    ap.add_argument("-ctv", "--kv-v", choices=sorted(GGML_TYPES), default="bf16",
                    help="KV cache values; default bf16")
    ap.add_argument("-s", "--seed", type=int, default=0, help="seed of the prompt token ids; default 0")
    ap.add_argument("--outtype", default="bf16", choices=["f32", "f16", "bf16", "q8_0"],
                    help="GGUF weight type of llama.cpp's converter; default bf16 (the checkpoint's)")
    ap.add_argument("-fa", "--flash-attn", choices=["auto", "on", "off"], default="auto",
                    help="llama.cpp flash attention; auto: on exactly when the V cache is quantized")
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "memra-bench-gguf",
                    help="where converted GGUFs are kept between runs")
    args = ap.parse_args()
    if args.n_prompt < 0 or args.n_gen < 0 or args.n_prompt + args.n_gen == 0:
        ap.error("-p and -n must be >= 0 and not both 0")
    if args.repetitions < 1 or args.threads < 1:
        ap.error("-r and -t must be >= 1")

    exe = memra_exe()
    model_dir = Path(args.model_dir) if args.model_dir else exe.parent / "models" / "default"
    if not (model_dir / "config.json").is_file():
        sys.exit(f"error: {model_dir / 'config.json'}: not found")
    common = ["-p", args.n_prompt, "-n", args.n_gen, "-t", args.threads, "-ctk", args.kv_k, "-ctv", args.kv_v,
              "-s", args.seed]
    tokens = json.loads(run_memra(exe, "bench", model_dir, *common, "--print-tokens"))
    load_before = os.getloadavg()

    print(f"memra: {model_dir}: bench {' '.join(map(str, common))} -r {args.repetitions}", file=sys.stderr)
    memra = json.loads(run_memra(exe, "bench", model_dir, *common, "-r", args.repetitions, "-o", "json"))

    gguf = cached_gguf(model_dir, args.outtype, args.cache_dir)
    flash_attn = args.flash_attn == "on" or (args.flash_attn == "auto" and args.kv_v not in ("f32", "bf16"))
    print(f"llama.cpp: {gguf}", file=sys.stderr)
    llm = LlamaCppBench(gguf, args.n_prompt, args.n_gen, args.threads, args.kv_k, args.kv_v, flash_attn)
    try:
        ids = tokens["prompt"]
        if max(ids + [tokens["gen_first"]]) >= llm.n_vocab:
            sys.exit(f"error: memra's token ids reach {max(ids + [tokens['gen_first']])}, past llama.cpp's "
                     f"vocabulary of {llm.n_vocab}")
        llama = []
        if args.n_prompt > 0:
            llama.append(bench_llama(llm, f"pp{args.n_prompt}", lambda: llm.prompt(ids), args.n_prompt,
                                     args.repetitions))
        if args.n_gen > 0:
            llama.append(bench_llama(llm, f"tg{args.n_gen}", lambda: llm.generation(tokens["gen_first"], args.n_gen),
                                     args.n_gen, args.repetitions))
        llama_params = llm.n_params
    finally:
        llm.close()
    load_after = os.getloadavg()

    print(f"\nmodel {model_dir}: memra {memra[0]['n_params']} params ({memra[0]['dtype']}), llama.cpp "
          f"{llama_params} params (GGUF {args.outtype}); threads {args.threads}; KV {args.kv_k}/{args.kv_v}; "
          f"llama.cpp flash attention {'on' if flash_attn else 'off'}; reps {args.repetitions} after one warm-up; "
          f"prompt: {len(ids)} ids from memra bench --print-tokens -s {args.seed}\n")
    print("| test | memra t/s | llama.cpp t/s | memra/llama.cpp |")
    print("| ---: | ---: | ---: | ---: |")
    for m, l in zip(memra, llama):
        assert m["test"] == l["test"], (m["test"], l["test"])
        print(f"| {m['test']} | {m['avg_ts']:.2f} ± {m['stddev_ts']:.2f} | {l['avg_ts']:.2f} ± {l['stddev_ts']:.2f} "
              f"| {m['avg_ts'] / l['avg_ts']:.2f} |")
    print()
    print(f"load average (1/5/15 min) before: {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after: {' '.join(f'{x:.2f}' for x in load_after)}; {os.cpu_count()} CPUs")
    facts = memra_build_facts(exe)
    print(f"memra build: {exe}; " + "; ".join(f"{k} {v}" for k, v in facts.items()) + f"; threads {args.threads}")
    print(f"llama.cpp build: llama-cpp-python {importlib.metadata.version('llama_cpp_python')}; threads "
          f"{args.threads}; {llama_cpp.llama_print_system_info().decode().strip()}")


if __name__ == "__main__":
    main()
