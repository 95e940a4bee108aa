#!/usr/bin/env python3
"""Issue 13's overhead goal: the Python layer costs ≤ 2 % of the same job through the CLI.

The same product A.mgt @ B.mgt → C (N×N f32, same engine settings) three ways, round-robin
`--reps` times (default 3) so drift hits all alike; medians reported:
  cli      `mgmm-stream run plan.toml` as a process (its wall from outside: start-up included)
  py_proc  `python3 -c "import mgmm_stream; mgmm_stream.matmul(...)"` as a process (the
           interpreter and the import included)
  py_call  mgmm_stream.matmul(...) called in this process (what a notebook user sees)
Each also reports the step wall from its run report, so the engine's own time is visible.

  PYTHONPATH=/tmp/py python3 tools/bench/python_overhead.py --mgmm .dev/bin/mgmm-stream --n 32768
"""
import argparse, json, os, statistics, subprocess, sys, time

ap = argparse.ArgumentParser()
ap.add_argument("--mgmm", required=True)
ap.add_argument("--n", type=int, default=32768)
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--dir", default="/tmp/pyover")
ap.add_argument("--backend", default="cuda")
args = ap.parse_args()
args.mgmm = os.path.abspath(args.mgmm)
os.makedirs(args.dir, exist_ok=True)
os.chdir(args.dir)
n = args.n
for name, seed in (("A", 1), ("B", 2)):
    if not os.path.exists(f"{name}.mgt"):
        subprocess.run([args.mgmm, "gen", f"{name}.mgt", "--rows", str(n), "--cols", str(n),
                        "--seed", str(seed)], check=True, capture_output=True)
subprocess.run(["cat", "A.mgt", "B.mgt"], stdout=subprocess.DEVNULL, check=True)
engine = {"backend": args.backend, "durable": False, "host_memory": "16GiB"}
with open("plan.toml", "w") as f:
    f.write('[matrices.A]\npath = "A.mgt"\n[matrices.B]\npath = "B.mgt"\n')
    f.write('[[step]]\noutput = "C_cli.mgt"\nexpr = "A @ B"\n[engine]\n')
    f.write('backend = "%s"\ndurable = false\nhost_memory = "16GiB"\n' % args.backend)

import mgmm_stream as mg

CALL = ("mg.matmul('A.mgt', 'B.mgt', out='C_py.mgt', restart=True, progress=False, "
        f"backend='{args.backend}', host_memory='16GiB', engine={{'durable': False}})")


def clean(p):
    for s in ("", ".journal", ".crc32c"):
        if os.path.exists(p + s):
            os.remove(p + s)


def cli():
    clean("C_cli.mgt")
    t = time.perf_counter()
    subprocess.run([args.mgmm, "run", "plan.toml", "--quiet", "--report", "cli.json"], check=True)
    w = time.perf_counter() - t
    return w, sum(s["wall_s"] for s in json.load(open("cli.json"))["steps"])


def py_proc():
    clean("C_py.mgt")
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import mgmm_stream as mg; " + CALL], check=True)
    return time.perf_counter() - t, float("nan")


def py_call():
    clean("C_py.mgt")
    t = time.perf_counter()
    eval(CALL)
    return time.perf_counter() - t, float("nan")


res = {"cli": [], "py_proc": [], "py_call": []}
for r in range(args.reps):
    for name, f in (("cli", cli), ("py_proc", py_proc), ("py_call", py_call)):
        w, step = f()
        res[name].append(w)
        print(json.dumps({"rep": r, "method": name, "wall_s": round(w, 4), "step_wall_s": step}), flush=True)
ok = subprocess.run(["cmp", "C_cli.mgt", "C_py.mgt"]).returncode == 0
base = statistics.median(res["cli"])
print(f"N = {n}, backend {args.backend}, {args.reps} reps, medians:")
for name, v in res.items():
    m = statistics.median(v)
    print(f"  {name:8s} {m:7.3f} s  [{min(v):.3f}–{max(v):.3f}]  ratio to cli {m / base:.3f}")
print(f"  outputs bit-identical: {ok}")
