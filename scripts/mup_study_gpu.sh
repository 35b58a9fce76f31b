#!/usr/bin/env bash
# The muP study of the research note in one device call: both seeded LR-transfer sweeps and one
# seeded token-horizon study, each part training its runs in 4 worker processes.
# With MPS (nvidia-cuda-mps-control there and MPS not 0; this script starts and stops its own
# control daemon), the parts run at once: all three on one GPU, or the muP sweep and the horizon
# study on GPU 0 and the SP sweep on GPU 1. Under MPS the processes' kernels share the SMs instead
# of taking turns in time slices (on an H200, 16 sweep runs took 20.9 s in 8 processes under MPS,
# 28.2 s in 4 without; docs/MUP.md). Without MPS: GPU 0 runs the muP sweep, then the horizon
# study, GPU 1 the SP sweep (one GPU: all three one after another).
# Sweeps: widths 128..1024 (experts = width/16, top-2), 9 LRs 2^-11..2^-3, 3 seeds, WSD, 262 steps
# of 8192 tokens (2.15M tokens per run), 108 runs each. Horizon: the 128-wide proxy (muP), 5 LRs
# 2^-11..2^-7, 3 seeds, warmup then a constant LR for HORIZON_STEPS steps, the EMA of the weights
# evaluated every 128 steps from step 512, the last 5 budgets held out, WSD runs with decay at
# half and all of the horizon to check the EMA stand-in.
# BIN: folder with moka (scripts/stage_gpu.sh) or a build folder; DATA: the GCIDE text folder
# (default: unpack BIN/gcide.gz). Writes logs, CSVs and JSON to $OUT and prints the wall time of
# each part and of the whole (the issue's budget: 600 s on two H200s).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/gpu_env.sh"
gpu_script_folders "${1:-}" mup_study_out
DATA=${DATA:-}
if [[ -z $DATA ]]; then
  DATA=$OUT/gcide
  mkdir -p "$DATA" && gunzip -c "$BIN/gcide.gz" > "$DATA/gcide" || { echo "no GCIDE text: set DATA"; exit 1; }
fi
HORIZON_STEPS=${HORIZON_STEPS:-2560}
PARTS=${PARTS:-all}  # all, or horizon: the horizon study alone on GPU 0
GPUS=$(nvidia-smi -L | wc -l)
SECOND_GPU=$(( GPUS >= 2 ? 1 : 0 ))
say() { echo "[${SECONDS}s] $*"; }
rc=0

MODEL=(--d-model 128 --heads 4 --head-dim 32 --q-rank 64 --kv-rank 64 --layers 4 --dense-intermediate 512
       --experts 8 --top-k 2 --expert-intermediate 128 --batch 64 --seq 128)
sweep() {  # sweep PARAM GPU
  local start=$SECONDS
  CUDA_VISIBLE_DEVICES=$2 timeout 590 "$MOKA" lr-sweep --backend cuda --param "$1" --data "$DATA" "${MODEL[@]}" \
    --mults 1,2,4,8 --lr-min 0.00048828125 --lr-max 0.125 --lr-points 9 --steps 262 --warmup 26 --schedule wsd \
    --seeds 3 --workers 4 --eval-batches 8 --json "$OUT/lr_sweep_$1.json" --csv "$OUT/lr_sweep_$1.csv" --plot '' \
    > "$OUT/lr_sweep_$1.log" 2> "$OUT/lr_sweep_$1.err" || { echo "FAILED: lr-sweep $1"; tail -3 "$OUT/lr_sweep_$1.err"; return 1; }
  say "lr-sweep $1 on GPU $2: $((SECONDS - start)) s"
  cat "$OUT/lr_sweep_$1.log"
}
horizon() {  # horizon GPU
  local start=$SECONDS half=$((HORIZON_STEPS / 2))
  CUDA_VISIBLE_DEVICES=$1 timeout 590 "$MOKA" lr-horizon --backend cuda --param mup --data "$DATA" "${MODEL[@]}" \
    --steps "$HORIZON_STEPS" --warmup 64 --eval-every 128 --fit-from 512 --ema 0.99 --holdout 5 \
    --lr-min 0.00048828125 --lr-max 0.0078125 --lr-points 5 --seeds 3 --workers 4 --eval-batches 8 \
    --wsd-check "$half,$HORIZON_STEPS" --json "$OUT/lr_horizon.json" --plot '' \
    > "$OUT/lr_horizon.log" 2> "$OUT/lr_horizon.err" || { echo "FAILED: lr-horizon"; tail -3 "$OUT/lr_horizon.err"; return 1; }
  say "lr-horizon on GPU $1: $((SECONDS - start)) s"
  cat "$OUT/lr_horizon.log"
}

# An MPS control daemon of this script's own (gpu_env.sh), stopped on exit.
start_mps() {
  mps_daemon_start || return 1
  trap mps_daemon_stop EXIT
  # A daemon that started is not yet a server that takes clients: a two-step run must train.
  if timeout 60 "$MOKA" train --backend cuda --data "$DATA" --max-bytes 1000000 \
      --steps 2 --eval-every 0 > "$OUT/mps_probe.log" 2>&1; then
    return 0
  fi
  echo "MPS did not start, or a CUDA run failed under it ($OUT/mps_probe.log): the parts take turns on the GPU"
  mps_daemon_stop
  trap - EXIT
  return 1
}
run_part() {  # run_part mup|sp|horizon GPU: its report in $OUT/NAME.txt
  if [[ $1 == horizon ]]; then horizon "$2"; else sweep "$1" "$2"; fi > "$OUT/$1.txt" 2>&1
}

MPS_ON=0
start_mps && MPS_ON=1
say "$GPUS GPU(s); horizon of $HORIZON_STEPS steps; parts: $PARTS; MPS: $( ((MPS_ON)) && echo on || echo off)"
case $PARTS in
  horizon) run_part horizon 0 ;;
  all)
    if ((MPS_ON)); then
      run_part mup 0 & run_part horizon 0 & run_part sp "$SECOND_GPU" & wait
    elif (( SECOND_GPU == 1 )); then
      { run_part mup 0 && run_part horizon 0; } & run_part sp 1 & wait
    else
      run_part mup 0 && run_part horizon 0 && run_part sp 0
    fi ;;
  *) echo "PARTS must be all or horizon"; exit 2 ;;
esac
cat "$OUT"/{mup,sp,horizon}.txt 2>/dev/null
grep -q FAILED "$OUT"/{mup,sp,horizon}.txt 2>/dev/null && rc=1
say "the whole study: ${SECONDS} s (budget 600 s on two GPUs), exit code $rc"
exit $rc
