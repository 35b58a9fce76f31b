#!/usr/bin/python3
"""Plots of `moka coordcheck` and `moka lr-sweep` CSVs.

usage: plot_mup.py coordcheck CSV PNG   -- mean |activation| vs width, one panel per activation,
                                            one line per step
       plot_mup.py lrsweep CSV PNG      -- validation loss vs LR, one line per width, fitted
                                            optimum eta* marked
       plot_mup.py check                -- exits 0 when matplotlib loads (moka asks before
                                            the work starts)
Needs matplotlib (Debian: python3-matplotlib, so /usr/bin/python3).
"""
import csv
import math
import sys
from collections import defaultdict


def load_pyplot():
    try:
        import matplotlib
    except ImportError:
        sys.exit(f"plot_mup.py: {sys.executable} has no matplotlib "
                 "(Debian: apt install python3-matplotlib, as scripts/setup.sh does)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def plot_coordcheck(plt, rows, png):
    series = defaultdict(lambda: defaultdict(list))  # activation -> step -> [(width, value)]
    for r in rows:
        series[r["activation"]][int(r["step"])].append((int(r["width"]), float(r["mean_abs"])))
    names = list(series)
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        for step, pts in sorted(series[name].items()):
            pts.sort()
            ax.plot([w for w, _ in pts], [v for _, v in pts], marker="o", label=f"step {step}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("width (d_model)")
    axes[0][0].set_ylabel("mean |activation|")
    axes[0][-1].legend(fontsize="small")
    fig.suptitle(f"coordinate check ({rows[0]['param']})")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def plot_lrsweep(plt, rows, png):
    points = defaultdict(list)
    optima = {}
    for r in rows:
        if r["kind"] == "point":
            points[int(r["width"])].append((float(r["lr"]), float(r["loss"])))
        else:
            optima[int(r["width"])] = float(r["lr"])
    fig, ax = plt.subplots(figsize=(6, 4.2))
    finite = [l for pts in points.values() for _, l in pts if math.isfinite(l)]
    for width, pts in sorted(points.items()):
        pts.sort()
        shown = [(lr, l) for lr, l in pts if math.isfinite(l)]
        line, = ax.plot([lr for lr, _ in shown], [l for _, l in shown], marker="o", label=f"d={width}")
        eta = optima.get(width)
        if eta:
            near = min(shown, key=lambda p: abs(math.log(p[0] / eta)))
            ax.plot([eta], [near[1]], marker="*", markersize=14, color=line.get_color(), markeredgecolor="k")
    ax.set_xscale("log", base=2)
    ax.set_ylim(min(finite) - 0.05, min(max(finite), min(finite) + 1.5))
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"LR sweep ({rows[0]['param']}); * = fitted optimum")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    if sys.argv[1:] == ["check"]:
        load_pyplot()
        return
    if len(sys.argv) != 4 or sys.argv[1] not in ("coordcheck", "lrsweep"):
        sys.exit(__doc__)
    plt = load_pyplot()
    rows = read_rows(sys.argv[2])
    (plot_coordcheck if sys.argv[1] == "coordcheck" else plot_lrsweep)(plt, rows, sys.argv[3])


if __name__ == "__main__":
    main()
