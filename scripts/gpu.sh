#!/usr/bin/env bash
# The GPU runner: every check and measurement moka makes on a GPU machine, one subcommand each,
# in one device call each. Usage: bash gpu.sh SUBCOMMAND [BIN]
#   BIN: the binaries, a folder scripts/stage_gpu.sh made (it copies this script there) or a
#   build folder; default: this script's folder when it holds moka, else ../build. Logs and JSON
#   lines go to $OUT (default ./gpu_out; study, train and python: their own folder names).
#
#   check     the single-GPU suites of moka_gpu_tests, one process per suite (SUITES: gtest
#             filters), after, on two or more GPUs, the expert-parallel checks (moka_ep_gpu_check
#             on every GPU; SINGLE_GPU_TESTS=0 leaves the suites out). MODE=mps: the megakernel
#             suites instead, as an MPS client at MPS_PERCENT (50) of the GPU's threads.
#   bench     one GPU: bench/torch_baseline.py --paired-with paired_steps (torch's medians, then
#             ITERS runs alternating one moka and one torch fwd+bwd), `moka bench --backend cuda`
#             with those results, and the kernel lab's staged_baselines (the single-GPU path
#             against the per-expert cuBLAS loop). SHAPES, TOKENS, ITERS override. MODE=paired:
#             this build's layer paths and backward core against BASE's (a folder), ROUNDS (2)
#             rounds alternating the two, their new / base time ratios (SHAPES_PAIRED).
#   ep        N (2) GPUs: PyTorch + NCCL under `moka launch`, then `moka bench --gpus N`.
#             MODE=scale (N: every GPU; for 4 or 8): the expert-parallel checks, both benches per
#             shape, skewed routing (SKEW_SHAPES) in both row orders with timelines and routing
#             dumps (bench/compare_sim.py replays them), and the kernel lab's nvlink_incast.
#   train     the trainer (about 9 minutes; BUDGET_S, 450, bounds it): its GPU tests, tokens/s of
#             the 512-wide model against PyTorch eager, the GPU coordinate check, a calibration and
#             a time-boxed LR-transfer sweep. MODE=speed: its tests, step profiles and tokens/s at
#             d_model 512..2048 eager and in a CUDA graph against PyTorch eager and torch.compile.
#   study     the muP study (docs/MUP.md): both seeded LR-transfer sweeps and a seeded
#             token-horizon study, under an MPS daemon of its own where MPS runs (PARTS=horizon:
#             that part alone; DATA: the GCIDE folder, else BIN/gcide.gz unpacked; HORIZON_STEPS).
#   python    the Python package (PYTHONPATH must import moka of the same build): tests/python,
#             examples/train_tiny_moe.py against the PyTorch block at EP=1 and 2 (LOSS_TOLERANCE),
#             bench/python_overhead.py against the kernel lab's paired_steps (STEPS picks parts).
#   sanitize  bench/sanitize_gpu.sh: compute-sanitizer's four tools over the megakernel and layer
#             suites (TOOLS, SUITES, LIMIT_S).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/gpu_env.sh"
SUBCOMMAND=${1:-}
BIN=${2:-$HERE}
[[ -x $BIN/moka || -x $BIN/tools/moka ]] || BIN=$HERE/../build
BIN=$(cd "$BIN" && pwd)

# A binary of BIN: staged flat, or at its place in a build folder.
binary() {
  local name=$1 built
  case $name in
    moka) built=tools/moka ;;
    moka_gpu_tests) built=tests/cuda/moka_gpu_tests ;;
    moka_train_gpu_tests) built=tests/train/gpu/moka_train_gpu_tests ;;
    moka_ep_gpu_check) built=tests/cuda/moka_ep_gpu_check ;;
    *) built=bench/kernels/$name ;;
  esac
  if [[ -x $BIN/$name ]]; then echo "$BIN/$name"; else echo "$BIN/$built"; fi
}
MOKA=$(binary moka)
# The bench scripts: staged beside this script, or in the checkout's bench/.
BENCH=$HERE; [[ -f $BENCH/torch_baseline.py ]] || BENCH=$HERE/../bench
ROOT=$(cd "$HERE/.." && pwd)  # the checkout (the python subcommand runs from one)
# The training text beside the binaries (scripts/stage_gpu.sh puts it there), unless set.
if [[ -z ${MOKA_TEXT_DIR:-} && -d $BIN/fortunes ]]; then export MOKA_TEXT_DIR=$BIN/fortunes; fi
use_out() { OUT=${OUT:-$PWD/$1}; mkdir -p "$OUT"; }
say() { echo "[${SECONDS}s] $*" | tee -a "${SUMMARY:-/dev/null}"; }  # SUMMARY: a file that keeps them
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
SHAPES=${SHAPES:-qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,gpt-oss-120b,mixtral-8x7b}
TOKENS=${TOKENS:-4096,16384}
rc=0

# ---- check ----
# One process per suite: a device fault in one suite cannot hide the others' results.
single_gpu_suites() {
  local tests suite code
  tests=$(binary moka_gpu_tests)
  : > "$OUT/gpu_tests.log"
  SUITES=${SUITES:-Layouts/GroupedGemmLayouts.*:GroupedGemmChecks.*:Schedules/GroupedGemmSchedules.* Widths/GroupedGemmSwiglu.* Routing/DeviceSchedule.* Shapes/CudaLayerVsReference.* CudaLayer.* CudaRouter.*:Losses/CudaRouterLosses.*}
  set -f  # the suite filters are gtest patterns, not file globs
  for suite in $SUITES; do
    timeout 300 "$tests" --gtest_color=no --gtest_filter="$suite" >> "$OUT/gpu_tests.log" 2>&1
    code=$?
    echo "suite $suite: exit code $code"
    [[ $code -ne 0 ]] && rc=$code
  done
  set +f
  grep -E "^\[  FAILED  \]|Failure$|actual:|exception" "$OUT/gpu_tests.log" | head -40
}
# The megakernel suites as an MPS client whose grids must fit the SMs it owns.
mps_suites() {
  local tests whole_gpu_sms
  tests=$(binary moka_gpu_tests)
  whole_gpu_sms=$("$tests" --gtest_filter=MegakernelGrid.* 2>/dev/null | sed -n 's/.*the context.s \([0-9]*\).*/\1/p')
  mps_daemon_start || { echo "MPS is not available here"; rc=1; return; }
  SUITES=${SUITES:-MegakernelGrid.*:Megakernel.*:Shapes/MegakernelVsReference.*:MegakernelPath.*:MegakernelBackward.*:-*Dimensions*}
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=${MPS_PERCENT:-50} MOKA_TEST_GPU_SMS=$whole_gpu_sms timeout 400 \
    "$tests" --gtest_color=no --gtest_filter="$SUITES" > "$OUT/gpu_tests_mps.log" 2>&1 || rc=1
  mps_daemon_stop
  echo "MPS client at ${MPS_PERCENT:-50}% of the threads (the whole GPU: $whole_gpu_sms SMs): exit code $rc"
  grep -E "^\[ grid|^\[  PASSED|^\[  FAILED|Failure$|exception" "$OUT/gpu_tests_mps.log" | head -30
}
# moka_ep_gpu_check on N GPUs: device group and expert-parallel layers against the CPU reference.
ep_checks() {  # ep_checks N LOG
  timeout 300 "$MOKA" launch -n "$1" -- "$(binary moka_ep_gpu_check)" > "$2" 2>&1 || rc=1
  grep -E "passed|FAILED|error|failed|exited" "$2" | head -40
}
run_check() {
  use_out gpu_out
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/device.txt"
  if [[ ${MODE:-tests} == mps ]]; then mps_suites; return; fi
  (( GPUS >= 2 )) && ep_checks "$GPUS" "$OUT/ep_gpu_check.log"
  [[ ${SINGLE_GPU_TESTS:-1} == 1 ]] && single_gpu_suites
}

# ---- bench ----
bench_one_gpu() {
  local iters=${ITERS:-20}
  PYTHONUNBUFFERED=1 timeout 300 python3 "$BENCH/torch_baseline.py" --shapes "$SHAPES" --tokens "$TOKENS" \
    --iters "$iters" --paired-with "$(binary paired_steps)" --out "$OUT/torch.jsonl" 2>&1 | cut -c1-400 | tail -20
  timeout 400 "$MOKA" bench --backend cuda --shape "$SHAPES" --tokens "$TOKENS" --iters "$iters" --warmup 3 \
    --torch-results "$OUT/torch.jsonl" 2>&1 | tee "$OUT/bench.txt"
  timeout 100 "$MOKA" bench --backend cuda --shape qwen3-30b-a3b --tokens 4096 --iters 5 --json \
    > "$OUT/bench_smoke.jsonl" 2>&1 || true
  timeout 300 "$(binary staged_baselines)" --shape "$SHAPES" --tokens "$TOKENS" --iters "$iters" \
    > "$OUT/staged_baselines.jsonl" 2>&1 || rc=1
  cat "$OUT/staged_baselines.jsonl"
}
# This build's layer paths and backward core against BASE's, alternating the two binaries.
bench_against_base() {
  local shapes=${SHAPES_PAIRED:-qwen3-30b-a3b,mixtral-8x7b} round which folder tag
  [[ -n ${BASE:-} ]] || { echo "MODE=paired needs BASE (the other build's folder)"; rc=2; return; }
  : > "$OUT/paired.jsonl"
  for round in $(seq "${ROUNDS:-2}"); do
    for which in base new; do
      folder=$BIN; [[ $which == base ]] && folder=$(cd "$BASE" && pwd)
      tag="s/^{/{\"binary\":\"$which\",\"round\":$round,/"
      timeout 100 "$(BIN=$folder binary moka)" bench --backend cuda --shape "$shapes" --tokens 16384 --iters 6 \
        --warmup 2 --no-baselines --json 2>/dev/null | sed "$tag" >> "$OUT/paired.jsonl"
      timeout 60 "$(BIN=$folder binary mk_backward_core)" --shape "$shapes" --tokens 16384 --iters 3 \
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
}
run_bench() {
  use_out gpu_out
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/device.txt"
  if [[ ${MODE:-bench} == paired ]]; then bench_against_base; else bench_one_gpu; fi
}

# ---- ep ----
# PyTorch + NCCL, then moka's paths, over N GPUs; every stderr into one log (the device tool
# returns at most 8 files).
ep_torch() {  # ep_torch N SHAPES ITERS
  PYTHONUNBUFFERED=1 timeout 200 "$MOKA" launch -n "$1" -- python3 "$BENCH/torch_baseline.py" --shapes "$2" \
    --tokens "$TOKENS" --iters "$3" --out "$OUT/torch_ep$1.jsonl" >> "$OUT/runs_ep$1.log" 2>&1 || rc=1
}
ep_moka() {  # ep_moka N SHAPES ITERS
  timeout 250 "$MOKA" bench --gpus "$1" --backend cuda --shape "$2" --tokens "$TOKENS" --iters "$3" --warmup 3 \
    --torch-results "$OUT/torch_ep$1.jsonl" --json >> "$OUT/bench_ep$1.jsonl" 2>> "$OUT/runs_ep$1.log" || rc=1
}
# Skewed routing in both row orders, each with its timeline and routing dump, then incast.
ep_skew_and_incast() {  # ep_skew_and_incast N
  local shape routing order tag
  for shape in ${SKEW_SHAPES:-qwen3-30b-a3b}; do
    for routing in "zipf --gini 0.2" "zipf --gini 0.4" "one-rank"; do
      for order in round-robin rate-based; do
        tag="${shape}_${routing// /}_${order}"
        # shellcheck disable=SC2086  # $routing is an option and its value
        timeout 90 "$MOKA" bench --gpus "$1" --backend cuda --shape "$shape" --tokens 16384 --iters 10 --warmup 3 \
          --routing $routing --row-order "$order" --timeline "$OUT/timeline_$tag.jsonl" \
          --dump-routing "$OUT/routing_$tag.jsonl" --json >> "$OUT/skew_ep$1.jsonl" 2>> "$OUT/runs_ep$1.log" || rc=1
      done
    done
  done
  timeout 120 "$MOKA" launch -n "$1" -- "$(binary nvlink_incast)" --megabytes 512 --iters 10 \
    > "$OUT/incast_ep$1.jsonl" 2>&1 || rc=1
  cat "$OUT/incast_ep$1.jsonl"
  # The device tool returns at most 8 files: timelines and routing dumps travel as one archive
  # (then, here: bench/compare_sim.py moka skew_epN.jsonl timeline_TAG.jsonl routing_TAG.jsonl).
  tar czf "$OUT/cases_ep$1.tgz" -C "$OUT" $(cd "$OUT" && ls timeline_*.jsonl routing_*.jsonl 2>/dev/null) &&
    rm -f "$OUT"/timeline_*.jsonl "$OUT"/routing_*.jsonl
}
run_ep() {
  use_out gpu_out
  local shape
  if [[ ${MODE:-bench} != scale ]]; then
    N=${N:-2}
    ep_torch "$N" "$SHAPES" "${ITERS:-10}"
    ep_moka "$N" "$SHAPES" "${ITERS:-10}"
    cat "$OUT/bench_ep$N.jsonl"; tail -5 "$OUT/runs_ep$N.log"
    return
  fi
  N=${N:-$GPUS}
  TOKENS=4096,16384
  ep_checks "$N" "$OUT/checks_ep$N.log"
  ep_torch "$N" "$SHAPES" 10
  for shape in ${SHAPES//,/ }; do ep_moka "$N" "$shape" 10; done  # a failure costs one shape, not the run
  ep_skew_and_incast "$N"
  cat "$OUT/bench_ep$N.jsonl" "$OUT/skew_ep$N.jsonl" | cut -c1-400
}

# ---- train ----
# The x1 model of the GPU experiments; --width-mult M widens d_model, heads and experts M times.
MODEL=(--d-model 128 --heads 4 --head-dim 32 --q-rank 64 --kv-rank 64 --layers 4 --dense-intermediate 512
       --experts 8 --top-k 2 --expert-intermediate 128)
DATA_SHAPE=(--batch 64 --seq 128)  # 8192 tokens per step
TOKENS_PER_STEP=8192
tps_of() { grep -oP 'throughput: \K[0-9.]+' "$1" 2>/dev/null | tail -1; }
gpu_b() { (( GPUS >= 2 )) && echo 1 || echo 0; }  # the second GPU, or the first when there is one
train_tests() {  # train_tests LIMIT_S
  timeout "$1" "$(binary moka_train_gpu_tests)" --gtest_color=no > "$OUT/train_gpu_tests.log" 2>&1
}
coordcheck() {  # coordcheck mup|sp: x1..x16 (d_model 128..2048), 5 steps at LR 1e-2
  timeout 150 "$MOKA" coordcheck --backend cuda --param "$1" "${MODEL[@]}" --batch 8 --seq 128 --mults 1,2,4,8,16 \
    --csv "$OUT/coordcheck_$1_gpu.csv" --plot '' > "$OUT/coordcheck_$1_gpu.log" 2>&1 || echo failed > "$OUT/cc_$1.failed"
}
tests_and_mup_coordcheck() {
  export CUDA_VISIBLE_DEVICES=0
  train_tests 240 || echo failed > "$OUT/tests.failed"
  coordcheck mup
}
# Tokens/s at width 512 (x4), moka then PyTorch eager; then the SP coordinate check.
tokens_per_s_and_sp_coordcheck() {
  export CUDA_VISIBLE_DEVICES=$(gpu_b)
  timeout 120 "$MOKA" train --backend cuda "${MODEL[@]}" "${DATA_SHAPE[@]}" --width-mult 4 --steps 45 --eval-every 0 \
    --lr 0.0078125 > "$OUT/train_512_moka.log" 2>&1 || echo failed > "$OUT/tps.failed"
  PYTHONUNBUFFERED=1 timeout 180 python3 "$BENCH/torch_train_baseline.py" --d-model 512 --heads 16 --head-dim 32 \
    --q-rank 64 --kv-rank 64 --layers 4 --dense-intermediate 512 --experts 32 --top-k 2 --expert-intermediate 128 \
    --batch 64 --seq 128 --steps 40 --warmup-steps 5 --modes eager --out "$OUT/torch_train.jsonl" \
    > "$OUT/torch_train.log" 2>&1  # eager only: compiling (time unmeasured here) could pass the timeout
  coordcheck sp
}
# Steady tokens/s per width (one process), then four processes at x4 at once: TPS and CONCURRENT.
calibrate() {
  local m i
  declare -gA TPS
  for m in 1 2 4 8; do
    timeout 90 "$MOKA" train --backend cuda "${MODEL[@]}" "${DATA_SHAPE[@]}" --width-mult $m --steps 25 --eval-every 0 \
      > "$OUT/calibrate_x$m.log" 2>&1
    TPS[$m]=$(tps_of "$OUT/calibrate_x$m.log")
    say "calibration x$m (d_model $((128 * m))): ${TPS[$m]:-failed} tokens/s"
  done
  for i in 1 2 3 4; do
    timeout 120 "$MOKA" train --backend cuda "${MODEL[@]}" "${DATA_SHAPE[@]}" --width-mult 4 --steps 25 --eval-every 0 \
      > "$OUT/calibrate_x4_concurrent$i.log" 2>&1 &
  done
  wait
  CONCURRENT=$(python3 -c "import sys; print(sum(map(float, sys.argv[1:])))" \
    $(for i in 1 2 3 4; do tps_of "$OUT/calibrate_x4_concurrent$i.log"; done))
  say "4 processes at x4 together: ${CONCURRENT:-failed} tokens/s in all"
}
# The sweep's steps, workers and time per parameterization from the calibration and the budget.
sweep_plan() {  # sweep_plan PARALLEL_SWEEPS: prints STEPS WORKERS PER_PARAM FULL_S
  python3 - "${BUDGET_S:-450}" "$SECONDS" "$TOKENS_PER_STEP" "${TPS[1]:-0}" "${TPS[2]:-0}" "${TPS[4]:-0}" \
    "${TPS[8]:-0}" "${CONCURRENT:-0}" "$1" <<'PY'
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
}
train_sweep() {  # train_sweep mup|sp GPU
  export CUDA_VISIBLE_DEVICES=$2
  timeout $((PER_PARAM + 60)) "$MOKA" lr-sweep --backend cuda --param "$1" "${MODEL[@]}" "${DATA_SHAPE[@]}" \
    --mults 1,2,4,8 --lr-min 0.00048828125 --lr-max 0.125 --lr-points 9 --steps "$STEPS" --warmup "$((STEPS / 10))" \
    --schedule wsd --workers "$WORKERS" --eval-batches 8 --csv "$OUT/lr_sweep_$1_gpu.csv" --plot '' \
    > "$OUT/lr_sweep_$1_gpu.log" 2>&1 || echo failed > "$OUT/sweep_$1.failed"
}
# Tests, tokens/s against PyTorch eager and both coordinate checks (split over two GPUs), the
# calibration, then the muP and SP sweeps sized to what is left of BUDGET_S (at once on two GPUs).
train_and_sweep() {
  use_out train_gpu_out
  local p parallel_sweeps=$(( GPUS >= 2 ? 2 : 1 )) plan
  SUMMARY=$OUT/summary.txt
  : > "$SUMMARY"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
  if (( GPUS >= 2 )); then
    tests_and_mup_coordcheck & tokens_per_s_and_sp_coordcheck & wait
  else
    tests_and_mup_coordcheck; tokens_per_s_and_sp_coordcheck
  fi
  export CUDA_VISIBLE_DEVICES=0
  compgen -G "$OUT/*.failed" > /dev/null && rc=1
  rm -f "$OUT"/*.failed
  grep -E "^\[  (PASSED|FAILED) |^\[ result|Failure|error" "$OUT/train_gpu_tests.log" | head -30 | tee -a "$SUMMARY"
  say "moka train --backend cuda, d_model 512: $(tps_of "$OUT/train_512_moka.log") tokens/s; PyTorch eager:" \
      "$(grep -oP '"tokens_per_s": \K[0-9.]+' "$OUT/torch_train.jsonl" 2>/dev/null | tail -1) tokens/s"
  for p in mup sp; do say "coordcheck $p: $(grep -A7 'slope of' "$OUT/coordcheck_${p}_gpu.log" | tail -1)"; done
  calibrate
  plan=$(sweep_plan "$parallel_sweeps")
  read -r STEPS WORKERS PER_PARAM FULL_S <<< "$plan"
  say "sweep plan: $STEPS steps x $TOKENS_PER_STEP tokens per run, $WORKERS worker processes, ~${PER_PARAM}s per" \
      "parameterization; the full target (2.46M tokens per run, both sweeps) would take ~${FULL_S}s"
  if (( STEPS < 20 )); then say "sweep skipped: not enough time left or the calibration failed"; rc=1; return; fi
  if (( parallel_sweeps == 2 )); then train_sweep mup 0 & train_sweep sp 1 & wait; else train_sweep mup 0; train_sweep sp 0; fi
  compgen -G "$OUT/*.failed" > /dev/null && rc=1
  rm -f "$OUT"/*.failed
  for p in mup sp; do say "lr-sweep $p:"; grep -A6 -E "^width" "$OUT/lr_sweep_${p}_gpu.log" | tee -a "$SUMMARY"; done
}
# One `moka train` at width multiple M with the CUDA graph on or off; failures set rc.
train_run() {  # train_run MULT GRAPH LOG [more options]
  local m=$1 graph=$2 log=$3
  shift 3
  timeout 120 "$MOKA" train --backend cuda "${MODEL[@]}" "${DATA_SHAPE[@]}" --width-mult "$m" --eval-every 0 \
    --lr 0.0078125 --cuda-graph "$graph" "$@" > "$OUT/$log" 2>&1 || { echo "FAILED: $log"; tail -5 "$OUT/$log"; rc=1; }
}
# The trainer's speed on one GPU: tests, step profiles, tokens/s against PyTorch (train_speed.jsonl).
train_speed() {
  use_out train_speed_out
  local m graph d eager graph_tps commit device
  commit=$(cat "$BIN/commit.txt" 2>/dev/null || git -C "$HERE" rev-parse --short HEAD 2>/dev/null || echo unknown)
  device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
  say "train GPU tests"
  train_tests 200 || rc=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[       OK |^\[  FAILED  |Failure|error|^\[ result|Expected|Which is|^ *Actual" \
    "$OUT/train_gpu_tests.log" | head -80
  grep -E "^profile:|^stage|^(embedding|norms|attention|MoE|head|optimizer|EMA|router|inputs|step:)" \
    "$OUT/train_gpu_tests.log" | head -40
  for m in 4 8; do  # each profiled step waits for the GPU: per-stage times, not the throughput
    for graph in off on; do
      say "profile d_model $((128 * m)), --cuda-graph $graph"
      train_run "$m" "$graph" "profile_x${m}_graph_${graph}.log" --steps 20 --profile
      sed -n '/^profile:/,/^profile json/p' "$OUT/profile_x${m}_graph_${graph}.log"
    done
  done
  : > "$OUT/train_speed.jsonl"
  for m in 4 8 16; do  # moka then PyTorch at each width, back to back
    d=$((128 * m))
    train_run "$m" off "speed_x${m}_eager.log" --steps 40
    train_run "$m" on "speed_x${m}_graph.log" --steps 40
    eager=$(tps_of "$OUT/speed_x${m}_eager.log")
    graph_tps=$(tps_of "$OUT/speed_x${m}_graph.log")
    say "moka d_model $d: eager ${eager:-failed}, CUDA graph ${graph_tps:-failed} tokens/s"
    PYTHONUNBUFFERED=1 timeout 150 python3 "$BENCH/torch_train_baseline.py" --d-model "$d" --heads $((4 * m)) \
      --head-dim 32 --q-rank 64 --kv-rank 64 --layers 4 --dense-intermediate 512 --experts $((8 * m)) --top-k 2 \
      --expert-intermediate 128 --batch 64 --seq 128 --steps 30 --warmup-steps 5 --modes eager,compile \
      --out "$OUT/torch_x${m}.jsonl" > "$OUT/torch_x${m}.log" 2>&1 ||
      { echo "FAILED: torch d_model $d"; tail -5 "$OUT/torch_x${m}.log"; rc=1; }
    grep '"mode"' "$OUT/torch_x${m}.log"
    python3 - "$d" "${eager:-0}" "${graph_tps:-0}" "$OUT/torch_x${m}.jsonl" "$commit" "$device" >> "$OUT/train_speed.jsonl" <<'PY'
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
}
run_train() { if [[ ${MODE:-sweep} == speed ]]; then train_speed; else train_and_sweep; fi; }

# ---- study ----
# Sweeps: widths 128..1024 (experts = width/16, top-2), 9 LRs 2^-11..2^-3, 3 seeds, WSD, 262 steps
# of 8192 tokens (2.15M tokens per run). Horizon: the 128-wide proxy (muP), 5 LRs 2^-11..2^-7, 3
# seeds, warmup then a constant LR for HORIZON_STEPS steps, the EMA evaluated every 128 steps from
# step 512, the last 5 budgets held out, WSD runs with decay at half and all of the horizon.
study_sweep() {  # study_sweep PARAM GPU
  local start=$SECONDS
  CUDA_VISIBLE_DEVICES=$2 timeout 590 "$MOKA" lr-sweep --backend cuda --param "$1" --data "$DATA" "${MODEL[@]}" \
    "${DATA_SHAPE[@]}" --mults 1,2,4,8 --lr-min 0.00048828125 --lr-max 0.125 --lr-points 9 --steps 262 --warmup 26 \
    --schedule wsd --seeds 3 --workers 4 --eval-batches 8 --json "$OUT/lr_sweep_$1.json" --csv "$OUT/lr_sweep_$1.csv" \
    --plot '' > "$OUT/lr_sweep_$1.log" 2> "$OUT/lr_sweep_$1.err" ||
    { echo "FAILED: lr-sweep $1"; tail -3 "$OUT/lr_sweep_$1.err"; return 1; }
  say "lr-sweep $1 on GPU $2: $((SECONDS - start)) s"
  cat "$OUT/lr_sweep_$1.log"
}
study_horizon() {  # study_horizon GPU
  local start=$SECONDS steps=${HORIZON_STEPS:-2560}
  CUDA_VISIBLE_DEVICES=$1 timeout 590 "$MOKA" lr-horizon --backend cuda --param mup --data "$DATA" "${MODEL[@]}" \
    "${DATA_SHAPE[@]}" --steps "$steps" --warmup 64 --eval-every 128 --fit-from 512 --ema 0.99 --holdout 5 \
    --lr-min 0.00048828125 --lr-max 0.0078125 --lr-points 5 --seeds 3 --workers 4 --eval-batches 8 \
    --wsd-check "$((steps / 2)),$steps" --json "$OUT/lr_horizon.json" --plot '' \
    > "$OUT/lr_horizon.log" 2> "$OUT/lr_horizon.err" || { echo "FAILED: lr-horizon"; tail -3 "$OUT/lr_horizon.err"; return 1; }
  say "lr-horizon on GPU $1: $((SECONDS - start)) s"
  cat "$OUT/lr_horizon.log"
}
# An MPS daemon of this script's own, stopped on exit, once a two-step run trains under it (a
# daemon that started is not yet a server that takes clients).
study_mps() {
  mps_daemon_start || return 1
  trap mps_daemon_stop EXIT
  timeout 60 "$MOKA" train --backend cuda --data "$DATA" --max-bytes 1000000 --steps 2 --eval-every 0 \
    > "$OUT/mps_probe.log" 2>&1 && return 0
  echo "MPS did not start, or a CUDA run failed under it ($OUT/mps_probe.log): the parts take turns on the GPU"
  mps_daemon_stop
  trap - EXIT
  return 1
}
study_part() {  # study_part mup|sp|horizon GPU: its report in $OUT/NAME.txt
  if [[ $1 == horizon ]]; then study_horizon "$2"; else study_sweep "$1" "$2"; fi > "$OUT/$1.txt" 2>&1
}
# Under MPS the parts run at once (the processes' kernels share the SMs instead of taking turns in
# time slices; docs/MUP.md): all three on one GPU, or the muP sweep and the horizon study on GPU 0
# and the SP sweep on GPU 1. Without MPS: GPU 0 runs the muP sweep, then the horizon study, GPU 1
# the SP sweep (one GPU: all three one after another).
run_study() {
  use_out mup_study_out
  local second_gpu=$(( GPUS >= 2 ? 1 : 0 )) mps_on=0
  DATA=${DATA:-}
  if [[ -z $DATA ]]; then
    DATA=$OUT/gcide
    mkdir -p "$DATA" && gunzip -c "$BIN/gcide.gz" > "$DATA/gcide" || { echo "no GCIDE text: set DATA"; rc=1; return; }
  fi
  study_mps && mps_on=1
  say "$GPUS GPU(s); horizon of ${HORIZON_STEPS:-2560} steps; parts: ${PARTS:-all}; MPS: $( ((mps_on)) && echo on || echo off)"
  case ${PARTS:-all} in
    horizon) study_part horizon 0 ;;
    all)
      if ((mps_on)); then
        study_part mup 0 & study_part horizon 0 & study_part sp "$second_gpu" & wait
      elif ((second_gpu == 1)); then
        { study_part mup 0 && study_part horizon 0; } & study_part sp 1 & wait
      else
        study_part mup 0 && study_part horizon 0 && study_part sp 0
      fi ;;
    *) echo "PARTS must be all or horizon"; rc=2; return ;;
  esac
  cat "$OUT"/{mup,sp,horizon}.txt 2>/dev/null
  grep -q FAILED "$OUT"/{mup,sp,horizon}.txt 2>/dev/null && rc=1
  say "the whole study: ${SECONDS} s (budget 600 s on two GPUs)"
}

# ---- python ----
python_tests() {
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rs --tb=short --show-capture=no "$ROOT/tests/python" \
    > "$OUT/pytest.log" 2>&1 || rc=1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log"
}
# 200 steps with moka's block and with the pure-PyTorch block, on one GPU and under torchrun at
# EP=2: the loss curves must agree within LOSS_TOLERANCE (bf16) at every step.
python_example() {
  local block
  for block in moka torch; do
    timeout 120 python3 "$ROOT/examples/train_tiny_moe.py" --steps 200 --block $block --log-every 50 \
      --out "$OUT/example-ep1-$block.json" > "$OUT/example-ep1-$block.log" 2>&1 || rc=1
    timeout 150 torchrun --nproc-per-node 2 "$ROOT/examples/train_tiny_moe.py" --steps 200 --block $block \
      --log-every 50 --out "$OUT/example-ep2-$block.json" > "$OUT/example-ep2-$block.log" 2>&1 || rc=1
  done
  python3 - "$OUT" "${LOSS_TOLERANCE:-0.1}" <<'PY' || rc=1
import json, sys
out, tolerance = sys.argv[1], float(sys.argv[2])
failed = False
for ep in (1, 2):
    m, t = (json.load(open(f"{out}/example-ep{ep}-{block}.json")) for block in ("moka", "torch"))
    diff = max(abs(a - b) for a, b in zip(m["losses"], t["losses"]))
    ok = len(m["losses"]) == len(t["losses"]) and diff <= tolerance
    failed |= not ok
    print(f"example EP={ep}: tokens/s moka {m['tokens_per_s']:.0f}, torch block {t['tokens_per_s']:.0f} "
          f"({m['tokens_per_s'] / t['tokens_per_s']:.2f}x); max |loss difference| {diff:.4f} "
          f"({'within' if ok else 'OVER'} {tolerance}); final loss {m['losses'][-1]:.4f} vs {t['losses'][-1]:.4f}")
sys.exit(1 if failed else 0)
PY
}
# What the Python layer adds to the C++ one (device time at 16384 tokens for every named shape,
# host time per call at 256 tokens).
python_overhead() {
  timeout 300 python3 "$ROOT/bench/python_overhead.py" --paired-steps "$(binary paired_steps)" \
    --out "$OUT/overhead.jsonl" > "$OUT/overhead.log" 2>&1 || rc=1
  python3 -c "
import json, sys
for line in open(sys.argv[1]):
    row = json.loads(line)
    row.pop('python_runs_ms', None), row.pop('cpp_runs_ms', None)
    print(row)" "$OUT/overhead.jsonl"
}
run_python() {
  use_out python_gpu_out
  local step
  export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  for step in ${STEPS:-tests example overhead}; do
    case $step in
      tests) python_tests ;;
      example) python_example ;;
      overhead) python_overhead ;;
      *) echo "gpu.sh python: unknown step '$step' (tests, example, overhead)" >&2; rc=2; return ;;
    esac
  done
}

# ---- sanitize ----
run_sanitize() {
  use_out gpu_out
  local script=$HERE/sanitize_gpu.sh; [[ -f $script ]] || script=$ROOT/bench/sanitize_gpu.sh
  OUT=$OUT BIN=$(dirname "$(binary moka_gpu_tests)") bash "$script" || rc=1
}

case $SUBCOMMAND in
  check | bench | ep | train | study | python | sanitize) "run_$SUBCOMMAND" ;;
  *) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
say "gpu.sh $SUBCOMMAND: exit code $rc"
exit $rc
