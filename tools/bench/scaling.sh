#!/usr/bin/env bash
# Issue 37 on the multi-GPU machines (nvidia-h200-x2/-x4/-x8), everything in one call per case.
# GPU machine, repository root, .dev/bin carried (docs/GPU.md); needs nothing but python3+numpy
# (and torch for the in-core peer).
#   bash tools/bench/scaling.sh [CASE...]          default: startup scale f64
# Cases:
#   scale    N² fp32 from .mgt files (NS, default "32768 65536 100000") on 1, 2, 4, 8 GPUs (as many
#            as there are; GPUS="1 2 4 8" to choose), REPEAT runs each (default 2): step wall,
#            TFLOP/s, per-GPU rate and its ratio to the one-GPU rate at that size (goal ≥ 0.9),
#            bytes read against the minimum (the shared reader: stays 1.0 as GPUs are added),
#            the busy shares of every stage (what bounds a run that misses the goal), process −
#            step; in-core cuBLAS SGEMM per GPU (torch) beside it. Inputs warm (read once first).
#   f64      90 000² (N64) float64 from .npy on every GPU with device_memory = "20GiB" (the
#            eight-24-GB-card request): native fp64, then fp64_emulated;
#            each checked independently: 4 random 256×256 blocks recomputed in numpy float64 from
#            the .npy inputs, the error relative to (K+2)·u·|A||B|. Disk: 3 × 65 GB.
#   startup  a small job (8192² fp32) on 1, 2, 4, 8 GPUs, REPEAT × 3 runs: process − step by GPU
#            count, and a MGMM_TRACE timeline of the last run of each (start-up spans:
#            tools/trace_sum.py) — which part grows with the GPU count.
# Log: $OUT/scaling.log; reports $OUT/NAME-i.json; traces $OUT/trace_startup_G.json.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to scaling.log
REPEAT=${REPEAT:-2}; NGPU=$(gpu_count)
NS=${NS:-"32768 65536 100000"}; N64=${N64:-90000}
GPUS=${GPUS:-"1 2 4 8"}
W=${W:-/tmp/scaling}; mkdir -p "$W"; cd "$W"
[ $# -gt 0 ] || set -- startup scale f64
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee -a "$LOG"
counts() { local g; for g in $GPUS; do [ "$g" -le "$NGPU" ] && echo "$g"; done; }
devs() { python3 -c "import sys; print('[' + ', '.join(map(str, range(int(sys.argv[1])))) + ']')" "$1"; }

# one NAME N G: REPEAT runs of NAME.toml; one summary line per run.
one() {
  local name=$1 n=$2 g=$3 i t0 t1
  for i in $(seq 1 "$REPEAT"); do
    rm -rf "C_$name".*
    t0=$(date +%s.%N)
    "$MGMM" run "$name.toml" --report "$OUT/$name-$i.json" >> "$LOG" 2>&1
    t1=$(date +%s.%N)
    python3 - "$OUT/$name-$i.json" "$n" "$g" "$t0" "$t1" <<'PY' | tee -a "$LOG"
import json, sys
r = json.load(open(sys.argv[1]))["steps"][0]; n, g = int(sys.argv[2]), int(sys.argv[3])
proc = float(sys.argv[5]) - float(sys.argv[4]); tf = 2 * n**3 / r["wall_s"] / 1e12
shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r.get("busy_shares", []))
print(f"RESULT n={n} gpus={g} step={r['wall_s']:.3f}s {tf:.1f} TFLOP/s per_gpu={tf / g:.2f} "
      f"read/min={r['read_bytes'] / max(r['min_read_bytes'], 1):.3f} process-step={proc - r['wall_s']:.2f}s "
      f"bottleneck={r['bottleneck']} busy: {shares}")
PY
  done
}

for c in "$@"; do
  case $c in
  scale)
    log "peer: in-core cuBLAS SGEMM 8192² per GPU"
    python3 -c "
import time, torch
n = 8192; a = torch.randn(n, n, device='cuda'); b = torch.randn(n, n, device='cuda')
for _ in range(3): a @ b
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(10): a @ b
torch.cuda.synchronize(); print(f'in-core SGEMM: {20 * n**3 / (time.perf_counter() - t) / 1e12:.1f} TFLOP/s')" 2>&1 | tee -a "$LOG"
    for n in $NS; do
      gen_matrix "A$n.mgt" "$n" "$n" 1; gen_matrix "B$n.mgt" "$n" "$n" 2
      cat "A$n.mgt" "B$n.mgt" > /dev/null
      for g in $(counts); do
        write_plan "s${n}_$g.toml" "A$n.mgt" "B$n.mgt" "C_s${n}_$g.mgt" 'backend = "cuda"' \
          'precision = "fp32"' "devices = $(devs "$g")" 'host_memory = "32GiB"' 'durable = false'
        log "scale: ${n}² fp32 on $g GPU(s)"
        one "s${n}_$g" "$n" "$g"
      done
      rm -f "A$n.mgt"* "B$n.mgt"* C_s*
    done
    python3 - "$LOG" <<'PY' | tee -a "$LOG"
import re, sys, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    m = re.search(r"RESULT n=(\d+) gpus=(\d+) step=\S+ (\S+) TFLOP/s per_gpu=(\S+)", line)
    if m: rows[(int(m[1]), int(m[2]))].append(float(m[4]))
print("per-GPU rate (best of the runs) and its ratio to one GPU at that size:")
for (n, g) in sorted(rows):
    one = max(rows.get((n, 1), [0])) or float("nan")
    print(f"  {n}² on {g}: {max(rows[(n, g)]):.2f} TFLOP/s per GPU = {max(rows[(n, g)]) / one:.2f} × one GPU")
PY
    ;;
  f64)
    GEN_DTYPE=f64 gen_matrix A64.npy "$N64" "$N64" 1; GEN_DTYPE=f64 gen_matrix B64.npy "$N64" "$N64" 2
    for p in fp64 fp64_emulated; do
      write_plan "f64_$p.toml" A64.npy B64.npy "C_f64_$p.npy" 'backend = "cuda"' "precision = \"$p\"" \
        'devices = "all"' 'device_memory = "20GiB"' 'host_memory = "64GiB"' 'durable = false'
      log "f64: ${N64}² $p on every GPU, device_memory = 20GiB"
      REPEAT=1 one "f64_$p" "$N64" "$NGPU"
      python3 - "C_f64_$p.npy" "$N64" <<'PY' | tee -a "$LOG"
import sys, numpy as np
c = np.load(sys.argv[1], mmap_mode="r"); n = int(sys.argv[2])
A = np.load("A64.npy", mmap_mode="r"); B = np.load("B64.npy", mmap_mode="r")
rng = np.random.default_rng(1); u = 2.0 ** -53; worst = 0.0
for _ in range(4):
    i, j = (int(x) for x in rng.integers(0, n - 256, 2))
    a = np.asarray(A[i:i + 256], np.float64); b = np.asarray(B[:, j:j + 256], np.float64)
    ref = a @ b; g = np.abs(a) @ np.abs(b)
    worst = max(worst, float((np.abs(np.asarray(c[i:i + 256, j:j + 256]) - ref) / ((n + 2) * u * g)).max()))
print(f"independent check, {sys.argv[1]}: 4 blocks of 256², worst |C − A·B| / ((K+2)·u·|A||B|) = {worst:.3g} (≤ 1 within DGEMM's bound; the numpy reference has its own rounding)")
PY
      rm -f "C_f64_$p.npy"*
    done
    rm -f A64.npy* B64.npy*
    ;;
  startup)
    gen_matrix A8.mgt 8192 8192 1; gen_matrix B8.mgt 8192 8192 2; cat A8.mgt B8.mgt > /dev/null
    for g in $(counts); do
      write_plan "st_$g.toml" A8.mgt B8.mgt "C_st_$g.mgt" 'backend = "cuda"' 'precision = "fp32"' \
        "devices = $(devs "$g")" 'durable = false'
      log "startup: 8192² fp32 on $g GPU(s)"
      REPEAT=$((REPEAT * 3)) one "st_$g" 8192 "$g"
      rm -f C_st_*; MGMM_TRACE="$OUT/trace_startup_$g.json" "$MGMM" run "st_$g.toml" -q >> "$LOG" 2>&1
      python3 "$TOOLS/trace_sum.py" "$OUT/trace_startup_$g.json" 2>&1 | head -20 | tee -a "$LOG"
    done
    rm -f A8.mgt* B8.mgt* C_st_*
    ;;
  *) echo "unknown case '$c': use scale f64 startup" >&2; exit 2 ;;
  esac
done
