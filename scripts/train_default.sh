#!/usr/bin/env bash
# Makes the default model (models/default), in three steps:
#   scripts/train_default.sh prepare   here: the corpus from the Debian package python3.11-doc, the BPE tokenizer
#                                      (memra make-tokenizer, 1024 tokens) and the token ids, into .train/data
#   scripts/train_default.sh train     on the GPU machine (run with carry [".train"]): tools/train/train.py on
#                                      .train/data, the checkpoint and logs into $OUT/model ($OUT/train.log)
#   scripts/train_default.sh install DIR   copies a trained checkpoint (the fetched $OUT/model) into models/default
# Needs: scripts/setup.sh (memra built, .venv with tokenizers); python3.11-doc (setup installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
case "$mode" in
prepare)
    mkdir -p .train
    python3 tools/train/corpus.py .train/corpus
    build/memra make-tokenizer -f .train/corpus/train.txt .train/tokenizer --vocab-size 1024 \
        --model-max-length 4096 --force
    .venv/bin/python tools/train/prepare.py .train/tokenizer .train/data
    ;;
train)
    : "${OUT:?set OUT to the directory that receives the model}"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
    python3 tools/train/train.py .train/data "$OUT/model" "${@:2}" 2>&1 | tee "$OUT/train.log"
    ;;
install)
    src=${2:?usage: scripts/train_default.sh install DIR}
    mkdir -p models/default
    for f in config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json \
        train_log.json; do
        cp "$src/$f" models/default/"$f"
    done
    chmod 644 models/default/*
    ls -l models/default
    ;;
*)
    echo "usage: scripts/train_default.sh prepare | train [train.py options] | install DIR" >&2
    exit 2
    ;;
esac
