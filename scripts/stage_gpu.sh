#!/usr/bin/env bash
# Copies what scripts/gpu_check.sh needs on the GPU machine (binaries and scripts, no sources)
# into DEST (default: .dev/cuda of this checkout), for the device tool's `carry`.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-$ROOT/.dev/cuda}
mkdir -p "$DEST"
cp "$ROOT/build/tests/gpu/moka_gpu_tests" "$ROOT/build/tools/moka" "$DEST/"
[ -x "$ROOT/build/tests/moka_ep_gpu_check" ] && cp "$ROOT/build/tests/moka_ep_gpu_check" "$DEST/"
cp "$ROOT/scripts/gpu_check.sh" "$ROOT/scripts/device_check.sh" "$ROOT/scripts/ep_bench.sh" "$ROOT/scripts/gpu_env.sh" "$ROOT/bench/torch_baseline.py" "$DEST/"
strip "$DEST"/moka* 2>/dev/null || true
du -sh "$DEST"
