#!/usr/bin/env python3
"""How fast this host reads a file that is already in the page cache, by each route a pass over
it can take: `pread` into a buffer of each thread's own, a fresh `mmap` copied out (what
`read_block` does), a fresh `mmap` summed in place (no copy), and a copy between two buffers in
anonymous memory (the memory's own rate) — with 1, 4, 8 and 16 threads. `verify` reads every
matrix once on the host (issue 35: 12 GiB at 32768² fp32); this says which route can go faster
and by how much. Each route gets a fresh map, so its page faults are counted as a new process's.

    python3 tools/bench/host_read_rates.py FILE [--threads 1,4,8,16] [--chunk-mib 8]
"""
import argparse
import mmap
import os
import threading
import time

import numpy as np


def run(threads, work):
    """Run work(i) on `threads` threads at once; seconds from the start to the last end."""
    barrier = threading.Barrier(threads + 1)

    def body(i):
        barrier.wait()
        work(i)

    ts = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def ranges(size, threads, chunk):
    """Each thread's list of (offset, length) chunks: contiguous shares, whole chunks."""
    per = -(-size // threads)
    out = []
    for i in range(threads):
        lo, hi = i * per, min(size, (i + 1) * per)
        out.append([(o, min(chunk, hi - o)) for o in range(lo, hi, chunk)])
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("file")
    p.add_argument("--threads", default="1,4,8,16")
    p.add_argument("--chunk-mib", type=int, default=8)
    a = p.parse_args()
    chunk = a.chunk_mib << 20
    size = os.path.getsize(a.file) // 4096 * 4096
    gib = size / 2**30
    fd = os.open(a.file, os.O_RDONLY)
    with open(a.file, "rb") as f:  # into the page cache first
        while f.read(64 << 20):
            pass
    print(f"file {a.file}: {gib:.2f} GiB, chunks of {a.chunk_mib} MiB")
    for t in [int(x) for x in a.threads.split(",")]:
        rs = ranges(size, t, chunk)
        bufs = [np.empty(chunk, np.uint8) for _ in range(t)]
        for b in bufs:
            b[:] = 1  # touched: no page faults in the buffers during the timing

        def pread(i):
            for o, n in rs[i]:
                os.preadv(fd, [memoryview(bufs[i])[:n]], o)

        def mapped(copy):
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            arr = np.frombuffer(mm, np.uint8)
            sink = [0] * t

            def work(i):
                for o, n in rs[i]:
                    if copy:
                        np.copyto(bufs[i][:n], arr[o : o + n])
                    else:
                        sink[i] += int(arr[o : o + n].view(np.uint64).sum(dtype=np.uint64))

            s = run(t, work)
            del arr
            mm.close()
            return s

        src = np.ones(size // 4 if size > 2**31 else size, np.uint8)
        dst = np.zeros_like(src)
        dst[:] = 2  # touched, as the buffers
        rs_mem = ranges(src.size, t, chunk)

        def memcopy(i):
            for o, n in rs_mem[i]:
                np.copyto(dst[o : o + n], src[o : o + n])

        s_pread = run(t, pread)
        s_copy = mapped(True)
        s_sum = mapped(False)
        s_mem = run(t, memcopy)
        print(
            f"RATE threads {t:2}: pread {gib / s_pread:6.1f} GiB/s   mmap+copy {gib / s_copy:6.1f}   "
            f"mmap+sum {gib / s_sum:6.1f}   anonymous copy {src.size / 2**30 / s_mem:6.1f}"
        )
        del src, dst
    os.close(fd)


if __name__ == "__main__":
    main()
