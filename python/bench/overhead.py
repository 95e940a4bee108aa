"""Overhead of the Python layer against the CLI, side by side in one run (docs/PYTHON.md).

The same job both ways — C = A·B, f32, A and B .mgt files, C written to a .mgt file, CPU
backend — alternately, `--reps` times each; then, for context, the in-memory route
(numpy arrays in, numpy array out) and numpy's own `a @ b`.

    python python/bench/overhead.py --cli target/release/mgmm-stream --n 8192 --dir /tmp/ovh
"""

import argparse
import os
import resource
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

import mgmm_stream as mg


def fresh(p: Path) -> None:
    for q in (p, Path(str(p) + ".journal")):
        q.unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True, help="path to the mgmm-stream binary")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/mgmm_overhead")
    ap.add_argument("--no-memory", action="store_true", help="skip the in-memory route")
    args = ap.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    n = args.n
    for name, seed in (("A", 1), ("B", 2)):
        if not (d / f"{name}.mgt").exists():
            subprocess.run([args.cli, "gen", str(d / f"{name}.mgt"), "--rows", str(n), "--cols",
                            str(n), "--seed", str(seed)], check=True)
    plan = d / "plan.toml"
    plan.write_text(f'[matrices.A]\npath = "A.mgt"\n[matrices.B]\npath = "B.mgt"\n'
                    f'[[step]]\noutput = "C_cli.mgt"\nexpr = "A @ B"\n'
                    f'[engine]\nbackend = "cpu"\n')
    cli, py, cli_cpu, py_cpu = [], [], [], []

    def children_cpu():
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    for r in range(args.reps):
        fresh(d / "C_cli.mgt")
        t, c0 = time.perf_counter(), children_cpu()
        subprocess.run([args.cli, "run", str(plan), "--quiet"], check=True)
        cli.append(time.perf_counter() - t)
        cli_cpu.append(children_cpu() - c0)
        fresh(d / "C_py.mgt")
        t, c0 = time.perf_counter(), time.process_time()
        mg.matmul(str(d / "A.mgt"), str(d / "B.mgt"), out=str(d / "C_py.mgt"), backend="cpu",
                  progress=False)
        py.append(time.perf_counter() - t)
        py_cpu.append(time.process_time() - c0)
        print(f"rep {r + 1}: CLI {cli[-1]:.3f} s (CPU {cli_cpu[-1]:.2f} s), "
              f"Python {py[-1]:.3f} s (CPU {py_cpu[-1]:.2f} s)", flush=True)
    mc, mp = statistics.median(cli), statistics.median(py)
    cc, cp = statistics.median(cli_cpu), statistics.median(py_cpu)
    flop = 2.0 * n ** 3
    print(f"n = {n}, files → file: wall: CLI median {mc:.3f} s ({flop / mc / 1e9:.0f} GFLOP/s), "
          f"Python median {mp:.3f} s ({flop / mp / 1e9:.0f} GFLOP/s), "
          f"overhead {100 * (mp / mc - 1):+.2f} %; CPU time: CLI {cc:.2f} s, Python {cp:.2f} s, "
          f"overhead {100 * (cp / cc - 1):+.2f} %; load average {os.getloadavg()[0]:.1f}")
    if args.no_memory:
        return
    for name in ("A", "B"):
        if not (d / f"{name}.npy").exists():
            subprocess.run([args.cli, "export", str(d / f"{name}.mgt"), str(d / f"{name}.npy")],
                           check=True)
    a, b = np.load(d / "A.npy"), np.load(d / "B.npy")
    mem, npy = [], []
    for _ in range(args.reps):
        t = time.perf_counter()
        mg.matmul(a, b, backend="cpu", progress=False)
        mem.append(time.perf_counter() - t)
        t = time.perf_counter()
        _ = a @ b
        npy.append(time.perf_counter() - t)
    mm, mn = statistics.median(mem), statistics.median(npy)
    print(f"n = {n}, arrays → array: mgmm_stream median {mm:.3f} s "
          f"({flop / mm / 1e9:.0f} GFLOP/s), numpy a @ b median {mn:.3f} s "
          f"({flop / mn / 1e9:.0f} GFLOP/s)")
    print(f"threads: {os.cpu_count()} CPUs visible")


if __name__ == "__main__":
    main()
