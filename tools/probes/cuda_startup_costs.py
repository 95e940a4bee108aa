#!/usr/bin/env python3
"""What mgmm-stream's start-up and tear-down cost on the GPU machine, piece by piece (issue 10):
cuInit, retaining each GPU's primary context (one after the other, and one thread per GPU), and
allocating / freeing COUNT pinned buffers of SIZE MiB (cuMemHostAlloc PORTABLE, as the engine
does) from 1 thread and from several. Driver API through ctypes (ctypes releases the GIL, so
threads run in parallel). Prints one line per measurement.
Usage: cuda_startup_costs.py [COUNT] [SIZE_MIB]
"""
import ctypes, sys, time
from concurrent.futures import ThreadPoolExecutor

count = int(sys.argv[1]) if len(sys.argv) > 1 else 18
size = (int(sys.argv[2]) if len(sys.argv) > 2 else 256) << 20
cu = ctypes.CDLL("libcuda.so.1")


def ok(r, what):
    if r != 0:
        raise SystemExit(f"{what} failed: CUresult {r}")


t = time.perf_counter(); ok(cu.cuInit(0), "cuInit"); print(f"cuInit: {time.perf_counter() - t:.3f} s")
n = ctypes.c_int(); ok(cu.cuDeviceGetCount(ctypes.byref(n)), "count")
ctxs = {}


def retain(i):
    dev = ctypes.c_int(); ok(cu.cuDeviceGet(ctypes.byref(dev), i), "cuDeviceGet")
    c = ctypes.c_void_p(); t = time.perf_counter()
    ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev), "retain")
    ctxs[i] = (c, dev)
    return time.perf_counter() - t


t = time.perf_counter()
with ThreadPoolExecutor(n.value) as ex:
    each = list(ex.map(retain, range(n.value)))
print(f"retain {n.value} primary contexts, one thread each: {time.perf_counter() - t:.3f} s (each {', '.join(f'{x:.3f}' for x in each)})")
ctx0 = ctxs[0][0]
PORTABLE = 1


def alloc(_):
    ok(cu.cuCtxSetCurrent(ctx0), "set ctx")
    p = ctypes.c_void_p()
    ok(cu.cuMemHostAlloc(ctypes.byref(p), ctypes.c_size_t(size), PORTABLE), "cuMemHostAlloc")
    return p


def free(p):
    ok(cu.cuCtxSetCurrent(ctx0), "set ctx")
    ok(cu.cuMemFreeHost(p), "cuMemFreeHost")


gib = count * size / 2**30
for threads in (1, 2, 4, 8, 16):
    with ThreadPoolExecutor(threads) as ex:
        t = time.perf_counter(); ps = list(ex.map(alloc, range(count))); ta = time.perf_counter() - t
        t = time.perf_counter(); list(ex.map(free, ps)); tf = time.perf_counter() - t
    print(f"pinned {count}×{size >> 20} MiB ({gib:.2f} GiB), {threads:2d} threads: alloc {ta:.3f} s ({gib / ta:.1f} GiB/s), free {tf:.3f} s")
# Pinning malloc'd memory instead (cuMemHostRegister), for comparison.
libc = ctypes.CDLL("libc.so.6"); libc.aligned_alloc.restype = ctypes.c_void_p


def reg(_):
    ok(cu.cuCtxSetCurrent(ctx0), "set ctx")
    p = libc.aligned_alloc(ctypes.c_size_t(1 << 21), ctypes.c_size_t(size))
    ok(cu.cuMemHostRegister_v2(ctypes.c_void_p(p), ctypes.c_size_t(size), PORTABLE), "register")
    return p


def unreg(p):
    ok(cu.cuCtxSetCurrent(ctx0), "set ctx")
    ok(cu.cuMemHostUnregister(ctypes.c_void_p(p)), "unregister"); libc.free(ctypes.c_void_p(p))


for threads in (1, 8):
    with ThreadPoolExecutor(threads) as ex:
        t = time.perf_counter(); ps = list(ex.map(reg, range(count))); ta = time.perf_counter() - t
        t = time.perf_counter(); list(ex.map(unreg, ps)); tf = time.perf_counter() - t
    print(f"malloc+register {count}×{size >> 20} MiB, {threads:2d} threads: {ta:.3f} s ({gib / ta:.1f} GiB/s), unregister+free {tf:.3f} s")
# Pinning memory the process populated itself, in 2 MiB transparent huge pages where the
# kernel gives them: anonymous mmap, MADV_HUGEPAGE, MADV_POPULATE_WRITE (one thread per
# buffer), then cuMemHostRegister. Populating and registering are timed apart.
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23
try:
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
except OSError:
    thp = "unknown"
print(f"transparent huge pages: {thp}")


def populate(huge):
    p = libc.mmap(None, size, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|MAP_ANONYMOUS
    if huge:
        libc.madvise(p, size, MADV_HUGEPAGE)
    if libc.madvise(p, size, MADV_POPULATE_WRITE) != 0:
        ctypes.memset(p, 0, size)
    return p


def register(p):
    ok(cu.cuCtxSetCurrent(ctx0), "set ctx")
    ok(cu.cuMemHostRegister_v2(ctypes.c_void_p(p), ctypes.c_size_t(size), PORTABLE), "register")


def unregister(p):
    ok(cu.cuCtxSetCurrent(ctx0), "set ctx")
    ok(cu.cuMemHostUnregister(ctypes.c_void_p(p)), "unregister"); libc.munmap(p, size)


for huge in (False, True):
    for threads in (1, 8):
        with ThreadPoolExecutor(threads) as ex:
            t = time.perf_counter(); ps = list(ex.map(populate, [huge] * count)); tp = time.perf_counter() - t
            t = time.perf_counter(); list(ex.map(register, ps)); tr = time.perf_counter() - t
            t = time.perf_counter(); list(ex.map(unregister, ps)); tu = time.perf_counter() - t
        kind = "huge pages" if huge else "4 KiB pages"
        print(f"mmap+populate ({kind}) then register, {count}×{size >> 20} MiB, {threads:2d} threads: populate {tp:.3f} s, register {tr:.3f} s ({gib / (tp + tr):.1f} GiB/s together), unregister+unmap {tu:.3f} s")
