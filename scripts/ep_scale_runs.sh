#!/usr/bin/env bash
# Expert parallelism at scale, all in one call of a machine of 4 or 8 GPUs: the expert-parallel
# checks at EP=N (the megakernel's capacity overflow included), then side by side for every named
# shape at 4096 and 16384 tokens per rank: PyTorch + NCCL, moka's all-to-all path and the
# megakernel forward; then skewed routing (Zipf Gini 0.2 and 0.4, every token to rank 0's
# experts) with the megakernel's rows in round-robin (equal per-peer shares) and rate-based (the
# planner's proportional) order, each with a task timeline (dispatch and combine spans) and its
# routing dump, which bench/compare_sim.py replays through `moka simulate` at the measured
# bandwidth; then the kernel lab's `nvlink_incast` (k senders into one GPU with a victim flow
# from one of them to another GPU).
# BIN: the folder scripts/stage_gpu.sh made. Writes JSON lines and logs to $OUT.
set -uo pipefail
BIN=$(cd "${1:-build}" && pwd)
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
N=${N:-$(nvidia-smi -L | wc -l)}
SHAPES=${SHAPES:-qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,gpt-oss-120b,mixtral-8x7b}
SKEW_SHAPES=${SKEW_SHAPES:-qwen3-30b-a3b}
rc=0
LOG=$OUT/runs_ep$N.log  # every stderr but the checks': the device tool returns at most 8 files
timeout 300 "$BIN/moka" launch -n "$N" -- "$BIN/moka_ep_gpu_check" > "$OUT/checks_ep$N.log" 2>&1 || rc=1
grep -E "FAILED|passed" "$OUT/checks_ep$N.log"
PYTHONUNBUFFERED=1 timeout 200 "$BIN/moka" launch -n "$N" -- python3 "$BIN/torch_baseline.py" --shapes "$SHAPES" \
  --tokens 4096,16384 --iters 10 --out "$OUT/torch_ep$N.jsonl" >> "$LOG" 2>&1 || rc=1
for shape in ${SHAPES//,/ }; do  # one process per shape: a failure costs one shape, not the run
  timeout 90 "$BIN/moka" bench --gpus "$N" --backend cuda --shape "$shape" --tokens 4096,16384 --iters 10 \
    --warmup 3 --torch-results "$OUT/torch_ep$N.jsonl" --json >> "$OUT/bench_ep$N.jsonl" 2>> "$LOG" || rc=1
done
for shape in ${SKEW_SHAPES//,/ }; do
  for routing in "zipf --gini 0.2" "zipf --gini 0.4" "one-rank"; do
    for order in round-robin rate-based; do
      tag="${shape}_${routing// /}_${order}"
      timeout 90 "$BIN/moka" bench --gpus "$N" --backend cuda --shape "$shape" --tokens 16384 --iters 10 --warmup 3 \
        --routing $routing --row-order "$order" --timeline "$OUT/timeline_$tag.jsonl" \
        --dump-routing "$OUT/routing_$tag.jsonl" --json \
        >> "$OUT/skew_ep$N.jsonl" 2>> "$LOG" || rc=1
    done
  done
done
timeout 120 "$BIN/moka" launch -n "$N" -- "$BIN/nvlink_incast" --megabytes 512 --iters 10 > "$OUT/incast_ep$N.jsonl" 2>&1 || rc=1
cat "$OUT/incast_ep$N.jsonl"
# The device tool returns at most 8 files: timelines and routing dumps travel as one archive
# (then, here: bench/compare_sim.py moka skew_epN.jsonl timeline_TAG.jsonl routing_TAG.jsonl).
tar czf "$OUT/cases_ep$N.tgz" -C "$OUT" $(cd "$OUT" && ls timeline_*.jsonl routing_*.jsonl 2>/dev/null) &&
  rm -f "$OUT"/timeline_*.jsonl "$OUT"/routing_*.jsonl
cat "$OUT/bench_ep$N.jsonl" "$OUT/skew_ep$N.jsonl" | cut -c1-400
exit $rc
