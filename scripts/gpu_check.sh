#!/usr/bin/env bash
# Runs on the GPU machine: the GPU tests, the PyTorch baseline and `moka bench --backend cuda`,
# side by side in one run. Expects prebuilt binaries next to this script (scripts/stage_gpu.sh
# copies them) or under build/; writes logs and JSON lines to $OUT (or ./gpu_out).
#   MODE=tests|bench|all (default all); mps: the megakernel suites in an MPS client limited
#   to MPS_PERCENT (default 50) of the GPU's threads, whose grids must fit the SMs it owns;
#   paired: the megakernel layer and backward core of this build against BASE's moka (a folder),
#   ROUNDS (default 2) of runs alternating the two binaries, and their per-round time ratios;
#   SUITES (gtest filters), SHAPES, TOKENS, ITERS override the default lists.
# The benchmark first runs torch_baseline.py --paired-with moka: torch's own medians, then ITERS
# runs alternating one moka and one torch fwd+bwd (the median of per-run ratios, vs_torch_paired),
# then `moka bench`, which checks every output against the cuBLAS loop and times fwd and bwd.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/gpu_env.sh"
BIN=${BIN:-$HERE}
[[ -x $BIN/moka_gpu_tests ]] || BIN=$HERE/../build
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
MODE=${MODE:-all}
SHAPES=${SHAPES:-qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,gpt-oss-120b,mixtral-8x7b}
TOKENS=${TOKENS:-4096,16384}
ITERS=${ITERS:-20}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/device.txt"
rc=0
if [[ $MODE == tests || $MODE == all ]]; then
  # One process per suite: a device fault in one suite cannot hide the others' results.
  : > "$OUT/gpu_tests.log"
  SUITES=${SUITES:-Layouts/GroupedGemmLayouts.*:GroupedGemmChecks.* Widths/GroupedGemmSwiglu.* Routing/DeviceSchedule.* Shapes/CudaLayerVsReference.* CudaLayer.* CudaRouter.*}
  set -f  # the suite filters are gtest patterns, not file globs
  for suite in $SUITES; do
    timeout 300 "$BIN/moka_gpu_tests" --gtest_color=no --gtest_filter="$suite" >> "$OUT/gpu_tests.log" 2>&1
    src=$?
    echo "suite $suite: exit code $src"
    [[ $src -ne 0 ]] && rc=$src
  done
  grep -E "^\[  FAILED  \]|Failure$|actual:|exception" "$OUT/gpu_tests.log" | head -40
fi
if [[ $MODE == mps ]]; then
  whole_gpu_sms=$("$BIN/moka_gpu_tests" --gtest_filter=MegakernelGrid.* 2>/dev/null | sed -n 's/.*the context.s \([0-9]*\).*/\1/p')
  if mps_daemon_start; then
    SUITES=${SUITES:-MegakernelGrid.*:Megakernel.*:Shapes/MegakernelVsReference.*:MegakernelPath.*:MegakernelBackward.*:-*Dimensions*}
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=${MPS_PERCENT:-50} MOKA_TEST_GPU_SMS=$whole_gpu_sms timeout 400 \
      "$BIN/moka_gpu_tests" --gtest_color=no --gtest_filter="$SUITES" > "$OUT/gpu_tests_mps.log" 2>&1
    rc=$?
    mps_daemon_stop
    echo "MPS client at ${MPS_PERCENT:-50}% of the threads (the whole GPU: $whole_gpu_sms SMs): exit code $rc"
    grep -E "^\[ grid|^\[  PASSED|^\[  FAILED|Failure$|exception" "$OUT/gpu_tests_mps.log" | head -30
  else
    echo "MPS is not available here"; rc=1
  fi
fi
if [[ $MODE == paired ]]; then
  SHAPES=${SHAPES_PAIRED:-qwen3-30b-a3b,mixtral-8x7b}
  : > "$OUT/paired.jsonl"
  for round in $(seq "${ROUNDS:-2}"); do
    for which in base new; do
      bin=$BIN/moka; [[ $which == base ]] && bin=$BASE/moka
      tag="s/^{/{\"binary\":\"$which\",\"round\":$round,/"
      timeout 100 "$bin" bench --backend cuda --shape "$SHAPES" --tokens 16384 --iters 6 --warmup 2 --no-baselines \
        --json 2>/dev/null | sed "$tag" >> "$OUT/paired.jsonl"
      timeout 60 "$(dirname "$bin")/mk_backward_core" --shape "$SHAPES" --tokens 16384 --iters 3 \
        2>/dev/null | sed "$tag" >> "$OUT/paired.jsonl"
    done
  done
  python3 - "$OUT/paired.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
key = lambda r: (r["shape"], r["path"])
for k in sorted({key(r) for r in rows}):
    for metric in ("fwd_ms", "bwd_ms"):
        ratios = [n[metric] / b[metric] for b in rows for n in rows if key(b) == key(n) == k and
                  b["binary"] == "base" and n["binary"] == "new" and b["round"] == n["round"] and b.get(metric)]
        if ratios: print(f"{k[0]} {k[1]} {metric}: new / base {statistics.median(ratios):.3f} over {len(ratios)} rounds")
PY
fi
if [[ $MODE == bench || $MODE == all ]]; then
  PYTHONUNBUFFERED=1 timeout 300 python3 "$HERE/torch_baseline.py" --shapes "$SHAPES" --tokens "$TOKENS" \
    --iters "$ITERS" --paired-with "$BIN/paired_steps" --out "$OUT/torch.jsonl" 2>&1 | cut -c1-400 | tail -20
  timeout 400 "$BIN/moka" bench --backend cuda --shape "$SHAPES" --tokens "$TOKENS" --iters "$ITERS" --warmup 3 \
    --torch-results "$OUT/torch.jsonl" 2>&1 | tee "$OUT/bench.txt"
  timeout 100 "$BIN/moka" bench --backend cuda --shape qwen3-30b-a3b --tokens 4096 --iters 5 --json \
    > "$OUT/bench_smoke.jsonl" 2>&1 || true
  # The single-GPU path against the per-expert cuBLAS loop (the kernel lab's, bench/kernels/).
  timeout 300 "$BIN/staged_baselines" --shape "$SHAPES" --tokens "$TOKENS" --iters "$ITERS" \
    > "$OUT/staged_baselines.jsonl" 2>&1 || rc=1
fi
exit $rc
