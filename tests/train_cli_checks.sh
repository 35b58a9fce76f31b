#!/bin/sh
# CLI checks of the training commands that need a shell around moka: signals, files a command
# must or must not create, and a stand-in python.
# usage: train_cli_checks.sh MOKA SCENARIO; exits 77 (skipped) without the text corpus.
set -eu
moka=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
fail() {
  echo "FAIL: $*"
  cat out.txt 2>/dev/null || true
  exit 1
}
[ -d "${MOKA_TEXT_DIR:-/usr/share/games/fortunes}" ] || exit 77
small="--max-bytes 50000 --threads 1"

case $2 in
  train-sigterm-saves-then-fails)
    # shellcheck disable=SC2086
    "$moka" train --steps 1000000 --eval-every 1 --eval-batches 1 $small --save ck.safetensors >out.txt 2>&1 &
    pid=$!
    tries=0
    until grep -q "^step 3:" out.txt; do
      tries=$((tries + 1))
      [ $tries -lt 600 ] || fail "no training progress"
      sleep 0.1
    done
    kill -TERM $pid
    rc=0
    wait $pid || rc=$?
    [ $rc -ne 0 ] || fail "exit code 0 after SIGTERM"
    grep -q "training stopped by SIGTERM after step [0-9]*; --resume ck.safetensors continues it" out.txt ||
      fail "no stop message"
    step=$(sed -n 's/.*stopped by SIGTERM after step \([0-9]*\);.*/\1/p' out.txt)
    grep -q "saved ck.safetensors at step $step" out.txt || fail "no checkpoint at step $step"
    # shellcheck disable=SC2086
    "$moka" train --resume ck.safetensors --steps $((step + 2)) --eval-every 0 $small >out.txt 2>&1 ||
      fail "resuming the checkpoint failed"
    ;;
  coordcheck-plot-path-is-not-a-shell-command)
    # /bin/echo stands in for python: it passes the matplotlib check and "plots" by printing.
    # shellcheck disable=SC2086
    MOKA_PYTHON=/bin/echo "$moka" coordcheck --mults 1,2 --check-steps 1 $small \
      --plot "x.png'; touch PWNED; echo '" >out.txt 2>&1 || fail "coordcheck failed"
    [ ! -e PWNED ] || fail "the --plot path ran as a shell command"
    ;;
  coordcheck-failed-plot-fails-the-command)
    printf '#!/bin/sh\n[ "$2" = check ]\n' >python-without-plots
    chmod +x python-without-plots
    rc=0
    # shellcheck disable=SC2086
    MOKA_PYTHON=./python-without-plots "$moka" coordcheck --mults 1,2 --check-steps 1 $small --plot x.png \
      >out.txt 2>&1 || rc=$?
    [ $rc -ne 0 ] || fail "exit code 0 although the plot failed"
    grep -q "plotting x.png failed: plot_mup.py exited with status 1 (the data is in coordcheck.csv)" out.txt ||
      fail "no plot failure message"
    [ -s coordcheck.csv ] || fail "no CSV"
    ;;
  *)
    fail "unknown scenario $2"
    ;;
esac
echo "ok: $2"
