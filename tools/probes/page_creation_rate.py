#!/usr/bin/env python3
"""How fast can the host create the output's page-cache pages, and with how many threads?
(issue 10: outprep, the stage that populates output pages before writeback copies into them,
bound tf32/bf16 runs on the GPU machine.)

For P = 1, 2, 4, ... processes, each takes a disjoint slice of one new SIZE-byte file and
  populate: mmap(MAP_SHARED) + madvise(MADV_POPULATE_WRITE) of its slice (what outprep does);
  touch:    mmap + a write to every page (first-touch faults, what a copy without outprep costs);
  pwrite:   pwrite of its slice from a 64 MiB buffer (buffered writes, page cache only);
  falloc:   populate, on a file fallocate()d first (extents allocated, unwritten);
  files:    populate, but each process on a file of its own (is the limit per file?);
  anon:     MAP_PRIVATE|MAP_ANONYMOUS memory populated (no page cache: the allocator alone).
The file is created fresh (ftruncate, sparse) for every measurement and removed after; nothing is
fsynced. Prints GB/s of pages created per mode and P.
Usage: page_creation_rate.py DIR [SIZE_GIB] [P,P,...] [MODE,MODE,...]
"""
import mmap, os, sys, time
from multiprocessing import Process

MADV_POPULATE_WRITE = 23
d = sys.argv[1]
size = int(float(sys.argv[2] if len(sys.argv) > 2 else 8) * (1 << 30))
ps = [int(p) for p in (sys.argv[3] if len(sys.argv) > 3 else "1,2,4,8,16,32").split(",")]
PAGE = 4096


def worker(path, mode, lo, hi):
    if mode == "anon":
        mm = mmap.mmap(-1, hi - lo, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(MADV_POPULATE_WRITE)
        mm.close()
        return
    if mode == "files":
        path = f"{path}.{lo}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(fd, hi - lo)
        lo, hi = 0, hi - lo
    else:
        fd = os.open(path, os.O_RDWR)
    if mode == "pwrite":
        buf = b"\1" * (64 << 20)
        off = lo
        while off < hi:
            n = min(len(buf), hi - off)
            os.pwrite(fd, buf[:n], off)
            off += n
    else:
        mm = mmap.mmap(fd, hi - lo, mmap.MAP_SHARED, offset=lo)
        if mode != "touch":
            mm.madvise(MADV_POPULATE_WRITE)
        else:
            for off in range(0, hi - lo, PAGE):
                mm[off] = 1
        mm.close()
    os.close(fd)


def measure(mode, p):
    path = os.path.join(d, f"page_probe_{os.getpid()}.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    if mode == "falloc":
        os.posix_fallocate(fd, 0, size)
    else:
        os.ftruncate(fd, size)
    os.close(fd)
    per = (size // p) // (2 << 20) * (2 << 20)
    t = time.perf_counter()
    procs = [Process(target=worker, args=(path, mode, i * per, (i + 1) * per if i < p - 1 else size)) for i in range(p)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()
    dt = time.perf_counter() - t
    t2 = time.perf_counter()
    os.remove(path)
    if mode == "files":
        for i in range(p):
            os.remove(f"{path}.{i * per}")
    rm = time.perf_counter() - t2
    print(f"{mode:>8} P={p:2d}: {size / dt / 1e9:6.2f} GB/s ({size / 2**30:.0f} GiB in {dt:.2f} s; unlink {rm:.2f} s)", flush=True)


modes = (sys.argv[4] if len(sys.argv) > 4 else "populate,pwrite,touch,falloc,files,anon").split(",")
for mode in modes:
    for p in ps:
        if mode in ("touch",) and p < 4:
            continue  # python's per-page loop is too slow to mean anything with few processes
        measure(mode, p)
