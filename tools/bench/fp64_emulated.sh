#!/usr/bin/env bash
# Issue 34's goals on one GPU, side by side in one call: N² (default 32768) f64 from .npy
# files, the engine's native fp64 against precision = "fp64_emulated" (REPS runs each,
# interleaved), beside torch's in-core DGEMM and int8 GEMM rates (NN, and TN: B given as the
# transpose of an n×k array); then both outputs compared element by element (relative to
# |A||B|, in row bands) and the emulated one verified (`verify`: Freivalds plus the
# componentwise check; VERIFY=0 leaves it out). GPU machine, repository root, .dev/bin carried (docs/GPU.md).
# Log: $OUT/fp64_emulated.log,
# reports $OUT/{fp64,fp64_emulated}_i.json. TILES: see below; KEEP=1 leaves the work folder. Disk: 4·N²·8 bytes (32 GiB at 32768).
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to fp64_emulated.log
N=${N:-32768}; REPS=${REPS:-2}
W=${W:-/tmp/fp64e}; mkdir -p "$W"; cd "$W"
GEN_DTYPE=f64 gen_matrix A.npy "$N" "$N" 1
GEN_DTYPE=f64 gen_matrix B.npy "$N" "$N" 2
cat A.npy B.npy > /dev/null
for p in fp64 fp64_emulated; do
  write_plan "$p.toml" A.npy B.npy "C_$p.npy" 'backend = "cuda"' "precision = \"$p\"" \
    'devices = [0]' 'host_memory = "32GiB"' 'durable = false'
done
log "peers: torch in-core DGEMM and int8 GEMM"
python3 - <<'PY' 2>&1 | tee -a "$LOG"
import time, torch
def rate(f, flop, reps=10):
    for _ in range(3): f()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(reps): f()
    torch.cuda.synchronize(); return flop * reps / (time.perf_counter() - t) / 1e12
for n in (8192, 16384):
    a = torch.randn(n, n, device="cuda", dtype=torch.float64); b = torch.randn(n, n, device="cuda", dtype=torch.float64)
    print(f"torch DGEMM in-core {n}^2: {rate(lambda: a @ b, 2 * n**3):.1f} TFLOP/s")
    del a, b
    a8 = torch.randint(-128, 127, (n, n), device="cuda", dtype=torch.int8)
    b8 = torch.randint(-128, 127, (n, n), device="cuda", dtype=torch.int8)
    print(f"torch._int_mm NN {n}^2: {rate(lambda: torch._int_mm(a8, b8), 2 * n**3):.0f} TOP/s")
    print(f"torch._int_mm TN (b as the transpose of an n×k array) {n}^2: {rate(lambda: torch._int_mm(a8, b8.t()), 2 * n**3):.0f} TOP/s")
    del a8, b8
PY
for i in $(seq 1 "$REPS"); do
  for p in fp64 fp64_emulated; do
    rm -rf "C_$p.npy" "C_$p.npy".*
    log "run $i: $p"
    timed "$MGMM" run "$p.toml" --report "$OUT/${p}_$i.json" 2>&1 | tee -a "$LOG" | grep -E "wall|bottleneck|emulation|error|max RSS"
    python3 - "$OUT/${p}_$i.json" "$N" <<'PY' | tee -a "$LOG"
import json, sys
r = json.load(open(sys.argv[1]))["steps"][0]; n = int(sys.argv[2])
print(f"{r['precision']}: step {r['wall_s']:.3f} s = {2 * n**3 / r['wall_s'] / 1e12:.1f} TFLOP/s; emulation {r.get('emulation')}")
PY
  done
done
log "outputs compared: |emulated − native| / (|A||B|), row bands"
python3 - "$N" <<'PY' 2>&1 | tee -a "$LOG"
import sys, numpy as np
n = int(sys.argv[1])
A = np.load("A.npy", mmap_mode="r"); B = np.load("B.npy", mmap_mode="r")
E = np.load("C_fp64_emulated.npy", mmap_mode="r"); F = np.load("C_fp64.npy", mmap_mode="r")
rows = np.sort(np.random.default_rng(0).choice(n, size=64, replace=False))
Ar = np.abs(np.asarray(A[rows], np.float64))
G = np.zeros((len(rows), n))
for k0 in range(0, n, 2048):  # |A||B| for the sampled rows, B read once
    G += Ar[:, k0:k0 + 2048] @ np.abs(np.asarray(B[k0:k0 + 2048], np.float64))
d = np.abs(np.asarray(E[rows]) - np.asarray(F[rows])) / G
u = 2.0 ** -53
print(f"64 sampled rows: max |E−F|/(|A||B|) = {d.max() / u:.1f} u, median {np.median(d) / u:.3f} u "
      f"(each is within (K+2)u = {n + 2} u of the exact product)")
PY
# VERIFY=0 skips it (the componentwise check runs on the CPU: 115 s at 32768² on an H200 host).
if [ "${VERIFY:-1}" = 1 ]; then
  log "verify (Freivalds + componentwise) of the emulated output"
  "$MGMM" verify fp64_emulated.toml 2>&1 | tee -a "$LOG" | tail -6
fi
# TILES="16384 [8192,8192,32768]": the emulated step again with each of these engine.tile values
# (the int8 GEMM's rate grows with its size: 940–960 TOP/s at 8192², 1,284 at 16384² on an H200).
for tl in ${TILES:-}; do
  rm -rf C_fp64_emulated.npy C_fp64_emulated.npy.*
  log "fp64_emulated with engine.tile = $tl"
  timed "$MGMM" run fp64_emulated.toml --set "engine.tile=$tl" --report "$OUT/fp64_emulated_tile$(echo "$tl" | tr -dc 0-9).json" 2>&1 | tee -a "$LOG" | grep -E "wall|bottleneck|emulation|error|tile"
done
cd / && { [ -n "${KEEP:-}" ] || rm -rf "$W"; }  # KEEP=1: the inputs stay (a trace of the same files next)
