#!/usr/bin/env bash
# The muP study of the research note in one device call on two GPUs (one GPU runs the parts one
# after another, in about twice the time): both seeded LR-transfer sweeps and one seeded
# token-horizon study.
#   GPU 0: the muP sweep, then the token-horizon study;  GPU 1: the SP sweep.
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

say "$GPUS GPU(s); horizon of $HORIZON_STEPS steps; parts: $PARTS"
case $PARTS in
  horizon) horizon 0 > "$OUT/gpu0.txt" 2>&1; cat "$OUT/gpu0.txt" ;;
  all)
    if (( SECOND_GPU == 1 )); then
      { sweep mup 0 && horizon 0; } > "$OUT/gpu0.txt" 2>&1 &
      sweep sp 1 > "$OUT/gpu1.txt" 2>&1
      wait
      cat "$OUT/gpu0.txt" "$OUT/gpu1.txt"
    else
      { sweep mup 0 && horizon 0 && sweep sp 0; } > "$OUT/gpu0.txt" 2>&1
      cat "$OUT/gpu0.txt"
    fi ;;
  *) echo "PARTS must be all or horizon"; exit 2 ;;
esac
grep -q FAILED "$OUT"/gpu*.txt && rc=1
say "the whole study: ${SECONDS} s (budget 600 s on two GPUs), exit code $rc"
exit $rc
