"""Trains memra's default model (a small Step-3.5: full and sliding layers, MoE with a sigmoid router, selection
bias and shared expert, SwiGLU clamps, three chained MTP layers) on token ids, and exports it in the official
Hugging Face layout with FP8 routed experts.

    python tools/train/train.py DATA_DIR OUT_DIR [--minutes M] [--device cuda] ...

DATA_DIR holds train.u16 and heldout.u16 (little-endian uint16 token ids, tools/train/prepare.py writes them)
and tokenizer.json / tokenizer_config.json, which are copied into OUT_DIR with config.json,
generation_config.json, model.safetensors and train_log.json (hyperparameters, loss curve, held-out figures).

Recipe: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear warm-up then cosine decay to 10% over
whichever ends first, a wall-clock budget or --epochs passes over the data (the learning rate follows that
progress, so one run fits one device call), dropout on the residual branches, bf16 autocast,
loss = trunk cross-entropy + mtp_weight x the mean of the MTP layers' cross-entropies. Routed experts train
with straight-through FP8 block quantization over the last --qat fraction of the budget, so the exported FP8
experts are the trained ones. The router's selection bias is not trained by gradient: after each step it moves
by --bias-rate toward balanced expert load (sign of mean load minus each expert's load). The tail of the
training ids (--val-frac) is held back for validation every --eval-every seconds; the exported state is the last
one unless an earlier one validated better. The held-out split is scored once, at the end.
"""
import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step35_torch import Step35, config_json, export_tensors, make_config  # noqa: E402

# The default model's shape (README: "The default model"). Every width is a multiple of 128, head_dim 128, the
# sliding window 3 KV pages of 64 rows (ENGINE.md section 6).
DEFAULT_SHAPE = {
    "vocab_size": 1024, "hidden_size": 256, "head_dim": 128, "heads_full": 4, "heads_sliding": 2, "kv_heads": 1,
    "num_hidden_layers": 4, "num_nextn_predict_layers": 3, "sliding_window": 192, "intermediate_size": 384,
    "moe_layers": [1, 2, 3], "experts": 8, "top_k": 2, "expert_dim": 128, "shared_dim": 128, "router_scale": 3.0,
    "swiglu_limits": {"2": 7.0, "3": 7.0}, "swiglu_limits_shared": {"3": 16.0}, "max_seq_len": 4096,
}


def read_ids(path):
    return np.fromfile(path, dtype="<u2").astype(np.int64)


def batches(ids, seq, batch, gen):
    """Random windows of seq + 1 tokens."""
    n = len(ids) - seq - 1
    while True:
        starts = gen.integers(0, n, size=batch)
        yield np.stack([ids[s: s + seq + 1] for s in starts])


def losses(model, x, mtp_weight, dropout):
    logits, mtp = model(x[:, :-1], dropout=dropout)
    ce = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
    mtp_ce = []
    for k, lg in enumerate(mtp):
        # MTP layer k's row i sits at position i + k and predicts the token at i + k + 2.
        tgt = x[:, k + 2:]
        mtp_ce.append(F.cross_entropy(lg[:, : tgt.shape[1]].float().flatten(0, 1), tgt.flatten()))
    total = ce + mtp_weight * (sum(mtp_ce) / len(mtp_ce) if mtp_ce else 0.0)
    return total, ce, mtp_ce


@torch.no_grad()
def evaluate(model, ids, seq, device, max_windows, autocast):
    """Mean cross-entropy of the trunk and each MTP layer, and each MTP layer's top-1 accuracy, over consecutive
    non-overlapping windows of seq + 1 tokens (every position scored)."""
    model.eval()
    n_win = min(max_windows, (len(ids) - 1) // (seq + 1))
    tot = {"ce": 0.0, "n": 0, "mtp_ce": None, "mtp_acc": None, "mtp_n": None}
    for w in range(0, n_win, 16):
        chunk = np.stack([ids[i * (seq + 1): (i + 1) * (seq + 1)] for i in range(w, min(n_win, w + 16))])
        x = torch.from_numpy(chunk).to(device)
        with autocast():
            logits, mtp = model(x[:, :-1])
        tgt = x[:, 1:]
        tot["ce"] += F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), reduction="sum").item()
        tot["n"] += tgt.numel()
        if tot["mtp_ce"] is None:
            tot["mtp_ce"], tot["mtp_acc"], tot["mtp_n"] = [0.0] * len(mtp), [0] * len(mtp), [0] * len(mtp)
        for k, lg in enumerate(mtp):
            t = x[:, k + 2:]
            lg = lg[:, : t.shape[1]].float()
            tot["mtp_ce"][k] += F.cross_entropy(lg.flatten(0, 1), t.flatten(), reduction="sum").item()
            tot["mtp_acc"][k] += (lg.argmax(-1) == t).sum().item()
            tot["mtp_n"][k] += t.numel()
    model.train()
    return {"ce": tot["ce"] / tot["n"], "ppl": math.exp(tot["ce"] / tot["n"]), "tokens": tot["n"],
            "mtp_ppl": [math.exp(c / n) for c, n in zip(tot["mtp_ce"], tot["mtp_n"])],
            "mtp_top1": [a / n for a, n in zip(tot["mtp_acc"], tot["mtp_n"])]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--minutes", type=float, default=7.0, help="wall-clock training budget")
    ap.add_argument("--epochs", type=float, default=16.0, help="passes over the training ids at most")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: the budget only)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup-frac", type=float, default=0.03)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--mtp-weight", type=float, default=0.5)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--qat", type=float, default=0.25, help="last fraction of the budget with FP8 experts")
    ap.add_argument("--eval-every", type=float, default=30.0, help="seconds between validation evaluations")
    ap.add_argument("--val-frac", type=float, default=0.02, help="tail of the training ids kept for validation")
    ap.add_argument("--eval-windows", type=int, default=96)
    ap.add_argument("--final-windows", type=int, default=0, help="held-out windows of the final evaluation (0: all)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast on the CPU too (always on CUDA)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    gen = np.random.default_rng(args.seed)
    device = torch.device(args.device)
    train_ids = read_ids(args.data_dir / "train.u16")
    held_ids = read_ids(args.data_dir / "heldout.u16")
    # Validation (the tail of the training split, never trained on) picks the exported state; the held-out
    # split is only scored at the end.
    n_val = int(len(train_ids) * args.val_frac)
    val_ids, train_ids = train_ids[len(train_ids) - n_val:], train_ids[: len(train_ids) - n_val]
    for name, ids in (("training", train_ids), ("validation", val_ids), ("held-out", held_ids)):
        if len(ids) < args.seq + 2:
            raise SystemExit(f"train: {len(ids)} {name} tokens, need at least --seq + 2 = {args.seq + 2}")
    tok_cfg = json.loads((args.data_dir / "tokenizer.json").read_text())
    im_end = tok_cfg["model"]["vocab"]["<|im_end|>"]
    shape = dict(DEFAULT_SHAPE, im_end_id=im_end)
    if int(train_ids.max()) >= shape["vocab_size"]:
        raise SystemExit(f"train: token id {int(train_ids.max())} >= vocab_size {shape['vocab_size']}")
    cfg = make_config(shape)
    model = Step35(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    use_bf16 = device.type == "cuda" or args.bf16

    def autocast():
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_bf16)

    budget = args.minutes * 60.0
    # The hyperparameters, not where this machine wrote the files.
    hyper = {k: v for k, v in vars(args).items() if k not in ("data_dir", "out_dir")}
    log = {"args": hyper, "shape": shape,
           "params": n_params, "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(held_ids)),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "curve": [], "evals": []}
    print(f"train: {n_params} parameters, {len(train_ids)} train / {len(held_ids)} held-out tokens on {log['device']}",
          flush=True)
    it = batches(train_ids, args.seq, args.batch, gen)
    start = time.time()
    next_eval = args.eval_every
    step = 0
    qat_on = False
    tokens_per_step = args.batch * args.seq
    best = {"ce": float("inf")}
    while True:
        elapsed = time.time() - start
        frac = min(max(elapsed / budget, step * tokens_per_step / (args.epochs * len(train_ids))), 1.0)
        if frac >= 1.0 or (args.max_steps and step >= args.max_steps):
            break
        if args.max_steps:
            frac = step / args.max_steps
        if not qat_on and frac >= 1.0 - args.qat:
            model.set_fake_fp8(True)
            qat_on = True
        if frac < args.warmup_frac:
            lr = args.lr * (frac / args.warmup_frac)
        else:
            c = (frac - args.warmup_frac) / (1.0 - args.warmup_frac)
            lr = args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * c)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = torch.from_numpy(next(it)).to(device, non_blocking=True)
        with autocast():
            total, ce, mtp_ce = losses(model, x, args.mtp_weight, args.dropout)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for b in model.moe_blocks():
                load = b.last_load / b.last_load.sum()
                b.router_bias += args.bias_rate * torch.sign(load.mean() - load)
        step += 1
        if step % 50 == 0:
            row = {"step": step, "seconds": round(time.time() - start, 1), "lr": lr, "loss": ce.item(),
                   "mtp_loss": [m.item() for m in mtp_ce], "qat": qat_on}
            log["curve"].append(row)
            print(f"step {step} t={row['seconds']}s lr={lr:.2e} ce={row['loss']:.4f} "
                  f"mtp={[round(m, 3) for m in row['mtp_loss']]}", flush=True)
        if time.time() - start >= next_eval:
            ev = evaluate(model, val_ids, args.seq, device, args.eval_windows, autocast)
            ev.update(step=step, seconds=round(time.time() - start, 1), qat=qat_on)
            log["evals"].append(ev)
            print(f"eval step {step}: validation ppl {ev['ppl']:.3f} mtp ppl {[round(p, 2) for p in ev['mtp_ppl']]} "
                  f"top1 {[round(a, 3) for a in ev['mtp_top1']]}", flush=True)
            if ev["ce"] < best["ce"]:
                best = {"ce": ev["ce"], "step": step, "qat": qat_on,
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
            next_eval += args.eval_every
    log["steps"] = step
    log["train_seconds"] = round(time.time() - start, 1)
    last = evaluate(model, val_ids, args.seq, device, args.eval_windows, autocast)
    log["exported_step"] = step
    if best["ce"] < last["ce"]:
        model.load_state_dict(best["state"])
        log["exported_step"] = best["step"]
    print(f"train: exporting the state of step {log['exported_step']} "
          f"(validation ce {min(best['ce'], last['ce']):.4f})", flush=True)
    # Final held-out figures with the FP8 experts (the exported model) and with the unquantized weights.
    eval_windows = args.final_windows or (len(held_ids) - 1) // (args.seq + 1)
    model.set_fake_fp8(True)
    log["final_fp8"] = evaluate(model, held_ids, args.seq, device, eval_windows, autocast)
    model.set_fake_fp8(False)
    log["final_unquantized"] = evaluate(model, held_ids, args.seq, device, eval_windows, autocast)
    print(f"final held-out ppl: fp8 experts {log['final_fp8']['ppl']:.4f}, unquantized "
          f"{log['final_unquantized']['ppl']:.4f}; mtp top1 {log['final_fp8']['mtp_top1']}", flush=True)

    from safetensors.torch import save_file
    args.out_dir.mkdir(parents=True, exist_ok=True)
    save_file(export_tensors(model), str(args.out_dir / "model.safetensors"), metadata={"format": "pt"})
    (args.out_dir / "config.json").write_text(config_json(cfg))
    (args.out_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": [1, im_end], "pad_token_id": 1}, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(args.data_dir / name, args.out_dir / name)
    (args.out_dir / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"train: wrote {args.out_dir} after {step} steps", flush=True)


if __name__ == "__main__":
    main()
