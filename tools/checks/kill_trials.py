#!/usr/bin/env python3
"""Kill trials: SIGKILL a run 1-3 times at random moments, resume it, compare the bytes.

Runs on any machine (CPU backend, standard library only). One reference run writes the product;
each trial then starts the same plan from nothing, kills it with SIGKILL 1-3 times at random
moments (checkpoints are taken after every k-chunk, so many kills land in the middle of a
checkpoint write), and runs it to the end. A trial passes when the output (and its journal's
"complete" record) is byte-identical to the reference and the last run computed exactly the
tiles the journal did not hold when it started (the report's `tiles_computed` against the
distinct valid records read here). Output alternates between `.mgt` and `.npy`.

    python3 tools/checks/kill_trials.py --bin target/release/mgmm-stream --trials 100

Prints one line per trial and a summary; exits non-zero when any trial failed or an unfinished `.npy` had a header numpy would load.
"""

import argparse
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

PLAN = """[matrices.A]
path = "A.mgt"
generate = {{ rows = 2000, cols = 1800, dist = "normal", seed = 1 }}
[matrices.B]
path = "B.mgt"
generate = {{ rows = 1800, cols = 2200, dist = "normal", seed = 2 }}
[[step]]
output = "{out}"
expr = "A @ B"
[engine]
backend = "cpu"
threads = 1
tile = [256, 256, 128]
checkpoint_every = "0s"
"""


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def recorded_tiles(journal: str) -> set:
    """Sequence numbers of the journal's valid tile records (docs/FORMAT.md)."""
    try:
        data = open(journal, "rb").read()
    except FileNotFoundError:
        return set()
    nl = data.find(b"\n")
    if nl < 0:
        return set()
    body, seqs = data[nl + 1 :], set()
    for i in range(0, len(body) - 15, 16):
        rec = body[i : i + 16]
        magic, seq, _, check = struct.unpack("<IIII", rec)
        if magic == 0x4345524A and check == crc32c(rec[:12]) and seq != 0xFFFFFFFF:
            seqs.add(seq)
    return seqs


def run(binary, plan, report=None, timeout=600):
    args = [binary, "run", plan] + (["--report", report] if report else [])
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    a = ap.parse_args()
    binary = os.path.abspath(a.bin)
    rnd = random.Random(a.seed)
    work = a.dir or tempfile.mkdtemp(prefix="kill_trials.")
    os.makedirs(work, exist_ok=True)
    os.chdir(work)

    refs, durations, totals = {}, {}, {}
    for out in ("C.mgt", "C.npy"):
        plan = f"plan_{out}.toml"
        open(plan, "w").write(PLAN.format(out=out))
        # The first run also generates the inputs: time the second, which only multiplies.
        for attempt in range(2):
            for p in (out, out + ".journal", out + ".crc32c"):
                if os.path.exists(p):
                    os.remove(p)
            t = time.time()
            r = run(binary, plan, report="report.json")
            durations[out] = time.time() - t
            if r.returncode != 0:
                sys.exit(f"reference run of {out} failed:\n{r.stderr}")
        refs[out] = open(out, "rb").read()
        totals[out] = json.load(open("report.json"))["steps"][0]["tiles_total"]
        os.rename(out, "ref_" + out)
        for leftover in (out + ".journal", out + ".crc32c"):
            if os.path.exists(leftover):
                os.rename(leftover, "ref_" + leftover)
    print(f"reference runs: " + ", ".join(f"{k} {v:.2f} s" for k, v in durations.items()))

    passed = mid_ckpt = kills_total = late = unfinished_npy = npy_loadable = 0
    failures = []
    for trial in range(a.trials):
        out = ("C.mgt", "C.npy")[trial % 2]
        plan = f"plan_{out}.toml"
        for p in (out, out + ".journal", out + ".crc32c"):
            if os.path.exists(p):
                os.remove(p)
        shutil.rmtree(out + ".partial", ignore_errors=True)
        kills = rnd.randint(1, 3)
        saw_ckpt_write = False
        for _ in range(kills):
            proc = subprocess.Popen([binary, "run", plan], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(rnd.uniform(0.05, durations[out] * 0.9))
            if proc.poll() is not None:  # finished before the kill: not a kill
                late += 1
                continue
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills_total += 1
            part = out + ".partial"
            if os.path.isdir(part) and any(not f.endswith(".ckpt") for f in os.listdir(part)):
                saw_ckpt_write = True
        have = recorded_tiles(out + ".journal")
        # An unfinished .npy must not load as an array: numpy checks the magic and version.
        if out.endswith(".npy") and os.path.exists(out) and len(have) < totals[out]:
            head = open(out, "rb").read(4096)
            unfinished_npy += 1
            # numpy reads magic, version, then a header that must be a dict literal.
            if head[:6] == b"\x93NUMPY" and head[6] in (1, 2, 3) and head[7] == 0:
                start = 10 if head[6] == 1 else 12
                if head[start:].lstrip().startswith(b"{"):
                    npy_loadable += 1
        r = run(binary, plan, report="report.json")
        why = None
        if r.returncode != 0:
            why = f"final run exit {r.returncode}: {r.stderr.strip()[-300:]}"
        else:
            steps = json.load(open("report.json"))["steps"]
            # A run whose kills all came after it finished is skipped as complete: no steps.
            computed = steps[0]["tiles_computed"] if steps else 0
            got = open(out, "rb").read()
            if got != refs[out]:
                diff = next(i for i, (x, y) in enumerate(zip(got, refs[out])) if x != y) if len(got) == len(refs[out]) else -1
                why = f"output differs from the reference (first byte {diff}, sizes {len(got)}/{len(refs[out])})"
            elif computed != totals[out] - len(have):
                why = f"computed {computed} tiles, expected {totals[out] - len(have)} ({len(have)} recorded)"
        mid_ckpt += saw_ckpt_write
        if why:
            failures.append((trial, out, kills, why))
            print(f"trial {trial:3d} {out} kills={kills} recorded={len(have)} FAIL: {why}", flush=True)
        else:
            passed += 1
            print(f"trial {trial:3d} {out} kills={kills} recorded={len(have)} ok", flush=True)
    print(
        f"summary: {passed} of {a.trials} trials resumed byte-identical with exactly the missing tiles "
        f"recomputed; {kills_total} SIGKILLs ({late} more runs finished before their kill), "
        f"{mid_ckpt} trials left a checkpoint write unfinished; {npy_loadable} of {unfinished_npy} "
        f"unfinished .npy outputs had a header numpy accepts"
    )
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if failures or npy_loadable else 0)


if __name__ == "__main__":
    main()
