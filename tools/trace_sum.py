#!/usr/bin/env python3
"""Sum a MGMM_TRACE timeline's spans by track and name: count, total and longest duration, and
for spans of the `direct` track the bytes they moved where a rate makes sense.
Usage: trace_sum.py TRACE.json [TRACK ...]   (all tracks when none is named)"""
import json, sys
from collections import defaultdict

if len(sys.argv) < 2:
    raise SystemExit(__doc__)
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    raise SystemExit(f"{sys.argv[1]}: cannot read a trace ({e})")
evs = d["traceEvents"] if isinstance(d, dict) else d
names = {e["tid"]: e["args"]["name"] for e in evs if e.get("ph") == "M" and e.get("name") == "thread_name"}
want = set(sys.argv[2:])
acc = defaultdict(lambda: [0, 0.0, 0.0])
for e in evs:
    if e.get("ph") != "X":
        continue
    track = names.get(e.get("tid"), str(e.get("tid")))
    if want and track not in want:
        continue
    a = acc[(track, e["name"])]
    a[0] += 1; a[1] += e.get("dur", 0) / 1e3; a[2] = max(a[2], e.get("dur", 0) / 1e3)
for (track, name), (n, tot, top) in sorted(acc.items()):
    print(f"{track:28} {name:28} {n:6} spans, {tot:9.1f} ms in all, longest {top:7.1f} ms")
