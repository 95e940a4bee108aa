#!/usr/bin/env python3
"""How long a step takes when staging's loads, not the GEMMs, set the pace early on.

A model, no GPU: every input block is loaded once (the device's tile cache holds them all at
32768² fp64 on one H100), one after another at LOAD ms each, in the order the GEMMs first need
them; each GEMM (tile i, j, k-step k) needs A(i, k) and B(k, j) and takes GEMM ms; the GEMMs run
one after another as soon as their blocks are in. It prints the finish time and its ratio to the
GEMMs alone for serpentine rows and for growing squares — the engine walks squares when each
lane's tile cache holds every block it needs (`Layout::squares_fit`, as at 32768² fp64 on one
H100), serpentine rows otherwise — over a range of load times, and the bound of the best order:
a cube growing in (i, j, k), after a fraction f of the GEMMs f^(2/3) of the loads (continuous,
the first block's latency left out), which would need several tiles' k-loops interleaved on the
device (the engine runs a tile's k-loop through, on one accumulator). Last, growing squares
whose first q×q square goes k-chunk by k-chunk (the lane's start group: 2×2 by default, 3×3 for
fp64 since session 35, docs/decisions/0024-a-first-square-of-nine-for-fp64.md), with the last
writeback's end: a larger group feeds the GPU sooner but its tiles all end in its last k-chunk.

Session 34 measured on one H100 (docs/measurements/2026-12-07d-h100-2-tile-rates-traced-npy.log):
a 8192³ DGEMM at 52.8 TFLOP/s (20.8 ms; torch's in-core 32768² DGEMM 49.6), staging 32 blocks
of 512 MiB in 1.09-1.10 s busy (34 ms each), steps of 1.64-1.71 s; this model gives 1.65 s for
growing squares at 34 ms a load. 0.95 × in-core is 1.49 s: reached in squares at about 24 ms a
load (22 GB/s); the cube's bound at 34 ms (1.44 s) is 0.99 × in-core.

  python3 tools/probes/load_order_model.py [--grid 4] [--gemm 20.8] [--loads 32.4,25,20,16]
"""
import argparse


def finish(order, gk, load, gemm, group=1):
    """(finish of the last GEMM, end of the last load), in ms; the first `group` tiles of
    `order` go k-chunk by k-chunk (the lane's start group), the rest one after another."""
    return finish_gemms(gemms(order, gk, group), load, gemm)[:2]


def gemms(order, gk, group=1):
    """The GEMMs (i, j, k) in the lane's order: the first `group` tiles k-chunk by k-chunk,
    then every tile's k-chunks in turn."""
    first, rest = order[:group], order[group:]
    return [(i, j, k) for k in range(gk) for i, j in first] + [
        (i, j, k) for i, j in rest for k in range(gk)
    ]


def finish_gemms(seq, load, gemm, writeback=0.0, writers=2, download=10.0):
    """(finish of the last GEMM, end of the last load, end of the last writeback), in ms: loads
    back to back in first-need order, each GEMM once its blocks are in, each tile downloaded
    (`download` ms, one at a time) after its last GEMM and written back by one of `writers`
    threads in `writeback` ms."""
    gk = max(k for _, _, k in seq) + 1
    seen, t = {}, 0.0
    for i, j, k in seq:
        for key in (("A", i, k), ("B", k, j)):
            if key not in seen:
                t += load
                seen[key] = t
    g, ends = 0.0, []
    for i, j, k in seq:
        g = max(g, seen[("A", i, k)], seen[("B", k, j)]) + gemm
        if k == gk - 1:
            ends.append(g)
    d, w, last = 0.0, [0.0] * writers, 0.0
    for e in sorted(ends):
        d = max(d, e) + download
        x = min(range(writers), key=lambda n: w[n])
        w[x] = max(w[x], d) + writeback
        last = max(last, w[x])
    return g, t, last


def serpentine(n):
    return [(i, j) for i in range(n) for j in (range(n) if i % 2 == 0 else reversed(range(n)))]


def square(n):
    """Growing squares as the engine walks them (src/pipeline/stages/queue.rs): square s's
    column part top-down, then its row part left to right."""
    o = []
    for s in range(n):
        o += [(i, s) for i in range(s)]
        o += [(s, j) for j in range(s + 1)]
    return o


def cube_bound(load_over_gemm):
    """Best order's finish over the GEMMs' time: 1 + max_f (r·f^(2/3) − f)."""
    r = load_over_gemm
    return 1 + max(r * (f / 1000) ** (2 / 3) - f / 1000 for f in range(1001))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--grid", type=int, default=4, help="tiles per side (= k-steps)")
    p.add_argument("--gemm", type=float, default=20.8, help="ms per tile GEMM")
    p.add_argument("--loads", default="34,32.4,25,20,16,12.8", help="ms per block load")
    p.add_argument("--writeback", type=float, default=69.0,
                   help="ms a writeback thread takes per finished tile (2 threads)")
    a = p.parse_args()
    n = a.grid
    ideal = n**3 * a.gemm
    print(f"{n}×{n} tiles, {n} k-steps: {n**3} GEMMs of {a.gemm} ms = {ideal:.0f} ms; {2 * n * n} loads")
    for load in map(float, a.loads.split(",")):
        cells = []
        for name, order in (("serpentine", serpentine(n)), ("square", square(n))):
            g, _ = finish(order, n, load, a.gemm)
            cells.append(f"{name} {g:.0f} ms ({ideal / g:.3f})")
        r = 2 * n * n * load / ideal
        cells.append(f"best order ≥ {ideal * cube_bound(r):.0f} ms ({1 / cube_bound(r):.3f})")
        print(f"load {load:5.1f} ms (loads/GEMMs {r:.2f}): " + ", ".join(cells))
    print(f"growing squares with a start group of the first q×q square, k-chunk by k-chunk "
          f"(last GEMM / last writeback at {a.writeback} ms a tile on 2 threads):")
    for load in map(float, a.loads.split(",")):
        cells = []
        for q in range(1, n + 1):
            g, _, w = finish_gemms(gemms(square(n), n, q * q), load, a.gemm, a.writeback)
            cells.append(f"{q}×{q}: {g:.0f} / {w:.0f} ms")
        print(f"load {load:5.1f} ms: " + ", ".join(cells))


if __name__ == "__main__":
    main()
