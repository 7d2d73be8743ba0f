#!/usr/bin/env bash
# Run HERE (not on the GPU machine): unpacks the Debian packages the build needs into .deps/root,
# an ignored folder that the device tool carries to the GPU machine (which has no registries).
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=(libpcre2-dev libpcre2-8-0 libutf8proc-dev libutf8proc2 libfmt-dev libfmt9 nlohmann-json3-dev libexpected-dev libcli11-dev libgtest-dev libgmock-dev
      googletest libbenchmark-dev libbenchmark1debian)
rm -rf .deps && mkdir -p .deps/debs .deps/root
(cd .deps/debs && apt-get download "${pkgs[@]}" >/dev/null)
for f in .deps/debs/*.deb; do dpkg -x "$f" .deps/root; done
rm -rf .deps/debs
du -sh .deps
