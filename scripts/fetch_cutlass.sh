#!/usr/bin/env bash
# Fetches the pinned CUTLASS headers (BSD-3) into DEST/include. CMake runs it at configure time
# with DEST = <build dir>/_deps/cutlass, so every preset works from a clean clone.
# usage: scripts/fetch_cutlass.sh DEST
# The headers come from PyPI's nvidia-cutlass wheel (include/cutlass and include/cute under
# cutlass_library/source/), pinned by version and sha256: pip refuses any other file.
# Idempotent: does nothing when DEST holds the pinned wheel's headers.
set -euo pipefail
VERSION=4.2.0.0
SHA256=f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6
PIN="nvidia-cutlass==$VERSION --hash=sha256:$SHA256"
if (($# != 1)); then
  echo "usage: $0 DEST (CMake passes <build dir>/_deps/cutlass)" >&2
  exit 2
fi
DEST=$1
if [[ -f "$DEST/PIN" && "$(cat "$DEST/PIN")" == "$PIN" && -f "$DEST/include/cutlass/cutlass.h" ]]; then
  exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
echo "$PIN" > "$TMP/requirements.txt"
python3 -m pip download --quiet --no-deps --only-binary=:all: --require-hashes \
  -r "$TMP/requirements.txt" -d "$TMP/wheel"
unzip -q "$TMP"/wheel/nvidia_cutlass-"$VERSION"-*.whl 'cutlass_library/source/include/*' -d "$TMP/x"
mkdir -p "$DEST"
rm -rf "$DEST/include" "$DEST/PIN"
mv "$TMP/x/cutlass_library/source/include" "$DEST/include"
echo "$PIN" > "$DEST/PIN"
echo "CUTLASS $VERSION headers in $DEST/include"
