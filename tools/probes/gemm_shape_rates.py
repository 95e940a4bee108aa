#!/usr/bin/env python3
"""What one cuBLAS GEMM of each tile shape runs at on this GPU, in core, so a tile shape can be
chosen by measured rate rather than guessed (issue 35: the engine's 8192³ fp32 tiles ran at
≈ 46 TFLOP/s in a step where torch's one 32768² GEMM ran at 53). No engine, no files: torch's
`mm` (cuBLAS) on device buffers of each shape, `beta = 0` (`mm`) and accumulating into the
output (`addmm_`, the engine's k-blocks after the first), timed with CUDA events over a few
reps after one untimed call.

    python3 tools/probes/gemm_shape_rates.py [--dtype f32 f64] [--reps 5]

GPU machine (torch), repository root. One line per dtype and shape: ms per GEMM and TFLOP/s.
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


def rate(m, n, k, dt, reps, accumulate):
    a = torch.randn(m, k, device="cuda", dtype=dt)
    b = torch.randn(k, n, device="cuda", dtype=dt)
    c = torch.zeros(m, n, device="cuda", dtype=dt)
    f = (lambda: c.addmm_(a, b)) if accumulate else (lambda: torch.mm(a, b, out=c))
    f()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        f()
    e.record()
    e.synchronize()
    ms = s.elapsed_time(e) / reps
    del a, b, c
    torch.cuda.empty_cache()
    return ms, 2.0 * m * n * k / (ms * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", nargs="+", default=["f32", "f64"], choices=list(DT))
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print("GPU", torch.cuda.get_device_name(), "torch", torch.__version__)
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
