#!/usr/bin/python3
"""Draws a megakernel task timeline (`moka bench --timeline FILE`): one row per CTA, one bar per
task (dispatch, gate|up, down, combine, shared-expert tiles), so the overlap of NVLink
communication and expert GEMMs can be seen. Needs matplotlib (/usr/bin/python3 on Debian).

usage: bench/plot_timeline.py TIMELINE.jsonl OUT.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"dispatch": "tab:blue", "combine": "tab:orange", "gate_up": "tab:green", "down": "tab:red",
          "shared_gate_up": "tab:olive", "shared_down": "tab:purple"}


def main(path, out):
    spans = [json.loads(line) for line in open(path) if line.strip()]
    first = spans[0]
    fig, ax = plt.subplots(figsize=(14, 7))
    for kind, color in COLORS.items():
        bars = [(s["cta"], s["start_us"], s["end_us"] - s["start_us"]) for s in spans if s["kind"] == kind]
        for cta, start, width in bars:
            ax.broken_barh([(start, max(width, 0.05))], (cta - 0.4, 0.8), facecolors=color, linewidth=0)
        ax.plot([], [], color=color, linewidth=8, label=f"{kind} ({len(bars)})")
    ax.set_xlabel("time since the first task started (us)")
    ax.set_ylabel("CTA (one per SM; communication CTAs first)")
    ax.set_title(f"moka megakernel forward, {first['shape']}, {first['tokens_per_rank']} tokens/rank, "
                 f"EP={first['ep']} (rank 0)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
