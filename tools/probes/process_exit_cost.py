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
Two more, each `blas` plus one thing (what mgmm-stream holds instead of cuMemHostAlloc'ed memory):
  reg      PINNED_GIB of anonymous memory, populated, then cuMemHostRegister'ed (its pinned pools)
  regfile  a read-only map of FILE, cuMemHostRegister'ed with READ_ONLY (staging = "direct")
With --free, the probe releases what it registered before printing `done` (unregister, unmap)
and prints how long that took, so release and exit can be told apart.
Usage: process_exit_cost.py MODE [PINNED_GIB | FILE] [--free]
"""
import ctypes, os, sys, time

args = [a for a in sys.argv[1:] if a != "--free"]
free = "--free" in sys.argv
mode = args[0]
extra = mode in ("reg", "regfile")
gib = float(args[1]) if len(args) > 1 and mode != "regfile" else 4.5
order = ["python", "init", "ctx", "blas", "pinned", "devmem"]
level = 3 if extra else order.index(mode)


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
freed = 0.0
if extra:
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    if mode == "reg":
        size = int(gib * (1 << 30))
        addr = libc.mmap(None, size, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
        ctypes.memset(addr, 1, size)
        flags = 1  # PORTABLE
    else:
        fd = os.open(args[1], os.O_RDONLY); size = os.fstat(fd).st_size
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        flags = 1 | 8  # PORTABLE | READ_ONLY
    tr = time.time()
    ok(cu.cuMemHostRegister_v2(ctypes.c_void_p(addr), ctypes.c_size_t(size), flags), "cuMemHostRegister")
    print(f"registered {size / 2**30:.2f} GiB in {time.time() - tr:.3f} s", flush=True)
    if free:
        tf = time.time()
        ok(cu.cuMemHostUnregister(ctypes.c_void_p(addr)), "cuMemHostUnregister")
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
        freed = time.time() - tf
t1 = time.time()
print(f"done {t1:.6f} work {t1 - t0:.3f} freed {freed:.3f}", flush=True)
os._exit(0)
