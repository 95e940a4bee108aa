#!/usr/bin/env python3
"""Why does page-locking a freshly written input take longer than page-locking it again?

A step right after `gen` (or after a step that wrote its input) spent 3.55 s page-locking 30 GiB
of inputs that the next run locked in 1.21 s (docs/measurements/2026-12-03b-h200-1-*.log). This
probe writes a file, then page-locks a fresh read-only map of it (`cuMemHostRegister` READ_ONLY in
32 MiB pieces, as the engine's registry does) in the states it can be in, printing the file's
dirty and under-writeback pages (`cachestat`, Linux ≥ 6.5) before each:

  fresh        just written (dirty pages)
  writeback    just written, writeback started (`sync_file_range`), not waited for
  again        the same pages locked a second time (what the second run sees)
  synced       after `fsync`
  read         after reading the file once more (as `cat` would)
  prefaulted   after `MADV_POPULATE_READ` of the map (page tables filled), 1 and THREADS threads
  beside       while another thread populates an anonymous map (the output's prefault)

Usage: first_page_lock.py DIR [SIZE_MIB] [THREADS]    (GPU machine; driver API through ctypes)
"""
import ctypes, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor

d = sys.argv[1]
size = (int(sys.argv[2]) if len(sys.argv) > 2 else 8192) << 20
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 8
piece = 32 << 20
cu = ctypes.CDLL("libcuda.so.1")
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.syscall.restype = ctypes.c_long
PROT_READ, PROT_RW, MAP_SHARED, MAP_PRIVATE_ANON = 1, 3, 1, 0x22
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23
READ_ONLY, PORTABLE = 8, 1
SYS_CACHESTAT, SYS_SYNC_FILE_RANGE = 451, 277


def ok(r, what):
    if r != 0:
        raise SystemExit(f"{what} failed: CUresult {r}")


class Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in
                ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def cachestat(fd):
    r, s = Range(0, 0), Stat()
    if libc.syscall(SYS_CACHESTAT, fd, ctypes.byref(r), ctypes.byref(s), 0) != 0:
        return f"cachestat: errno {ctypes.get_errno()}"
    g = lambda n: f"{n * 4096 / 2**30:.2f} GiB"
    return f"cached {g(s.cache)}, dirty {g(s.dirty)}, writeback {g(s.writeback)}"


ok(cu.cuInit(0), "cuInit")
dev = ctypes.c_int(); ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p(); ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
ok(cu.cuCtxSetCurrent(ctx), "set ctx")
path = os.path.join(d, "lock_probe.bin")
pieces = [(o, min(piece, size - o)) for o in range(0, size, piece)]


def write_file():
    if os.path.exists(path):
        os.unlink(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    buf = os.urandom(1 << 20) * 64
    t = time.perf_counter()
    for o in range(0, size, len(buf)):
        os.write(fd, buf[: min(len(buf), size - o)])
    print(f"wrote {size >> 20} MiB in {time.perf_counter() - t:.2f} s")
    return fd


def lock(fd, label, prefault=0, beside=False):
    """Map fresh, optionally prefault, page-lock in pieces, then unlock and unmap."""
    st = cachestat(fd)
    base = libc.mmap(None, size, PROT_READ, MAP_SHARED, fd, 0)
    tp = 0.0
    if prefault:
        t = time.perf_counter()
        with ThreadPoolExecutor(prefault) as ex:
            list(ex.map(lambda p: libc.madvise(base + p[0], p[1], MADV_POPULATE_READ), pieces))
        tp = time.perf_counter() - t
    stop = threading.Event()
    if beside:
        def populate():
            n = 4 << 30
            while not stop.is_set():
                a = libc.mmap(None, n, PROT_RW, MAP_PRIVATE_ANON, -1, 0)
                for o in range(0, n, 4 << 20):
                    if stop.is_set():
                        break
                    libc.madvise(a + o, 4 << 20, MADV_POPULATE_WRITE)
                libc.munmap(a, n)
        th = threading.Thread(target=populate); th.start()
    t = time.perf_counter()
    for o, n in pieces:
        ok(cu.cuMemHostRegister_v2(ctypes.c_void_p(base + o), ctypes.c_size_t(n), READ_ONLY | PORTABLE), "register")
    tr = time.perf_counter() - t
    if beside:
        stop.set(); th.join()
    t = time.perf_counter()
    for o, _ in pieces:
        ok(cu.cuMemHostUnregister(ctypes.c_void_p(base + o)), "unregister")
    tu = time.perf_counter() - t
    t = time.perf_counter()
    libc.munmap(base, size)
    tm = time.perf_counter() - t
    pf = f"prefault ({prefault} threads) {tp:.3f} s, " if prefault else ""
    print(f"{label:<24} {pf}lock {tr:.3f} s ({size / tr / 1e9:5.1f} GB/s), unlock {tu:.3f} s, "
          f"unmap {tm:.3f} s   [{st}]")


fd = write_file()
lock(fd, "fresh (dirty)")
lock(fd, "again")
fd = write_file()
libc.syscall(SYS_SYNC_FILE_RANGE, fd, ctypes.c_long(0), ctypes.c_long(0), 2)  # WRITE, no wait
lock(fd, "writeback started")
lock(fd, "again")
os.fsync(fd)
lock(fd, "synced")
with open(path, "rb") as f:
    while f.read(64 << 20):
        pass
lock(fd, "read once more")
lock(fd, "prefaulted", prefault=1)
lock(fd, "prefaulted", prefault=threads)
lock(fd, "plain")
lock(fd, "beside output prefault", beside=True)
lock(fd, "prefaulted, beside", prefault=threads, beside=True)
os.close(fd)
os.unlink(path)
