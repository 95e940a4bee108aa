"""A product of two CUDA tensors whose result goes to host memory: ``mgmm_stream.matmul(a, b,
out=host)`` against torch's own ``torch.matmul(a, b)`` followed by ``.cpu()`` into a
preallocated host tensor (``out.copy_(c)``), pageable and pinned, side by side in one run,
runs interleaved (issue 36's goal: no slower). Also the result kept on the GPU (out=None,
when it fits) against plain ``a @ b``. Each figure is the wall of the whole call, synchronised;
the outputs are compared element by element with torch's, relative to (|A||B|).

    python python/bench/gpu_arrays_vs_torch.py --n 30000 --reps 3
"""

import argparse
import json
import statistics
import time

import numpy as np
import torch

import mgmm_stream as mg


def timed(f):
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = f()
    torch.cuda.synchronize()
    return time.perf_counter() - t, r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device-memory", default=None, help="mgmm's device_memory (e.g. 8GiB)")
    ap.add_argument("--tile", action="append", default=None, metavar="JSON",
                    help="more compute tiles to time beside `auto`, interleaved (repeatable): "
                         "'[8192, 8192, 30000]'")
    ap.add_argument("--trace", default=None, metavar="PATH",
                    help="MGMM_TRACE for the last call only (the one broken down at the end)")
    args = ap.parse_args()
    n = args.n
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(n, n, device="cuda", generator=g)
    b = torch.randn(n, n, device="cuda", generator=g)
    pageable = torch.empty((n, n))
    pinned = torch.empty((n, n), pin_memory=True)
    host_np = np.empty((n, n), np.float32)
    for arr in (pageable, pinned):
        arr.fill_(0)  # touch every page before timing, as a preallocated buffer would be
    host_np.fill(0)
    kw = dict(devices=[0], progress=False, precision="fp32")
    if args.device_memory:
        kw["device_memory"] = args.device_memory
    # Warm-ups: cuBLAS handles, the engine's first call (driver already up in torch).
    torch.matmul(a[:4096, :4096], b[:4096, :4096]); mg.matmul(a[:2048, :2048], b[:2048, :2048], **kw)
    flop = 2 * n ** 3
    rows = {k: [] for k in ("torch @ + .cpu() pageable", "torch @ + .cpu() pinned",
                            "mgmm out=numpy (pageable)", "mgmm out=pinned tensor",
                            "torch @ (on GPU)", "mgmm out=None (on GPU)")}
    for _ in range(args.reps):
        def torch_to(host):
            c = torch.matmul(a, b)
            host.copy_(c)
            del c
            return host
        rows["torch @ + .cpu() pageable"].append(timed(lambda: torch_to(pageable))[0])
        rows["mgmm out=numpy (pageable)"].append(timed(lambda: mg.matmul(a, b, out=host_np, **kw))[0])
        rows["torch @ + .cpu() pinned"].append(timed(lambda: torch_to(pinned))[0])
        rows["mgmm out=pinned tensor"].append(timed(lambda: mg.matmul(a, b, out=pinned, **kw))[0])
        t, c = timed(lambda: torch.matmul(a, b)); rows["torch @ (on GPU)"].append(t); del c
        t, c = timed(lambda: mg.matmul(a, b, **kw)); rows["mgmm out=None (on GPU)"].append(t)
        where = "GPU" if torch.is_tensor(c) and c.is_cuda else "host"
        del c
        for tile in args.tile or []:
            tk = dict(kw, tile=json.loads(tile), host_memory="16GiB")
            rows.setdefault(f"mgmm out=pinned tile={tile}", []).append(
                timed(lambda: mg.matmul(a, b, out=pinned, **tk))[0])
    print(f"n = {n} f32, {args.reps} interleaved runs each; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(0)}; mgmm out=None result went to the {where}")
    base = statistics.median(rows["torch @ + .cpu() pinned"])
    for k, v in rows.items():
        m = statistics.median(v)
        print(f"{k:30s} median {m:7.3f} s  (min {min(v):.3f}, max {max(v):.3f})  "
              f"{flop / m / 1e12:6.1f} TFLOP/s  torch-pinned/this {base / m:.2f}")
    print("mgmm (numpy out) / torch (pageable):",
          f"{statistics.median(rows['torch @ + .cpu() pageable']) / statistics.median(rows['mgmm out=numpy (pageable)']):.2f}× faster")
    # Where the engine's time goes in one such call (the step report matmul does not return).
    settings = mg._settings("auto", [0], None, args.device_memory, 0, None, {"precision": "fp32"})
    job, keep = mg._prepare(a, b, 1.0, False, False, None, settings)
    gpus = [k for _n, _d, k in keep if isinstance(k, mg._Gpu)]
    desc, _res = mg._output(job, host_np, None, gpus, args.device_memory)
    for g in gpus:
        g.wait()
    if args.trace:
        import os
        os.environ["MGMM_TRACE"] = args.trace  # read at the engine's next call, this one
    t = time.perf_counter()
    rep = job.run(desc, False, None, None, 1.0)
    call = time.perf_counter() - t
    print(f"one call through job.run: {call:.3f} s; step wall {rep['wall_s']:.3f} s, first GEMM "
          f"{rep.get('first_gemm_s')} s, bottleneck {rep['bottleneck']}, tile {rep.get('tile')}")
    print("  setup:", rep.get("setup_s"), " busy:", [(k, round(v, 2)) for k, v in rep["busy_shares"]])
    print("  pools:", [(p["name"], p.get("allocated"), p.get("buffers"), p.get("lazy")) for p in rep["pools"]],
          " direct bytes", rep.get("direct_bytes"))
    # Element by element against torch's f64 product for 16 sampled rows.
    idx = torch.arange(0, n, max(1, n // 16), device="cuda")
    a64, b64 = a[idx].double(), b.double()
    ref = a64 @ b64
    bound = (n + 2) * 2.0 ** -24 * (a64.abs() @ b64.abs())
    got = torch.from_numpy(host_np[idx.cpu().numpy()]).cuda().double()
    print(f"mgmm vs f64 on {len(idx)} rows: worst |err|/((n+2)u|A||B|) = "
          f"{float(((got - ref).abs() / bound).max()):.3f} (≤ 1 passes)")


if __name__ == "__main__":
    main()
