#!/usr/bin/env bash
# Fetches the pinned CUTLASS headers (BSD-3) from PyPI's nvidia-cutlass wheel into
# build/_deps/cutlass (or $1). The wheel carries include/cutlass and include/cute under
# cutlass_library/source/. Idempotent: does nothing when the pinned version is already there.
set -euo pipefail
VERSION=4.2.0.0
DEST=${1:-"$(cd "$(dirname "$0")/.." && pwd)/build/_deps/cutlass"}
if [[ -f "$DEST/VERSION" && "$(cat "$DEST/VERSION")" == "$VERSION" ]]; then exit 0; fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: "nvidia-cutlass==$VERSION" -d "$TMP"
mkdir -p "$DEST"
rm -rf "$DEST/include"
unzip -q "$TMP"/nvidia_cutlass-"$VERSION"-*.whl 'cutlass_library/source/include/*' -d "$TMP/x"
mv "$TMP/x/cutlass_library/source/include" "$DEST/include"
echo "$VERSION" > "$DEST/VERSION"
echo "CUTLASS $VERSION headers in $DEST/include"
