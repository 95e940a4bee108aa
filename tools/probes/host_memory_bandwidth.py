#!/usr/bin/env python3
"""How much memory traffic can the host move, all cores together? (issue 10: with tf32/bf16 a
32768² step on one GPU is host-bound, its busiest stages — check, outprep, staging, writeback —
each around 60 % busy; is the sum of their traffic what the host's memory can take?)

For P = 1, 2, 4, ... processes started together, each on arrays of SIZE MiB of its own:
  read:  a.max() over an array (reads it),
  write: a.fill(1) (writes it; the pages exist already),
  copy:  np.copyto(b, a) (reads one, writes the other; counted as both).
Prints the bytes moved per second, all processes together (median of REPS rounds).
Usage: host_memory_bandwidth.py [P,P,...] [SIZE_MIB] [REPS]
"""
import sys, time
import numpy as np
from multiprocessing import Barrier, Process, Queue


def touch(kind, a, b):
    if kind == "copy":
        np.copyto(b, a)
    elif kind == "write":
        a.fill(1)
    else:
        a.max()


def worker(kind, size, reps, bar, q):
    a = np.ones(size // 4, dtype=np.float32)
    b = np.zeros_like(a) if kind == "copy" else None
    for _ in range(2):  # first touch and a warm round, not timed
        touch(kind, a, b)
    times = []
    for _ in range(reps):
        bar.wait()
        t = time.perf_counter()
        touch(kind, a, b)
        times.append((t, time.perf_counter()))
    q.put(times)


def measure(kind, p, size, reps):
    bar, q = Barrier(p), Queue()
    procs = [Process(target=worker, args=(kind, size, reps, bar, q)) for _ in range(p)]
    for pr in procs:
        pr.start()
    per = [q.get() for _ in procs]
    for pr in procs:
        pr.join()
    rates = []
    for r in range(reps):
        t0 = min(x[r][0] for x in per)
        t1 = max(x[r][1] for x in per)
        moved = p * size * (2 if kind == "copy" else 1)
        rates.append(moved / (t1 - t0) / 1e9)
    rates.sort()
    print(f"{kind:>5} P={p:2d}: {rates[len(rates) // 2]:6.1f} GB/s moved (rounds {rates[0]:.1f}–{rates[-1]:.1f})", flush=True)


ps = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,4,8,16").split(",")]
size = int(sys.argv[2] if len(sys.argv) > 2 else 1024) << 20
reps = int(sys.argv[3] if len(sys.argv) > 3 else 5)
for kind in ("read", "write", "copy"):
    for p in ps:
        measure(kind, p, size, reps)
