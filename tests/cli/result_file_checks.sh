#!/bin/sh
# CLI checks of the result files (CSV, JSON, JSON lines): a run writes each one whole, and a run
# that fails part-way (here the file-size limit, as a full disk would) leaves the destination's
# old contents, or no file, and no temporary behind.
# usage: result_file_checks.sh MOKA SCENARIO; exits 77 (skipped) without prlimit or, for the
# training commands, without the text corpus.
set -eu
moka=$1
# shellcheck source=tests/cli/cli_scratch.sh
. "$(dirname "$0")/cli_scratch.sh"
command -v prlimit >/dev/null || exit 77

# The commands below run under $limited: nothing, or a file-size limit set by size_limited.
limited=""
# size_limited BYTES FUNCTION: runs the function with moka's files limited to BYTES (a write past
# the limit fails with EFBIG rather than killing the process) and sets rc to its exit code.
size_limited() {
  rc=0
  # shellcheck disable=SC2030  # the limit is meant for this one run only
  (trap '' XFSZ && limited="prlimit --fsize=$1" && $2) >out.txt 2>&1 || rc=$?
}

# failed_keeping FILE OLD_COPY: the last size_limited run failed writing FILE, which still holds
# OLD_COPY's bytes (or is absent when OLD_COPY is), and left no temporary.
failed_keeping() {
  [ "$rc" -ne 0 ] || fail "exit code 0 although $1 could not be written"
  grep -q "writing $1 failed: File too large" out.txt || fail "no error naming $1"
  if [ -e "$2" ]; then
    cmp -s "$1" "$2" || fail "$1 lost its old contents"
  else
    [ ! -e "$1" ] || fail "$1 was left behind"
  fi
  no_temporaries
}

no_temporaries() {
  for name in *.tmp.*; do
    if [ -e "$name" ]; then fail "temporary left: $name"; fi
  done
}

# every_line_has FILE FIELDS: FILE ends with a newline and each line has FIELDS comma-separated fields.
every_line_has() {
  [ "$(tail -c 1 "$1" | od -An -c | tr -d ' ')" = '\n' ] || fail "$1 does not end with a newline"
  awk -F, -v n="$2" 'NF != n { exit 1 }' "$1" || fail "$1 has a line without $2 fields"
}

# shellcheck disable=SC2031,SC2086  # $limited: empty, or a command and its option
simulate_series() { $limited "$moka" simulate --gpus 4 --tokens 16 --model fluid --policies rate-based,bvn --series-csv q.csv; }
# shellcheck disable=SC2031,SC2086
bench_dump() { $limited "$moka" bench --backend cpu --shape tiny --ep 2 --tokens 16,24 --iters 1 --dump-routing r.jsonl; }
# shellcheck disable=SC2031,SC2086
coordcheck_csv() { $limited "$moka" coordcheck --mults 1,2 --check-steps 1 --plot '' --csv c.csv $small; }
# shellcheck disable=SC2031,SC2086
lr_sweep_json() {
  $limited "$moka" lr-sweep --mults 1,2 --lr-points 3 --lr-min 0.001 --lr-max 0.1 --steps 6 --eval-batches 1 \
    --workers 2 --csv s.csv --json s.json --plot '' $small
}

plot="$(dirname "$0")/../../tools/plot_mup.py"
python=${MOKA_PYTHON:-/usr/bin/python3}  # the interpreter moka runs its plots with
# shellcheck disable=SC2031,SC2086
mup_plot() { $limited "$python" "$plot" coordcheck c.csv p.png; }

case $2 in
  simulate-series-csv-is-whole)
    simulate_series >out.txt 2>&1 || fail "simulate failed"
    [ "$(head -n 1 q.csv)" = "policy,epoch,time_s,q0,q1,q2,q3" ] || fail "no header"
    every_line_has q.csv 7
    grep -q '^rate-based,0,' q.csv || fail "no series of rate-based"
    grep -q '^bvn,0,' q.csv || fail "no series of bvn"
    no_temporaries
    cp q.csv old.csv
    size_limited $(($(wc -c <q.csv) - 1)) simulate_series
    failed_keeping q.csv old.csv
    # A run that fails before its first epoch no longer empties the file it was given.
    printf '{"shape":' >truncated.jsonl
    rc=0
    "$moka" simulate --replay truncated.jsonl --series-csv q.csv >out.txt 2>&1 || rc=$?
    [ $rc -ne 0 ] || fail "a truncated dump was replayed"
    cmp -s q.csv old.csv || fail "q.csv lost its old contents"
    no_temporaries
    ;;
  bench-dump-routing-appends-whole-lines)
    bench_dump >out.txt 2>&1 || fail "bench failed"
    [ "$(wc -l <r.jsonl)" = 2 ] || fail "expected a line per case"
    cp r.jsonl first_run.jsonl
    bench_dump >out.txt 2>&1 || fail "the second bench failed"
    [ "$(wc -l <r.jsonl)" = 4 ] || fail "the second run did not append its lines"
    [ "$(head -n 2 r.jsonl)" = "$(cat first_run.jsonl)" ] || fail "the first run's lines changed"
    "$moka" simulate --replay r.jsonl --model fluid --policies rate-based --json >out.txt 2>&1 ||
      fail "the dump does not replay"
    [ "$(grep -c '"policy":"rate-based"' out.txt)" = 4 ] || fail "expected 4 epochs replayed"
    no_temporaries
    # The second case cannot be appended: the first case's line stays, whole.
    rm r.jsonl
    size_limited $(($(wc -c <first_run.jsonl) - 1)) bench_dump
    head -n 1 first_run.jsonl >first_line.jsonl
    failed_keeping r.jsonl first_line.jsonl
    ;;
  coordcheck-csv-is-whole)
    [ -d "${MOKA_TEXT_DIR:-/usr/share/games/fortunes}" ] || exit 77
    coordcheck_csv >out.txt 2>&1 || fail "coordcheck failed"
    # The header and 2 widths x 2 steps x 6 activations.
    [ "$(wc -l <c.csv)" = 25 ] || fail "expected 25 lines in c.csv"
    every_line_has c.csv 5
    no_temporaries
    printf 'old\n' >c.csv
    cp c.csv old.csv
    size_limited 100 coordcheck_csv
    failed_keeping c.csv old.csv
    ;;
  lr-sweep-json-is-whole)
    [ -d "${MOKA_TEXT_DIR:-/usr/share/games/fortunes}" ] || exit 77
    lr_sweep_json >out.txt 2>&1 || fail "lr-sweep failed"
    every_line_has s.csv 9
    [ "$(tail -n 1 s.json)" = "}" ] || fail "s.json does not end its document"
    if command -v python3 >/dev/null; then
      python3 -c "import json, sys; json.load(open(sys.argv[1]))" s.json || fail "s.json is not JSON"
    fi
    no_temporaries
    # The CSV fits under the limit, the JSON does not: the old JSON stays.
    cp s.json old.json
    size_limited $(($(wc -c <s.csv) + 1)) lr_sweep_json
    failed_keeping s.json old.json
    ;;
  mup-plot-is-whole)
    "$python" "$plot" check 2>/dev/null || exit 77
    printf 'param,width,step,activation,mean_abs\nmup,64,0,attn,1.0\nmup,128,0,attn,1.1\n' >c.csv
    mup_plot >out.txt 2>&1 || fail "plot_mup.py failed"
    [ "$(head -c 4 p.png | od -An -c | tr -d ' ')" = '211PNG' ] || fail "p.png is not a PNG"
    for name in p.png.*; do
      if [ -e "$name" ]; then fail "temporary left: $name"; fi
    done
    cp p.png old.png
    size_limited 100 mup_plot
    [ "$rc" -ne 0 ] || fail "exit code 0 although p.png could not be written"
    cmp -s p.png old.png || fail "p.png lost its old contents"
    for name in p.png.*; do
      if [ -e "$name" ]; then fail "temporary left: $name"; fi
    done
    ;;
  *)
    fail "unknown scenario $2"
    ;;
esac
echo "ok: $2"
