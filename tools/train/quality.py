"""The default model's quality on the held-out split: `memra perplexity` for every KV format pair, the FP8
checkpoint against its exact BF16 form, the MTP layers' top-1 accuracy, and the count-based baselines on the
very tokens memra scores.

    python tools/train/quality.py [--model DIR] [--memra build/memra] [--chunks 128] [-c 512] [-t N]

Baselines (from the training split's tokens, each document starting with BOS as in training):
- bigram PPL: P(w | prev) = lam * count(prev, w) / count(prev) + (1 - lam) * P_unigram(w) (add-one unigram), lam
  chosen on the scored held-out tokens themselves (the most favourable value for the baseline);
- for MTP layer k (row p at position p takes the token at p + 1 and predicts the token at p + 2), the skip-bigram
  top-1 for its offset from the trunk's position t = p - k (predict x[t + k + 2] from x[t]), and the plain
  bigram top-1 from the token the layer is given (x[p + 1]).
Prints a Markdown table (the README's) and, with --json FILE, writes every figure.
"""
import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import DEFAULT_SOURCES, join, split_files  # noqa: E402
from dequant import dequantize_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KV_PAIRS = [("f32", "f32"), ("bf16", "bf16"), ("q8_0", "q8_0"), ("q8_0", "q5_1"), ("q5_1", "q5_1")]


def train_tokens(tok, sources):
    train, _ = split_files(sources)
    texts = [p.read_text(encoding="utf-8").replace("\r\n", "\n").strip("\n") for p in train]
    return [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch([t for t in texts if t],
                                                                       add_special_tokens=True)]


def offset_counts(docs, vocab, d):
    """counts[a, b]: how often b follows a at distance d inside a document."""
    c = np.zeros((vocab, vocab), dtype=np.int64)
    for ids in docs:
        if len(ids) > d:
            np.add.at(c, (ids[:-d], ids[d:]), 1)
    return c


def scored_chunks(tok, text, ctx, n_chunks):
    """The token chunks memra perplexity scores: the whole text tokenized (BOS first), non-overlapping chunks of
    ctx tokens, the first token of each replaced by BOS."""
    ids = np.asarray(tok.encode(text, add_special_tokens=True).ids, dtype=np.int64)
    bos = ids[0]
    n = len(ids) // ctx if n_chunks < 0 else min(n_chunks, len(ids) // ctx)
    chunks = ids[: n * ctx].reshape(n, ctx).copy()
    chunks[:, 0] = bos
    return chunks


def bigram_baselines(docs, chunks, vocab, n_mtp):
    ctx = chunks.shape[1]
    first = ctx // 2
    c1 = offset_counts(docs, vocab, 1)
    uni = (np.bincount(np.concatenate(docs), minlength=vocab) + 1.0)
    uni /= uni.sum()
    prev = chunks[:, first: ctx - 1].ravel()
    nxt = chunks[:, first + 1:].ravel()
    row = c1[prev].astype(np.float64)
    p_ml = row[np.arange(len(nxt)), nxt] / np.maximum(row.sum(1), 1)
    best = None
    for lam in np.linspace(0.0, 0.99, 100):
        nll = -np.log(lam * p_ml + (1 - lam) * uni[nxt]).mean()
        if best is None or nll < best[0]:
            best = (nll, lam)
    out = {"bigram_ppl": math.exp(best[0]), "bigram_lambda": float(best[1]), "scored_tokens": int(len(nxt)),
           "bigram_top1_next": None, "mtp": []}
    top_next = c1.argmax(1)
    out["bigram_top1_next"] = float((top_next[prev] == nxt).mean())
    for k in range(n_mtp):
        d = k + 2
        top_d = offset_counts(docs, vocab, d).argmax(1)
        # Rows p in [k, ctx - 2] whose target p + 2 lies in the scored half [first + 1, ctx - 1].
        p = np.arange(max(k, first - 1), ctx - 2)
        tgt = chunks[:, p + 2]
        skip = float((top_d[chunks[:, p - k]] == tgt).mean())
        given = float((top_next[chunks[:, p + 1]] == tgt).mean())
        out["mtp"].append({"layer": k, "offset": d, "skip_bigram_top1": skip, "bigram_top1_from_given": given,
                           "rows": int(tgt.size)})
    return out


def memra_ppl(memra, model, text_file, ctx, chunks, threads, kv_k, kv_v, mtp=False, numerics="device"):
    cmd = [str(memra), "perplexity", str(model), "-f", str(text_file), "-c", str(ctx), "--chunks", str(chunks),
           "-t", str(threads), "-ctk", kv_k, "-ctv", kv_v, "-o", "json", "--numerics", numerics] + \
        (["--mtp"] if mtp else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"quality: {' '.join(cmd)} failed ({r.returncode}): {r.stderr}")
    return json.loads(r.stdout)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "default")
    ap.add_argument("--memra", type=Path, default=ROOT / "build" / "memra")
    ap.add_argument("--sources", type=Path, default=DEFAULT_SOURCES)
    ap.add_argument("--chunks", type=int, default=128)
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--numerics", choices=["device", "exact"], default="device",
                    help="memra's numerics for every run (ENGINE.md section 4)")
    args = ap.parse_args(argv)
    cfg = json.loads((args.model / "config.json").read_text())
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    _, heldout = split_files(args.sources)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text_file = tmp / "heldout.txt"
        text = join(heldout)
        text_file.write_text(text, encoding="utf-8")
        chunks = scored_chunks(tok, text, args.ctx, args.chunks)
        base = bigram_baselines(train_tokens(tok, args.sources), chunks, cfg["vocab_size"],
                                cfg["num_nextn_predict_layers"])
        rows = []
        for kv_k, kv_v in KV_PAIRS:
            r = memra_ppl(args.memra, args.model, text_file, args.ctx, args.chunks, args.threads, kv_k, kv_v,
                          mtp=(kv_k, kv_v) == ("bf16", "bf16"), numerics=args.numerics)
            rows.append({"experts": "fp8", "kv_k": kv_k, "kv_v": kv_v, **r})
            print(f"quality: fp8 {kv_k}/{kv_v}: PPL {r['ppl']:.4f} +/- {r['ppl_stderr']:.4f}", file=sys.stderr)
        bf16_dir = dequantize_checkpoint(args.model, tmp / "bf16")
        r = memra_ppl(args.memra, bf16_dir, text_file, args.ctx, args.chunks, args.threads, "bf16", "bf16",
                      numerics=args.numerics)
        rows.append({"experts": "bf16", "kv_k": "bf16", "kv_v": "bf16", **r})
    report = {"model": str(args.model), "numerics": args.numerics, "ctx": args.ctx, "chunks": int(chunks.shape[0]), "baselines": base,
              "runs": rows}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"Numerics {args.numerics}. Held-out: {chunks.shape[0]} chunks of {args.ctx} tokens, "
          f"{base['scored_tokens']} scored tokens; "
          f"bigram PPL {base['bigram_ppl']:.2f} (lambda {base['bigram_lambda']:.2f})\n")
    print("| experts | KV K / V | PPL | vs bigram |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['experts']} | {r['kv_k']} / {r['kv_v']} | {r['ppl']:.4f} ± {r['ppl_stderr']:.4f} | "
              f"{base['bigram_ppl'] / r['ppl']:.2f}x lower |")
    mtp = next(r for r in rows if "mtp" in r and r["mtp"])["mtp"]
    print("\n| MTP layer | predicts | top-1 | PPL | skip-bigram top-1 (same offset) | bigram top-1 (given token) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for m, b in zip(mtp, base["mtp"]):
        print(f"| {m['layer']} | t+{b['offset']} | {m['top1']:.4f} | {m['ppl']:.3f} | {b['skip_bigram_top1']:.4f} | "
              f"{b['bigram_top1_from_given']:.4f} |")


if __name__ == "__main__":
    main()
