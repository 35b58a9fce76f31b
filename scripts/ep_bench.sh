#!/usr/bin/env bash
# On a machine with 2+ GPUs: the expert-parallel benchmark, side by side in one call: the
# PyTorch + NCCL all_to_all_single path (bench/torch_baseline.py under `moka launch`) and
# `moka bench --gpus N --backend cuda` (moka's all-to-all path, NCCL all-to-all and peer-copy
# bandwidth of the dispatch volume). BIN: folder with moka and torch_baseline.py.
set -uo pipefail
BIN=$(cd "${1:-build}" && pwd)
OUT=${OUT:-$PWD/gpu_out}
N=${N:-2}
SHAPES=${SHAPES:-qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,gpt-oss-120b,mixtral-8x7b}
TOKENS=${TOKENS:-4096,16384}
ITERS=${ITERS:-10}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
PYTHONUNBUFFERED=1 timeout 200 "$BIN/moka" launch -n "$N" -- python3 "$BIN/torch_baseline.py" --shapes "$SHAPES" \
  --tokens "$TOKENS" --iters "$ITERS" --out "$OUT/torch_ep$N.jsonl" > "$OUT/torch_ep$N.log" 2>&1
tail -3 "$OUT/torch_ep$N.log"
timeout 250 "$BIN/moka" bench --gpus "$N" --backend cuda --shape "$SHAPES" --tokens "$TOKENS" --iters "$ITERS" \
  --warmup 3 --torch-results "$OUT/torch_ep$N.jsonl" --json > "$OUT/bench_ep$N.jsonl" 2> "$OUT/bench_ep$N.log"
rc=$?
cat "$OUT/bench_ep$N.jsonl"; tail -5 "$OUT/bench_ep$N.log"
exit $rc
