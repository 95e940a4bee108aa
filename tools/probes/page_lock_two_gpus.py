#!/usr/bin/env python3
"""Does page-locking inputs cost more with two GPUs, and which flags or threads avoid it?

On two H200s the engine page-locked 8 GiB of a 32768² step's inputs in 0.71–0.84 s against
0.24–0.37 s on one GPU of the same host (docs/measurements/HISTORY.md §25), and the tf32/bf16 steps became
slower on two GPUs than on one. The engine registers 32 MiB pieces of the files' read-only maps
with `cuMemHostRegister(PORTABLE | READ_ONLY)` from each lane's staging thread. This probe
registers an input-sized file the same way, with the contexts of one or of every GPU alive, with
and without PORTABLE (a registration only the current context sees), and on one or on one thread
per GPU (each in its own GPU's context), printing GB/s for locking and unlocking.

Two more modes ask whether the cost can be moved or split:
  late   register everything with only GPU 0's context alive, then create GPU 1's context (timed)
         and copy the whole registered file to GPU 1 (does a later context see the pages, and
         what does creating it cost now?), then register a fresh map with both alive to compare;
  procs  one process per GPU (CUDA_VISIBLE_DEVICES), each registering its half of the file at the
         same time: does the driver serialise across processes too?

Usage: page_lock_two_gpus.py DIR [SIZE_MIB] [flags|late|procs]   (GPU machine; driver API, ctypes)
"""
import ctypes, os, sys, threading, time

d = sys.argv[1]
size = (int(sys.argv[2]) if len(sys.argv) > 2 else 8192) << 20
mode = sys.argv[3] if len(sys.argv) > 3 else "flags"
if mode == "half":  # a child of `procs`: register its half of the parent's file, print seconds
    pass
elif mode not in ("flags", "late", "procs"):
    raise SystemExit(f"unknown mode {mode!r}: use flags, late or procs")
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
if mode == "half":
    # argv: DIR SIZE half INDEX COUNT; the parent wrote the file and waits on stdin's close.
    idx, cnt = int(sys.argv[4]), int(sys.argv[5])
    fd = os.open(path, os.O_RDONLY)
    base = libc.mmap(None, size, PROT_READ, MAP_SHARED, fd, 0)
    mine = [(o, min(piece, size - o)) for o in range(0, size, piece)][idx::cnt]
    ok(cu.cuCtxSetCurrent(ctx(0)), "set ctx 0")
    for o, n in mine:  # warm: the first lock of fresh pages is slower
        ok(cu.cuMemHostRegister_v2(ctypes.c_void_p(base + o), ctypes.c_size_t(n), READ_ONLY | PORTABLE), "register")
    for o, n in mine:
        ok(cu.cuMemHostUnregister(ctypes.c_void_p(base + o)), "unregister")
    print("ready", flush=True); sys.stdin.readline()
    t0 = time.perf_counter()
    for o, n in mine:
        ok(cu.cuMemHostRegister_v2(ctypes.c_void_p(base + o), ctypes.c_size_t(n), READ_ONLY | PORTABLE), "register")
    t = time.perf_counter() - t0
    print(f"{t:.4f} {t0:.6f}", flush=True)
    sys.exit()
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


if mode == "procs":
    import subprocess
    kids = [subprocess.Popen([sys.executable, __file__, d, str(size >> 20), "half", str(i), str(ngpu)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "CUDA_VISIBLE_DEVICES": str(i)}) for i in range(ngpu)]
    for k in kids:
        assert k.stdout.readline().strip() == "ready"
    for k in kids:
        k.stdin.write("go\n"); k.stdin.flush()
    res = [tuple(map(float, k.stdout.readline().split())) for k in kids]
    [k.wait() for k in kids]
    t_all = max(t0 + t for t, t0 in res) - min(t0 for _, t0 in res)
    for i, (t, _) in enumerate(res):
        print(f"process {i} (GPU {i} only): its {size // ngpu >> 20} MiB locked in {t:.3f} s ({size / ngpu / t / 1e9:5.1f} GB/s)")
    print(f"{ngpu} processes together: {size >> 20} MiB in {t_all:.3f} s ({size / t_all / 1e9:5.1f} GB/s)", flush=True)
    os.close(fd); os.unlink(path); sys.exit()

if mode == "late":
    ok(cu.cuCtxSetCurrent(ctx(0)), "set ctx 0")
    # warm-up lock, then keep a registration made with only GPU 0's context alive
    base = libc.mmap(None, size, PROT_READ, MAP_SHARED, fd, 0)
    for rep in ("warm-up", "kept"):
        t0 = time.perf_counter()
        for o, n in pieces:
            ok(cu.cuMemHostRegister_v2(ctypes.c_void_p(base + o), ctypes.c_size_t(n), READ_ONLY | PORTABLE), "register")
        tr = time.perf_counter() - t0
        print(f"1 context alive, PORTABLE|RO ({rep}): lock {tr:.3f} s ({size / tr / 1e9:5.1f} GB/s)", flush=True)
        if rep == "warm-up":
            for o, n in pieces:
                ok(cu.cuMemHostUnregister(ctypes.c_void_p(base + o)), "unregister")
    if ngpu >= 2:
        t0 = time.perf_counter(); ctx(1); tc = time.perf_counter() - t0
        ok(cu.cuCtxSetCurrent(ctx(1)), "set ctx 1")
        dptr = ctypes.c_uint64(); ok(cu.cuMemAlloc_v2(ctypes.byref(dptr), ctypes.c_size_t(piece)), "alloc on GPU 1")
        t0 = time.perf_counter()
        r = 0
        for o, n in pieces:
            r = cu.cuMemcpyHtoD_v2(dptr, ctypes.c_void_p(base + o), ctypes.c_size_t(n))
            if r != 0:
                break
        tcp = time.perf_counter() - t0
        print(f"GPU 1's context created after: {tc:.3f} s; copy of the registered file to GPU 1: "
              + (f"{tcp:.3f} s ({size / tcp / 1e9:5.1f} GB/s)" if r == 0 else f"failed, CUresult {r}"), flush=True)
        ok(cu.cuCtxSetCurrent(ctx(0)), "set ctx 0")
        t0 = time.perf_counter()
        for o, n in pieces:
            ok(cu.cuMemHostUnregister(ctypes.c_void_p(base + o)), "unregister")
        print(f"unlock with both alive: {time.perf_counter() - t0:.3f} s", flush=True)
        libc.munmap(base, size)
        lock(f"{ngpu} contexts alive, PORTABLE|RO, 1 thread (fresh map)", READ_ONLY | PORTABLE, 1)
    os.close(fd); os.unlink(path); sys.exit()

# Warm: the first lock of freshly written pages is slower (docs/measurements/HISTORY.md §20).
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
