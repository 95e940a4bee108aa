#!/usr/bin/env python3
"""Host-side fill strategies for H2D, measured on the GPU machine (docs/GPU.md):
  (1) cuMemHostRegister(READ_ONLY) on 256 MiB windows of the file's memory map, then DMA straight
      from the map (registration faults the pages in and pins them; unregister after);
  (2) pread with 16 threads into one pinned buffer, then DMA (what mgmm-stream does).
The file is in the page cache (warm). Prints GB/s of file bytes delivered to the device."""
import mmap, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import numpy as np, cupy as cp
path = sys.argv[1]; win = 256 << 20; n = int(sys.argv[2]) if len(sys.argv) > 2 else 8
rt = cp.cuda.runtime
fd = os.open(path, os.O_RDONLY)
mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
base = np.frombuffer(mm, dtype=np.uint8)
dev = cp.empty(win, dtype=cp.uint8)
READ_ONLY = 8  # cudaHostRegisterReadOnly
def registered():
    t = time.perf_counter(); reg = 0.0
    for i in range(n):
        p = base[4096 + i * win:].ctypes.data
        r0 = time.perf_counter(); rt.hostRegister(p, win, READ_ONLY); reg += time.perf_counter() - r0
        rt.memcpy(dev.data.ptr, p, win, rt.memcpyHostToDevice)
        rt.hostUnregister(p)
    return time.perf_counter() - t, reg
pinned = cp.cuda.alloc_pinned_memory(win)
pbuf = np.frombuffer(pinned, dtype=np.uint8, count=win)
pool = ThreadPoolExecutor(16)
def pread_fill():
    t = time.perf_counter(); fill = 0.0
    chunk = 4 << 20
    for i in range(n):
        f0 = time.perf_counter()
        def rd(j):
            os.preadv(fd, [memoryview(pbuf[j:j + chunk])], 4096 + i * win + j)
        list(pool.map(rd, range(0, win, chunk)))
        fill += time.perf_counter() - f0
        rt.memcpy(dev.data.ptr, pbuf.ctypes.data, win, rt.memcpyHostToDevice)
    return time.perf_counter() - t, fill
for name, f in (("register+DMA", registered), ("16-thread pread+DMA", pread_fill)):
    f()  # warm
    t, part = f()
    gb = n * win / 1e9
    print(f"{name:>22}: {gb / t:5.1f} GB/s end to end ({gb:.1f} GB in {t:.3f} s; registration/fill {part:.3f} s)")
