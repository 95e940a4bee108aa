#!/usr/bin/env python3
"""Where one fp64_emulated block's time goes on the GPU, kernel by kernel: kernels/ozaki.cu
compiled with NVRTC (through CuPy, with the options src/backend/cuda/emulate.rs uses) and
launched in emulate.rs's order with its grids, the int8 GEMMs done by torch._int_mm in the TN
layout (cuBLAS int8 → int32, as the lane's cublasGemmEx), each timed with CUDA events; then
the block's result against torch's DGEMM of the same block, element by element relative to
|A||B|, and the DGEMM's time beside it. No engine, no files: the kernels alone, so a change to
them is measured in seconds (tools/bench/fp64_emulated.sh measures the whole step).

    python3 tools/probes/ozaki_kernel_times.py --n 8192 [--reps 3]

GPU machine (torch and cupy), repository root. Prints one line per kernel (mean ms over the
reps), the element-wise total against the int8 GEMMs' total, and the accuracy check.
"""
import argparse
import math
import os
import re
import statistics

import cupy as cp
import numpy as np
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SRC = open(os.path.join(ROOT, "kernels", "ozaki.cu")).read()
# The moduli as the kernels hold them (oz_m's `return` literals, in order), not a copy.
_body = SRC[SRC.index("u32 oz_m(int l)"):]
MODULI = [int(x) for x in re.findall(r"return (\d+);", _body[:_body.index("\n}")])]


def t_of(n):
    """ozaki::t_of: the largest t with 2^(2t+2) <= M."""
    return (math.prod(MODULI[:max(n, 1)]).bit_length() - 1 - 2) // 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192, help="m = n = k of the block")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    m = n = k = args.n
    kp, np_ = -(-k // 16) * 16, -(-n // 16) * 16
    src = SRC.replace("OZ_T_TABLE", ", ".join(str(t_of(i)) for i in range(17)))
    mod = cp.RawModule(code=src, options=("--device-int128", "--fmad=false"))
    f = mod.get_function
    I, L = np.int32, np.int64
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    A = torch.randn(m, k, device=dev, dtype=torch.float64, generator=g)
    B = torch.randn(k, n, device=dev, dtype=torch.float64, generator=g)
    C = torch.zeros(m, n, device=dev, dtype=torch.float64)
    cpx = cp.from_dlpack
    qa, xa = (torch.empty(m, device=dev, dtype=torch.int32) for _ in range(2))
    qb, xb = (torch.empty(n, device=dev, dtype=torch.int32) for _ in range(2))
    sa, sb = torch.empty(m, device=dev, dtype=torch.float64), torch.empty(n, device=dev, dtype=torch.float64)
    flags = torch.zeros(4, device=dev, dtype=torch.int32)
    a_plane, b_plane = m * kp, np_ * kp
    a8 = torch.zeros(16 * a_plane, device=dev, dtype=torch.int8)
    b8 = torch.zeros(16 * b_plane, device=dev, dtype=torch.int8)
    planes = torch.empty(16 * m * n, device=dev, dtype=torch.uint8)
    # A row-major m×k: op(A) row i at i·k + p; B row-major k×n: op(B) column j at j + p·n.
    ars, aks, brs, bks = L(k), L(1), L(1), L(n)
    tiles = lambda count: (-(-count // 32), -(-kp // 32))
    grid2 = lambda ymax: (-(-n // 256), max(1, min(m, ymax)))
    P = lambda t: cpx(t)

    def gemm(l):
        a = a8[l * a_plane:l * a_plane + m * kp].view(m, kp)
        b = b8[l * b_plane:l * b_plane + np_ * kp].view(np_, kp)
        return torch._int_mm(a, b.t())  # m×np int32, row-major: emulate.rs's c32

    times = {}

    def timed(name, fn):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        r = fn()
        e.record()
        e.synchronize()
        times.setdefault(name, []).append(s.elapsed_time(e))
        return r

    for rep in range(args.reps + 1):  # the first is a warm-up, not counted
        if rep == 1:
            times.clear()
        flags.zero_()
        timed("oz_info A", lambda: f("oz_info")((m,), (256,), (P(A), I(m), I(k), ars, aks, P(qa), P(sa), P(xa), P(flags), np.uint32(1))))
        timed("oz_info B", lambda: f("oz_info")((n,), (256,), (P(B), I(n), I(k), brs, bks, P(qb), P(sb), P(xb), P(flags), np.uint32(2))))
        timed("oz_coarse A+B", lambda: (
            f("oz_coarse")(tiles(m), (32, 8), (P(A), I(m), I(k), I(kp), ars, aks, P(qa), P(xa), P(a8))),
            f("oz_coarse")(tiles(n), (32, 8), (P(B), I(n), I(k), I(kp), brs, bks, P(qb), P(xb), P(b8)))))
        c32 = timed("int8 GEMM (coarse)", lambda: gemm(0))
        timed("oz_select", lambda: f("oz_select")(grid2(256), (256,), (P(c32), I(m), I(n), I(np_), I(k), P(qa), P(sa), P(xa), P(qb), P(sb), P(xb), P(flags[1:]))))
        fl = flags.cpu().numpy().astype(np.uint32)
        assert fl[0] == 0 and fl[3] == 3, fl
        nm = int(max(1, fl[1]))
        t = t_of(nm)
        timed("oz_split A+B", lambda: (
            f("oz_split")(tiles(m), (32, 8), (P(A), I(m), I(k), I(kp), ars, aks, P(qa), I(t), I(nm), L(a_plane), P(a8))),
            f("oz_split")(tiles(n), (32, 8), (P(B), I(n), I(k), I(kp), brs, bks, P(qb), I(t), I(nm), L(b_plane), P(b8)))))
        for l in range(nm):
            c32 = timed("int8 GEMM (per modulus)", lambda: gemm(l))
            timed("oz_reduce", lambda: f("oz_reduce")(grid2(65535), (256,), (P(c32), I(m), I(n), I(np_), I(l), P(planes[l * m * n:]))))
        Mq = math.prod(MODULI[:nm])
        timed("oz_rebuild", lambda: f("oz_rebuild")(grid2(65535), (256,), (P(planes), I(nm), I(m), I(n), P(qa), P(qb), I(t), np.uint64(Mq % 2**64), np.uint64(Mq >> 64), np.float64(1.0), np.float64(0.0), P(C))))
    dgemm = []
    for _ in range(args.reps + 1):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        ref = A @ B
        e.record()
        e.synchronize()
        dgemm.append(s.elapsed_time(e))
    dg = statistics.mean(dgemm[1:])
    print(f"block {m}×{n}×{k} f64 on {torch.cuda.get_device_name(0)}, {nm} moduli, mean of {args.reps} reps (ms):")
    elem = gemms = 0.0
    for name, v in times.items():
        per = sum(v) / args.reps  # per block: every launch of this name in one block
        print(f"  {name:32s} {per:8.3f}  ({len(v) // args.reps} launches per block)")
        if "GEMM" in name:
            gemms += per
        else:
            elem += per
    flop = 2 * m * n * k
    print(f"  int8 GEMMs {gemms:.3f} ms ({(nm + 1) * flop / gemms / 1e9:.0f} TOP/s), element-wise {elem:.3f} ms "
          f"({elem / gemms:.2f} × the GEMMs): block {gemms + elem:.3f} ms = {flop / (gemms + elem) / 1e9:.1f} TFLOP/s "
          f"against torch's DGEMM {dg:.3f} ms = {flop / dg / 1e9:.1f} TFLOP/s ({dg / (gemms + elem):.2f} ×)")
    rows = torch.randperm(m, generator=torch.Generator().manual_seed(0))[:64].to(dev)
    G = A[rows].abs() @ B.abs()
    d = ((C[rows] - ref[rows]).abs() / G).max().item() / 2.0**-53
    print(f"  64 sampled rows: max |emulated − DGEMM| / (|A||B|) = {d:.2f} u "
          f"(each within (K+2)·u = {k + 2} u of the exact product: {'ok' if d <= 2 * (k + 2) else 'TOO LARGE'})")


if __name__ == "__main__":
    main()
