#!/bin/sh
# CLI checks of the training commands that need a shell around moka: signals, files a command
# must or must not create, and a stand-in python.
# usage: train_cli_checks.sh MOKA SCENARIO; exits 77 (skipped) without the text corpus or, for
# the scenarios that read JSON or run gcide_records.py, without python3.
set -eu
moka=$1
scripts=$(cd "$(dirname "$0")/../../scripts" && pwd)
# shellcheck source=tests/cli/cli_scratch.sh
. "$(dirname "$0")/cli_scratch.sh"
# json_check FILE EXPRESSION: the python expression over `d` (the parsed file) must hold.
json_check() {
  python3 -c "import json, math, sys; d = json.load(open(sys.argv[1])); assert $2, sys.argv[2]" "$1" "$2" ||
    fail "$1: $2"
}

# signal_run SIGNAL PATTERN COMMAND...: runs the command in the background with SIGINT not ignored
# (a non-interactive shell's background jobs ignore it), sends SIGNAL once out.txt matches
# PATTERN, and sets rc to the command's exit code.
signal_run() {
  signal=$1
  pattern=$2
  shift 2
  env --default-signal=INT true 2>/dev/null || exit 77
  env --default-signal=INT "$@" >out.txt 2>&1 &
  pid=$!
  tries=0
  until grep -q "$pattern" out.txt; do
    tries=$((tries + 1))
    [ $tries -lt 600 ] || fail "no progress before SIG$signal"
    sleep 0.1
  done
  kill -"$signal" $pid
  rc=0
  wait $pid || rc=$?
}

# Sets as_limited_user to what runs a command as a user the kernel holds to RLIMIT_NPROC (root
# is exempt: then nobody, in a folder of the work directory it may write), or exits 77 (skipped).
limited_user() {
  command -v prlimit >/dev/null || exit 77
  as_limited_user=""
  [ "$(id -u)" = 0 ] || return 0
  command -v setpriv >/dev/null || exit 77
  as_limited_user="setpriv --reuid=65534 --regid=65534 --clear-groups"
  $as_limited_user test -x "$moka" || exit 77
  chmod 755 "$work"
  mkdir -m 777 nobody
  cd nobody
}

# launch-sigint-exits-130, launch-sigterm-exits-143: the launcher passes the signal on to its
# workers and exits 128 + the signal, as a shell reports a process the signal ended.
case $2 in
  launch-sig*)
    signal=$(echo "$2" | sed 's/^launch-sig\([a-z]*\)-exits-[0-9]*$/\1/' | tr a-z A-Z)
    signal_run "$signal" "^worker started" "$moka" launch -n 2 -- sh -c 'echo worker started; exec sleep 100'
    [ $rc = "${2##*-}" ] || fail "exit code $rc after SIG$signal, expected ${2##*-}"
    grep -q "moka launch: interrupted by SIG$signal; passed it on to the workers" out.txt ||
      fail "no interruption message"
    echo "ok: $2"
    exit 0
    ;;
  launch-workers-get-the-grace-period-after-sigterm)
    # Workers that catch SIGTERM finish their work (a trainer's checkpoint) within --grace.
    # Rank 1 says it started once rank 0 has set its trap too (ready.0).
    signal_run TERM "worker 1 started" "$moka" launch -n 2 --grace 20 -- \
      sh -c 'trap "sleep 1; echo saved > saved.\$RANK; exit 0" TERM; touch ready.$RANK
             until [ -f ready.0 ]; do sleep 0.05; done; echo worker $RANK started; sleep 100 & wait'
    [ $rc = 143 ] || fail "exit code $rc after SIGTERM, expected 143"
    [ -f saved.0 ] && [ -f saved.1 ] || fail "a worker did not get to save"
    echo "ok: $2"
    exit 0
    ;;
  launch-stops-what-a-failed-job-started)
    # Rank 1 fails; rank 0 and the process it started are stopped with it (its process group).
    child="sleep 1000.$$"  # a command line no other process has
    rc=0
    "$moka" launch -n 2 --grace 0 -- sh -c "[ \$RANK = 1 ] && exit 3; $child & sleep 100" >out.txt 2>&1 || rc=$?
    [ $rc = 3 ] || fail "exit code $rc, expected rank 1's 3"
    sleep 0.2
    if pgrep -f "$child" >/dev/null; then
      pkill -f "$child"
      fail "a worker's child outlived the job"
    fi
    echo "ok: $2"
    exit 0
    ;;
  launch-gives-the-workers-a-fresh-job-key)
    # Both workers of a job hold the same 64-hex-digit key, another job another one; a key the
    # caller set is passed on as it is.
    "$moka" launch -n 2 -- printenv MOKA_JOB_KEY >out.txt 2>&1 || fail "launch failed"
    [ "$(sort -u out.txt | wc -l)" = 1 ] && grep -qx "[0-9a-f]\{64\}" out.txt || fail "not one 64-digit key per job"
    sort -u out.txt >first.txt
    "$moka" launch -n 1 -- printenv MOKA_JOB_KEY >again.txt 2>&1 || fail "launch failed"
    ! cmp -s first.txt again.txt || fail "two jobs got the same key"
    MOKA_JOB_KEY=the-caller-s-own-key "$moka" launch -n 1 -- printenv MOKA_JOB_KEY >out.txt 2>&1 || fail "launch failed"
    grep -qx "the-caller-s-own-key" out.txt || fail "the caller's key was not passed on"
    echo "ok: $2"
    exit 0
    ;;
  launch-failed-fork-stops-the-started-workers)
    # Under a limit of 3 processes the third worker's fork fails: the launcher stops the workers
    # it started instead of leaving them unsupervised.
    limited_user
    child="sleep 1000.$$"  # a command line no other process has
    rc=0
    $as_limited_user prlimit --nproc=3 "$moka" launch -n 3 -- sh -c "exec $child" >out.txt 2>&1 || rc=$?
    [ $rc != 0 ] && grep -q "moka launch: cannot start worker [0-2] of 3 (fork: .*); stopped the [0-2] started" out.txt ||
      fail "no clear error for the failed fork (exit $rc)"
    sleep 0.2
    leftover=$(pgrep -f "$child" || true)
    if [ -n "$leftover" ]; then
      kill $leftover
      fail "a started worker outlived the failed launch"
    fi
    echo "ok: $2"
    exit 0
    ;;
  launch-n-beyond-the-limit)
    rc=0
    "$moka" launch -n 5000 -- true >out.txt 2>&1 || rc=$?
    [ $rc != 0 ] && grep -q "moka launch -n 5000 exceeds the [0-9]* workers this machine allows" out.txt ||
      fail "no limit on -n (exit $rc)"
    rc=0
    (ulimit -p 64 2>/dev/null || exit 77; "$moka" launch -n 4000 -- true) >out.txt 2>&1 || rc=$?
    [ $rc = 77 ] && exit 77
    grep -q "moka launch -n 4000 exceeds the 64 workers" out.txt || fail "RLIMIT_NPROC not honoured (exit $rc)"
    echo "ok: $2"
    exit 0
    ;;
esac

if [ "$2" = gcide-records-load-as-text ]; then
  # A 202-entry dictionary in dictd form (index: headword, base64 offset, base64 length), with a
  # header entry, a duplicate index line and the markup the converter removes; moka trains on
  # the result with the fortunes loader.
  command -v python3 >/dev/null || exit 77
  python3 - <<'PY' || fail "making the fixture"
b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
def num(v):
    s = ""
    while True:
        s = b64[v % 64] + s
        v //= 64
        if not v:
            return s
entries = [("00-database-info", "This file was converted by dictfmt.\n"),
           ("Apple", 'Apple \\Ap"ple\\, n. [AS. \xe6ppel.]\n   The fleshy fruit of a tree. See {Pome}.\n   [1913 Webster]\n\n'
                     "         He ate the apple whole. --Milton.\n   [1913 Webster]\n"),
           ("Zest", "Zest \\Zest\\, n.\n   Keen enjoyment; relish; gusto.\n   [WordNet 1.5]\n" + "More zest. " * 400 + "\n")]
# FNV-1a (the split hash) keeps the parity of a record's odd bytes in its low bit: vary it.
entries += [(f"Word{i}", f"Word{i} \\Word\\, n.\n   Sense {i} of a made-up word{'s' * (i % 2)}, for the validation split.\n")
            for i in range(200)]
data, index = b"", []
for word, text in entries:
    raw = text.encode()
    index.append(f"{word}\t{num(len(data))}\t{num(len(raw))}")
    data += raw
index.append(index[-1].replace("Zest", "zest"))
open("tiny.dict", "wb").write(data)
open("tiny.index", "w").write("\n".join(index) + "\n")
PY
  mkdir text
  python3 "$scripts/gcide_records.py" tiny.index tiny.dict text/tiny >out.txt 2>&1 || fail "the converter failed"
  grep -q "202 entries" out.txt || fail "expected 202 entries"
  [ "$(grep -c '^%$' text/tiny)" = 202 ] || fail "expected 202 records"
  grep -q '^Apple  n\. \[AS\. .*\]$' text/tiny || fail "pronunciation markup not removed"
  grep -q 'See Pome\.' text/tiny || fail "cross-reference braces not removed"
  ! grep -q 'Webster\]\|WordNet 1.5\]\|database' text/tiny || fail "source tags or the header kept"
  grep -q -- '--Milton\.' text/tiny || fail "the quotation was dropped"
  "$moka" train --data text --steps 2 --seq 16 --batch 2 --eval-every 2 --eval-batches 1 >out.txt 2>&1 ||
    fail "moka could not train on the converted text"
  grep -q "train / [0-9]* validation bytes" out.txt || fail "no text summary"
  echo "ok: $2"
  exit 0
fi

[ -d "${MOKA_TEXT_DIR:-/usr/share/games/fortunes}" ] || exit 77

case $2 in
  train-sigint-saves-then-exits-130 | train-sigterm-saves-then-exits-143)
    signal=$(echo "$2" | sed 's/^train-sig\([a-z]*\)-.*/\1/' | tr a-z A-Z)
    # shellcheck disable=SC2086
    signal_run "$signal" "^step 3:" "$moka" train --steps 1000000 --eval-every 1 --eval-batches 1 $small \
      --save ck.safetensors
    [ $rc = "${2##*-}" ] || fail "exit code $rc after SIG$signal, expected ${2##*-}"
    grep -q "training stopped by SIG$signal after step [0-9]*; --resume ck.safetensors continues it" out.txt ||
      fail "no stop message"
    step=$(sed -n "s/.*stopped by SIG$signal after step \([0-9]*\);.*/\1/p" out.txt)
    grep -q "saved ck.safetensors at step $step" out.txt || fail "no checkpoint at step $step"
    # shellcheck disable=SC2086
    "$moka" train --resume ck.safetensors --steps $((step + 2)) --eval-every 0 $small >out.txt 2>&1 ||
      fail "resuming the checkpoint failed"
    ;;
  lr-sweep-beyond-the-thread-limit)
    # Under a limit of 4 processes and threads, 16 workers cannot all start: a clear error, and
    # the workers started stopped and joined (never "terminate called").
    limited_user
    rc=0
    # shellcheck disable=SC2086
    $as_limited_user prlimit --nproc=4 "$moka" lr-sweep --mults 1 --lr-points 16 --workers 16 --steps 1 \
      --eval-batches 1 --plot '' --json '' $small >out.txt 2>&1 || rc=$?
    [ $rc = 2 ] && ! grep -q "terminate called" out.txt &&
      grep -q "training runs: cannot start worker thread [0-9]* of 16: .*ulimit -u" out.txt ||
      fail "exit code $rc, expected 2 and a clear error"
    ;;
  train-profile-prints-stages)
    # The CPU path of --profile: the table with every stage, and a JSON line a script can read.
    # shellcheck disable=SC2086
    "$moka" train --steps 5 --eval-every 0 --log-every 2 --profile $small >out.txt 2>&1 || fail "train --profile failed"
    for stage in "embedding forward" "attention forward" "MoE forward" "head + loss backward" "MoE backward" \
      "optimizer" "EMA" "router bias"; do
      grep -q "^$stage " out.txt || fail "no row for $stage"
    done
    grep -q "^profile: 5 steps, cpu, host steady_clock" out.txt || fail "no profile header"
    command -v python3 >/dev/null || exit 0
    sed -n 's/^profile json: //p' out.txt >p.json
    json_check p.json 'd["steps"] == 5 and d["mode"] == "cpu" and d["launches_per_step"] == -1'
    json_check p.json 'len(d["stages"]) == 14 and all(s["ms_per_step"] >= 0 for s in d["stages"])'
    json_check p.json 'd["stages"][2]["stage"] == "attention forward" and d["stages"][2]["ms_per_step"] > 0'
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
  lr-horizon-tiny-run-writes-its-fields)
    command -v python3 >/dev/null || exit 77
    rc=0
    "$moka" lr-horizon --json '' --plot x.png >out.txt 2>&1 || rc=$?
    [ $rc -ne 0 ] && grep -q -- "--plot draws from --json" out.txt || fail "--plot without --json accepted"
    # shellcheck disable=SC2086
    "$moka" lr-horizon --steps 60 --warmup 5 --eval-every 20 --ema 0.75 --lr-min 0.002 --lr-max 0.2 --lr-points 5 \
      --holdout 1 --seeds 2 --wsd-check 40 --eval-batches 2 --workers 2 --json h.json --plot '' $small \
      >out.txt 2>&1 || fail "lr-horizon failed"
    grep -q "^fit log eta\* = beta log B + gamma over 3 budgets: beta" out.txt || fail "no fit line"
    grep -q "^beta over 2 seeds: " out.txt || fail "no spread of beta"
    grep -q "^held-out max error" out.txt || fail "no held-out error"
    grep -q "^WSD check at 40 steps" out.txt || fail "no WSD check"
    json_check h.json 'd["command"] == "lr-horizon" and d["seeds"] == 2 and len(d["lrs"]) == 5'
    json_check h.json '[b["steps"] for b in d["budgets"]] == [20, 40, 60] and all(len(b["loss"]) == 5 for b in d["budgets"])'
    json_check h.json 'math.isfinite(d["fit"]["beta"]) and 0 <= d["fit"]["r2"] <= 1 and d["fit"]["points"] == 3'
    json_check h.json 'len(d["held_out"]) == 1 and d["held_out"][0]["relative_error"] == d["held_out_max_error"]'
    json_check h.json 'd["budgets"][-1]["held_out"] and d["holdout_fit"]["points"] == 2'
    json_check h.json 'all(b["fitted"] for b in d["budgets"]) and d["fit_from_steps"] == 0'
    json_check h.json 'len(d["beta_per_seed"]) == 2 and d["beta_over_seeds"]["count"] == 2'
    json_check h.json 'd["extrapolated"][0]["tokens"] == 10 * 60 * 4 * 32'
    json_check h.json 'len(d["wsd_checks"]) == 1 and len(d["wsd_checks"][0]["wsd_loss"]) == 5'
    json_check h.json '[[len(run) for run in seed] for seed in d["runs_seed_lr_budget"]] == [[3] * 5] * 2'
    if python3 "$(dirname "$moka")/plot_mup.py" check 2>/dev/null; then
      python3 "$(dirname "$moka")/plot_mup.py" horizon h.json h.png >out.txt 2>&1 || fail "the horizon plot failed"
      [ -s h.png ] || fail "no horizon plot"
    fi
    ;;
  lr-sweep-seeds-write-their-spread)
    command -v python3 >/dev/null || exit 77
    # shellcheck disable=SC2086
    "$moka" lr-sweep --mults 1,2 --lr-points 3 --lr-min 0.001 --lr-max 0.1 --steps 6 --seeds 2 --eval-batches 1 \
      --workers 2 --csv s.csv --json s.json --plot '' $small >out.txt 2>&1 || fail "lr-sweep failed"
    grep -q "log2 eta\* over 2 seeds: mean +- std \[min, max\]" out.txt || fail "no spread header"
    grep -q "^drift log2(eta\*_widest / eta\*_base) = .*; over 2 seeds .* +- .* \[.*\]" out.txt || fail "no drift spread"
    json_check s.json 'd["seeds"] == 2 and len(d["points"]) == 12 and sorted({p["seed"] for p in d["points"]}) == [1, 2]'
    json_check s.json 'all(len(o["eta_star_per_seed"]) == 2 and o["log2_eta_star_over_seeds"]["count"] == 2 for o in d["optima"])'
    json_check s.json 'len(d["drift_log2_per_seed"]) == 2 and d["drift_log2_over_seeds"]["count"] == 2'
    [ "$(grep -c '^seed_optimum,' s.csv)" = 4 ] || fail "expected 4 per-seed optima in the CSV"
    if python3 "$(dirname "$moka")/plot_mup.py" check 2>/dev/null; then
      python3 "$(dirname "$moka")/plot_mup.py" lrsweep s.csv s.png >out.txt 2>&1 || fail "the sweep plot failed"
      [ -s s.png ] || fail "no sweep plot"
    fi
    ;;
  *)
    fail "unknown scenario $2"
    ;;
esac
echo "ok: $2"
