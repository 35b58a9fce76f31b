#!/bin/sh
# `moka bench --ep 16` under a limit of 4 processes and threads (RLIMIT_NPROC), too few for its
# 16 emulated ranks: a clear error naming the rank that could not start and the limit, exit code
# 2, never "terminate called" (a rank's thread, or a pool thread within a rank, failing to start).
# usage: bench_thread_limit.sh MOKA; exits 77 (skipped) where the limit cannot be applied. The
# kernel does not hold root to RLIMIT_NPROC, so root runs the check as nobody (setpriv).
set -eu
moka=$1
command -v prlimit >/dev/null || exit 77
as_limited_user=""
if [ "$(id -u)" = 0 ]; then
  command -v setpriv >/dev/null || exit 77
  as_limited_user="setpriv --reuid=65534 --regid=65534 --clear-groups"
  $as_limited_user test -x "$moka" || exit 77
fi
cd /
rc=0
out=$($as_limited_user prlimit --nproc=4 "$moka" bench --shape tiny --backend cpu --ep 16 --tokens 16 --iters 1 2>&1) ||
  rc=$?
echo "$out"
expected="moka: capacity exceeded: cannot start the thread of emulated rank [0-9]* of 16: .*ulimit -u"
if [ $rc != 2 ] || echo "$out" | grep -q "terminate called" || ! echo "$out" | grep -q "$expected"; then
  echo "FAIL: exit code $rc, expected 2 and the message above"
  exit 1
fi
echo "ok: bench --ep 16 under 4 processes and threads"
