#!/usr/bin/env python3
"""Measured dispatch and combine spans of a megakernel run against `moka simulate`'s prediction
for the same routing at the measured peer-copy bandwidth (issue 8, item 4).

usage: bench/compare_sim.py MOKA BENCH.jsonl TIMELINE.jsonl [ROUTING_DUMP.jsonl]
BENCH.jsonl: `moka bench --gpus N --backend cuda --json` lines (the case the timeline is of is
the last line of its shape and token count); TIMELINE.jsonl: its `--timeline` file; ROUTING_DUMP: its
`--dump-routing` file (without it, simulate draws uniform routing of the same shape).
Prints one JSON line per simulated policy: predicted completion, measured spans, and the error.
"""
import json
import subprocess
import sys

def span(spans, kind):
    ks = [s for s in spans if s["kind"] == kind]
    return (max(s["end_us"] for s in ks) - min(s["start_us"] for s in ks)) * 1e-6 if ks else 0.0


def main(moka, bench_path, timeline_path, dump_path=None):
    spans = [json.loads(line) for line in open(timeline_path) if line.strip()]
    shape, tokens, ep = spans[0]["shape"], spans[0]["tokens_per_rank"], spans[0]["ep"]
    rows = [json.loads(line) for line in open(bench_path) if line.startswith("{")]
    row = [r for r in rows if r["shape"] == shape and r["tokens_per_rank"] == tokens][-1]
    cmd = [moka, "simulate", "--gpus", str(ep), "--link-gbps", str(row["peer_copy_gbs"]), "--model", "fluid",
           "--policies", "rate-based", "round-robin", "--shape", shape, "--json"]
    if dump_path:
        cmd += ["--replay", dump_path]
    else:
        cmd += ["--tokens", str(tokens), "--routing", "uniform"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    measured = {"dispatch_s": span(spans, "dispatch"), "combine_s": span(spans, "combine")}
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        sim = json.loads(line)
        print(json.dumps({"shape": shape, "tokens_per_rank": tokens, "ep": ep, "policy": sim["policy"],
                          "link_gbs": row["peer_copy_gbs"], "predicted_s": sim["completion_s"], **measured,
                          "dispatch_over_predicted": measured["dispatch_s"] / sim["completion_s"],
                          "megakernel_config": row.get("megakernel_config", "")}))


if __name__ == "__main__":
    main(*sys.argv[1:])
