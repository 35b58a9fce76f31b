#!/usr/bin/env bash
# The Python package's GPU checks and measurements in one device call (two GPUs for the EP=2
# parts; about 5 minutes):
#   1. tests/python on the GPU (the CUDA tests compare with the fp32 reference at EP=1 and, under
#      torchrun, EP=2; CUDA graph capture and replay; the CPU tests run too);
#   2. examples/train_tiny_moe.py, 200 steps with moka's block and with the pure-PyTorch block, on
#      one GPU and under torchrun at EP=2: the loss curves must agree within bf16 tolerance
#      (--loss-tolerance, default 0.1 at every step) and tokens/s of both are reported;
#   3. bench/python_overhead.py: what the Python layer adds to the C++ layer (device time at 16384
#      tokens for every named shape, host time per call at 256 tokens).
# moka must be importable (PYTHONPATH holding the built package: build/python, or the folder
# scripts/ names) and MOKA the moka binary of the same build. Writes JSON and logs to $OUT.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
MOKA=${MOKA:-$ROOT/build/tools/moka}
PAIRED_STEPS=${PAIRED_STEPS:-$(dirname "$MOKA")/../bench/kernels/paired_steps}  # the kernel lab's
OUT=${OUT:-$PWD/python_gpu_out}
TOLERANCE=${LOSS_TOLERANCE:-0.1}
STEPS=${STEPS:-tests example overhead}
mkdir -p "$OUT"
source "$HERE/gpu_env.sh"
# The training text beside the moka binary (scripts/stage_gpu.sh puts it there), unless set.
if [[ -z ${MOKA_TEXT_DIR:-} && -d $(dirname "$MOKA")/fortunes ]]; then export MOKA_TEXT_DIR=$(dirname "$MOKA")/fortunes; fi
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
status=0
for step in $STEPS; do case $step in
tests)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rs --tb=short --show-capture=no "$ROOT/tests/python" \
    > "$OUT/pytest.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" ;;
example)
  for block in moka torch; do
    timeout 120 python3 "$ROOT/examples/train_tiny_moe.py" --steps 200 --block $block --log-every 50 \
      --out "$OUT/example-ep1-$block.json" > "$OUT/example-ep1-$block.log" 2>&1 || status=1
    timeout 150 torchrun --nproc-per-node 2 "$ROOT/examples/train_tiny_moe.py" --steps 200 --block $block \
      --log-every 50 --out "$OUT/example-ep2-$block.json" > "$OUT/example-ep2-$block.log" 2>&1 || status=1
  done
  python3 - "$OUT" "$TOLERANCE" <<'PY' || status=1
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
  ;;
overhead)
  timeout 300 python3 "$ROOT/bench/python_overhead.py" --paired-steps "$PAIRED_STEPS" --out "$OUT/overhead.jsonl" \
    > "$OUT/overhead.log" 2>&1 || status=1
  python3 -c "
import json, sys
for line in open(sys.argv[1]):
    row = json.loads(line)
    row.pop('python_runs_ms', None), row.pop('cpp_runs_ms', None)
    print(row)" "$OUT/overhead.jsonl" ;;
*) echo "python_gpu_check: unknown step '$step' (tests, example, overhead)" >&2; exit 2 ;;
esac; done
exit $status
