#!/usr/bin/env python3
"""Sum a MGMM_TRACE timeline's spans by track and name: count, total and longest duration, and
for spans of the `direct` track the bytes they moved where a rate makes sense.
With --within TRACK, each span of TRACK (e.g. `verify`, one span per pass) is listed with its
start and length, and the other spans are summed by the span of TRACK they start inside: which
reads and device folds belong to which pass.
Usage: trace_sum.py TRACE.json [--within TRACK] [TRACK ...]   (all tracks when none is named)"""
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
args = sys.argv[2:]
within = None
if args[:1] == ["--within"]:
    if len(args) < 2:
        raise SystemExit(__doc__)
    within, args = args[1], args[2:]
want = set(args)
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

if within is not None:
    xs = [e for e in evs if e.get("ph") == "X"]
    outer = sorted((e for e in xs if names.get(e.get("tid")) == within), key=lambda e: e["ts"])
    t00 = min((e["ts"] for e in xs), default=0)
    for o in outer:
        lo, hi = o["ts"], o["ts"] + o.get("dur", 0)
        print(f"\n{within}: {o['name']}: from {(lo - t00) / 1e3:.1f} ms, {(hi - lo) / 1e3:.1f} ms long")
        inner = defaultdict(lambda: [0, 0.0, float("inf"), 0.0])
        for e in xs:
            track = names.get(e.get("tid"), str(e.get("tid")))
            if track == within or not lo <= e["ts"] < hi or (want and track not in want):
                continue
            a = inner[(track, e["name"])]
            a[0] += 1; a[1] += e.get("dur", 0) / 1e3
            a[2] = min(a[2], e["ts"]); a[3] = max(a[3], e["ts"] + e.get("dur", 0))
        for (track, name), (n, tot, first, last) in sorted(inner.items()):
            print(f"  {track:26} {name:28} {n:6} spans, {tot:9.1f} ms in all, "
                  f"{(first - lo) / 1e3:7.1f}..{(last - lo) / 1e3:7.1f} ms into it")
