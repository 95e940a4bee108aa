#!/usr/bin/env python3
"""Issue 13's GPU goal, side by side in one run on the GPU machine: C = A·B, f32, N×N (default
30000), from two numpy arrays in RAM to a numpy array in RAM, over the GPUs given (default 0,1):

  mgmm     mgmm_stream.matmul(a, b, out=c)       (preallocated output, like the torch code)
  mgmm_new mgmm_stream.matmul(a, b)              (returns a new array)
  torch    what a user writes by hand: rows of A split across the GPUs, B copied to each,
           `@` on each, `.cpu()` into a preallocated output (fp32: TF32 off, torch's default)
  cublasxt cuBLASXt SGEMM on the same arrays (pinning on, block 8192), over the same GPUs

Every figure is end to end from arrays in RAM to the result in RAM, each method `--reps`
times (default 3) in turn (round-robin, so drift hits all alike); the median is reported.
torch's first call (CUDA context, cuBLAS handles) is timed separately as `torch_cold`;
mgmm's calls create their CUDA contexts every time and that is inside its figures. The
results are compared with each other (max |difference| relative to max |C|).

Needs the mgmm_stream wheel (docs/PYTHON.md says how to build it on the development machine)
installed in the GPU machine's Python, plus numpy and torch:

  python3 -m pip install --no-deps --target "$OUT/py" .whl/mgmm_stream-*.whl
  PYTHONPATH="$OUT/py" python3 tools/bench/python_vs_torch.py --n 30000 --devices 0,1

Prints one JSON line per measurement and a summary table.
"""
import argparse
import ctypes
import glob
import json
import statistics
import time

import numpy as np


def mgmm_method(devs, new, backend):
    import mgmm_stream as mg

    def run(a, b, c):
        kw = dict(backend=backend, devices=devs, precision="fp32", progress=False)
        return mg.matmul(a, b, **kw) if new else mg.matmul(a, b, out=c, **kw)

    return run


def torch_method(devs):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False

    def run(a, b, c):
        ta, tb, tc = torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c)
        bounds = np.linspace(0, a.shape[0], len(devs) + 1).astype(int)
        parts = []
        for d, r0, r1 in zip(devs, bounds[:-1], bounds[1:]):
            dev = torch.device(f"cuda:{d}")
            parts.append((r0, r1, ta[r0:r1].to(dev) @ tb.to(dev)))
        for r0, r1, p in parts:
            tc[r0:r1] = p.cpu()
        return c

    return run


def cublasxt_method(devs, block=8192):
    names = ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]
    names += glob.glob("/usr/local/cuda*/lib64/libcublas.so*")
    lib = None
    for n in names:
        try:
            lib = ctypes.CDLL(n)
            break
        except OSError:
            pass
    if lib is None:
        return None

    def run(a, b, c):
        m, k = a.shape
        n = b.shape[1]
        h = ctypes.c_void_p()
        assert lib.cublasXtCreate(ctypes.byref(h)) == 0
        ids = (ctypes.c_int * len(devs))(*devs)
        assert lib.cublasXtDeviceSelect(h, len(devs), ids) == 0
        assert lib.cublasXtSetBlockDim(h, block) == 0
        assert lib.cublasXtSetPinningMemMode(h, 1) == 0
        al, be, sz = ctypes.c_float(1.0), ctypes.c_float(0.0), ctypes.c_size_t
        ptr = lambda x: x.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
        # Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: pass B first.
        r = lib.cublasXtSgemm(h, 0, 0, sz(n), sz(m), sz(k), ctypes.byref(al), ptr(b), sz(n),
                              ptr(a), sz(k), ctypes.byref(be), ptr(c), sz(n))
        lib.cublasXtDestroy(h)
        assert r == 0, f"cublasXtSgemm returned {r}"
        return c

    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=30000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--devices", default="0,1")
    ap.add_argument("--methods", default="mgmm,mgmm_new,torch,cublasxt")
    ap.add_argument("--backend", default="cuda", help="mgmm's backend (cpu: a smoke test)")
    args = ap.parse_args()
    devs = [int(d) for d in args.devices.split(",")]
    n = args.n
    rng = np.random.default_rng(1)
    t = time.perf_counter()
    a = rng.random((n, n), dtype=np.float32) - 0.5
    b = rng.random((n, n), dtype=np.float32) - 0.5
    print(f"inputs: 2 × {n}×{n} f32 = {2 * a.nbytes / 1e9:.1f} GB in RAM "
          f"({time.perf_counter() - t:.1f} s to generate)", flush=True)
    methods = {}
    for name in args.methods.split(","):
        if name == "mgmm":
            methods[name] = mgmm_method(devs, False, args.backend)
        elif name == "mgmm_new":
            methods[name] = mgmm_method(devs, True, args.backend)
        elif name == "torch":
            methods[name] = torch_method(devs)
        elif name == "cublasxt":
            m = cublasxt_method(devs)
            if m is None:
                print("cuBLASXt: libcublas not found; skipped")
            else:
                methods[name] = m
        else:
            raise SystemExit(f"unknown method {name}")
    outs = {k: np.zeros((n, n), np.float32) for k in methods}  # preallocated, pages touched
    flop = 2.0 * n ** 3
    times = {k: [] for k in methods}
    results = {}
    if "torch" in methods:
        t = time.perf_counter()
        methods["torch"](a, b, outs["torch"])
        cold = time.perf_counter() - t
        print(json.dumps(dict(method="torch_cold", n=n, gpus=len(devs), wall_s=cold,
                              tflops=flop / cold / 1e12)), flush=True)
    for rep in range(args.reps):
        for name, fn in methods.items():
            t = time.perf_counter()
            results[name] = fn(a, b, outs[name])
            dt = time.perf_counter() - t
            times[name].append(dt)
            print(json.dumps(dict(method=name, rep=rep + 1, n=n, gpus=len(devs), wall_s=dt,
                                  tflops=flop / dt / 1e12)), flush=True)
    ref_name = next(iter(results))
    ref = results[ref_name]
    scale = float(np.abs(ref).max())
    print(f"\n| method | median wall s | TFLOP/s | max abs diff to {ref_name}, relative to max abs C |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        diff = float(np.abs(results[name] - ref).max()) / scale
        print(f"| {name} | {med:.3f} | {flop / med / 1e12:.1f} | {diff:.2e} |")


if __name__ == "__main__":
    main()
