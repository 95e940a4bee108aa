#!/usr/bin/env python3
"""Every track and span name of an MGMM_TRACE timeline (any command's: `run`, `verify`): how many
spans, their total and longest duration, and when the first began and the last ended, in ms from
the process start. `tools/trace_gaps.py` reads a step's GEMM timeline; this reads anything.

    python3 tools/trace_spans.py TRACE.json
"""
import json
import sys
from collections import defaultdict

ev = json.load(open(sys.argv[1]))["traceEvents"]
names = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
agg = defaultdict(lambda: [0, 0.0, 0.0, float("inf"), 0.0])
for e in ev:
    if e["ph"] != "X":
        continue
    a = agg[(names.get(e["tid"], str(e["tid"])), e["name"])]
    a[0] += 1
    a[1] += e["dur"] / 1e3
    a[2] = max(a[2], e["dur"] / 1e3)
    a[3] = min(a[3], e["ts"] / 1e3)
    a[4] = max(a[4], (e["ts"] + e["dur"]) / 1e3)
print(f"{'track':24} {'span':42} {'n':>5} {'total ms':>9} {'longest':>8} {'from':>8} {'to':>8}")
for (track, name), (n, tot, lng, t0, t1) in sorted(agg.items(), key=lambda kv: kv[1][3]):
    print(f"{track[:24]:24} {name[:42]:42} {n:5} {tot:9.1f} {lng:8.1f} {t0:8.1f} {t1:8.1f}")
