#!/usr/bin/env python3
"""numpy (OpenBLAS) f32 GEMM throughput, in memory, to print beside `cargo bench --bench cpu_gemm`."""
import time, numpy as np
for n in (1024, 2048, 4096):
    rng = np.random.default_rng(1)
    a = rng.uniform(-1, 1, (n, n)).astype(np.float32); b = rng.uniform(-1, 1, (n, n)).astype(np.float32)
    a @ b
    ts = []
    for _ in range(5):
        t = time.perf_counter(); a @ b; ts.append(time.perf_counter() - t)
    ts.sort()
    print(f"numpy n={n}: {2*n**3/ts[2]/1e9:.1f} GFLOP/s")
