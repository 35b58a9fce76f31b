#!/usr/bin/env bash
# Copies what the GPU runner needs on a bare GPU machine (binaries, scripts and the training
# text, no sources) into DEST (default: .dev/cuda of this checkout), for the device tool's
# `carry`: `bash DEST/gpu.sh check|bench|ep|train|study|sanitize` runs from there (gpu.sh python
# runs from a checkout: it needs the package, its tests and the example).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-$ROOT/.dev/cuda}
mkdir -p "$DEST"
cp "$ROOT/build/tests/cuda/moka_gpu_tests" "$ROOT/build/tests/train/gpu/moka_train_gpu_tests" "$ROOT/build/tools/moka" "$DEST/"
[ -x "$ROOT/build/tests/cuda/moka_ep_gpu_check" ] && cp "$ROOT/build/tests/cuda/moka_ep_gpu_check" "$DEST/"
# The kernel lab (bench/kernels/README.md).
cp "$ROOT"/build/bench/kernels/{mk_forward_core,mk_backward_core,mk_tune,nvlink_incast,staged_baselines,paired_steps,gemm_schedules} "$DEST/"
cp "$ROOT/scripts/gpu.sh" "$ROOT/scripts/gpu_env.sh" "$ROOT/bench/torch_baseline.py" "$ROOT/bench/torch_train_baseline.py" \
  "$ROOT/bench/sanitize_gpu.sh" "$DEST/"
# The commit the binaries were built from, for the results' JSON lines.
git -C "$ROOT" rev-parse --short HEAD > "$DEST/commit.txt"
# The fortunes text (scripts/fetch_data.sh) for the trainer: the GPU machine has no network.
TEXT=${MOKA_TEXT_DIR:-/usr/share/games/fortunes}
if [ -d "$TEXT" ]; then
  rm -rf "$DEST/fortunes"
  cp -a "$TEXT" "$DEST/fortunes"
else
  echo "stage_gpu: no training text at $TEXT (run scripts/fetch_data.sh): gpu.sh train will fail" >&2
fi
# The GCIDE text (scripts/fetch_data.sh gcide), gzipped (~11 MB) to fit the carry limit; unpack
# it on the GPU machine with: mkdir -p gcide && gunzip -c DEST/gcide.gz > gcide/gcide
GCIDE=${MOKA_DATA_DIR:-$HOME/.cache/moka-data}/gcide/text/gcide
[ -f "$GCIDE" ] && gzip -c "$GCIDE" > "$DEST/gcide.gz"
strip "$DEST"/moka* "$DEST"/{mk_forward_core,mk_backward_core,mk_tune,nvlink_incast,staged_baselines,paired_steps,gemm_schedules} \
  2>/dev/null || true
du -sh "$DEST"
