#!/usr/bin/env python3
"""What bounds `verify`'s dense pass on a GPU, band by band (issue 35)? Its CUDA fold
(src/backend/cuda/fold.rs) takes bands of about 32 MiB of op(A)'s stored rows (h = 256 rows of
a 32768-column f32 matrix), copies each up, widens it to f64 and runs three skinny DGEMMs
against the right-hand sides of the pass over op(B): h × K times K × rg (rounds · groups
columns) and twice h × K times K × g. Those DGEMMs have few output tiles (256 × 64) and a deep
K; if cuBLAS runs them slowly, the DGEMMs, not the copies, set the pass's pace.

This probe times, with torch (cuBLAS) on one GPU, per band shape: the H2D copy of the f32
band from pinned memory, its widening to f64, and the three DGEMMs (band @ Z, row-major as
the fold issues them), and the same DGEMMs with the band stacked 4 and 16 times deeper (more
rows per GEMM). Prints ms per band and the whole pass's time for a 32768² A (128 bands).

  python3 tools/probes/verify_band_dgemm.py [--k 32768] [--h 256 1024] [--rg 64] [--g 32]
"""
import argparse

import torch


def timed(f, reps):
    f()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        f()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=32768)
    p.add_argument("--h", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--rg", type=int, default=64)
    p.add_argument("--g", type=int, default=32)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; K = {a.k}, rg = {a.rg}, g = {a.g}; ms per call")
    z = torch.randn(a.k, a.rg, dtype=torch.float64, device=dev)
    zg = torch.randn(a.k, a.g, dtype=torch.float64, device=dev)
    for h in a.h:
        host = torch.randn(h, a.k, dtype=torch.float32).pin_memory()
        band = torch.empty(h, a.k, dtype=torch.float32, device=dev)
        wide = torch.empty(h, a.k, dtype=torch.float64, device=dev)
        out = torch.zeros(h, a.rg, dtype=torch.float64, device=dev)
        outg = torch.zeros(h, a.g, dtype=torch.float64, device=dev)
        cp = timed(lambda: band.copy_(host, non_blocking=True), a.reps)
        wd = timed(lambda: wide.copy_(band), a.reps)
        g1 = timed(lambda: out.addmm_(wide, z), a.reps)
        g2 = timed(lambda: outg.addmm_(wide, zg), a.reps)
        # The transposed pass: op(A) = Aᵀ, K = the band's h rows, M = the columns.
        outt = torch.zeros(a.k, a.rg, dtype=torch.float64, device=dev)
        gt = timed(lambda: outt.addmm_(wide.t(), z[:h]), a.reps)
        bands = a.k * a.k // (h * a.k)
        per = cp + wd + g1 + 2 * g2
        mb = h * a.k * 4 / 2**20
        print(f"h {h:5} ({mb:.0f} MiB): copy {cp:.3f} ({mb / 1024 / cp * 1e3:.1f} GiB/s), widen {wd:.3f}, "
              f"DGEMM rg {g1:.3f} ({2 * h * a.k * a.rg / g1 / 1e9:.2f} TFLOP/s), g {g2:.3f} ×2; "
              f"transposed rg {gt:.3f}; band {per:.3f} ms, {bands} bands {per * bands / 1e3:.3f} s "
              f"(copies alone {cp * bands / 1e3:.3f} s)")


if __name__ == "__main__":
    main()
