"""mgmm_stream.dask.matmul against Dask's own ``a @ b`` on the same file-backed arrays and the
same workers, side by side in one run (docs/PYTHON.md, BENCHMARKS.md).

Both routes go file to file: A.npy and B.npy are dask arrays over the files
(``mgmm_stream.dask.from_npy``, chunks read in the workers), and the product is written to a
.npy — by the engine's shard tasks, or by ``to_npy(a @ b)`` (Dask's blocked product, each
output chunk written by the worker that computes it). Runs alternate, ``--reps`` each; the
outputs are compared element by element at the end. CPU by default (``--backend cpu``); on a
GPU machine start one worker per GPU (``--gpus``: dask_cuda.LocalCUDACluster when installed,
else workers with ``CUDA_VISIBLE_DEVICES`` each) and Dask's side runs on CuPy chunks.

    python python/bench/dask_vs_dask.py --n 8192 --workers 2 --threads 1 --dir /tmp/dvd
"""

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="threads per worker")
    ap.add_argument("--chunk", type=int, default=2048, help="Dask chunk edge")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backend", default="cpu", help="mgmm-stream backend: cpu, cuda, auto")
    ap.add_argument("--gpus", type=int, default=0, help="one worker per GPU; Dask side on CuPy")
    ap.add_argument("--dir", default="/tmp/mgmm_dask_bench")
    ap.add_argument("--host-memory", action="append", default=None, metavar="SIZE",
                    help="time mgmm_stream.dask.matmul with this host_memory too, interleaved "
                         "with the default (repeatable: --host-memory 2GiB)")
    ap.add_argument("--durable", action="store_true",
                    help="mgmm-stream's default durable output (fsync per tile, journal); without "
                         "it durable = false, the guarantee Dask's to_npy gives (no fsync)")
    args = ap.parse_args()

    import dask
    import dask.array as da
    from distributed import Client, LocalCluster

    import mgmm_stream.dask as mgd

    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    n, dt = args.n, np.dtype(args.dtype)
    for name, seed in (("A", 1), ("B", 2)):
        p = d / f"{name}.npy"
        if p.exists():
            # Another size's inputs left in --dir are made again (they were reused before: a
            # run at 16384 after one at 8192 multiplied the 8192² files).
            have = np.load(p, mmap_mode="r")
            if have.shape != (n, n) or have.dtype != dt:
                del have
                p.unlink()
        if not p.exists():
            m = np.lib.format.open_memmap(p, mode="w+", dtype=dt, shape=(n, n))
            rng = np.random.default_rng(seed)
            for r in range(0, n, 1024):
                m[r:r + 1024] = rng.standard_normal((min(1024, n - r), n)).astype(dt)
            m.flush()
            del m
    if args.gpus:
        try:
            from dask_cuda import LocalCUDACluster

            cluster = LocalCUDACluster(n_workers=args.gpus, threads_per_worker=args.threads)
        except ImportError:
            # One Nanny per GPU, each with its own CUDA_VISIBLE_DEVICES and the host's memory
            # shared among the GPUs' workers (what dask-cuda does: its LocalCUDACluster parses
            # memory_limit="auto" with nthreads=1, total_cores=n_workers; a bare Nanny's "auto"
            # would give a one-thread worker 1/cores of the host).
            from distributed import Nanny, Scheduler, SpecCluster
            from distributed.system import MEMORY_LIMIT

            workers = {f"gpu{g}": {"cls": Nanny, "options": {
                "nthreads": args.threads, "memory_limit": MEMORY_LIMIT // args.gpus,
                "env": {"CUDA_VISIBLE_DEVICES": str(g)}}}
                for g in range(args.gpus)}
            cluster = SpecCluster(workers=workers, scheduler={"cls": Scheduler, "options": {
                "dashboard_address": None}})
    else:
        cluster = LocalCluster(n_workers=args.workers, threads_per_worker=args.threads,
                               processes=True, dashboard_address=None)
    client = Client(cluster)
    nw = len(client.scheduler_info()["workers"])
    print(f"n={n} {dt} workers={nw} threads/worker={args.threads} chunk={args.chunk} "
          f"backend={args.backend} gpus={args.gpus} mgmm durable={args.durable}", flush=True)
    ch = (args.chunk, args.chunk)
    A, B = mgd.from_npy(d / "A.npy", chunks=ch), mgd.from_npy(d / "B.npy", chunks=ch)

    def clear(name: str) -> None:
        """The previous rep's output, removed before the clock starts (for both sides)."""
        for q in d.glob(name + "*"):
            if q.is_dir():
                for f in q.iterdir():
                    f.unlink()
                q.rmdir()
            else:
                q.unlink()

    def ours(host_memory=None) -> None:
        t0 = time.perf_counter()
        r = mgd.matmul(A, B, out=str(d / "C_mg.npy"), backend=args.backend, report=True,
                       host_memory=host_memory,
                       engine=None if args.durable else {"durable": False})
        total = time.perf_counter() - t0
        # Where the time went: each shard task's run (start-up, the step, what follows it in
        # the same task: the last shard finalizes), the rest is Dask's and the prepare task's.
        for k, rep in enumerate(r["reports"]):
            st = rep["steps"][0] if rep.get("steps") else {}
            start = sum(v for _n, v in rep.get("startup_s", []))
            # `wall_s` starts after the backend's start (the first entry of `startup_s`).
            backend = dict(rep.get("startup_s", [])).get("backend", 0.0)
            run = rep["wall_s"] + backend
            after = run - start - st.get("wall_s", 0.0)
            print(f"  shard {k}/{r['shards']} (host_memory {st.get('host_budget_bytes', 0) / 2**30:.1f} "
                  f"GiB, {st.get('write_mode')}): task run {run:.3f} s = start-up "
                  f"{start:.3f} + step {st.get('wall_s', 0.0):.3f} (first GEMM "
                  f"{st.get('first_gemm_s')}, flush {st.get('flush_s', 0.0):.3f}, "
                  f"{st.get('bottleneck')}, backend kept: {st.get('backend_reused')}) + after "
                  f"the step {after:.3f} (the step's set-up, the split step's finalize)", flush=True)
        # Shards on different workers run side by side: the longest is what the call waited
        # for (the sum was printed before, and went negative with two workers).
        runs = max((rep["wall_s"] + dict(rep.get("startup_s", [])).get("backend", 0.0)
                    for rep in r["reports"]), default=0.0)
        print(f"  outside the longest shard run (prepare, finalize task, Dask): {total - runs:.3f} s",
              flush=True)

    def theirs() -> None:
        a, b = A, B
        if args.gpus:
            import cupy

            a, b = a.map_blocks(cupy.asarray), b.map_blocks(cupy.asarray)
            prod = (a @ b).map_blocks(cupy.asnumpy)
        else:
            prod = a @ b
        with dask.config.set({"array.slicing.split_large_chunks": False}):
            mgd.to_npy(prod, str(d / "C_dask.npy"))

    times: dict = {"mgmm_stream.dask.matmul": [], "dask a @ b (to_npy)": []}
    runs = [("mgmm_stream.dask.matmul", ours), ("dask a @ b (to_npy)", theirs)]
    for hm in args.host_memory or []:
        times[f"mgmm_stream.dask.matmul host_memory={hm}"] = []
        runs.append((f"mgmm_stream.dask.matmul host_memory={hm}",
                     lambda hm=hm: ours(host_memory=hm)))
    for rep in range(args.reps):
        for label, fn in runs:
            clear("C_dask.npy" if fn is theirs else "C_mg.npy")
            t0 = time.perf_counter()
            fn()
            dtm = time.perf_counter() - t0
            times[label].append(dtm)
            print(f"rep {rep + 1}: {label}: {dtm:.2f} s = {2 * n**3 / dtm / 1e9:.1f} GFLOP/s",
                  flush=True)
    def cores() -> str:
        import os as _os
        th = [ln for ln in open("/proc/self/status") if ln.startswith("Threads:")]
        return (f"pid {_os.getpid()}: {len(_os.sched_getaffinity(0))} CPUs in its affinity of "
                f"{_os.cpu_count()}, {th[0].split()[1] if th else '?'} threads")
    for w, info in client.run(cores).items():
        print(f"  worker {w}: {info}", flush=True)
    x = np.load(d / "C_mg.npy", mmap_mode="r")
    y = np.load(d / "C_dask.npy", mmap_mode="r")
    worst = 0.0
    for r in range(0, n, 1024):
        xa = np.asarray(x[r:r + 1024], np.float64)
        ya = np.asarray(y[r:r + 1024], np.float64)
        worst = max(worst, float(np.max(np.abs(xa - ya) / (np.abs(ya) + 1.0))))
    ours_m = statistics.median(times["mgmm_stream.dask.matmul"])
    theirs_m = statistics.median(times["dask a @ b (to_npy)"])
    print(f"median: mgmm_stream.dask {ours_m:.2f} s, dask a @ b {theirs_m:.2f} s, "
          f"ratio (dask / ours) {theirs_m / ours_m:.2f}x; max |diff|/(|c|+1) {worst:.2e}",
          flush=True)
    for hm in args.host_memory or []:
        m = statistics.median(times[f"mgmm_stream.dask.matmul host_memory={hm}"])
        print(f"median with host_memory={hm}: {m:.2f} s, ratio (dask / ours) {theirs_m / m:.2f}x",
              flush=True)
    client.close()
    cluster.close()


if __name__ == "__main__":
    main()
