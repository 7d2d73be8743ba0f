#!/usr/bin/env python3
"""A load test for `memra serve` (or any OpenAI-compatible server), printed the way `vllm bench serve` prints
its results so the numbers compare line by line.

Random prompts of --input-len token ids (drawn from [--id-low, --id-high) with a fixed seed, as vLLM's random
dataset does) go to /v1/completions as streams of --output-len tokens (ignore_eos), --max-concurrency at a time,
arriving at --request-rate per second (inf: all at once). Each stream asks for logprobs 0, so every chunk says how
many tokens it carries: TTFT is the time to the first token, ITL the gap before each later chunk divided among
its tokens, TPOT (e2e - TTFT) / (tokens - 1). --cancel-fraction of the requests hang up after their first token
(cancellations under load); they count as cancelled, not as successful. --prefix-len P puts the same P random
ids before every prompt (vLLM's --random-prefix-len), the workload a prefix cache serves.

    python3 bench/serve_load.py --url http://127.0.0.1:8080 --num-prompts 200 --max-concurrency 32
"""
import argparse
import http.client
import json
import random
import statistics
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor


def percentile(values, p):
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def one_request(url, model, prompt, output_len, cancel, api_key):
    """Streams one completion; returns a dict of timings, or an error."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=3600)
    body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "stream": True, "temperature": 0,
            "logprobs": 0}
    if model:
        body["model"] = model
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    if resp.status != 200:
        return {"error": f"HTTP {resp.status}: {resp.read()[:200]!r}"}
    ttft, last, tokens, itl = None, None, 0, []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            return {"error": chunk["error"]["message"]}
        lp = chunk["choices"][0].get("logprobs")
        n = len(lp["tokens"]) if lp else 0
        if n == 0:
            continue
        now = time.perf_counter()
        if ttft is None:
            ttft = now - t0
            if n > 1:
                itl.extend([0.0] * (n - 1))
        else:
            itl.extend([(now - last) / n] * n)
        last = now
        tokens += n
        if cancel:
            conn.sock.close()
            return {"cancelled": True}
    e2e = time.perf_counter() - t0
    conn.close()
    return {"ttft": ttft, "itl": itl, "e2e": e2e, "tokens": tokens}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default=None, help="the model field (default: none, the server's own)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--max-concurrency", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="arrivals per second (inf: all at once)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--prefix-len", type=int, default=0, help="random ids every prompt starts with (shared)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--id-low", type=int, default=300, help="random prompt ids are drawn from [low, high)")
    ap.add_argument("--id-high", type=int, default=1000)
    ap.add_argument("--cancel-fraction", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    prefix = [rng.randrange(args.id_low, args.id_high) for _ in range(args.prefix_len)]
    prompts = [prefix + [rng.randrange(args.id_low, args.id_high) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    cancels = [rng.random() < args.cancel_fraction for _ in range(args.num_prompts)]
    gaps = [rng.expovariate(args.request_rate) if args.request_rate != float("inf") else 0.0
            for _ in range(args.num_prompts)]
    results = [None] * args.num_prompts
    limit = threading.Semaphore(args.max_concurrency)

    def run(i):
        with limit:
            results[i] = one_request(args.url, args.model, prompts[i], args.output_len, cancels[i], args.api_key)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(args.num_prompts, args.max_concurrency * 2))) as pool:
        futures = []
        for i in range(args.num_prompts):
            time.sleep(gaps[i])
            futures.append(pool.submit(run, i))
        for f in futures:
            f.result()
    duration = time.perf_counter() - start

    ok = [r for r in results if r and "ttft" in r]
    failed = [r for r in results if r and "error" in r]
    cancelled = [r for r in results if r and r.get("cancelled")]
    out_tokens = sum(r["tokens"] for r in ok)
    in_tokens = (args.prefix_len + args.input_len) * len(ok)
    ttft = [r["ttft"] * 1000 for r in ok]
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) * 1000 for r in ok if r["tokens"] > 1]
    itl = [x * 1000 for r in ok for x in r["itl"]]
    summary = {
        "successful_requests": len(ok), "failed_requests": len(failed), "cancelled_requests": len(cancelled),
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "mean_ttft_ms": statistics.fmean(ttft) if ttft else float("nan"), "median_ttft_ms": percentile(ttft, 50),
        "p99_ttft_ms": percentile(ttft, 99),
        "mean_tpot_ms": statistics.fmean(tpot) if tpot else float("nan"), "median_tpot_ms": percentile(tpot, 50),
        "p99_tpot_ms": percentile(tpot, 99),
        "mean_itl_ms": statistics.fmean(itl) if itl else float("nan"), "median_itl_ms": percentile(itl, 50),
        "p99_itl_ms": percentile(itl, 99),
        "max_concurrency": args.max_concurrency, "input_len": args.input_len, "prefix_len": args.prefix_len,
        "output_len": args.output_len,
    }
    w = 40
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    rows = [("Successful requests:", len(ok)), ("Failed requests:", len(failed)),
            ("Cancelled requests:", len(cancelled)), ("Maximum request concurrency:", args.max_concurrency),
            ("Benchmark duration (s):", f"{duration:.2f}"), ("Total input tokens:", in_tokens),
            ("Total generated tokens:", out_tokens),
            ("Request throughput (req/s):", f"{summary['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}"),
            ("Total Token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}")]
    for k, v in rows:
        print(f"{k:<{w}}{v:<10}")
    for title, key in [("Time to First Token", "ttft"), ("Time per Output Token (excl. 1st token)", "tpot"),
                       ("Inter-token Latency", "itl")]:
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        label = key.upper()
        print(f"{f'Mean {label} (ms):':<{w}}{summary[f'mean_{key}_ms']:<10.2f}")
        print(f"{f'Median {label} (ms):':<{w}}{summary[f'median_{key}_ms']:<10.2f}")
        print(f"{f'P99 {label} (ms):':<{w}}{summary[f'p99_{key}_ms']:<10.2f}")
    print("=" * 50)
    for r in failed[:5]:
        print("failed:", r["error"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
