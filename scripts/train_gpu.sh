#!/usr/bin/env bash
# The trainer's GPU measurements in one device call (about 9 minutes; BUDGET_S, default 450,
# bounds it, so the run fits one call of the GPU machine):
#   1. the GPU training tests (engine vs the CPU reference, loss falls, bit-exact resume);
#   2. tokens/s of the 512-wide model: `moka train --backend cuda` against the same model in
#      PyTorch eager (bench/torch_train_baseline.py), back to back on one GPU;
#   3. the GPU coordinate check (muP and SP, widths 128..2048);
#   4. a calibration (tokens/s per width; 4 concurrent processes against one), which sizes
#   5. the LR-transfer sweep: widths 128..1024 (experts = width/16, top-2), 9 LRs 2^-11..2^-3,
#      muP and SP, each run as many steps of 8192 tokens as the remaining time allows.
# With two GPUs, steps 1-3 split over them, and the muP and SP sweeps run at once, one per GPU
# (each sweep still runs on one H200; the summary gives the one-GPU time of both).
# BIN: folder with moka, moka_train_gpu_tests, the bench scripts and fortunes/ (scripts/stage_gpu.sh),
# or a build folder. Writes logs and CSVs to $OUT (plots are drawn later from the CSVs:
# python3 tools/plot_mup.py coordcheck|lrsweep CSV PNG).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/gpu_env.sh"
gpu_script_folders "${1:-}" train_gpu_out
BUDGET_S=${BUDGET_S:-450}
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

GPUS=$(nvidia-smi -L | wc -l)
gpu_b() { (( GPUS >= 2 )) && echo 1 || echo 0; }  # the second GPU, or the first when there is one
tps_of() { grep -oP 'throughput: \K[0-9.]+' "$1" | tail -1; }

# 1. Tests, then the muP coordinate check, on GPU 0.
tests_and_mup_coordcheck() {
  export CUDA_VISIBLE_DEVICES=0
  timeout 240 "$TRAIN_TESTS" --gtest_color=no > "$OUT/train_gpu_tests.log" 2>&1 || echo failed > "$OUT/tests.failed"
  coordcheck mup
}

# 2. Tokens/s at width 512 (x4), moka then PyTorch eager; then the SP coordinate check.
tokens_per_s_and_sp_coordcheck() {
  export CUDA_VISIBLE_DEVICES=$(gpu_b)
  timeout 120 "$MOKA" train --backend cuda "${MODEL[@]}" "${DATA[@]}" --width-mult 4 --steps 45 --eval-every 0 \
    --lr 0.0078125 > "$OUT/train_512_moka.log" 2>&1 || echo failed > "$OUT/tps.failed"
  PYTHONUNBUFFERED=1 timeout 180 python3 "$BENCH/torch_train_baseline.py" --d-model 512 --heads 16 --head-dim 32 \
    --q-rank 64 --kv-rank 64 --layers 4 --dense-intermediate 512 --experts 32 --top-k 2 --expert-intermediate 128 \
    --batch 64 --seq 128 --steps 40 --warmup-steps 5 --modes eager --out "$OUT/torch_train.jsonl" \
    > "$OUT/torch_train.log" 2>&1  # eager only: compiling (time unmeasured here) could pass the timeout
  coordcheck sp
}

# 3. Coordinate check on the GPU, x1..x16 (d_model 128..2048), 5 steps at LR 1e-2.
coordcheck() {
  timeout 150 "$MOKA" coordcheck --backend cuda --param "$1" "${MODEL[@]}" --batch 8 --seq 128 --mults 1,2,4,8,16 \
    --csv "$OUT/coordcheck_$1_gpu.csv" --plot '' > "$OUT/coordcheck_$1_gpu.log" 2>&1 || echo failed > "$OUT/cc_$1.failed"
}

if (( GPUS >= 2 )); then
  tests_and_mup_coordcheck &
  tokens_per_s_and_sp_coordcheck &
  wait
else
  tests_and_mup_coordcheck
  tokens_per_s_and_sp_coordcheck
fi
export CUDA_VISIBLE_DEVICES=0
if compgen -G "$OUT/*.failed" > /dev/null; then rc=1; fi
grep -E "^\[  (PASSED|FAILED) |^\[ result|Failure|error" "$OUT/train_gpu_tests.log" | head -30 | tee -a "$SUMMARY"
MOKA_TPS=$(tps_of "$OUT/train_512_moka.log")
TORCH_TPS=$(grep -oP '"tokens_per_s": \K[0-9.]+' "$OUT/torch_train.jsonl" 2>/dev/null | tail -1)
say "moka train --backend cuda, d_model 512: ${MOKA_TPS:-failed} tokens/s; PyTorch eager: ${TORCH_TPS:-failed} tokens/s"
for p in mup sp; do say "coordcheck $p: $(grep -A7 'slope of' "$OUT/coordcheck_${p}_gpu.log" | tail -1)"; done
rm -f "$OUT"/*.failed

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
PARALLEL_SWEEPS=$(( GPUS >= 2 ? 2 : 1 ))
PLAN=$(python3 - "$BUDGET_S" "$SECONDS" "$TOKENS_PER_STEP" "${TPS[1]:-0}" "${TPS[2]:-0}" "${TPS[4]:-0}" \
  "${TPS[8]:-0}" "${CONCURRENT:-0}" "$PARALLEL_SWEEPS" <<'PY'
import sys
budget, now, tps_step = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
tps = [float(v) for v in sys.argv[4:8]]
concurrent, parallel_sweeps = float(sys.argv[8]), int(sys.argv[9])
if min(tps) <= 0:
    print("0 1 0 0"); sys.exit()
speedup = concurrent / tps[2] if concurrent > 0 else 1.0
workers = 4 if speedup >= 1.1 else 1
speedup = max(speedup, 1.0) if workers == 4 else 1.0
overhead = 2.0                       # per run: model set-up, first-step allocations, validation
lrs = 9
per_param = (budget - now - 30) / (2 / parallel_sweeps)  # muP and SP, at once on two GPUs
step_cost = sum(tps_step / t for t in tps) * lrs  # seconds per step of all 36 runs of one sweep
steps = int((0.85 * per_param * speedup - overhead * lrs * len(tps)) / step_cost)  # 15% margin: a killed sweep keeps nothing
full = 2 * (300 * step_cost + overhead * lrs * len(tps)) / speedup  # one GPU, both sweeps, 2.46M tokens per run
print(max(steps, 0), workers, int(per_param), int(full))
PY
)
read -r STEPS WORKERS PER_PARAM FULL_S <<< "$PLAN"
say "sweep plan: $STEPS steps x $TOKENS_PER_STEP tokens = $((STEPS * TOKENS_PER_STEP)) tokens per run, $WORKERS worker processes, ~${PER_PARAM}s per parameterization; the full target (2.46M tokens per run, both sweeps) would take ~${FULL_S}s at the measured rates"
sweep() {
  export CUDA_VISIBLE_DEVICES=$2
  timeout $((PER_PARAM + 60)) "$MOKA" lr-sweep --backend cuda --param "$1" "${MODEL[@]}" "${DATA[@]}" \
    --mults 1,2,4,8 --lr-min 0.00048828125 --lr-max 0.125 --lr-points 9 --steps "$STEPS" --warmup "$WARMUP" \
    --schedule wsd --workers "$WORKERS" --eval-batches 8 --csv "$OUT/lr_sweep_$1_gpu.csv" --plot '' \
    > "$OUT/lr_sweep_$1_gpu.log" 2>&1 || echo failed > "$OUT/sweep_$1.failed"
}
if (( STEPS >= 20 )); then
  WARMUP=$((STEPS / 10))
  if (( PARALLEL_SWEEPS == 2 )); then
    sweep mup 0 &
    sweep sp 1 &
    wait
  else
    sweep mup 0
    sweep sp 0
  fi
  if compgen -G "$OUT/*.failed" > /dev/null; then rc=1; fi
  rm -f "$OUT"/*.failed
  for p in mup sp; do
    say "lr-sweep $p:"
    grep -A6 -E "^width" "$OUT/lr_sweep_${p}_gpu.log" | tee -a "$SUMMARY"
  done
else
  say "sweep skipped: not enough time left or the calibration failed"
  rc=1
fi
say "done, exit code $rc"
exit $rc
