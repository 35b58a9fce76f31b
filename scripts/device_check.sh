#!/usr/bin/env bash
# One device call that checks the GPU paths: the expert-parallel checks on every GPU of the
# machine (device group + EP layer vs the CPU reference), then the single-GPU suites on GPU 0.
# BIN: folder with moka, moka_gpu_tests, moka_ep_gpu_check and the scripts (scripts/stage_gpu.sh).
set -uo pipefail
BIN=$(cd "${1:-build}" && pwd)
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=index,name,driver_version --format=csv | tee "$OUT/device.txt"
rc=0
GPUS=$(nvidia-smi -L | wc -l)
if [ "$GPUS" -ge 2 ]; then
  timeout 240 "$BIN/moka" launch -n "$GPUS" -- "$BIN/moka_ep_gpu_check" > "$OUT/ep_gpu_check.log" 2>&1 || rc=1
  grep -E "passed|FAILED|error|failed|exited" "$OUT/ep_gpu_check.log" | head -40
fi
if [ "${SINGLE_GPU_TESTS:-1}" = 1 ]; then
  OUT=$OUT MODE=tests SUITES=${SUITES:-} BIN=$BIN bash "$BIN/gpu_check.sh" || rc=1
fi
exit $rc
