"""What keeping the backend between calls saves (docs/PYTHON.md, "One backend kept between
calls"): the same `matmul` in one process, `--reps` times each way, interleaved — `kept` (the
package's default: the second call on takes the backend the first left) against `fresh`
(every call followed by `empty_cache()`, inside its time: it starts its backend and frees it,
as every call did before). Three jobs: numpy arrays in RAM → numpy array, `.npy` paths → `.npy` file, and (with
torch and a GPU) CUDA tensors → host array. Prints per job and way the median call wall, the
backend's start in `run`'s report of the same plan (`startup_s`'s "backend"), and the ratio.

    python python/bench/kept_backend.py --n 16384 --reps 3 [--backend cuda] [--dir /tmp/kept]
"""

import argparse
import os
import statistics
import time

import numpy as np

import mgmm_stream as mg


def timed(f, sync=None):
    if sync:
        sync()
    t = time.perf_counter()
    f()
    if sync:
        sync()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dir", default="/tmp/kept_backend")
    args = ap.parse_args()
    n = args.n
    os.makedirs(args.dir, exist_ok=True)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    pa, pb, pc = (os.path.join(args.dir, f) for f in ("A.npy", "B.npy", "C.npy"))
    np.save(pa, a)
    np.save(pb, b)
    host = np.empty((n, n), np.float32)
    # One GPU named everywhere: a kept backend serves calls whose devices setting is the same.
    kw = dict(backend=args.backend, devices=[0], progress=False, engine={"durable": False})
    jobs = {
        "arrays → array": (lambda: mg.matmul(a, b, out=host, **kw), None),
        ".npy → .npy": (lambda: mg.matmul(pa, pb, out=pc, restart=True, **kw), None),
    }
    try:
        import torch

        if torch.cuda.is_available() and args.backend != "cpu":
            ta, tb = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
            jobs["CUDA tensors → array"] = (lambda: mg.matmul(ta, tb, out=host, **kw),
                                           torch.cuda.synchronize)
    except ImportError:
        pass
    plan = {"matrices": {"A": {"path": pa}, "B": {"path": pb}},
            "step": [{"output": pc, "expr": "A @ B"}],
            "engine": {"backend": args.backend, "devices": [0], "durable": False}}
    mg.matmul(a[:1024, :1024], b[:1024, :1024], **kw)  # the process's first start, not timed
    rows = {(j, w): [] for j in jobs for w in ("fresh", "kept")}
    backend_s = {"fresh": [], "kept": []}
    for _ in range(args.reps):
        for way in ("fresh", "kept"):
            if way == "fresh":
                mg.empty_cache()
            for j, (f, sync) in jobs.items():
                # fresh: the call starts its backend and frees it before it returns, as every
                # call did before backends were kept.
                g = (lambda f=f: (f(), mg.empty_cache())) if way == "fresh" else f
                rows[(j, way)].append(timed(g, sync))
            rep = mg.run(plan, restart=True, progress=False)
            st = rep["steps"][0]
            backend_s[way].append(dict(rep["startup_s"])["backend"])
            assert st["backend_reused"] == (way == "kept"), (way, st["backend_reused"])
    print(f"n = {n} f32, backend {args.backend}, {args.reps} interleaved runs each way")
    for j in jobs:
        f, k = statistics.median(rows[(j, "fresh")]), statistics.median(rows[(j, "kept")])
        print(f"{j:22s} fresh {f:7.3f} s  kept {k:7.3f} s  saved {f - k:+.3f} s  "
              f"(fresh/kept {f / k:.2f}×; runs fresh {', '.join(f'{x:.3f}' for x in rows[(j, 'fresh')])}; "
              f"kept {', '.join(f'{x:.3f}' for x in rows[(j, 'kept')])})")
    print(f"the backend's seconds in run()'s report: fresh {statistics.median(backend_s['fresh']):.3f}, "
          f"kept {statistics.median(backend_s['kept']):.3f}")


if __name__ == "__main__":
    main()
