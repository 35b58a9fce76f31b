#!/usr/bin/env python3
"""Every numeric option of every `moka` command, given each hostile value of issue 32's matrix
(0, -1, 2^31, 2^63-1, 1e30, nan, inf, text) on top of arguments that keep a valid run tiny:
each run must end within its time bound with a clear exit (0, or an error message and a
non-zero code), never by a signal, an uncaught exception, or a sanitizer report (in the ASan /
UBSan build every report is fatal, and its text is checked here too); a floating-point option
must refuse nan and inf with a message naming it.

The numeric options are read from each command's --help, so a new option is covered without
editing this file. Runs happen in a scratch directory (the commands' default output files land
there). With --lab DIR the commands are the kernel lab's executables in DIR (bench/kernels/; run
it with no GPU visible, so that every valid run stops at its GPU check).
Usage: flag_matrix.py MOKA [--jobs N] [--timeout S] | flag_matrix.py --lab DIR [--jobs N] [--timeout S]
"""

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile

VALUES = ["0", "-1", "2147483648", "9223372036854775807", "1e30", "nan", "inf", "text"]
NON_FINITE = ("nan", "inf")

# Arguments under which a run with valid values stays small; the option under test comes last
# and overrides any of them (CLI11 keeps the last value).
TINY_MODEL = ["--d-model", "16", "--layers", "1", "--experts", "2", "--top-k", "1", "--batch", "1", "--seq", "8",
              "--max-bytes", "20000"]
BASE = {
    "bench": ["--backend", "cpu", "--shape", "tiny", "--tokens", "8", "--iters", "1", "--warmup", "0"],
    "train": TINY_MODEL + ["--steps", "1", "--eval-batches", "1"],
    "simulate": ["--tokens", "64", "--series-points", "4"],
    "coordcheck": TINY_MODEL + ["--check-steps", "1", "--mults", "1,2", "--plot", ""],
    "lr-sweep": TINY_MODEL + ["--steps", "1", "--lr-points", "2", "--seeds", "1", "--eval-batches", "1",
                              "--mults", "1,2", "--plot", ""],
    "lr-horizon": TINY_MODEL + ["--steps", "16", "--lr-points", "3", "--seeds", "1", "--eval-batches", "1",
                                "--eval-every", "4", "--holdout", "0", "--ema", "0.5", "--plot", "", "--json", ""],
    "launch": ["-n", "1"],
}
# The kernel lab's executables (--lab): each one is its own command.
LAB_BASE = {
    "mk_forward_core": ["--shape", "tiny", "--tokens", "64", "--minibatch", "256"],
    "mk_backward_core": ["--shape", "tiny", "--tokens", "64", "--minibatch", "256"],
    "mk_tune": ["--shape", "tiny", "--tokens", "64"],
    "nvlink_incast": [],
    "staged_baselines": ["--shape", "tiny", "--tokens", "64"],
    "paired_steps": ["--shape", "tiny", "--tokens", "64"],
    "gemm_schedules": ["--shape", "tiny", "--tokens", "64"],
    "fp8_gemm": ["--shape", "tiny", "--tokens", "64"],
}
# What follows the options (launch runs a command after --).
TAIL = {"launch": ["--", "help"]}
# Options --help leaves out (fault injection), tested all the same.
HIDDEN = {"bench": [("--fail-rank", "INT")]}

FAILURE_TEXT = re.compile(r"runtime error:|AddressSanitizer|LeakSanitizer|terminate called|Segmentation fault|"
                          r"core dumped|std::bad_alloc")


def numeric_options(prefix):
    """The (option, type) pairs of the command `prefix` runs whose --help type is INT, UINT or FLOAT."""
    text = subprocess.run(prefix + ["--help"], capture_output=True, text=True, timeout=30).stdout
    return re.findall(r"^\s+(?:-\w,)?(--[a-z0-9-]+) (INT|UINT|FLOAT)\b", text, re.M)


def run_case(prefix, base, tail, option, kind, value, timeout, scratch):
    argv = prefix + base + [option, value] + tail
    what = " ".join([os.path.basename(argv[0])] + argv[1:])
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=scratch,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"{what}: still running after {timeout} s"
    output = done.stdout + done.stderr
    if done.returncode < 0:
        return f"{what}: killed by signal {-done.returncode}\n{output[-600:]}"
    found = FAILURE_TEXT.search(output)
    if found:
        return f"{what}: '{found.group(0)}' in its output\n{output[-1200:]}"
    if done.returncode != 0 and not done.stderr.strip():
        return f"{what}: exit {done.returncode} with no message"
    # A floating-point option refuses NaN and infinity by name (a comparison-based range check
    # lets NaN through, a one-sided one infinity; either then runs on NaNs).
    if kind == "FLOAT" and value in NON_FINITE and (done.returncode == 0 or option not in done.stderr):
        return f"{what}: not refused by name (exit {done.returncode})\n{output[-600:]}"
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("moka", nargs="?")
    parser.add_argument("--lab", metavar="DIR", help="the kernel lab's executables in DIR instead of moka's commands")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args()
    if bool(args.moka) == bool(args.lab):
        parser.error("give MOKA or --lab DIR")
    # Each command: the argv prefix that runs it, its base arguments and what follows the option.
    if args.lab:
        commands = {name: ([os.path.join(os.path.abspath(args.lab), name)], base, [])
                    for name, base in LAB_BASE.items()}
    else:
        moka = os.path.abspath(args.moka)
        commands = {name: ([moka, name], base, TAIL.get(name, [])) for name, base in BASE.items()}
    cases = [(*commands[c], o, k, v) for c in commands
             for o, k in numeric_options(commands[c][0]) + HIDDEN.get(c, []) for v in VALUES]
    if len(cases) < 100:
        sys.exit(f"flag_matrix: only {len(cases)} cases: the --help format changed?")
    with tempfile.TemporaryDirectory(prefix="moka_flags_") as scratch:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            failures = [f for f in pool.map(lambda c: run_case(*c, args.timeout, scratch), cases) if f]
    for f in failures:
        print("FAIL", f)
    print(f"flag_matrix: {len(cases)} runs over {len(commands)} commands, {len(failures)} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
