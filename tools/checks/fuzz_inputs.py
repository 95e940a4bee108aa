#!/usr/bin/env python3
"""Fuzz the edges a user's files reach: plans, `.mgt` headers and tables, `.npy` headers.

Runs on any machine (standard library only). Each case is a mutated input handed to the binary
with a time limit, classified by what the process did:

* ok        — exit 0, or a non-zero exit with an `error:` message on stderr;
* panic     — exit 101 or `panicked at` on stderr (a bug: bad input must get a clear error);
* crash     — killed by a signal, or another exit status without a message;
* hang      — still running at the time limit.

Mutations: command-line numbers (shapes, tiles, threads, raw descriptors: `gen`, `import`,
`info`, under `ulimit -f` so a large shape fails fast), plans (a line deleted, duplicated or swapped; a value replaced by one of a list of
hostile values; bytes flipped; truncated), `.mgt` files (bytes flipped in the header, the
checksum table or the data; truncated; extended), `.npy` files (header dictionaries rewritten
with hostile shapes, dtypes, orders and lengths; bytes flipped). Plans go to `plan` and, when
small, `run`; matrix files to `info --check` and to a `run` that reads them.

    python3 tools/checks/fuzz_inputs.py --bin target/release/mgmm-stream --cases 20000

Prints a summary by kind and the first few failures; exits non-zero on any panic, crash or hang.
"""

import argparse
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile

BASE_PLAN = """[matrices.A]
path = "A.mgt"
generate = { rows = 70, cols = 50, dist = "normal", seed = 1 }

[matrices.B]
path = "B.npy"

[[step]]
output = "C.mgt"
expr = "A @ B"
alpha = 1.0

[[step]]
output = "D.npy"
expr = "(A @ B).T @ A"

[engine]
backend = "cpu"
threads = 1
precision = "fp32"
host_memory = "64MiB"
tile = [32, 32, 16]
checkpoint_every = "5min"
durable = false
"""

HOSTILE = [
    "-1", "0", "1", "18446744073709551615", "9223372036854775807", "1e308", "-1e308", "nan",
    "inf", "-inf", '""', '"abc"', '"0B"', '"1PiB"', '"-5GiB"', "[]", "[0, 0, 0]",
    "[1, 2]", "[4294967296, 1, 1]", "{}", "true", '"A @ A @ A @ A"', '"A @"', '"(A"',
    '"A.T.T.T @ B"', '"../../../etc/passwd"', '"/dev/zero"', '"/proc/self/mem"', '"\\u0000"',
    '"fp64"', '"bf16"', '"tf32"', '"cuda"', '"sim"', '"0s"', '"1ns"', '"off"',
]


NUMBERS = ["0", "1", "2", "7", "64", "1000", "-1", "4294967296", "3000000000",
           "9223372036854775807", "18446744073709551615", "18446744073709551616", "1e9", "x"]


def npy_bytes(header: str, data: bytes, version=(1, 0)) -> bytes:
    h = header.encode("latin1")
    if version[0] == 1:
        pre = b"\x93NUMPY" + bytes(version) + struct.pack("<H", len(h))
    else:
        pre = b"\x93NUMPY" + bytes(version) + struct.pack("<I", len(h))
    return pre + h + data


def good_npy(rows, cols, rnd) -> bytes:
    hdr = "{'descr': '<f4', 'fortran_order': False, 'shape': (%d, %d), }" % (rows, cols)
    hdr += " " * ((64 - (10 + len(hdr) + 1) % 64) % 64) + "\n"
    data = struct.pack("<%df" % (rows * cols), *(rnd.uniform(-1, 1) for _ in range(rows * cols)))
    return npy_bytes(hdr, data)


def mutate_plan(text: str, rnd) -> str:
    lines = text.split("\n")
    for _ in range(rnd.randint(1, 3)):
        if not "".join(lines):
            break
        op = rnd.randrange(6)
        i = rnd.randrange(len(lines))
        if op == 0:
            del lines[i]
        elif op == 1:
            lines.insert(i, lines[rnd.randrange(len(lines))])
        elif op == 2 and "=" in lines[i]:
            key = lines[i].split("=", 1)[0]
            lines[i] = f"{key}= {rnd.choice(HOSTILE)}"
        elif op == 3:
            j = rnd.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == 4:
            s = bytearray("\n".join(lines).encode())
            for _ in range(rnd.randint(1, 4)):
                s[rnd.randrange(len(s))] = rnd.randrange(256)
            lines = s.decode("utf-8", "replace").split("\n")
        else:
            lines = "\n".join(lines)[: rnd.randrange(len("\n".join(lines)) + 1)].split("\n")
    return "\n".join(lines)


def mutate_bytes(data: bytes, rnd, region=None) -> bytes:
    d = bytearray(data)
    op = rnd.randrange(5)
    lo, hi = region or (0, len(d))
    hi = min(hi, len(d))
    if op <= 2 and hi > lo:
        for _ in range(rnd.randint(1, 8)):
            d[rnd.randrange(lo, hi)] ^= 1 << rnd.randrange(8)
    elif op == 3:
        d = d[: rnd.randrange(len(d) + 1)]
    else:
        d += bytes(rnd.randrange(1, 5000))
    return bytes(d)


def mutate_npy(rnd, base_data: bytes) -> bytes:
    descr = rnd.choice(["<f4", "<f8", "<f2", ">f4", "<i4", "|b1", "<c8", "O", "<f4x", "", "<V4"])
    fo = rnd.choice(["False", "True", "0", "'x'", "None"])
    shape = rnd.choice(["(50, 40)", "(40, 50)", "(0, 40)", "(50,)", "(50, 40, 2)", "()", "(-1, 40)",
                        "(18446744073709551616, 2)", "(2**40, 2**40)", "(50, 40", "[50, 40]"])
    extra = rnd.choice(["", "'x': 1, ", "'descr': '<f8', "])
    hdr = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, %s}" % (descr, fo, shape, extra)
    if rnd.random() < 0.3:
        hdr = hdr[: rnd.randrange(len(hdr) + 1)]
    hdr += " " * rnd.randrange(70) + rnd.choice(["\n", "", "\x00"])
    version = rnd.choice([(1, 0), (2, 0), (3, 0), (9, 9), (1, 0)])
    raw = npy_bytes(hdr, base_data, version)
    return mutate_bytes(raw, rnd, (0, 128)) if rnd.random() < 0.3 else raw


def classify(r):
    if r is None:
        return "hang"
    if r.returncode == 101 or "panicked at" in r.stderr:
        return "panic"
    if r.returncode == 0 or (r.returncode > 0 and "error" in r.stderr.lower()):
        return "ok"
    return "crash"


def call(binary, args, timeout, limit_file=False):
    if limit_file:
        args = ["-c", 'ulimit -f 10000; exec "$0" "$@"', binary] + args
        binary = "sh"
    try:
        return subprocess.run([binary] + args, capture_output=True, text=True, timeout=timeout,
                              errors="replace")
    except subprocess.TimeoutExpired:
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--cases", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=20.0)
    a = ap.parse_args()
    binary = os.path.abspath(a.bin)
    rnd = random.Random(a.seed)
    work = tempfile.mkdtemp(prefix="fuzz_inputs.")
    os.chdir(work)
    base_b = good_npy(50, 40, rnd)
    open("B.npy", "wb").write(base_b)
    open("plan.toml", "w").write(BASE_PLAN)
    r = call(binary, ["run", "plan.toml"], 120)
    if r is None or r.returncode != 0:
        sys.exit(f"the unmutated plan does not run:\n{r and r.stderr}")
    good_mgt = open("A.mgt", "rb").read()
    counts = {}
    failures = []
    for case in range(a.cases):
        d = f"c{case % 8}"
        shutil.rmtree(d, ignore_errors=True)
        os.mkdir(d)
        kind = rnd.choice(["plan", "plan", "mgt", "npy", "args"])
        if kind == "plan":
            shutil.copy("B.npy", d)
            shutil.copy("A.mgt", d)
            open(f"{d}/plan.toml", "w", errors="replace").write(mutate_plan(BASE_PLAN, rnd))
            runs = [["plan", f"{d}/plan.toml"]] + ([["run", f"{d}/plan.toml"]] if rnd.random() < 0.25 else [])
        elif kind == "mgt":
            region = rnd.choice([(0, 4096), (4096, 8192), (0, len(good_mgt))])
            open(f"{d}/A.mgt", "wb").write(mutate_bytes(good_mgt, rnd, region))
            shutil.copy("B.npy", d)
            open(f"{d}/plan.toml", "w").write(BASE_PLAN)
            runs = [["info", "--check", f"{d}/A.mgt"], ["run", f"{d}/plan.toml"]]
        elif kind == "args":
            # Command-line numbers a user could type: shapes, tiles, thread counts, raw
            # descriptors. Under `ulimit -f` (5 MB), so a shape that is only large fails fast.
            shutil.copy("B.npy", d)
            n = lambda: rnd.choice(NUMBERS)
            runs = [rnd.choice([
                ["gen", f"{d}/Z.mgt", "--rows", n(), "--cols", n()],
                ["gen", f"{d}/Z.mgt", "--rows", n(), "--cols", n(), "--tile", n(),
                 "--dtype", rnd.choice(["f32", "f64", "f16", "bf16", "i8"])],
                ["gen", f"{d}/Z.mgt", "--rows", "8", "--cols", "8", "--threads", n()],
                ["import", f"raw:rows={n()},cols={n()},dtype=f32,offset={n()}:{d}/B.npy", f"{d}/I.mgt"],
                ["import", f"{d}/B.npy", f"{d}/I.mgt", "--tile", n()],
                ["info", f"raw:rows={n()},cols={n()},dtype=f64:{d}/B.npy", "--check"],
            ])]
        else:
            shutil.copy("A.mgt", d)
            open(f"{d}/B.npy", "wb").write(mutate_npy(rnd, base_b[128:]))
            open(f"{d}/plan.toml", "w").write(BASE_PLAN)
            runs = [["info", f"{d}/B.npy"], ["run", f"{d}/plan.toml"]]
        for args in runs:
            res = classify(call(binary, args, a.timeout, limit_file=kind == "args"))
            counts[(kind, res)] = counts.get((kind, res), 0) + 1
            if res != "ok":
                keep = f"fail{len(failures)}"
                shutil.copytree(d, keep)
                failures.append((case, kind, res, args, keep))
        if (case + 1) % 1000 == 0:
            print(f"{case + 1} cases, {len(failures)} failures", flush=True)
    total = sum(counts.values())
    print(f"summary: {a.cases} mutated inputs, {total} commands run")
    for kind in ("plan", "mgt", "npy", "args"):
        row = {res: counts.get((kind, res), 0) for res in ("ok", "panic", "crash", "hang")}
        print(f"  {kind:5s} " + "  ".join(f"{k} {v}" for k, v in row.items()))
    for case, kind, res, args, keep in failures[:10]:
        print(f"  FAIL case {case} {kind} {res}: {' '.join(args)} (inputs kept in {work}/{keep})")
    if not failures:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
