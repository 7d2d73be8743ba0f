#!/usr/bin/env bash
# Installs everything memra needs (Debian packages, the PyPI oracles into .venv), builds, and
# runs the main job (memra run) on the embedded default model. Idempotent: a second run only rebuilds.
#   scripts/setup.sh          install + build + run the main job
#   scripts/setup.sh deps     install only
#   scripts/setup.sh base     Debian packages and .venv from requirements-dev.txt, not the model oracles
#   scripts/setup.sh oracles  the model oracles only (needs base; scripts/test.sh runs it alongside its
#                             sanitizer build)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
case "$mode" in
all | deps | base | oracles) ;;
*) echo "usage: scripts/setup.sh [deps|base|oracles]" >&2; exit 2 ;;
esac

install_debian_packages() {
    local apt_packages=(
        build-essential cmake ninja-build clang libclang-rt-14-dev python3-venv
        libgtest-dev libgmock-dev libbenchmark-dev
        nlohmann-json3-dev libcli11-dev libfmt-dev libexpected-dev libpcre2-dev libutf8proc-dev libcpp-httplib-dev
        openmpi-bin libopenmpi-dev  # mpirun: one tensor-parallel rank per process (run, bench, perplexity)
        iproute2  # ss: the server tests read the listening socket's backlog
        python3.11-doc  # the default model's corpus (tools/train/corpus.py): its held-out split for the tests
    )
    local missing=() p
    for p in "${apt_packages[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if ((${#missing[@]})); then
        echo "setup: installing Debian packages: ${missing[*]}"
        local sudo_cmd=()
        [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
        "${sudo_cmd[@]}" apt-get update -qq
        DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}"
    fi
}

# The venv is rebuilt only when requirements-dev.txt changes; pip keeps its wheel cache in
# ~/.cache/pip (PIP_CACHE_DIR to move it), so a rebuild downloads nothing twice.
install_dev_venv() {
    local req_hash
    req_hash=$(sha256sum requirements-dev.txt | cut -d' ' -f1)
    if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.requirements-hash 2>/dev/null)" != "$req_hash" ]; then
        echo "setup: creating .venv from requirements-dev.txt"
        python3 -m venv .venv
        .venv/bin/python -m pip install -q --upgrade pip
        .venv/bin/python -m pip install -q -r requirements-dev.txt
        echo "$req_hash" > .venv/.requirements-hash
    fi
}

# The model oracles (requirements-oracle.txt: torch, transformers, llama-cpp-python) on top, stamped
# separately: torch's CUDA wheels are ~5.6 GB (~4 min cold) and llama-cpp-python compiles llama.cpp
# (~5 min on 2 cores); pip caches both the downloads and the built wheel. The llama-cpp-python sdist
# is kept too: tests/oracle/llamacpp_step35.py takes llama.cpp's own GGUF converter from it.
install_oracles() {
    if [ ! -f .venv/.requirements-hash ]; then
        echo "setup: .venv missing: run scripts/setup.sh base first" >&2
        exit 1
    fi
    local oracle_hash oracle_cache llama_version
    oracle_hash=$(sha256sum requirements-oracle.txt | cut -d' ' -f1)
    oracle_cache=${MEMRA_ORACLE_CACHE:-$HOME/.cache/memra-oracle}
    if [ "$(cat .venv/.oracle-hash 2>/dev/null)" != "$oracle_hash" ]; then
        echo "setup: installing the model oracles from requirements-oracle.txt (first time: several minutes)"
        CMAKE_ARGS="-DLLAVA_BUILD=OFF" .venv/bin/python -m pip install -q -r requirements-oracle.txt
        llama_version=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))')
        .venv/bin/python -m pip download -q --no-deps --no-binary :all: --dest "$oracle_cache/sdist" \
            "llama-cpp-python==$llama_version"
        echo "$oracle_hash" > .venv/.oracle-hash
    fi
}

if [ "$mode" != oracles ]; then
    install_debian_packages
    install_dev_venv
fi
[ "$mode" = base ] && exit 0
install_oracles
[ "$mode" = all ] || exit 0

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMRA_WERROR=ON >/dev/null
cmake --build build -j"$(nproc)"
# The main job: continue a prompt with the embedded default model (trained on the Python documentation) on the
# CPU engine, greedy, so repeatable.
build/memra run --prompt "A list is a mutable sequence" -n 48 --temp 0
