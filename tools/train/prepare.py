"""Tokenizes the default model's corpus for training: each document of tools/train/corpus.py's split, encoded
with Hugging Face `tokenizers` from TOKENIZER_DIR/tokenizer.json with its BOS prepended (a document starts
with BOS, as a prompt does), concatenated into little-endian uint16 ids.

    python tools/train/prepare.py TOKENIZER_DIR OUT_DIR [--sources DIR]
writes OUT_DIR/train.u16, OUT_DIR/heldout.u16 and copies tokenizer.json / tokenizer_config.json.
"""
import argparse
import shutil
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import DEFAULT_SOURCES, split_files  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tokenizer_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--sources", type=Path, default=DEFAULT_SOURCES)
    args = ap.parse_args(argv)
    tok = Tokenizer.from_file(str(args.tokenizer_dir / "tokenizer.json"))
    if tok.get_vocab_size() > 65536:
        raise SystemExit(f"prepare: {tok.get_vocab_size()} tokens do not fit uint16")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, files in zip(("train", "heldout"), split_files(args.sources)):
        texts = [p.read_text(encoding="utf-8").replace("\r\n", "\n").strip("\n") for p in files]
        encs = tok.encode_batch([t for t in texts if t], add_special_tokens=True)
        ids = np.concatenate([np.asarray(e.ids, dtype="<u2") for e in encs])
        ids.tofile(args.out_dir / f"{name}.u16")
        print(f"prepare: {name}: {len(encs)} documents, {len(ids)} tokens", file=sys.stderr)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(args.tokenizer_dir / name, args.out_dir / name)


if __name__ == "__main__":
    main()
