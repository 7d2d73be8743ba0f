#!/usr/bin/env bash
# Run HERE (not on the GPU machine): unpacks the Debian packages the build needs into .deps/root, the server
# tests' wheels into .deps/wheels and llama.cpp's source into .deps/llama.cpp: an ignored folder that the device
# tool carries to the GPU machine (which has no registries; carry what the run needs, within 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=(libpcre2-dev libpcre2-8-0 libutf8proc-dev libutf8proc2 libfmt-dev libfmt9 nlohmann-json3-dev libexpected-dev libcli11-dev libgtest-dev libgmock-dev
      googletest libbenchmark-dev libbenchmark1debian
      libcpp-httplib-dev libcpp-httplib0.11 libssl-dev libssl3 zlib1g-dev libbrotli-dev libbrotli1)
rm -rf .deps && mkdir -p .deps/debs .deps/root
(cd .deps/debs && apt-get download "${pkgs[@]}" >/dev/null)
for f in .deps/debs/*.deb; do dpkg -x "$f" .deps/root; done
rm -rf .deps/debs
# The server tests' Python clients, for the GPU machine's Python (3.10 to 3.12): pure wheels and binary ones.
py=.venv/bin/python  # scripts/setup.sh's venv has pip; Debian's python3 may not
[ -x "$py" ] || py=python3
for v in 3.10 3.11 3.12; do
    "$py" -m pip download -q openai==3.57.0 prometheus-client==0.26.0 pytest==9.2.0 --only-binary=:all: \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --python-version "$v" --implementation cp \
        -d .deps/wheels
done
# llama.cpp's CUDA build as the GPU peer (scripts/gpu.sh with MEMRA_GPU_LLAMA=1): the llama.cpp that the pinned
# llama-cpp-python's sdist vendors (the CPU oracles' version, with Step-3.5), stripped to what llama-bench with the
# CPU and CUDA backends and the GGUF converter need, as .deps/llama.cpp.tar.gz (the tree is 176 MB, the stripped
# one 24 MB, compressed about 5; the carry limit is 64 MiB).
llama_version=$(sed -n 's/^llama-cpp-python==\([^ ]*\).*/\1/p' requirements-oracle.txt)
sdist=$(mktemp -d)
"$py" -m pip download -q --no-deps --no-binary :all: --dest "$sdist" "llama-cpp-python==$llama_version"
tar xzf "$sdist/llama_cpp_python-$llama_version.tar.gz" -C "$sdist"
src=$sdist/llama_cpp_python-$llama_version/vendor/llama.cpp
tree=$sdist/llama.cpp
mkdir -p "$tree/tools"
for f in CMakeLists.txt cmake common ggml include src vendor licenses LICENSE convert_hf_to_gguf.py conversion gguf-py \
         tools/llama-bench; do
    cp -r "$src/$f" "$tree/$f"
done
for b in "$tree"/ggml/src/ggml-*/; do
    case $(basename "$b") in ggml-cpu | ggml-cuda) ;; *) rm -rf "$b" ;; esac
done
printf 'llama_add_compile_flags()\nadd_subdirectory(llama-bench)\n' >"$tree/tools/CMakeLists.txt"
tar czf .deps/llama.cpp.tar.gz -C "$sdist" llama.cpp
rm -rf "$sdist"
du -sh .deps/*
