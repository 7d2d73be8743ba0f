"""The default model's corpus: the reStructuredText sources of the Python 3.11 documentation, as the Debian
package python3.11-doc installs them (/usr/share/doc/python3.11/html/_sources, PSF License Version 2).

Files are read in sorted path order; every 20th file (sorted index % 20 == 7) is held out, the rest is the
training split. Documents are joined with one blank line. Deterministic: the same package version gives the
same bytes.

    python tools/train/corpus.py OUT_DIR [--sources DIR]   writes OUT_DIR/train.txt, OUT_DIR/heldout.txt
"""
import argparse
import hashlib
import sys
from pathlib import Path

DEFAULT_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
HELDOUT_EVERY = 20
HELDOUT_INDEX = 7


def split_files(sources):
    files = sorted(p for p in sources.rglob("*.txt") if p.is_file())
    if not files:
        raise SystemExit(f"corpus: no *.txt under {sources} (install the Debian package python3.11-doc)")
    train, heldout = [], []
    for i, p in enumerate(files):
        (heldout if i % HELDOUT_EVERY == HELDOUT_INDEX else train).append(p)
    return train, heldout


def join(files):
    parts = []
    for p in files:
        text = p.read_text(encoding="utf-8").replace("\r\n", "\n").strip("\n")
        if text:
            parts.append(text)
    return "\n\n".join(parts) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--sources", type=Path, default=DEFAULT_SOURCES)
    args = ap.parse_args(argv)
    train, heldout = split_files(args.sources)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, files in (("train", train), ("heldout", heldout)):
        data = join(files).encode("utf-8")
        (args.out_dir / f"{name}.txt").write_bytes(data)
        print(f"corpus: {name}: {len(files)} files, {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
