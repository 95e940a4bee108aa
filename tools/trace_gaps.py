#!/usr/bin/env python3
"""Where did the GPUs wait? Reads a timeline written with MGMM_TRACE=PATH (src/trace.rs).

    python3 tools/trace_gaps.py TRACE.json [--min-ms 2] [--top 12]

Prints the start-up phases, then per GPU and step ("cuda:0 gemm, step 1"; on the CPU the lane's
busy spans, which include its copies, stand in for GEMMs): time to the first GEMM, GEMM busy
time, the idle time between GEMMs and after the last one, and the largest gaps with what every
other track was doing during each (the share of the gap each track spent busy or waiting).
"""
import argparse
import json
import sys


def load(path):
    """The trace's spans by track name; exits with a message naming `path` if it is not one."""
    try:
        with open(path) as f:
            d = json.load(f)
    except OSError as e:
        sys.exit(f"trace_gaps: cannot read {path}: {e.strerror}")
    except ValueError as e:
        sys.exit(f"trace_gaps: {path} is not JSON ({e}); give the file MGMM_TRACE=PATH wrote")
    if not isinstance(d, dict) or "traceEvents" not in d:
        what = "a run's report (--report)" if isinstance(d, dict) and "steps" in d else "not a trace"
        sys.exit(f"trace_gaps: {path} is {what}: give the file MGMM_TRACE=PATH wrote "
                 "(e.g. MGMM_TRACE=trace.json mgmm-stream run plan.toml)")
    names, spans = {}, {}
    for e in d["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[e["tid"]] = e["args"]["name"]
    for e in d["traceEvents"]:
        if e.get("ph") == "X":
            spans.setdefault(names.get(e["tid"], str(e["tid"])), []).append(
                (e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3, e["name"]))
    for v in spans.values():
        v.sort()
    return spans, d.get("otherData", {}).get("dropped_events", 0)


def overlap(spans, a, b):
    """Milliseconds of [a, b) covered by each state of `spans`."""
    out = {}
    for s, e, n in spans:
        if e <= a or s >= b:
            continue
        out[n] = out.get(n, 0.0) + min(e, b) - max(s, a)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--min-ms", type=float, default=2.0, help="smallest gap listed")
    ap.add_argument("--top", type=int, default=12, help="gaps listed per GPU")
    a = ap.parse_args()
    spans, dropped = load(a.trace)
    if dropped:
        print(f"note: {dropped} events were dropped (trace buffer full)")
    steps = [(s, e, n) for s, e, n in spans.get("start-up", [])
             if n.startswith("step") and ":" not in n]
    print("start-up phases (ms from process start):")
    for s, e, n in spans.get("start-up", []):
        print(f"  {n:<18} {s:9.1f} .. {e:9.1f}  ({e - s:8.1f} ms)")
    # What the phases are made of, up to the first step: each GPU lane's parts (context,
    # streams, cuBLAS handle, warm-up GEMM), and the pinned buffers' populating and registering.
    first = steps[0][0] if steps else float("inf")
    parts = [(s, e, f"{t}: {n}") for t, sp in spans.items() if t.endswith(" lane")
             for s, e, n in sp if s < first]
    for s, e, n in sorted(parts):
        print(f"  {n:<30} {s:9.1f} .. {e:9.1f}  ({e - s:8.1f} ms)")
    for what in ("populate", "register"):
        sp = [x for x in spans.get("pinned memory", []) if x[2] == what and x[0] < first]
        if sp:
            print(f"  pinned memory: {what} {len(sp)} buffers {min(x[0] for x in sp):9.1f} .. "
                  f"{max(x[1] for x in sp):9.1f}  (longest {max(x[1] - x[0] for x in sp):.1f} ms)")
    gemm_tracks = [t for t in spans if t.endswith(" gemm")]
    if not gemm_tracks and "lane" in spans:
        gemm_tracks = ["lane"]
    # One section per GPU and step: a plan's steps each start from an idle GPU.
    sections = []
    for t in gemm_tracks:
        all_g = [x for x in spans[t] if x[2] in ("gemm", "busy")]
        for s0, s1, name in steps or [(float("-inf"), float("inf"), "run")]:
            g = [x for x in all_g if s0 <= x[0] <= s1]
            if g:
                if steps:
                    sections.append((f"{t}, {name}", s0, s1, g))
                else:
                    sections.append((t, g[0][0], g[-1][1], g))
    if not steps:
        print("\nno step ran in this trace (a step already complete is skipped: run with --restart)")
    for t, s0, s1, g in sections:
        # On the CPU the lane computes the GEMMs itself: its busy spans (copies included) stand in.
        what = "lane busy spans" if t.startswith("lane") else "GEMMs"
        busy = sum(e - s for s, e, _ in g)
        gaps = [(g[i + 1][0] - g[i][1], g[i][1], g[i + 1][0]) for i in range(len(g) - 1)]
        between = sum(x[0] for x in gaps if x[0] > 0)
        print(f"\n{t}: step {s1 - s0:.1f} ms; first of the {what} at +{g[0][0] - s0:.1f} ms; "
              f"{what} {busy:.1f} ms ({len(g)}); idle between them {between:.1f} ms; "
              f"after the last {s1 - g[-1][1]:.1f} ms")
        big = sorted((x for x in gaps if x[0] >= a.min_ms), reverse=True)[: a.top]
        if a.top > 0 and not big:
            print(f"  no gap of {a.min_ms:g} ms or more (--min-ms)")
        for d, ga, gb in sorted(big, key=lambda x: x[1]):
            print(f"  gap {d:7.1f} ms at +{ga - s0:8.1f} ms:")
            for other, sp in spans.items():
                if other == "start-up" or t.startswith(other):
                    continue
                o = overlap(sp, ga, gb)
                if o:
                    parts = ", ".join(f"{n} {100 * v / d:.0f}%" for n, v in sorted(o.items()))
                    print(f"      {other:<22} {parts}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `| head`
        sys.stderr.close()
        sys.exit(0)
