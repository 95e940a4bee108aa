#!/usr/bin/env python3
"""The three requests that started mgmm-stream, through the Python API, scaled by --scale.

1. A 30000² product over two GPUs from two numpy arrays in RAM, where `torch.cat` ran out of
   memory: ``matmul(a, b, devices=[0, 1])`` returns the product as a numpy array.
2. A 100k×100k product (40 GB per f32 matrix) from disk: the inputs are ``.npy`` files opened as
   ``np.memmap`` (read in place from the file), the result goes to ``C.npy`` (``out=``).
3. The chain A(3000×100)·B(100×100)·C(100×3.6M), cheap to compute but 43 GB of result: the
   small product in RAM, then the wide one streamed to ``chain.npy``.

At --scale 1 these are the real sizes (they need the GPUs and disk of the original requests);
the default 0.05 runs anywhere in a few seconds per request. Each result is spot-checked
against numpy in f64 on a few rows.

    python examples/python_requests.py --scale 0.05 --dir /tmp/requests
"""

import argparse
import os
import time

import numpy as np

import mgmm_stream as mg


def spot_check(name, c, a, b, rows=4):
    """Compare a few rows of c with numpy in f64."""
    idx = np.linspace(0, c.shape[0] - 1, rows).astype(int)
    ref = np.asarray(a[idx], np.float64) @ np.asarray(b, np.float64)
    err = float(np.abs(np.asarray(c[idx], np.float64) - ref).max())
    scale = max(1.0, float(np.abs(ref).max()))
    print(f"  {name}: max |error| on {rows} rows = {err:.2e} (relative {err / scale:.1e})")
    assert err / scale < 1e-3, f"{name}: result does not match numpy"


def random_npy(path, rows, cols, seed, chunk=4096):
    """A .npy file of N(0,1) f32 values, written in row chunks (never all in RAM)."""
    if os.path.exists(path):
        return np.load(path, mmap_mode="r")
    m = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, cols))
    rng = np.random.default_rng(seed)
    for r in range(0, rows, chunk):
        m[r:r + chunk] = rng.standard_normal((min(chunk, rows - r), cols), dtype=np.float32)
    m.flush()
    return np.load(path, mmap_mode="r")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=0.05, help="fraction of the original sizes")
    ap.add_argument("--dir", default="requests_data", help="where files are written")
    ap.add_argument("--devices", default="all", help='"all" or GPU ordinals, e.g. 0,1')
    ap.add_argument("--backend", default="auto", help="auto, cpu or cuda")
    args = ap.parse_args()
    s = args.scale
    os.makedirs(args.dir, exist_ok=True)
    devices = "all" if args.devices == "all" else [int(d) for d in args.devices.split(",")]
    kw = dict(devices=devices, backend=args.backend)
    rng = np.random.default_rng(0)

    n = max(2, int(30000 * s))
    print(f"1. {n}×{n} f32 from two arrays in RAM to an array in RAM")
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    t = time.perf_counter()
    c = mg.matmul(a, b, **kw)
    dt = time.perf_counter() - t
    print(f"  {dt:.2f} s, {2 * n**3 / dt / 1e12:.2f} TFLOP/s")
    spot_check("request 1", c, a, b)
    del a, b, c

    n = max(2, int(100_000 * s))
    print(f"2. {n}×{n} f32 from .npy files on disk to C.npy")
    a = random_npy(os.path.join(args.dir, "A.npy"), n, n, 1)
    b = random_npy(os.path.join(args.dir, "B.npy"), n, n, 2)
    t = time.perf_counter()
    c = mg.matmul(a, b, out=os.path.join(args.dir, "C.npy"), restart=True, **kw)
    dt = time.perf_counter() - t
    print(f"  {dt:.2f} s, {2 * n**3 / dt / 1e12:.2f} TFLOP/s; result {c.nbytes / 1e9:.2f} GB "
          f"in {os.path.join(args.dir, 'C.npy')}")
    spot_check("request 2", c, a, b)
    del a, b, c

    cols = max(2, int(3_600_000 * s))
    print(f"3. chain (3000×100)·(100×100)·(100×{cols}) f32 to chain.npy")
    a = rng.standard_normal((3000, 100), dtype=np.float32)
    b = rng.standard_normal((100, 100), dtype=np.float32)
    wide = random_npy(os.path.join(args.dir, "W.npy"), 100, cols, 3)
    t = time.perf_counter()
    ab = mg.matmul(a, b, progress=False, **kw)
    c = mg.matmul(ab, wide, out=os.path.join(args.dir, "chain.npy"), restart=True, **kw)
    dt = time.perf_counter() - t
    print(f"  {dt:.2f} s; result {c.nbytes / 1e9:.2f} GB in {os.path.join(args.dir, 'chain.npy')}")
    spot_check("request 3", c, np.asarray(a, np.float64) @ b, wide)


if __name__ == "__main__":
    main()
