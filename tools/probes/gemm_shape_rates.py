#!/usr/bin/env python3
"""What one cuBLAS GEMM of each tile shape runs at on this GPU, in core, so a tile shape can be
chosen by measured rate rather than guessed (issue 35: the engine's 8192³ fp32 tiles ran at
≈ 46 TFLOP/s in a step where torch's one 32768² GEMM ran at 53). No engine, no files: torch's
`mm` (cuBLAS) on device buffers of each shape, `beta = 0` (`mm`) and accumulating into the
output (`addmm_`, the engine's k-blocks after the first), timed with CUDA events over a few
reps after one untimed call.

    python3 tools/probes/gemm_shape_rates.py [--dtype f32 f64] [--reps 5]

GPU machine (torch), repository root. One line per dtype and shape: ms per GEMM and TFLOP/s.

    python3 tools/probes/gemm_shape_rates.py --walk 32768 8192 [--streams 1 2 3]

A step's GEMMs as the engine issues them, in core: the N×N product (N = 32768) walked as
(N/T)² output tiles of T×T, each T×T×T k-chunk one GEMM accumulating into its tile, tile after
tile, on 1, 2 or 3 CUDA streams (tile i on stream i mod S, so one tile's GEMMs stay in order
while the next tile's may fill the SMs the last wave of the previous leaves idle), against one
N³ GEMM. The question: is the tile GEMMs' shortfall against the one big call (≈ 3 % for fp32 at
8192³) their tails, which a second stream would fill.
"""
import argparse

import torch

SHAPES = [  # (m, n, k): the engine's tile shapes and the one-GEMM reference
    (8192, 8192, 8192),
    (8192, 8192, 16384),
    (8192, 8192, 32768),
    (16384, 16384, 8192),
    (16384, 8192, 8192),
    (16384, 16384, 16384),
    (30000, 30000, 30000),
    (32768, 32768, 32768),
]
DT = {"f32": torch.float32, "f64": torch.float64, "tf32": torch.float32, "bf16": torch.bfloat16}


def timed(f, reps, flop):
    """(ms per call, TFLOP/s) of `f` (`flop` per call), by CUDA events over `reps` calls after
    one untimed call."""
    f()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        f()
    e.record()
    e.synchronize()
    ms = s.elapsed_time(e) / reps
    return ms, flop / (ms * 1e-3) / 1e12


def rate(m, n, k, dt, reps, accumulate):
    a = torch.randn(m, k, device="cuda", dtype=dt)
    b = torch.randn(k, n, device="cuda", dtype=dt)
    c = torch.zeros(m, n, device="cuda", dtype=dt)
    f = (lambda: c.addmm_(a, b)) if accumulate else (lambda: torch.mm(a, b, out=c))
    r = timed(f, reps, 2.0 * m * n * k)
    del a, b, c
    torch.cuda.empty_cache()
    return r


def walk(n, t, dt, streams, reps, paired=False):
    """(ms, TFLOP/s) of the tiled walk of an n³ product in t³ GEMMs on `streams` streams;
    `paired`: `streams` tiles at a time, k-chunk by k-chunk (each tile's GEMMs on its stream),
    so that every GEMM's tail may overlap another tile's GEMM, not only each tile's last."""
    g = n // t
    a = [torch.randn(t, t, device="cuda", dtype=dt) for _ in range(g)]  # A's k-blocks (reused)
    b = [torch.randn(t, t, device="cuda", dtype=dt) for _ in range(g)]
    accs = [torch.zeros(t, t, device="cuda", dtype=dt) for _ in range(streams * 2)]
    ss = [torch.cuda.current_stream()] + [torch.cuda.Stream() for _ in range(streams - 1)]

    def once():
        main = torch.cuda.current_stream()
        for s in ss[1:]:
            s.wait_stream(main)
        order = []  # (tile, k-chunk) in issue order
        if paired:
            for t0 in range(0, g * g, streams):
                for kk in range(g):
                    order += [(tile, kk) for tile in range(t0, min(t0 + streams, g * g))]
        else:
            order = [(tile, kk) for tile in range(g * g) for kk in range(g)]
        for tile, kk in order:
            c = accs[tile % len(accs)]
            with torch.cuda.stream(ss[tile % streams]):
                if kk == 0:
                    torch.mm(a[kk], b[kk], out=c)
                else:
                    c.addmm_(a[kk], b[kk])
        for s in ss[1:]:
            main.wait_stream(s)

    r = timed(once, reps, 2.0 * n**3)
    del a, b, accs
    torch.cuda.empty_cache()
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", nargs="+", default=["f32", "f64"], choices=list(DT))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--walk", nargs=2, type=int, metavar=("N", "T"))
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 2])
    args = ap.parse_args()
    print("GPU", torch.cuda.get_device_name(), "torch", torch.__version__)
    if args.walk:
        n, t = args.walk
        for name in args.dtype:
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            ms, r = rate(n, n, n, DT[name], 2, False)
            print(f"{name:4} one {n}³ GEMM: {ms:8.2f} ms {r:6.1f} TFLOP/s", flush=True)
            for _ in range(2):  # twice, interleaved: the GPU's clocks drift
                for s in args.streams:
                    for paired in (False, True) if s > 1 else (False,):
                        ms, r = walk(n, t, DT[name], s, 2, paired)
                        how = f"{s} tiles at a time" if paired else "tile by tile"
                        print(f"{name:4} walk {n}² in {t}³ GEMMs on {s} stream(s), {how}: "
                              f"{ms:8.2f} ms {r:6.1f} TFLOP/s", flush=True)
        return
    for name in args.dtype:
        torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
        for m, n, k in SHAPES:
            big = m * n * k >= 30000**3
            reps = max(1, args.reps // 2) if big else args.reps
            ms0, r0 = rate(m, n, k, DT[name], reps, False)
            ms1, r1 = rate(m, n, k, DT[name], reps, True)
            print(f"{name:4} m={m:5} n={n:5} k={k:5}: beta=0 {ms0:8.2f} ms {r0:6.1f} TFLOP/s"
                  f" | accumulate {ms1:8.2f} ms {r1:6.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
