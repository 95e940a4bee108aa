#!/usr/bin/env python3
"""How long a process that used the GPU takes to end, by what it held (issue 10: the ~0.3 s that
pass between mgmm-stream's report and its exit, even with `_exit`).

Does MODE's work, prints `done <epoch seconds>` and calls `os._exit(0)` (no clean-up of ours),
so the caller can subtract that from the time it sees the process end. Modes, each including the
one before it:
  python   nothing (interpreter start and exit)
  init     cuInit
  ctx      retain the primary context of GPU 0
  blas     cublasCreate and one 8192² SGEMM
  pinned   cuMemHostAlloc PINNED_GIB of page-locked memory (touched)
  devmem   cuMemAlloc 40 GiB of device memory
Usage: exit_probe.py MODE [PINNED_GIB]
"""
import ctypes, os, sys, time

mode = sys.argv[1]
gib = float(sys.argv[2]) if len(sys.argv) > 2 else 4.5
order = ["python", "init", "ctx", "blas", "pinned", "devmem"]
level = order.index(mode)


def ok(r, what):
    if r != 0:
        raise SystemExit(f"{what} failed: {r}")


t0 = time.time()
if level >= 1:
    cu = ctypes.CDLL("libcuda.so.1")
    ok(cu.cuInit(0), "cuInit")
if level >= 2:
    dev = ctypes.c_int(); ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p(); ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
    ok(cu.cuCtxSetCurrent(ctx), "set ctx")
if level >= 3:
    blas = ctypes.CDLL("libcublas.so.13")
    h = ctypes.c_void_p(); ok(blas.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
    n = 8192
    bufs = []
    for _ in range(3):
        p = ctypes.c_uint64(); ok(cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n * n * 4)), "alloc"); bufs.append(p)
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    ok(blas.cublasSgemm_v2(h, 0, 0, n, n, n, ctypes.byref(one), ctypes.c_void_p(bufs[0].value), n,
                           ctypes.c_void_p(bufs[1].value), n, ctypes.byref(zero), ctypes.c_void_p(bufs[2].value), n), "sgemm")
    ok(cu.cuCtxSynchronize(), "sync")
if level >= 4:
    p = ctypes.c_void_p(); size = int(gib * (1 << 30))
    ok(cu.cuMemHostAlloc(ctypes.byref(p), ctypes.c_size_t(size), 1), "cuMemHostAlloc")
    ctypes.memset(p, 1, size)
if level >= 5:
    big = ctypes.c_uint64(); ok(cu.cuMemAlloc_v2(ctypes.byref(big), ctypes.c_size_t(40 << 30)), "devmem")
t1 = time.time()
print(f"done {t1:.6f} work {t1 - t0:.3f}", flush=True)
os._exit(0)
