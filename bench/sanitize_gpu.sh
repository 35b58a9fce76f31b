#!/usr/bin/env bash
# compute-sanitizer's four tools (memcheck, racecheck, synccheck, initcheck) over the megakernel
# and layer GPU tests, one process per (tool, suite), on a GPU machine (`scripts/gpu.sh sanitize`
# runs it). Prints each run's summary and writes one JSON line per run to $OUT/sanitize.jsonl
# (for bench/results/).
#   BIN: folder with moka_gpu_tests (scripts/stage_gpu.sh stages it with this script).
#   TOOLS, SUITES (gtest filters, space-separated) and LIMIT_S (per run) override the defaults.
# The full-size tests (named shapes at model sizes) are left out: under the sanitizers they
# would take hours, and the reduced-token cases cover the same code paths.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
[[ -f $HERE/gpu_env.sh ]] && source "$HERE/gpu_env.sh"
BIN=${BIN:-$HERE}
[[ -x $BIN/moka_gpu_tests ]] || BIN=$HERE/../build/tests/cuda
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
SANITIZER=${SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
TOOLS=${TOOLS:-memcheck racecheck synccheck initcheck}
SUITES=${SUITES:-Shapes/MegakernelVsReference.*:Megakernel.*:MegakernelGrid.*:MegakernelCore.* MegakernelPath.*:MegakernelBackward.*:MegakernelBackwardTwoRanks.*:-*Dimensions* MegakernelBackwardGemm.* CudaLayer.*:Shapes/CudaLayerVsReference.*:-CudaLayer.NamedShapes* CudaRouter.*:Losses/CudaRouterLosses.*}
# The tests' in-kernel wait bound (2 s) is too short for kernels slowed down by a sanitizer.
export MOKA_TEST_SPIN_TIMEOUT_S=${MOKA_TEST_SPIN_TIMEOUT_S:-120}
LIMIT_S=${LIMIT_S:-300}
COMMIT=${COMMIT:-$(cat "$BIN/commit.txt" 2>/dev/null || git -C "$HERE" rev-parse --short HEAD 2>/dev/null || echo unknown)}
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
rc=0
set -f  # the suite filters are gtest patterns, not file globs
for tool in $TOOLS; do
  for suite in $SUITES; do
    log="$OUT/sanitize-$tool-$(echo "$suite" | tr -c 'A-Za-z0-9' '_' | cut -c1-40).log"
    start=$(date +%s)
    timeout "$LIMIT_S" "$SANITIZER" --tool "$tool" --error-exitcode 99 --print-limit 20 \
      "$BIN/moka_gpu_tests" --gtest_color=no --gtest_filter="$suite" > "$log" 2>&1
    code=$?
    seconds=$(( $(date +%s) - start ))
    # racecheck reports hazards ("RACECHECK SUMMARY: N hazards displayed"), the others errors.
    errors=$(grep -oE "(ERROR SUMMARY: [0-9]+|RACECHECK SUMMARY: [0-9]+)" "$log" | tail -1 | grep -oE "[0-9]+$")
    passed=$(grep -oE "^\[  PASSED  \] [0-9]+" "$log" | grep -oE "[0-9]+$")
    failed=$(grep -cE "^\[  FAILED  \] [A-Za-z]" "$log")
    echo "sanitize $tool '$suite': exit $code, sanitizer errors ${errors:-?}, tests passed ${passed:-0}, failed $failed, ${seconds}s"
    printf '{"tool":"%s","suites":"%s","exit_code":%d,"sanitizer_errors":%s,"tests_passed":%s,"tests_failed":%s,"seconds":%d,"commit":"%s","date":"%s","device":"%s","command":"bench/sanitize_gpu.sh"}\n' \
      "$tool" "$suite" "$code" "${errors:-null}" "${passed:-0}" "$failed" "$seconds" "$COMMIT" "$(date -u +%F)" "$DEVICE" \
      >> "$OUT/sanitize.jsonl"
    [[ $code -ne 0 ]] && rc=1 && grep -m 12 -E "=========.*(Error|error|Barrier|Missing|Invalid|Race|Uninitialized)" "$log"
  done
done
exit $rc
