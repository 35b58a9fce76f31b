#!/usr/bin/env python3
"""Checks the layer rows of `moka bench --json`: every field present, and the derived ones
consistent with the rest.

    bench_json_check.py [options] -- MOKA ARGS...   runs moka and checks its stdout
    bench_json_check.py [options] --file FILE       checks the JSON lines of an earlier run

Each layer row (path reference, single-gpu, all-to-all or megakernel) must have positive
fwd_ms, bwd_ms, fwdbwd_ms and floor_fwdbwd_ms, with
  fwdbwd_ms = fwd_ms + bwd_ms within --sum-tolerance (relative; each is a median of its own, so
    only a one-run bench, --iters 1, makes them add up exactly),
  fwdbwd_vs_floor = fwdbwd_ms / floor_fwdbwd_ms,
  peak_memory_bytes null on the CPU backend (nothing accounts for its host buffers), a positive
    integer on CUDA,
  torch_fwdbwd_ms, speedup_vs_torch = torch_fwdbwd_ms / fwdbwd_ms and torch_peak_memory_bytes
    taken from the --torch file's line of the same shape, tokens and ep, or all null without one.
Megakernel rows also give their backward's saved context (context_mode) and their speedups over
the path they alternated with. Exits 1 naming every violation.
"""
import argparse
import json
import math
import subprocess
import sys

LAYER_PATHS = {"reference", "single-gpu", "all-to-all", "megakernel"}
FIELDS = ["shape", "backend", "path", "ep", "tokens_per_rank", "iters", "fwd_ms", "bwd_ms", "fwdbwd_ms",
          "floor_fwdbwd_ms", "fwdbwd_vs_floor", "peak_memory_bytes", "torch_fwdbwd_ms", "speedup_vs_torch",
          "torch_peak_memory_bytes"]


def close(a, b, tolerance):
    return abs(a - b) <= tolerance * max(abs(a), abs(b))


def positive(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def torch_rows(path):
    rows = {}
    if path:
        with open(path) as f:
            for line in f:
                if line.strip():
                    j = json.loads(line)
                    rows[(j.get("shape"), j.get("tokens_per_rank"), j.get("ep", 1))] = j
    return rows


def check_row(r, torch, a):
    where = f"{r.get('shape')} T={r.get('tokens_per_rank')} ep={r.get('ep')} {r.get('path')}"
    missing = [f for f in FIELDS if f not in r]
    if missing:
        return [f"{where}: missing {', '.join(missing)}"]
    bad = []
    for f in ("fwd_ms", "bwd_ms", "fwdbwd_ms", "floor_fwdbwd_ms", "fwdbwd_vs_floor"):
        if not positive(r[f]):
            bad.append(f"{where}: {f} = {r[f]!r} is not a positive number")
    if bad:
        return bad
    if not close(r["fwdbwd_ms"], r["fwd_ms"] + r["bwd_ms"], a.sum_tolerance):
        bad.append(f"{where}: fwdbwd_ms {r['fwdbwd_ms']} is not fwd_ms + bwd_ms = {r['fwd_ms'] + r['bwd_ms']}")
    if not close(r["fwdbwd_vs_floor"], r["fwdbwd_ms"] / r["floor_fwdbwd_ms"], 1e-9):
        bad.append(f"{where}: fwdbwd_vs_floor {r['fwdbwd_vs_floor']} is not fwdbwd_ms / floor_fwdbwd_ms")
    if a.floor_is_a_bound and r["fwdbwd_vs_floor"] < 1:
        bad.append(f"{where}: fwdbwd_vs_floor {r['fwdbwd_vs_floor']} is below 1: the floor is no bound")
    memory = r["peak_memory_bytes"]
    if r["backend"] == "cpu" and memory is not None:
        bad.append(f"{where}: peak_memory_bytes {memory!r} on the CPU backend, which measures none")
    if r["backend"] == "cuda" and not (isinstance(memory, int) and memory > 0):
        bad.append(f"{where}: peak_memory_bytes {memory!r} is not a positive integer")
    t = torch.get((r["shape"], r["tokens_per_rank"], r["ep"]))
    if t is None or not t.get("fwdbwd_ms"):
        for f in ("torch_fwdbwd_ms", "speedup_vs_torch", "torch_peak_memory_bytes"):
            if r[f] is not None:
                bad.append(f"{where}: {f} = {r[f]!r} without a torch result")
    else:
        if r["torch_fwdbwd_ms"] != t["fwdbwd_ms"]:
            bad.append(f"{where}: torch_fwdbwd_ms {r['torch_fwdbwd_ms']!r} is not torch's {t['fwdbwd_ms']}")
        if (not positive(r["speedup_vs_torch"])
                or not close(r["speedup_vs_torch"], t["fwdbwd_ms"] / r["fwdbwd_ms"], 1e-9)):
            bad.append(f"{where}: speedup_vs_torch {r['speedup_vs_torch']!r} is not torch_fwdbwd_ms / fwdbwd_ms")
        if r["torch_peak_memory_bytes"] != t.get("peak_memory_bytes"):
            bad.append(f"{where}: torch_peak_memory_bytes {r['torch_peak_memory_bytes']!r} is not torch's "
                       f"{t.get('peak_memory_bytes')!r}")
    if r["path"] == "megakernel":
        if r.get("context_mode") not in ("resident", "replay"):
            bad.append(f"{where}: context_mode {r.get('context_mode')!r} is neither resident nor replay")
        for f in ("fwd_speedup_vs_paired", "bwd_speedup_vs_paired", "fwdbwd_speedup_vs_paired"):
            if not positive(r.get(f)):
                bad.append(f"{where}: {f} = {r.get(f)!r} is not a positive number")
    return bad


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", help="JSON lines to check instead of running moka")
    p.add_argument("--torch", default="", help="the torch results the bench was given (--torch-results)")
    p.add_argument("--sum-tolerance", type=float, default=1e-9,
                   help="relative tolerance of fwdbwd_ms = fwd_ms + bwd_ms (default 1e-9: one run)")
    p.add_argument("--floor-is-a-bound", action="store_true", help="also require fwdbwd_vs_floor >= 1")
    p.add_argument("--paths", default="", help="comma list: the paths every case must have, each once")
    p.add_argument("command", nargs="*", help="moka and its arguments (after --)")
    a = p.parse_args()
    if bool(a.file) == bool(a.command):
        p.error("give either --file or a moka command after --")
    if a.file:
        with open(a.file) as f:
            text = f.read()
    else:
        run = subprocess.run(a.command, capture_output=True, text=True, timeout=150)
        sys.stderr.write(run.stderr)
        if run.returncode != 0:
            print(f"FAIL: {' '.join(a.command)} exited with {run.returncode}\n{run.stdout}")
            return 1
        text = run.stdout
    rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    rows = [r for r in rows if r.get("path") in LAYER_PATHS]
    torch = torch_rows(a.torch)
    bad = [] if rows else ["no layer rows"]
    for r in rows:
        bad += check_row(r, torch, a)
    if a.paths:
        want = sorted(a.paths.split(","))
        cases = {}
        for r in rows:
            cases.setdefault((r["shape"], r["tokens_per_rank"], r["ep"]), []).append(r["path"])
        for case, paths in cases.items():
            if sorted(paths) != want:
                bad.append(f"{case}: paths {sorted(paths)}, expected {want}")
    for b in bad:
        print("FAIL:", b)
    if not bad:
        print(f"ok: {len(rows)} layer rows")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
