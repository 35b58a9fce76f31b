#!/usr/bin/env bash
# Compiler launcher of the megakernels' objects (src/cuda/CMakeLists.txt): runs the compile and
# fails it when ptxas reports that it serialized wgmma instructions (C7515, C7520, ...: "Potential
# Performance Loss: wgmma.mma_async instructions are serialized"). That advisory is not an error
# to nvcc, but in a megakernel it has meant a 10-20x slower kernel (docs/MEGAKERNEL.md, "Memory
# order at the barriers"), which no CPU test can see.
set -uo pipefail
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$@" > "$log" 2>&1
rc=$?
cat "$log"
if ((rc == 0)) && grep -q "wgmma.mma_async instructions are serialized" "$log"; then
  echo "error: ptxas serialized the wgmma instructions of this megakernel (see above); find the change that" \
       "caused it (a fence, an early exit or a call between the MMAs and their waits)" >&2
  exit 1
fi
exit "$rc"
