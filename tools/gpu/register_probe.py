#!/usr/bin/env python3
"""Does page-locking inputs cost more with two GPUs, and which flags or threads avoid it?

On two H200s the engine page-locked 8 GiB of a 32768² step's inputs in 0.71–0.84 s against
0.24–0.37 s on one GPU of the same host (BENCHMARKS.md §25), and the tf32/bf16 steps became
slower on two GPUs than on one. The engine registers 32 MiB pieces of the files' read-only maps
with `cuMemHostRegister(PORTABLE | READ_ONLY)` from each lane's staging thread. This probe
registers an input-sized file the same way, with the contexts of one or of every GPU alive, with
and without PORTABLE (a registration only the current context sees), and on one or on one thread
per GPU (each in its own GPU's context), printing GB/s for locking and unlocking.

Usage: register_probe.py DIR [SIZE_MIB]    (GPU machine; driver API through ctypes)
"""
import ctypes, os, sys, threading, time

d = sys.argv[1]
size = (int(sys.argv[2]) if len(sys.argv) > 2 else 8192) << 20
piece = 32 << 20
cu = ctypes.CDLL("libcuda.so.1")
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PROT_READ, MAP_SHARED = 1, 1
READ_ONLY, PORTABLE = 8, 1


def ok(r, what):
    if r != 0:
        raise SystemExit(f"{what} failed: CUresult {r}")


ok(cu.cuInit(0), "cuInit")
n = ctypes.c_int(); ok(cu.cuDeviceGetCount(ctypes.byref(n)), "count"); ngpu = n.value
ctxs = []


def ctx(i):
    """GPU i's primary context, retained (created) on first use."""
    while len(ctxs) <= i:
        dev = ctypes.c_int(); ok(cu.cuDeviceGet(ctypes.byref(dev), len(ctxs)), "cuDeviceGet")
        c = ctypes.c_void_p(); ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev), "retain")
        ctxs.append(c)
    return ctxs[i]


path = os.path.join(d, "register_probe.bin")
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
buf = os.urandom(1 << 20) * 64
for o in range(0, size, len(buf)):
    os.write(fd, buf[: min(len(buf), size - o)])
os.fsync(fd)
pieces = [(o, min(piece, size - o)) for o in range(0, size, piece)]


def lock(label, flags, threads, first_ctx=0):
    """Register every piece (thread t takes every threads-th piece, in GPU t's context), then
    unregister; a fresh map each time."""
    base = libc.mmap(None, size, PROT_READ, MAP_SHARED, fd, 0)

    def part(t, fn):
        ok(cu.cuCtxSetCurrent(ctx((first_ctx + t) % max(len(ctxs), 1))), "set ctx")
        for o, n in pieces[t::threads]:
            fn(o, n)

    def run(fn):
        ths = [threading.Thread(target=part, args=(t, fn)) for t in range(threads)]
        t0 = time.perf_counter()
        [th.start() for th in ths]; [th.join() for th in ths]
        return time.perf_counter() - t0

    tr = run(lambda o, n: ok(cu.cuMemHostRegister_v2(ctypes.c_void_p(base + o), ctypes.c_size_t(n), flags), "register"))
    tu = run(lambda o, n: ok(cu.cuMemHostUnregister(ctypes.c_void_p(base + o)), "unregister"))
    libc.munmap(base, size)
    print(f"{label:<44} lock {tr:.3f} s ({size / tr / 1e9:5.1f} GB/s), unlock {tu:.3f} s", flush=True)


# Warm: the first lock of freshly written pages is slower (BENCHMARKS.md §20).
ctx(0)
lock("warm-up (1 context)", READ_ONLY | PORTABLE, 1)
for rep in range(2):
    lock("1 context alive, PORTABLE|RO, 1 thread", READ_ONLY | PORTABLE, 1)
    lock("1 context alive, RO, 1 thread", READ_ONLY, 1)
if ngpu >= 2:
    for i in range(ngpu):
        ctx(i)
    for rep in range(2):
        lock(f"{ngpu} contexts alive, PORTABLE|RO, 1 thread", READ_ONLY | PORTABLE, 1)
        lock(f"{ngpu} contexts alive, RO (ctx 0 only), 1 thread", READ_ONLY, 1)
        lock(f"{ngpu} contexts alive, PORTABLE|RO, {ngpu} threads", READ_ONLY | PORTABLE, ngpu)
        lock(f"{ngpu} contexts alive, RO, {ngpu} threads (own ctx)", READ_ONLY, ngpu)
        lock(f"{ngpu} contexts alive, PORTABLE|RO, 4 threads", READ_ONLY | PORTABLE, 4)
os.close(fd); os.unlink(path)
