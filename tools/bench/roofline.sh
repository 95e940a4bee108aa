#!/usr/bin/env bash
# Issue 35's goals on one GPU, side by side in one call, every ratio against torch's in-core
# GEMM measured in the same call: 32768² (N) fp32 from .mgt and from .npy (interleaved, REPEAT
# runs each), fp64 from .npy (host_memory 16 and 32 GiB), tf32 and bf16 from .mgt, each run's
# step wall and process wall (start-up and exit: process − step), `verify` of the fp32 product,
# the driver's own start-up floor (cuInit + a context, tools/probes/cuda_startup_costs.py), and
# torch's in-core SGEMM / DGEMM / TF32 / BF16 rates. Inputs warm, outputs to files, durable =
# false. GPU machine (one GPU is enough), repository root, .dev/bin carried (docs/GPU.md).
# Disk: the inputs, 4·N²·4 + 2·N²·8 bytes, and one output at a time (43 GB at 32768). Log:
# $OUT/roofline.log, reports (roof_NAME_i.json) in $OUT/roofline_reports.tgz, and the table at the end.
# TRACE=1: round 1's runs write their timelines (MGMM_TRACE) to $OUT/trace_NAME.json, and
# tools/trace_gaps.py's reading of each goes into the log. VERIFY=0: no verify of the fp32
# product. NO_PROBE=1: no driver start-up probe. PEERS="fp32 ...": torch's in-core rates for
# these precisions only (default all four; at N = 65536 only fp32 fits an 80 GB card). KEEP=1:
# the work folder W and its inputs are kept (another script may read them: ooc_disk_bound.sh
# generates the same A.mgt and B.mgt). Only the inputs the jobs (and verify) read are generated.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to roofline.log
N=${N:-32768}; REPEAT=${REPEAT:-2}
# The jobs, in the order of each round (more are defined below: tf32_npy, bf16_npy, NAME_copy,
# NAME_direct).
JOBS=${JOBS:-fp32_mgt fp32_npy fp64_npy fp64_npy32 tf32_mgt bf16_mgt}
VERIFY=${VERIFY:-1}
W=${W:-/tmp/roof}; mkdir -p "$W"; cd "$W"
wants() { [[ " $JOBS " =~ $1 ]]; } # wants REGEX: some job's name matches
if wants '(fp32|tf32|bf16)_' || [ "$VERIFY" = 1 ]; then
  gen_matrix A.mgt "$N" "$N" 1; gen_matrix B.mgt "$N" "$N" 2
fi
if wants '(fp32|tf32|bf16)_npy'; then export_npy A.mgt A.npy; export_npy B.mgt B.npy; fi
if wants 'fp64_npy'; then GEN_DTYPE=f64 gen_matrix A64.npy "$N" "$N" 3; GEN_DTYPE=f64 gen_matrix B64.npy "$N" "$N" 4; fi
if wants 'fp64_mgt'; then GEN_DTYPE=f64 gen_matrix A64.mgt "$N" "$N" 3; GEN_DTYPE=f64 gen_matrix B64.mgt "$N" "$N" 4; fi
for f in A.mgt B.mgt A.npy B.npy A64.npy B64.npy A64.mgt B64.mgt; do [ -f $f ] && cat $f > /dev/null; done
E=("backend = \"${BACKEND:-cuda}\"" 'devices = [0]' 'host_memory = "16GiB"' 'durable = false')
write_plan fp32_mgt.toml A.mgt B.mgt C_fp32_mgt.mgt "${E[@]}"
write_plan fp32_npy.toml A.npy B.npy C_fp32_npy.npy "${E[@]}"
write_plan fp64_npy.toml A64.npy B64.npy C_fp64_npy.npy "${E[@]}" 'precision = "fp64"'
write_plan fp64_mgt.toml A64.mgt B64.mgt C_fp64_mgt.mgt "${E[@]}" 'precision = "fp64"'
# A k-step as deep as the matrix: A's blocks are whole rows of its file, page-locked as they are
# (decision 0023), so staging copies only B's narrow blocks — half the bytes of fp64_npy's copies.
write_plan fp64_npy_k32.toml A64.npy B64.npy C_fp64_npy_k32.npy "${E[@]/16GiB/32GiB}" 'precision = "fp64"' "tile = [8192, 8192, $N]"
# The same with room to page-lock both 8 GiB inputs at once: at 16 GiB the pools leave 11.5 GiB,
# and the ranges released to make room cost staging's thread (2026-12-06d: 2.0 s against 2.3-2.4).
write_plan fp64_npy32.toml A64.npy B64.npy C_fp64_npy32.npy "${E[@]/16GiB/32GiB}" 'precision = "fp64"'
write_plan tf32_mgt.toml A.mgt B.mgt C_tf32_mgt.mgt "${E[@]}" 'precision = "tf32"'
write_plan bf16_mgt.toml A.mgt B.mgt C_bf16_mgt.mgt "${E[@]}" 'precision = "bf16"'
write_plan tf32_npy.toml A.npy B.npy C_tf32_npy.npy "${E[@]}" 'precision = "tf32"'
write_plan bf16_npy.toml A.npy B.npy C_bf16_npy.npy "${E[@]}" 'precision = "bf16"'
# Each job with `staging` set: NAME_copy, NAME_direct (JOBS to run them; what `auto` picks for a
# row-major file was measured so, BENCHMARKS). NAME_pread: the same plan run with
# MGMM_READ_PREAD=1 (staging's copies by `pread`, none out of the files' maps). NAME_opN (N = 1,
# 2, 4, 8): N threads populate the output's pages (MGMM_OUTPREP_THREADS=N). NAME_sgN (N = 1, 4,
# 9): the first N output tiles computed k-chunk by k-chunk (MGMM_START_GROUP=N). NAME_wi: the
# warm-up GEMM before the backend is handed over, whatever the precision (MGMM_WARMUP_INLINE=1).
# NAME_cb: B's blocks copied, A's page-locked (MGMM_AUTO_COPIES=b). NAME_gsN (N = 1, 2): the
# lane's GEMMs on N streams (MGMM_GEMM_STREAMS=N).
for f in fp32_mgt fp32_npy fp64_npy fp64_npy32 fp64_npy_k32 fp64_mgt tf32_mgt bf16_mgt tf32_npy bf16_npy; do
  for m in copy direct; do
    sed -e "s/C_$f\./C_${f}_$m./" -e "s/^\[engine\]$/[engine]\nstaging = \"$m\"/" "$f.toml" > "${f}_$m.toml"
  done
  for m in "" _copy; do sed -e "s/C_$f$m\./C_$f${m}_pread./" "$f$m.toml" > "$f${m}_pread.toml"; done
  # NAME_opN: the same plan with N threads populating the output's pages (MGMM_OUTPREP_THREADS).
  for t in 1 2 4 8; do sed -e "s/C_$f\./C_${f}_op$t./" "$f.toml" > "${f}_op$t.toml"; done
  # NAME_sgN: the same plan with a start group of N tiles (MGMM_START_GROUP).
  for t in 1 4 9; do sed -e "s/C_$f\./C_${f}_sg$t./" "$f.toml" > "${f}_sg$t.toml"; done
  sed -e "s/C_$f\./C_${f}_wi./" "$f.toml" > "${f}_wi.toml"
  sed -e "s/C_$f\./C_${f}_cb./" "$f.toml" > "${f}_cb.toml"
  for t in 1 2; do sed -e "s/C_$f\./C_${f}_gs$t./" "$f.toml" > "${f}_gs$t.toml"; done
done

log "driver start-up floor and torch in-core rates"
[ -n "${NO_PROBE:-}" ] || python3 "$TOOLS/probes/cuda_startup_costs.py" 2>&1 | tee -a "$LOG"
python3 - "$N" "${PEERS:-fp32 fp64 tf32 bf16}" <<'PY' 2>&1 | tee -a "$LOG"
import sys, time, torch
n, want = int(sys.argv[1]), sys.argv[2].split()
def rate(dt, tf32=False):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    a = torch.randn(n, n, device="cuda", dtype=dt); b = torch.randn(n, n, device="cuda", dtype=dt)
    for _ in range(2): a @ b
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(3): a @ b
    torch.cuda.synchronize(); r = 3 * 2 * n**3 / (time.perf_counter() - t) / 1e12
    del a, b; torch.cuda.empty_cache(); return r
for name, dt, tf in (("fp32", torch.float32, False), ("fp64", torch.float64, False),
                     ("tf32", torch.float32, True), ("bf16", torch.bfloat16, False)):
    if name in want:
        print(f"PEER {name} torch in-core {n}^2: {rate(dt, tf):.1f} TFLOP/s")
PY

run1() { # NAME I: run NAME.toml once, process wall in NAME_I.time
  rm -rf "C_$1".* ; local s tr=(); s=$(date +%s%N)
  [ -n "${TRACE:-}" ] && [ "$2" = 1 ] && tr=(env "MGMM_TRACE=$OUT/trace_$1.json")
  [[ $1 == *_pread ]] && tr=(env MGMM_READ_PREAD=1 "${tr[@]:1}")
  [[ $1 =~ _op([0-9]+)$ ]] && tr=(env "MGMM_OUTPREP_THREADS=${BASH_REMATCH[1]}" "${tr[@]:1}")
  [[ $1 =~ _sg([0-9]+)$ ]] && tr=(env "MGMM_START_GROUP=${BASH_REMATCH[1]}" "${tr[@]:1}")
  [[ $1 == *_wi ]] && tr=(env MGMM_WARMUP_INLINE=1 "${tr[@]:1}")
  [[ $1 == *_cb ]] && tr=(env MGMM_AUTO_COPIES=b "${tr[@]:1}")
  [[ $1 =~ _gs([0-9]+)$ ]] && tr=(env "MGMM_GEMM_STREAMS=${BASH_REMATCH[1]}" "${tr[@]:1}")
  "${tr[@]}" "$MGMM" run "$1.toml" --quiet --report "$OUT/roof_$1_$2.json" 2>&1 | tail -2 | tee -a "$LOG"
  echo $(( ($(date +%s%N) - s) / 1000000 )) > "$1_$2.ms"
  [ "$2" = v ] || rm -rf "C_$1".*   # the disk holds the inputs and one output at a time
}
for i in $(seq 1 "$REPEAT"); do
  for j in $JOBS; do log "run $i $j"; run1 $j "$i"; done
done
if [ -n "${TRACE:-}" ]; then
  for j in $JOBS; do
    log "where $j's GPU waited (round 1, tools/trace_gaps.py)"
    python3 "$TOOLS/trace_gaps.py" "$OUT/trace_$j.json" --top 6 2>&1 | tee -a "$LOG"
  done
fi
if [ "$VERIFY" = 1 ]; then
  log "verify of the fp32 product, twice"
  run1 fp32_mgt v
  for i in 1 2; do
    s=$(date +%s%N); "$MGMM" verify fp32_mgt.toml 2>&1 | tail -3 | tee -a "$LOG"
    echo $(( ($(date +%s%N) - s) / 1000000 )) > "verify_$i.ms"
  done
fi
python3 - "$N" "$REPEAT" "$OUT" $JOBS <<'PY' 2>&1 | tee -a "$LOG"
import json, re, statistics, sys
n, reps, out, jobs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
peer = {m[1]: float(m[2]) for m in re.finditer(r"PEER (\w+) torch in-core \d+\^2: ([\d.]+)", open(f"{out}/roofline.log").read())}
def row(name):
    st = [json.load(open(f"{out}/roof_{name}_{i}.json"))["steps"][0] for i in range(1, reps + 1)]
    pw = [int(open(f"{name}_{i}.ms").read()) / 1e3 for i in range(1, reps + 1)]
    return st, pw
print(f"| {n}², 1 GPU | step (each run) | TFLOP/s | process − step | first GEMM | bottleneck | torch in-core | ratio |")
walls = {}
for name in jobs:
    st, pw = row(name)
    w = [s["wall_s"] for s in st]; walls[name] = w
    tf = [2 * n**3 / x / 1e12 for x in w]
    p = peer.get(name.split("_")[0])
    print(f"| {name} | {' / '.join(f'{x:.3f}' for x in w)} s | {' / '.join(f'{x:.1f}' for x in tf)} | "
          f"{' / '.join(f'{b - a:.2f}' for a, b in zip(w, pw))} s | {' / '.join(str(round(s.get('first_gemm_s') or 0, 3)) for s in st)} s | "
          f"{st[-1]['bottleneck']} | {p} | {' / '.join(f'{x / p:.2f}' for x in tf) if p else '-'} |")
for npy in ("fp32_npy", "fp32_npy_copy", "fp32_npy_direct"):
    if npy in walls and "fp32_mgt" in walls:
        r = [a / b for a, b in zip(walls[npy], walls["fp32_mgt"])]
        print(f"RESULT {npy} / fp32_mgt (interleaved):", " / ".join(f"{x:.3f}" for x in r), "(goal ≤ 1.05)")
for name in jobs:
    if name.endswith("_pread") and name[:-6] in walls:
        r = [a / b for a, b in zip(walls[name[:-6]], walls[name])]
        print(f"RESULT {name[:-6]} / {name} (copies out of the map against pread, interleaved):", " / ".join(f"{x:.3f}" for x in r))
import os
if not os.path.exists(f"{out}/roof_fp32_mgt_v.json"):
    sys.exit(0)
v = json.load(open(f"{out}/roof_fp32_mgt_v.json"))["steps"][0]["wall_s"]
for i in (1, 2):
    t = int(open(f"verify_{i}.ms").read()) / 1e3
    print(f"RESULT verify {t:.2f} s (process) = {t / v:.2f} × the product's step {v:.3f} s (goal ≤ 0.25)")
PY
# At most a few files come back from the GPU machine: the reports in one archive.
(cd "$OUT" && tar czf roofline_reports.tgz roof_*.json && rm -f roof_*.json)
cd / && { [ -n "${KEEP:-}" ] || rm -rf "$W"; }
