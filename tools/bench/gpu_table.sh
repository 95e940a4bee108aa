#!/usr/bin/env bash
# BENCHMARKS.md's GPU tables (the jobs of issue 10: does the host keep up when the GPUs are fast?). REPEAT runs of each
# job (default 3), the median and spread of step wall, TFLOP/s, the bottleneck the report names,
# and process wall (start-up + tear-down), with in-core cuBLAS and cuBLASXt in the same run.
# GPU machine (nvidia-h200-x2), repository root, .dev/bin carried (docs/GPU.md).
#   bash tools/bench/gpu_table.sh [CASE...]      default: probe sq fp64 chain big peers
# Cases:
#   probe  page-cache page creation per mode and process count (tools/probes/page_creation_rate.py)
#   sq     32768² fp32 / tf32 / bf16 on 1 GPU and on 2 GPUs (inputs warm, output to a file,
#          durable = false)
#   fp64   60000² fp64 on 2 GPUs, default device memory and device_memory = "20GiB"; on one GPU
#          45000² (60000²'s inputs and output do not fit that machine's 64 GB disk); N64=… sets it
#   chain  the 43 GB request (A·B·C)ᵀ, A 3000×100, B 100×100, C 100×3 600 000, one step
#   big    100 000² tf32 on 2 GPUs, warm (inputs generated, then read once to warm them)
#   peers  in-core cuBLAS per GPU on 8192² tiles (fp32, tf32, bf16, fp64; torch) and cuBLASXt
#          fp32 on 1 and 2 GPUs on the 32768² inputs (tools/peers/cublasxt_torch.py)
# Extra engine lines for every mgmm-stream plan: ENGINE_EXTRA='write = "mmap"' etc., with
# TAG=_mmap appended to the job names so that the variant's reports stand beside the default's.
# KEEP=1 keeps the generated fp64 and 100 000² inputs for a following variant run.
# The first run after a case writes its inputs is reported apart, as NAME_first (see `first`).
# Log: $OUT/gpu_table.log; every run's report in $OUT/NAME-i.json; table at the end.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to gpu_table.log
N=${N:-32768}; REPEAT=${REPEAT:-3}; NGPU=$(gpu_count)
W=${W:-/tmp/keepup}; mkdir -p "$W"; cd "$W"
[ $# -gt 0 ] || set -- probe sq fp64 chain big peers
for c in "$@"; do
  case $c in probe|sq|fp64|chain|big|peers) ;;
  *) echo "unknown case '$c': use probe sq fp64 chain big peers" >&2; exit 2;; esac
done
EXTRA=()
[ -n "${ENGINE_EXTRA:-}" ] && EXTRA=("$ENGINE_EXTRA")
nvidia-smi --query-gpu=index,name,memory.used --format=csv | tee -a "$LOG"

# plan NAME A B OUT EXPR PRECISION DEVICES [ENGINE_LINE...]
plan() {
  local n=$1${TAG:-} a=$2 b=$3 o=$4 e=$5 p=$6 d=$7; shift 7
  {
    printf '[matrices.A]\npath = "%s"\n[matrices.B]\npath = "%s"\n' "$a" "$b"
    printf '[[step]]\noutput = "%s"\nexpr = "%s"\n[engine]\n' "$o" "$e"
    printf 'backend = "cuda"\nprecision = "%s"\ndevices = %s\ndurable = false\n' "$p" "$d"
    local l; for l in "$@" "${EXTRA[@]}"; do printf '%s\n' "$l"; done
  } > "$n.toml"
}
# runs NAME OUT: REPEAT runs of NAME.toml (OUT removed before each), reports in $OUT/NAME-i.json,
# process wall measured around the process.
runs() {
  local i n=$1${TAG:-}
  for i in $(seq 1 "$REPEAT"); do
    rm -f "$2" "$2.journal" "$2.crc32c"
    log "mgmm $n run $i"
    local t0 t1; t0=$(date +%s.%N)
    "$MGMM" run "$n.toml" --report "$OUT/$n-$i.json" >> "$LOG" 2>&1
    t1=$(date +%s.%N)
    python3 - "$OUT/$n-$i.json" "$t0" "$t1" <<'PY' | tee -a "$LOG"
import json, sys
r = json.load(open(sys.argv[1])); proc = float(sys.argv[3]) - float(sys.argv[2])
r["outer_wall_s"] = proc
json.dump(r, open(sys.argv[1], "w"), indent=1)
for s in r["steps"]:
    sh = ", ".join(f"{n} {100*v:.0f}%" for n, v in s["busy_shares"])
    print(f"  step {s['step']}: {s['wall_s']:.3f} s, {s['gflops_per_s']/1e3:.1f} TFLOP/s, bottleneck {s['bottleneck']}; busy {sh}")
    print("  setup:", ", ".join(f"{n} {v:.3f}" for n, v in s.get("setup_s", [])))
print(f"  process {proc:.2f} s (run's own {r['wall_s']:.2f} s); start-up:", ", ".join(f"{n} {v:.3f}" for n, v in r.get("startup_s", [])))
PY
  done
  rm -f "$2" "$2.journal" "$2.crc32c"
}

# first NAME OUT: one run of NAME.toml right after its inputs were written, reported as NAME_first
# beside the REPEAT runs: the kernel's first long-term pin of freshly written pages is slower
# (docs/measurements/HISTORY.md §20), a once-per-file cost that would otherwise land in run 1 of the first job.
first() {
  cp "$1${TAG:-}.toml" "$1_first${TAG:-}.toml"
  REPEAT=1 runs "$1_first" "$2"
}

case_probe() { log "page creation (8 GiB file in $W)"; logged python3 "$TOOLS/probes/page_creation_rate.py" "$W" 8 1,2,4,8,16,32; }

case_sq() {
  gen_matrix A.mgt "$N" "$N" 1; gen_matrix B.mgt "$N" "$N" 2
  cat A.mgt B.mgt > /dev/null
  local p
  for p in fp32 tf32 bf16; do
    plan "sq_${p}_g1" A.mgt B.mgt C.mgt "A @ B" "$p" "[0]" 'host_memory = "16GiB"'
    [ $p = fp32 ] && first "sq_${p}_g1" C.mgt
    runs "sq_${p}_g1" C.mgt
    if [ "$NGPU" -ge 2 ]; then
      plan "sq_${p}_g2" A.mgt B.mgt C.mgt "A @ B" "$p" '"all"' 'host_memory = "16GiB"'; runs "sq_${p}_g2" C.mgt
    fi
  done
}

case_fp64() {
  local n=${N64:-60000}
  [ "$NGPU" -ge 2 ] || n=${N64:-45000}
  log "fp64: ${n}² on $NGPU GPU(s)"
  GEN_DTYPE=f64 gen_matrix A64.mgt "$n" "$n" 3; GEN_DTYPE=f64 gen_matrix B64.mgt "$n" "$n" 4
  cat A64.mgt B64.mgt > /dev/null
  plan fp64 A64.mgt B64.mgt C64.mgt "A @ B" fp64 '"all"' 'host_memory = "32GiB"'
  first fp64 C64.mgt; runs fp64 C64.mgt
  plan fp64_20g A64.mgt B64.mgt C64.mgt "A @ B" fp64 '"all"' 'host_memory = "32GiB"' 'device_memory = "20GiB"'
  runs fp64_20g C64.mgt
  [ -n "${KEEP:-}" ] || rm -f A64.mgt B64.mgt A64.mgt.gen B64.mgt.gen
}

case_chain() {
  [ -f cA.mgt ] || "$MGMM" gen cA.mgt --rows 3000 --cols 100 --seed 11 2>&1 | tail -1
  [ -f cB.mgt ] || "$MGMM" gen cB.mgt --rows 100 --cols 100 --seed 12 2>&1 | tail -1
  [ -f cC.mgt ] || "$MGMM" gen cC.mgt --rows 100 --cols 3600000 --seed 13 --tile 4096 2>&1 | tail -1
  {
    printf '[matrices.A]\npath = "cA.mgt"\n[matrices.B]\npath = "cB.mgt"\n[matrices.C]\npath = "cC.mgt"\n'
    printf '[[step]]\noutput = "D.mgt"\nexpr = "(A @ B @ C).T"\n[engine]\n'
    printf 'backend = "cuda"\ndevices = "all"\ndurable = false\nhost_memory = "16GiB"\n'
    local l; for l in "${EXTRA[@]}"; do printf '%s\n' "$l"; done
  } > "chain${TAG:-}.toml"
  runs chain D.mgt
}

case_big() {
  [ "$NGPU" -ge 2 ] || { log "big: needs 2 GPUs"; return; }
  rm -f A.mgt B.mgt A.mgt.gen B.mgt.gen
  gen_matrix Ab.mgt 100000 100000 1; gen_matrix Bb.mgt 100000 100000 2
  cat Ab.mgt Bb.mgt > /dev/null
  plan big_tf32 Ab.mgt Bb.mgt Cb.mgt "A @ B" tf32 '"all"' 'host_memory = "32GiB"'
  first big_tf32 Cb.mgt; runs big_tf32 Cb.mgt
  [ -n "${KEEP:-}" ] || rm -f Ab.mgt Bb.mgt Ab.mgt.gen Bb.mgt.gen
}

case_peers() {
  log "in-core cuBLAS (torch), 8192² per GPU"
  python3 - <<'PY' 2>&1 | tee -a "$LOG"
import torch, time
n = 8192
for name, dt, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                       ("bf16", torch.bfloat16, False), ("fp64", torch.float64, False)):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    for d in range(torch.cuda.device_count()):
        a = torch.randn(n, n, device=f"cuda:{d}").to(dt); b = torch.randn(n, n, device=f"cuda:{d}").to(dt)
        for _ in range(2): a @ b
        torch.cuda.synchronize(d); t = time.perf_counter(); r = 5
        for _ in range(r): a @ b
        torch.cuda.synchronize(d); dt_s = (time.perf_counter() - t) / r
        print(f"peer cuBLAS in-core {name} cuda:{d}: {2*n**3/dt_s/1e12:.1f} TFLOP/s")
PY
  gen_matrix A.mgt "$N" "$N" 1; gen_matrix B.mgt "$N" "$N" 2
  export_npy A.mgt A.npy; export_npy B.mgt B.npy
  python3 "$TOOLS/peers/cublasxt_torch.py" --a A.npy --b B.npy --out peer_C.bin --ngpu 1 --which cublasxt 2>&1 | grep peer | tee -a "$LOG"
  [ "$NGPU" -ge 2 ] && python3 "$TOOLS/peers/cublasxt_torch.py" --a A.npy --b B.npy --out peer_C.bin --ngpu 2 --which cublasxt 2>&1 | grep peer | tee -a "$LOG"
  rm -f A.npy B.npy peer_C.bin
}

for c in "$@"; do log "case $c ($(date +%T))"; "case_$c"; done

log "table (median [min–max] of $REPEAT runs)"
python3 - "$OUT" <<'PY' | tee -a "$LOG"
import glob, json, os, re, statistics as st, sys
runs = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*-[0-9]*.json"))):
    name = re.sub(r"-\d+\.json$", "", os.path.basename(f))
    r = json.load(open(f))
    if not r.get("steps"):
        continue
    s = max(r["steps"], key=lambda s: s["wall_s"])
    runs.setdefault(name, []).append((sum(x["wall_s"] for x in r["steps"]), s["gflops_per_s"] / 1e3,
                                      s["bottleneck"], r.get("outer_wall_s", 0) - sum(x["wall_s"] for x in r["steps"])))
print(f"{'job':<16} {'step wall s':<22} {'TFLOP/s':<20} {'process − step s':<18} bottleneck")
for name, v in runs.items():
    w = [x[0] for x in v]; t = [x[1] for x in v]; o = [x[3] for x in v]
    f = lambda a, d=3: f"{st.median(a):.{d}f} [{min(a):.{d}f}–{max(a):.{d}f}]"
    print(f"{name:<16} {f(w):<22} {f(t,1):<20} {f(o,2):<18} {','.join(sorted(set(x[2] for x in v)))}")
PY
