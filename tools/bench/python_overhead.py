#!/usr/bin/env python3
"""Issue 13's overhead goal: the Python layer costs ≤ 2 % of the same job through the CLI.

The same product A.mgt @ B.mgt → C (N×N f32, same engine settings) three ways, round-robin
`--reps` times (default 3) so drift hits all alike; medians reported:
  cli      `mgmm-stream run plan.toml` as a process (its wall from outside: start-up included)
  py_proc  `python3 -c "import mgmm_stream; mgmm_stream.matmul(...)"` as a process (the
           interpreter and the import included)
  py_call  mgmm_stream.matmul(...) called in this process (what a notebook user sees)
Each also reports the step wall from its run report, so the engine's own time is visible.
`--ext npy` does it from .npy inputs to a .npy output (issue 35: `matmul(a, b, out="C.npy")`
from paths measured about 1.1 s slower than the CLI on an H200); `--durable` with the default
durable = true; `--trace DIR` writes each run's MGMM_TRACE timeline there (cli_R.json,
py_proc_R.json, py_call_R.json; the in-process call's timeline is its process's, so its
py_call file holds every call until then), for `tools/trace_sum.py … start-up`.

  PYTHONPATH=/tmp/py python3 tools/bench/python_overhead.py --mgmm .dev/bin/mgmm-stream --n 32768
  PYTHONPATH=/tmp/py python3 tools/bench/python_overhead.py --mgmm .dev/bin/mgmm-stream --ext npy --trace $OUT
"""
import argparse, json, os, statistics, subprocess, sys, time

ap = argparse.ArgumentParser()
ap.add_argument("--mgmm", required=True)
ap.add_argument("--n", type=int, default=32768)
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--dir", default="/tmp/pyover")
ap.add_argument("--backend", default="cuda")
ap.add_argument("--ext", choices=("mgt", "npy"), default="mgt")
ap.add_argument("--durable", action="store_true")
ap.add_argument("--trace", default=None)
args = ap.parse_args()
args.mgmm = os.path.abspath(args.mgmm)
trace = os.path.abspath(args.trace) if args.trace else None
os.makedirs(args.dir, exist_ok=True)
os.chdir(args.dir)
n, x, dur = args.n, args.ext, "true" if args.durable else "false"
for name, seed in (("A", 1), ("B", 2)):
    if not os.path.exists(f"{name}.{x}"):
        subprocess.run([args.mgmm, "gen", f"{name}.{x}", "--rows", str(n), "--cols", str(n),
                        "--seed", str(seed)], check=True, capture_output=True)
subprocess.run(["cat", f"A.{x}", f"B.{x}"], stdout=subprocess.DEVNULL, check=True)
with open("plan.toml", "w") as f:
    f.write(f'[matrices.A]\npath = "A.{x}"\n[matrices.B]\npath = "B.{x}"\n')
    f.write(f'[[step]]\noutput = "C_cli.{x}"\nexpr = "A @ B"\n[engine]\n')
    f.write(f'backend = "{args.backend}"\ndurable = {dur}\nhost_memory = "16GiB"\n')

import mgmm_stream as mg

CALL = (f"mg.matmul('A.{x}', 'B.{x}', out='C_py.{x}', restart=True, progress=False, "
        f"backend='{args.backend}', host_memory='16GiB', engine={{'durable': {args.durable}}})")


def traced(name, rep):
    """The environment of a run whose timeline goes to TRACE/NAME_REP.json (unchanged without
    --trace)."""
    env = dict(os.environ)
    if trace:
        env["MGMM_TRACE"] = os.path.join(trace, f"{name}_{rep}.json")
    return env


def clean(p):
    for s in ("", ".journal", ".crc32c"):
        if os.path.exists(p + s):
            os.remove(p + s)


def cli(r):
    clean(f"C_cli.{x}")
    t = time.perf_counter()
    subprocess.run([args.mgmm, "run", "plan.toml", "--quiet", "--report", "cli.json"], check=True,
                   env=traced("cli", r))
    w = time.perf_counter() - t
    return w, sum(s["wall_s"] for s in json.load(open("cli.json"))["steps"])


def py_proc(r):
    clean(f"C_py.{x}")
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import mgmm_stream as mg; " + CALL], check=True,
                   env=traced("py_proc", r))
    return time.perf_counter() - t, float("nan")


def py_call(r):
    clean(f"C_py.{x}")
    if trace and r == 0:
        # The in-process calls' timeline: read at the first call that finds MGMM_TRACE set.
        os.environ["MGMM_TRACE"] = os.path.join(trace, "py_call.json")
    t = time.perf_counter()
    eval(CALL)
    return time.perf_counter() - t, float("nan")


res = {"cli": [], "py_proc": [], "py_call": []}
for r in range(args.reps):
    for name, f in (("cli", cli), ("py_proc", py_proc), ("py_call", py_call)):
        w, step = f(r)
        res[name].append(w)
        print(json.dumps({"rep": r, "method": name, "wall_s": round(w, 4), "step_wall_s": step}), flush=True)
ok = subprocess.run(["cmp", f"C_cli.{x}", f"C_py.{x}"]).returncode == 0
base = statistics.median(res["cli"])
print(f"N = {n}, .{x}, durable = {dur}, backend {args.backend}, {args.reps} reps, medians:")
for name, v in res.items():
    m = statistics.median(v)
    print(f"  {name:8s} {m:7.3f} s  [{min(v):.3f}–{max(v):.3f}]  ratio to cli {m / base:.3f}")
print(f"  outputs bit-identical: {ok}")
