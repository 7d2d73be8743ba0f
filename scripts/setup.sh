#!/usr/bin/env bash
# Installs everything memra needs (Debian packages, the PyPI oracles into .venv), builds, and
# runs the main job (memra run) on the embedded default model. Idempotent: a second run only rebuilds.
#   scripts/setup.sh          install + build + run the main job
#   scripts/setup.sh deps     install only (used by scripts/test.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}

apt_packages=(
    build-essential cmake ninja-build clang libclang-rt-14-dev python3-venv
    libgtest-dev libgmock-dev libbenchmark-dev
    nlohmann-json3-dev libcli11-dev libfmt-dev libexpected-dev libpcre2-dev libutf8proc-dev
)
missing=()
for p in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "setup: installing Debian packages: ${missing[*]}"
    sudo_cmd=()
    [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}"
fi

# The venv is rebuilt only when requirements-dev.txt changes; pip keeps its wheel cache in
# ~/.cache/pip (PIP_CACHE_DIR to move it), so a rebuild downloads nothing twice.
req_hash=$(sha256sum requirements-dev.txt | cut -d' ' -f1)
if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.requirements-hash 2>/dev/null)" != "$req_hash" ]; then
    echo "setup: creating .venv from requirements-dev.txt"
    python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -r requirements-dev.txt
    echo "$req_hash" > .venv/.requirements-hash
fi
[ "$mode" = deps ] && exit 0

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMRA_WERROR=ON >/dev/null
cmake --build build -j"$(nproc)"
# The main job: generate from the embedded default model on the CPU engine (greedy, so repeatable).
build/memra run --prompt "The quick brown fox" -n 32 --temp 0
