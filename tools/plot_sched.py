#!/usr/bin/python3
"""Plots of `moka simulate` for docs/SCHEDULING.md (needs matplotlib: /usr/bin/python3 on Debian).

usage: tools/plot_sched.py MOKA_BINARY OUT_DIR
Runs the simulator itself and writes hot_queue.png, skew.png and buffers.png into OUT_DIR.
"""
import csv
import json
import subprocess
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MOKA, OUT = sys.argv[1], sys.argv[2]
BASE = ["--gpus", "64", "--tokens", "4096", "--seed", "1"]


def simulate(*args):
    cmd = [MOKA, "simulate", *BASE, "--json", *args]
    print(" ".join(cmd), flush=True)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def hot_queue():
    with tempfile.NamedTemporaryFile(suffix=".csv") as f:
        rows = simulate("--gini", "0.3", "--policies", "round-robin,rate-based", "--series-csv", f.name,
                        "--series-points", "400")
        hot = rows[0]["hot_receiver"]
        series = {}
        for r in csv.DictReader(open(f.name)):
            series.setdefault(r["policy"], []).append((float(r["time_s"]), float(r[f"q{hot}"])))
    tstar = rows[0]["tstar_s"]
    plt.figure(figsize=(7, 4))
    for policy, points in series.items():
        plt.plot([t / tstar for t, _ in points], [q / 2**20 for _, q in points], label=policy)
    plt.xlabel("time / T*")
    plt.ylabel(f"queue at hottest receiver (GPU {hot}), MiB")
    plt.title("64 GPUs, Zipf expert Gini 0.3, chunk level, unbounded buffers")
    plt.legend()
    plt.grid(alpha=0.3)
    plt.tight_layout()
    plt.savefig(f"{OUT}/hot_queue.png", dpi=120)


def skew():
    ginis = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    by_policy = {}
    for g in ginis:
        for r in simulate("--gini", str(g), "--buffer-mb", "4", "--back-pressure", "pfc"):
            by_policy.setdefault(r["policy"], []).append(r["completion_over_tstar"])
    plt.figure(figsize=(7, 4))
    for policy, ys in by_policy.items():
        plt.plot(ginis, ys, marker="o", label=policy)
    plt.yscale("log")
    plt.xlabel("target per-expert load Gini (Zipf)")
    plt.ylabel("completion / T*")
    plt.title("64 GPUs, 4 MiB per port, PFC, 1 us barriers")
    plt.legend(fontsize=8)
    plt.grid(alpha=0.3, which="both")
    plt.tight_layout()
    plt.savefig(f"{OUT}/skew.png", dpi=120)


def buffers():
    sizes = [0.5, 1, 2, 4, 8, 16, 32, 64]
    plt.figure(figsize=(7, 4))
    for mode in ["pfc", "credit"]:
        by_policy = {}
        for mb in sizes:
            for r in simulate("--gini", "0.3", "--buffer-mb", str(mb), "--back-pressure", mode,
                              "--policies", "rate-based,round-robin,spreadout,destination-major"):
                by_policy.setdefault(r["policy"], []).append(r["completion_over_tstar"])
        for policy, ys in by_policy.items():
            plt.plot(sizes, ys, marker="o", linestyle="-" if mode == "pfc" else ":", label=f"{policy} ({mode})")
    plt.xscale("log", base=2)
    plt.xlabel("buffer per output port, MiB")
    plt.ylabel("completion / T*")
    plt.title("64 GPUs, Zipf Gini 0.3, back-pressure")
    plt.legend(fontsize=7)
    plt.grid(alpha=0.3)
    plt.tight_layout()
    plt.savefig(f"{OUT}/buffers.png", dpi=120)


hot_queue()
skew()
buffers()
