#!/usr/bin/env bash
# On a machine with >= 2 GPUs: the expert-parallel device-group checks (NCCL all-to-all-v,
# symmetric memory, device barrier with timeout). BIN: folder holding moka and
# moka_ep_gpu_check (default build/). Logs go to $OUT when set.
set -uo pipefail
BIN=${1:-build}
export NCCL_NVLS_ENABLE=0
# NCCL ships inside the PyTorch environment's nvidia/nccl package on the GPU machines.
NCCL_LIB=$(python3 -c "import nvidia.nccl as n; import os; print(os.path.join(list(n.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$NCCL_LIB" ] && export LD_LIBRARY_PATH="$NCCL_LIB:${LD_LIBRARY_PATH:-}"
LOG=${OUT:-/tmp}/ep_gpu_check.log
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$LOG"
timeout 120 "$BIN/moka" launch -n 2 -- "$BIN/moka_ep_gpu_check" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
