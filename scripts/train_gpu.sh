#!/usr/bin/env bash
# Issue 7 on one H200 in one device call (about 8 minutes; BUDGET_S, default 450, bounds it):
#   1. the GPU training tests (engine vs the CPU reference, loss falls, bit-exact resume);
#   2. tokens/s of the 512-wide model: `moka train --backend cuda` against the same model in
#      PyTorch eager (bench/torch_train_baseline.py), back to back;
#   3. the GPU coordinate check (muP and SP, widths 128..2048);
#   4. a calibration (tokens/s per width; 4 concurrent processes against one), which sizes
#   5. the LR-transfer sweep: widths 128..1024 (experts = width/16, top-2), 9 LRs 2^-11..2^-3,
#      muP then SP, each run as many steps of 8192 tokens as the remaining time allows.
# BIN: folder with moka, moka_train_gpu_tests, the bench scripts and fortunes/ (scripts/stage_gpu.sh),
# or a build folder. Writes logs and CSVs to $OUT (plots are drawn later from the CSVs:
# python3 tools/plot_mup.py coordcheck|lrsweep CSV PNG).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=$(cd "${1:-$HERE}" && pwd)
OUT=${OUT:-$PWD/train_gpu_out}
mkdir -p "$OUT"
source "$HERE/gpu_env.sh"
BUDGET_S=${BUDGET_S:-450}
MOKA=$BIN/moka; [[ -x $MOKA ]] || MOKA=$BIN/tools/moka
TESTS=$BIN/moka_train_gpu_tests; [[ -x $TESTS ]] || TESTS=$BIN/tests/train_gpu/moka_train_gpu_tests
BENCH=$HERE; [[ -f $BENCH/torch_train_baseline.py ]] || BENCH=$HERE/../bench
if [[ -z ${MOKA_TEXT_DIR:-} && -d $BIN/fortunes ]]; then export MOKA_TEXT_DIR=$BIN/fortunes; fi
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
say() { echo "[${SECONDS}s] $*" | tee -a "$SUMMARY"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
rc=0

# The x1 model of the GPU experiments; --width-mult M widens it (d_model, heads, experts).
MODEL=(--d-model 128 --heads 4 --head-dim 32 --q-rank 64 --kv-rank 64 --layers 4 --dense-intermediate 512
       --experts 8 --top-k 2 --expert-intermediate 128)
DATA=(--batch 64 --seq 128)  # 8192 tokens per step
TOKENS_PER_STEP=8192

# 1. Tests.
timeout 240 "$TESTS" --gtest_color=no > "$OUT/train_gpu_tests.log" 2>&1 || rc=1
grep -E "^\[  (PASSED|FAILED) |^\[ result|Failure|error" "$OUT/train_gpu_tests.log" | head -30 | tee -a "$SUMMARY"
say "GPU tests done (exit code status so far: $rc)"

# 2. Tokens/s at width 512 (x4), moka then PyTorch eager.
tps_of() { grep -oP 'throughput: \K[0-9.]+' "$1" | tail -1; }
timeout 120 "$MOKA" train --backend cuda "${MODEL[@]}" "${DATA[@]}" --width-mult 4 --steps 45 --eval-every 0 \
  --lr 0.0078125 > "$OUT/train_512_moka.log" 2>&1 || rc=1
MOKA_TPS=$(tps_of "$OUT/train_512_moka.log")
say "moka train --backend cuda, d_model 512: ${MOKA_TPS:-failed} tokens/s"
PYTHONUNBUFFERED=1 timeout 180 python3 "$BENCH/torch_train_baseline.py" --d-model 512 --heads 16 --head-dim 32 \
  --q-rank 64 --kv-rank 64 --layers 4 --dense-intermediate 512 --experts 32 --top-k 2 --expert-intermediate 128 \
  --batch 64 --seq 128 --steps 40 --warmup-steps 5 --out "$OUT/torch_train.jsonl" > "$OUT/torch_train.log" 2>&1
TORCH_TPS=$(grep -oP '"tokens_per_s": \K[0-9.]+' "$OUT/torch_train.jsonl" 2>/dev/null | tail -1)
say "PyTorch eager, d_model 512: ${TORCH_TPS:-failed} tokens/s"

# 3. Coordinate check on the GPU, x1..x16 (d_model 128..2048), 5 steps at LR 1e-2.
for p in mup sp; do
  timeout 150 "$MOKA" coordcheck --backend cuda --param "$p" "${MODEL[@]}" --batch 8 --seq 128 --mults 1,2,4,8,16 \
    --csv "$OUT/coordcheck_${p}_gpu.csv" --plot '' > "$OUT/coordcheck_${p}_gpu.log" 2>&1 || rc=1
  say "coordcheck $p: $(grep -A7 'slope of' "$OUT/coordcheck_${p}_gpu.log" | tail -1)"
done

# 4. Calibration: steady tokens/s per width (one process), and four processes at x4 at once.
declare -A TPS
for m in 1 2 4 8; do
  timeout 90 "$MOKA" train --backend cuda "${MODEL[@]}" "${DATA[@]}" --width-mult $m --steps 25 --eval-every 0 \
    > "$OUT/calibrate_x$m.log" 2>&1
  TPS[$m]=$(tps_of "$OUT/calibrate_x$m.log")
  say "calibration x$m (d_model $((128 * m))): ${TPS[$m]:-failed} tokens/s"
done
for i in 1 2 3 4; do
  timeout 120 "$MOKA" train --backend cuda "${MODEL[@]}" "${DATA[@]}" --width-mult 4 --steps 25 --eval-every 0 \
    > "$OUT/calibrate_x4_concurrent$i.log" 2>&1 &
done
wait
CONCURRENT=$(python3 -c "import sys; print(sum(map(float, sys.argv[1:])))" \
  $(for i in 1 2 3 4; do tps_of "$OUT/calibrate_x4_concurrent$i.log"; done))
say "4 processes at x4 together: ${CONCURRENT:-failed} tokens/s in all"

# 5. Size and run the sweep.
PLAN=$(python3 - "$BUDGET_S" "$SECONDS" "$TOKENS_PER_STEP" "${TPS[1]:-0}" "${TPS[2]:-0}" "${TPS[4]:-0}" \
  "${TPS[8]:-0}" "${CONCURRENT:-0}" <<'PY'
import sys
budget, now, tps_step = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
tps = [float(v) for v in sys.argv[4:8]]
concurrent = float(sys.argv[8])
if min(tps) <= 0:
    print("0 1 0 0"); sys.exit()
speedup = concurrent / tps[2] if concurrent > 0 else 1.0
workers = 4 if speedup >= 1.1 else 1
speedup = max(speedup, 1.0) if workers == 4 else 1.0
overhead = 2.0                       # per run: model set-up, first-step allocations, validation
lrs = 9
per_param = (budget - now - 30) / 2  # muP, then SP
step_cost = sum(tps_step / t for t in tps) * lrs  # seconds per step of all 36 runs of one sweep
steps = int((per_param * speedup - overhead * lrs * len(tps)) / step_cost)
full = 2 * (300 * step_cost + overhead * lrs * len(tps)) / speedup  # 300 steps x 8192 = 2.46M tokens per run
print(max(steps, 0), workers, int(per_param), int(full))
PY
)
read -r STEPS WORKERS PER_PARAM FULL_S <<< "$PLAN"
say "sweep plan: $STEPS steps x $TOKENS_PER_STEP tokens = $((STEPS * TOKENS_PER_STEP)) tokens per run, $WORKERS worker processes, ~${PER_PARAM}s per parameterization; the full target (2.46M tokens per run, both sweeps) would take ~${FULL_S}s at the measured rates"
if (( STEPS >= 20 )); then
  WARMUP=$((STEPS / 10))
  for p in mup sp; do
    timeout $((PER_PARAM + 120)) "$MOKA" lr-sweep --backend cuda --param "$p" "${MODEL[@]}" "${DATA[@]}" \
      --mults 1,2,4,8 --lr-min 0.00048828125 --lr-max 0.125 --lr-points 9 --steps "$STEPS" --warmup "$WARMUP" \
      --schedule wsd --workers "$WORKERS" --eval-batches 8 --csv "$OUT/lr_sweep_${p}_gpu.csv" --plot '' \
      > "$OUT/lr_sweep_${p}_gpu.log" 2>&1 || rc=1
    say "lr-sweep $p:"
    grep -A6 -E "^width" "$OUT/lr_sweep_${p}_gpu.log" | tee -a "$SUMMARY"
  done
else
  say "sweep skipped: not enough time left or the calibration failed"
  rc=1
fi
say "done, exit code $rc"
exit $rc
