#!/usr/bin/python3
"""Plots of `moka coordcheck` and `moka lr-sweep` CSVs and `moka lr-horizon` JSON.

usage: plot_mup.py coordcheck CSV PNG   -- mean |activation| vs width, one panel per activation,
                                            one line per step
       plot_mup.py lrsweep CSV PNG      -- validation loss vs LR, one line per width, fitted
                                            optimum eta* marked; with several seeds the mean
                                            loss with +-1 std bars, eta*'s min..max over seeds
       plot_mup.py horizon JSON PNG     -- loss vs LR per token budget; eta* vs budget (log-log)
                                            with the power-law fit, held-out budgets and the
                                            spread over seeds
       plot_mup.py check                -- exits 0 when matplotlib loads (moka asks before
                                            the work starts)
Needs matplotlib (Debian: python3-matplotlib, so /usr/bin/python3).
"""
import csv
import json
import math
import os
import statistics
import sys
import tempfile
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


def save_figure(fig, png):
    """Writes the figure whole or not at all: to a temporary file beside png, then renamed over it
    (an interrupted plot leaves the old file, never a torn one)."""
    fd, temporary = tempfile.mkstemp(prefix=os.path.basename(png) + ".", suffix=".png",
                                     dir=os.path.dirname(png) or ".")
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(temporary, 0o666 & ~umask)  # the mode a new file gets (mkstemp makes it 0600)
        fig.savefig(temporary, dpi=110)
        os.replace(temporary, png)
    except BaseException:
        os.unlink(temporary)
        raise


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
    save_figure(fig, png)


def plot_lrsweep(plt, rows, png):
    losses = defaultdict(lambda: defaultdict(list))  # width -> lr -> [loss per seed]
    optima, seed_optima = {}, defaultdict(list)
    for r in rows:
        width = int(r["width"])
        if r["kind"] == "point":
            losses[width][float(r["lr"])].append(float(r["loss"]))
        elif r["kind"] == "optimum":
            optima[width] = float(r["lr"])
        elif r["kind"] == "seed_optimum":
            seed_optima[width].append(float(r["lr"]))
    seeds = max(len(v) for by_lr in losses.values() for v in by_lr.values())
    fig, ax = plt.subplots(figsize=(6, 4.2))
    finite = []
    for width, by_lr in sorted(losses.items()):
        shown = [(lr, statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0)
                 for lr, v in sorted(by_lr.items()) if all(math.isfinite(x) for x in v)]
        finite += [m for _, m, _ in shown]
        line = ax.errorbar([p[0] for p in shown], [p[1] for p in shown],
                           yerr=[p[2] for p in shown] if seeds > 1 else None, marker="o", capsize=3, label=f"d={width}")
        color = line.lines[0].get_color()
        eta = optima.get(width)
        if eta and shown:
            near = min(shown, key=lambda p: abs(math.log(p[0] / eta)))
            spread = seed_optima.get(width, [])
            # The seed-mean curve's optimum can lie just outside its seeds' range: the bar then ends at it.
            xerr = [[max(0.0, eta - min(spread))], [max(0.0, max(spread) - eta)]] if seeds > 1 and spread else None
            ax.errorbar([eta], [near[1]], xerr=xerr, marker="*", markersize=14, color=color, markeredgecolor="k",
                        capsize=4)
    ax.set_xscale("log", base=2)
    ax.set_ylim(min(finite) - 0.05, min(max(finite), min(finite) + 1.5))
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("validation loss (nats/byte)")
    title = f"LR sweep ({rows[0]['param']}); * = fitted optimum"
    if seeds > 1:
        title += f"\n{seeds} seeds: mean +-1 std, * bars = eta* min..max"
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, png)


def plot_horizon(plt, doc, png):
    budgets = doc["budgets"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    cmap = plt.get_cmap("viridis")
    finite = []
    for i, b in enumerate(budgets):
        pts = [(lr, l, s) for lr, l, s in zip(doc["lrs"], b["loss"], b["loss_std"]) if l is not None]
        finite += [l for _, l, _ in pts]
        color = cmap(i / max(1, len(budgets) - 1))
        left.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts] if doc["seeds"] > 1 else None,
                      color=color, marker="o", markersize=3, capsize=2, label=f"{b['tokens']:.3g} tok")
        if b["usable"]:
            p = b["parabola"]
            x = math.log(b["eta_star"])
            left.plot([b["eta_star"]], [p["a"] * x * x + p["b"] * x + p["c"]], marker="*", markersize=11, color=color,
                      markeredgecolor="k")
    left.set_xscale("log", base=2)
    if finite:
        left.set_ylim(min(finite) - 0.05, min(max(finite), min(finite) + 1.0))
    left.set_xlabel("peak learning rate")
    left.set_ylabel("EMA validation loss (nats/byte)")
    left.set_title("loss vs LR per token budget; * = eta*")
    left.legend(fontsize="x-small", ncol=2)

    groups = ((lambda b: b["fitted"] and not b["held_out"], "o", "fitted budgets"),
              (lambda b: b["held_out"], "s", "held out"),
              (lambda b: b["usable"] and not b["fitted"], "^", "not fitted (before --fit-from)"))
    for member, marker, label in groups:
        pts = [b for b in budgets if member(b)]
        if not pts:
            continue
        spread = [b["ln_eta_star_over_seeds"] for b in pts]
        yerr = None
        if doc["seeds"] > 1:
            yerr = [[b["eta_star"] - math.exp(s["min"]) if s["count"] else 0 for b, s in zip(pts, spread)],
                    [math.exp(s["max"]) - b["eta_star"] if s["count"] else 0 for b, s in zip(pts, spread)]]
        right.errorbar([b["tokens"] for b in pts], [b["eta_star"] for b in pts], yerr=yerr, marker=marker,
                       linestyle="none", capsize=3, label=label)
    fit = doc["fit"]
    xs = [b["tokens"] for b in budgets] + [e["tokens"] for e in doc["extrapolated"]]
    lo, hi = min(xs), max(xs)
    grid = [lo * (hi / lo) ** (i / 50) for i in range(51)]
    right.plot(grid, [math.exp(fit["gamma"]) * t ** fit["beta"] for t in grid], "k-",
               label=f"fit: beta {fit['beta']:.3f}, R^2 {fit['r2']:.3f}")
    if "holdout_fit" in doc:
        h = doc["holdout_fit"]
        right.plot(grid, [math.exp(h["gamma"]) * t ** h["beta"] for t in grid], "k:",
                   label=f"fit without held out: beta {h['beta']:.3f}")
    checks = [w for w in doc["wsd_checks"] if w["usable"]]
    if checks:
        right.plot([w["tokens"] for w in checks], [w["wsd_eta_star"] for w in checks], marker="x", markersize=10,
                   color="tab:green", linestyle="none", label="real WSD runs with decay")
    for e in doc["extrapolated"]:
        right.plot([e["tokens"]], [e["eta_star"]], marker="D", color="tab:red", linestyle="none")
    if doc["seeds"] > 1:
        s = doc["beta_over_seeds"]
        right.text(0.03, 0.04, f"beta over {s['count']} seeds: {s['mean']:.3f} +- {s['std']:.3f}",
                   transform=right.transAxes, fontsize="small")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("token budget B")
    right.set_ylabel("eta*")
    right.set_title(f"log eta* vs log B (held-out max error {100 * doc['held_out_max_error']:.1f}%)")
    right.legend(fontsize="x-small")
    fig.suptitle(f"token-horizon LR study ({doc['param']}, d_model {doc['d_model']}, EMA {doc['ema_decay']})")
    fig.tight_layout()
    save_figure(fig, png)


def main():
    if sys.argv[1:] == ["check"]:
        load_pyplot()
        return
    if len(sys.argv) != 4 or sys.argv[1] not in ("coordcheck", "lrsweep", "horizon"):
        sys.exit(__doc__)
    plt = load_pyplot()
    kind, data, png = sys.argv[1:]
    if kind == "horizon":
        with open(data) as f:
            plot_horizon(plt, json.load(f), png)
    else:
        (plot_coordcheck if kind == "coordcheck" else plot_lrsweep)(plt, read_rows(data), png)


if __name__ == "__main__":
    main()
