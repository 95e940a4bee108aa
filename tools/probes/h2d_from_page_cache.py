#!/usr/bin/env python3
"""Can the GPU copy input tiles straight out of the page cache? (issue 10: staging-bound tf32/bf16)

The engine copies every input tile from the memory-mapped file into a pinned buffer ("staging")
before the host-to-device copy. This probe asks whether the driver can instead page-lock the
file's own mapping (`cuMemHostRegister` with `CU_MEMHOSTREGISTER_READ_ONLY` on a read-only
`MAP_SHARED` map of a file in the page cache) and DMA from it, and what that costs against the
copy it would replace:

  * registering SIZE_MIB of the mapped file in pieces of PIECE_MIB, from 1 and from THREADS threads
  * unregistering it
  * H2D from the registered map, from a pinned buffer, and from the unregistered map (pageable)
  * memcpy from the map into a pinned buffer with THREADS threads (what staging does today)

Driver API through ctypes (calls release the GIL, so threads run in parallel).
Usage: h2d_from_page_cache.py FILE [SIZE_MIB] [PIECE_MIB] [THREADS]
"""
import ctypes, os, sys, time
from concurrent.futures import ThreadPoolExecutor

path = sys.argv[1]
size = (int(sys.argv[2]) if len(sys.argv) > 2 else 4096) << 20
piece = (int(sys.argv[3]) if len(sys.argv) > 3 else 256) << 20
threads = int(sys.argv[4]) if len(sys.argv) > 4 else 8
cu = ctypes.CDLL("libcuda.so.1")
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.memcpy.restype = ctypes.c_void_p
libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
PROT_READ, MAP_SHARED = 1, 1
READ_ONLY, PORTABLE = 8, 1


def ok(r, what):
    if r != 0:
        name = ctypes.c_char_p()
        cu.cuGetErrorName(r, ctypes.byref(name))
        raise SystemExit(f"{what} failed: CUresult {r} {name.value}")


def gbs(n, s):
    return f"{n / s / 1e9:6.1f} GB/s"


fd = os.open(path, os.O_RDONLY)
if os.fstat(fd).st_size < size:
    raise SystemExit(f"{path} is smaller than {size >> 20} MiB")
base = libc.mmap(None, size, PROT_READ, MAP_SHARED, fd, 0)
if base in (None, ctypes.c_void_p(-1).value):
    raise SystemExit(f"mmap failed: errno {ctypes.get_errno()}")

ok(cu.cuInit(0), "cuInit")
dev = ctypes.c_int(); ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p(); ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
ok(cu.cuCtxSetCurrent(ctx), "set ctx")
attr = ctypes.c_int()
ok(cu.cuDeviceGetAttribute(ctypes.byref(attr), 113, dev), "attribute")
print(f"READ_ONLY_HOST_REGISTER_SUPPORTED: {attr.value}")
print(f"file {path}, {size >> 20} MiB mapped read-only, pieces {piece >> 20} MiB, {threads} threads")
pieces = [(o, min(piece, size - o)) for o in range(0, size, piece)]


def setcur():
    ok(cu.cuCtxSetCurrent(ctx), "set ctx")


def reg(p, flags=READ_ONLY | PORTABLE):
    setcur()
    ok(cu.cuMemHostRegister_v2(ctypes.c_void_p(base + p[0]), ctypes.c_size_t(p[1]), flags), "cuMemHostRegister")


def unreg(p):
    setcur()
    ok(cu.cuMemHostUnregister(ctypes.c_void_p(base + p[0])), "cuMemHostUnregister")


# Without READ_ONLY the driver should refuse a read-only map.
r = cu.cuMemHostRegister_v2(ctypes.c_void_p(base), ctypes.c_size_t(piece), PORTABLE)
print(f"register without READ_ONLY: CUresult {r}")
if r == 0:
    unreg(pieces[0])

dptr = ctypes.c_uint64()
ok(cu.cuMemAlloc_v2(ctypes.byref(dptr), ctypes.c_size_t(size)), "cuMemAlloc")
pinned = ctypes.c_void_p()
ok(cu.cuMemHostAlloc(ctypes.byref(pinned), ctypes.c_size_t(size), PORTABLE), "cuMemHostAlloc")
ctypes.memset(pinned, 1, size)


def h2d(src):
    ok(cu.cuCtxSynchronize(), "sync")
    t = time.perf_counter()
    for o, n in pieces:
        ok(cu.cuMemcpyHtoD_v2(ctypes.c_uint64(dptr.value + o), ctypes.c_void_p(src + o), ctypes.c_size_t(n)), "H2D")
    ok(cu.cuCtxSynchronize(), "sync")
    return time.perf_counter() - t


for rep in range(2):
    t = time.perf_counter()
    for p in pieces:
        reg(p)
    t_reg1 = time.perf_counter() - t
    t_h2d = h2d(base)
    t = time.perf_counter()
    for p in pieces:
        unreg(p)
    t_unreg1 = time.perf_counter() - t
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(reg, pieces))
    t_regn = time.perf_counter() - t
    t_h2d2 = h2d(base)
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(unreg, pieces))
    t_unregn = time.perf_counter() - t
    print(f"rep {rep}: register 1 thread {t_reg1:.3f} s ({gbs(size, t_reg1)}), {threads} threads "
          f"{t_regn:.3f} s ({gbs(size, t_regn)}); unregister 1 thread {t_unreg1:.3f} s, "
          f"{threads} threads {t_unregn:.3f} s; H2D from the registered map {gbs(size, t_h2d)}, {gbs(size, t_h2d2)}")

t_pin = h2d(pinned.value)
t_page = h2d(base)
print(f"H2D from a pinned buffer {gbs(size, t_pin)}; from the unregistered map (pageable) {gbs(size, t_page)}")


def cp(p):
    libc.memcpy(pinned.value + p[0], base + p[0], p[1])


small = [(o, min(4 << 20, size - o)) for o in range(0, size, 4 << 20)]
for n in (1, threads, 16):
    t = time.perf_counter()
    with ThreadPoolExecutor(n) as ex:
        list(ex.map(cp, small))
    dt = time.perf_counter() - t
    print(f"memcpy map -> pinned, {n} threads, 4 MiB pieces: {dt:.3f} s ({gbs(size, dt)})")
