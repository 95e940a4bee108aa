#!/usr/bin/env python3
"""The numpy peer for the out-of-core CPU benchmark: C = A @ B computed in row panels over
np.memmap of .npy files (A row panel @ whole B), result written to a raw file through a memmap.
Prints one JSON line: seconds, GFLOP/s, bytes read and written."""
import json, sys, time
import numpy as np
a_path, b_path, out_path, panel = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
t0 = time.perf_counter()
A = np.load(a_path, mmap_mode="r"); B = np.load(b_path, mmap_mode="r")
m, k = A.shape; n = B.shape[1]
C = np.lib.format.open_memmap(out_path, mode="w+", dtype=np.float32, shape=(m, n))
for r in range(0, m, panel):
    C[r:r + panel] = A[r:r + panel] @ B
C.flush(); del C
dt = time.perf_counter() - t0
print(json.dumps(dict(peer="numpy_row_panels_memmap", seconds=dt, gflops=2 * m * n * k / dt / 1e9, panel_rows=panel)))
