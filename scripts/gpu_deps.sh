#!/usr/bin/env bash
# Run HERE (not on the GPU machine): unpacks the Debian packages the build needs into .deps/root,
# an ignored folder that the device tool carries to the GPU machine (which has no registries).
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
du -sh .deps
