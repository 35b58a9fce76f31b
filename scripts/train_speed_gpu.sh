#!/usr/bin/env bash
# The trainer's speed on one GPU, in one device call (about 6 minutes, at most 10; builds nothing):
#   1. the trainer's GPU tests (moka_train_gpu_tests: stages against the CPU, the model against
#      the CPU, captured steps against eager steps bit for bit, the profile's counts);
#   2. the step profile (`moka train --profile`) at d_model 512 and 1024, eager and CUDA graph;
#   3. tokens/s at d_model 512, 1024 and 2048, back to back on one GPU: `moka train` eager and
#      with --cuda-graph on, then the same model in PyTorch eager and torch.compile
#      (bench/torch_train_baseline.py).
# BIN: folder with moka, moka_train_gpu_tests, the bench scripts and fortunes/ (scripts/stage_gpu.sh),
# or a build folder. Writes logs and train_speed.jsonl (one line per width) to $OUT and prints
# every result.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/gpu_env.sh"
gpu_script_folders "${1:-}" train_speed_out
if [[ -z ${MOKA_TEXT_DIR:-} && -d $BIN/fortunes ]]; then export MOKA_TEXT_DIR=$BIN/fortunes; fi
COMMIT=$(cat "$BIN/commit.txt" 2>/dev/null || git -C "$HERE" rev-parse --short HEAD 2>/dev/null || echo unknown)
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
rc=0
say() { echo "[${SECONDS}s] $*"; }

# The x1 model of the GPU experiments (scripts/train_gpu.sh); --width-mult M widens d_model,
# heads and experts M times.
MODEL=(--d-model 128 --heads 4 --head-dim 32 --q-rank 64 --kv-rank 64 --layers 4 --dense-intermediate 512
       --experts 8 --top-k 2 --expert-intermediate 128)
DATA=(--batch 64 --seq 128)
train() {  # train MULT GRAPH LOG [more options]
  local m=$1 graph=$2 log=$3
  shift 3
  timeout 120 "$MOKA" train --backend cuda "${MODEL[@]}" "${DATA[@]}" --width-mult "$m" --eval-every 0 \
    --lr 0.0078125 --cuda-graph "$graph" "$@" > "$OUT/$log" 2>&1 || { echo "FAILED: $log"; tail -5 "$OUT/$log"; rc=1; }
}
tps_of() { grep -oP 'throughput: \K[0-9.]+' "$OUT/$1" 2>/dev/null | tail -1; }

# 1. Tests.
say "train GPU tests"
timeout 200 "$TRAIN_TESTS" --gtest_color=no > "$OUT/train_gpu_tests.log" 2>&1 || rc=1
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[       OK |^\[  FAILED  |Failure|error|^\[ result|Expected|Which is|^ *Actual" \
  "$OUT/train_gpu_tests.log" | head -80
grep -E "^profile:|^stage|^(embedding|norms|attention|MoE|head|optimizer|EMA|router|inputs|step:)" \
  "$OUT/train_gpu_tests.log" | head -40

# 2. Profiles (each step waits for the GPU here: the per-stage times, not the throughput).
for m in 4 8; do
  for graph in off on; do
    say "profile d_model $((128 * m)), --cuda-graph $graph"
    train "$m" "$graph" "profile_x${m}_graph_${graph}.log" --steps 20 --profile
    sed -n '/^profile:/,/^profile json/p' "$OUT/profile_x${m}_graph_${graph}.log"
  done
done

# 3. Throughput, moka then PyTorch at each width, back to back.
: > "$OUT/train_speed.jsonl"
for m in 4 8 16; do
  d=$((128 * m))
  train "$m" off "speed_x${m}_eager.log" --steps 40
  train "$m" on "speed_x${m}_graph.log" --steps 40
  EAGER=$(tps_of "speed_x${m}_eager.log")
  GRAPH=$(tps_of "speed_x${m}_graph.log")
  say "moka d_model $d: eager ${EAGER:-failed}, CUDA graph ${GRAPH:-failed} tokens/s"
  PYTHONUNBUFFERED=1 timeout 150 python3 "$BENCH/torch_train_baseline.py" --d-model "$d" --heads $((4 * m)) \
    --head-dim 32 --q-rank 64 --kv-rank 64 --layers 4 --dense-intermediate 512 --experts $((8 * m)) --top-k 2 \
    --expert-intermediate 128 --batch 64 --seq 128 --steps 30 --warmup-steps 5 --modes eager,compile \
    --out "$OUT/torch_x${m}.jsonl" > "$OUT/torch_x${m}.log" 2>&1 || { echo "FAILED: torch d_model $d"; tail -5 "$OUT/torch_x${m}.log"; rc=1; }
  grep '"mode"' "$OUT/torch_x${m}.log"
  python3 - "$d" "${EAGER:-0}" "${GRAPH:-0}" "$OUT/torch_x${m}.jsonl" "$COMMIT" "$DEVICE" >> "$OUT/train_speed.jsonl" <<'PY'
import json, sys
d, eager, graph, torch_file, commit, device = sys.argv[1:]
t = {}
try:
    t = json.loads(open(torch_file).read().splitlines()[-1])
except (OSError, IndexError, ValueError):
    pass
te, tc = t.get("torch_eager_tokens_per_s"), t.get("torch_compile_tokens_per_s")
best = max(float(eager), float(graph))
line = {"d_model": int(d), "tokens_per_s": best, "moka_eager_tokens_per_s": float(eager),
        "moka_graph_tokens_per_s": float(graph), "torch_eager_tokens_per_s": te, "torch_compile_tokens_per_s": tc,
        "compile_warmup_s": t.get("compile_warmup_s"), "moka_over_eager": best / te if te else None,
        "moka_over_compile": best / tc if tc else None, "commit": commit, "device": device}
print(json.dumps(line))
PY
  tail -1 "$OUT/train_speed.jsonl"
done
say "done, exit code $rc"
exit $rc
