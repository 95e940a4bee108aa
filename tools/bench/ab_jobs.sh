#!/usr/bin/env bash
# gpu_table.sh's jobs with two or more builds (or settings), runs interleaved (A, B, …, A, B, …) so
# that a host's drift hits every variant alike: a before/after measurement of one change on the
# jobs of tools/bench/gpu_table.sh. GPU machine, repository root, binaries carried (docs/GPU.md).
#   VARIANTS="A=.dev/bin/mgmm-a B=.dev/bin/mgmm-stream B1=.dev/bin/mgmm-stream:MGMM_X=1" \
#     RUNS=2 bash tools/bench/ab_jobs.sh [CASE...]      default: sq chain fp64 big
# A variant is NAME=BINARY[:VAR=VALUE[,VAR=VALUE…]] (environment set for its runs only); an
# item --set=KEY=VALUE is passed to `run` instead (C=.dev/bin/mgmm-stream:--set=engine.staging=copy).
# Cases (as gpu_table.sh; every plan `durable = false`, output to a file, inputs warm):
#   sq     32768² tf32 / bf16 / fp32 on every GPU, tf32 on GPU 0 (host_memory 16 GiB)
#   chain  the 43 GB request (A·B·C)ᵀ, one step, every GPU (host_memory 16 GiB)
#   fp64   60000² fp64 on every GPU (45000² on one), host_memory 32 GiB (FP64_HOST=…); and with
#          device_memory = "20GiB" (first two variants only, one run each)
#   big    100 000² tf32 on every GPU, host_memory 32 GiB (two GPUs only)
# Each case's inputs are generated, read once, and run once untimed (the first run after
# writing pays the kernel's first pin of fresh pages, docs/measurements/HISTORY.md §20). Consecutive outputs'
# checksum tables are compared: every variant must write the same bytes.
# TRACE=1: round 1's runs also write their timeline (MGMM_TRACE) to $OUT/JOB_VARIANT_1.trace.json
# (read them with tools/trace_gaps.py).
# Log: $OUT/ab_jobs.log; reports $OUT/JOB_VARIANT_i.json; the table at the end.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to ab_jobs.log
RUNS=${RUNS:-2}; NGPU=$(gpu_count)
read -r -a VARS <<< "${VARIANTS:?set VARIANTS, e.g. A=.dev/bin/mgmm-a B=.dev/bin/mgmm-stream}"
W=${W:-/tmp/ab_jobs}; mkdir -p "$W"; cd "$W"
[ $# -gt 0 ] || set -- sq chain fp64 big
nvidia-smi --query-gpu=index,name --format=csv,noheader | tee -a "$LOG"

# plan NAME A B OUT EXPR PRECISION DEVICES [ENGINE_LINE...]
plan() {
  local n=$1 a=$2 b=$3 o=$4 e=$5 p=$6 d=$7; shift 7
  {
    printf '[matrices.A]\npath = "%s"\n[matrices.B]\npath = "%s"\n' "$a" "$b"
    printf '[[step]]\noutput = "%s"\nexpr = "%s"\n[engine]\n' "$o" "$e"
    printf 'backend = "cuda"\nprecision = "%s"\ndevices = %s\ndurable = false\n' "$p" "$d"
    local l; for l in "$@"; do printf '%s\n' "$l"; done
  } > "$n.toml"
}

# table_crc FILE: the .mgt's checksum table (header flag bit 0), as hex, or "-".
table_crc() {
  python3 - "$1" <<'PY'
import hashlib, struct, sys
f = open(sys.argv[1], "rb"); h = f.read(76)
rows, cols = struct.unpack_from("<QQ", h, 16); tr, tc = struct.unpack_from("<II", h, 32)
flags, off = struct.unpack_from("<QQ", h, 56)
if not flags & 1: print("-"); sys.exit()
n = -(-rows // tr) * -(-cols // tc); f.seek(off)
print(hashlib.md5(f.read(4 * n)).hexdigest())
PY
}

# one NAME OUT VARIANT TAG: run NAME.toml with VARIANT, report $OUT/NAME_TAG.json, one line.
one() {
  local n=$1 o=$2 v=$3 tag=$4 bin items=() env=() args=() x t0 t1
  bin=${v#*=}; bin=${bin%%:*}
  [[ $v == *:* ]] && IFS=, read -r -a items <<< "${v#*:}"
  for x in "${items[@]}"; do
    if [[ $x == --set=* ]]; then args+=(--set "${x#--set=}"); else env+=("$x"); fi
  done
  rm -f "$o" "$o.journal" "$o.crc32c"
  [ -n "${TRACE:-}" ] && [[ $tag == *_1 ]] && env+=("MGMM_TRACE=$OUT/${n}_$tag.trace.json")
  t0=$(date +%s.%N)
  env "${env[@]}" "$ROOT/$bin" run "$n.toml" "${args[@]}" -q --report "$OUT/${n}_$tag.json" >> "$LOG" 2>&1
  local rc=$?
  t1=$(date +%s.%N)
  local crc; crc=$(table_crc "$o" 2>/dev/null || echo "?")
  python3 - "$OUT/${n}_$tag.json" "$t0" "$t1" "$rc" "$crc" <<'PY' | tee -a "$LOG"
import json, os, sys
f, t0, t1, rc, crc = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
name = os.path.basename(f)[:-5]
if rc != "0" or not os.path.exists(f):
    print(f"{name}: exit {rc}"); sys.exit()
r = json.load(open(f)); r["outer_wall_s"] = t1 - t0; r["table_md5"] = crc
json.dump(r, open(f, "w"), indent=1)
s = max(r["steps"], key=lambda s: s["wall_s"]); step = sum(x["wall_s"] for x in r["steps"])
top = ", ".join(f"{n} {100*v:.0f}%" for n, v in s["busy_shares"][:4])
print(f"{name}: step {step:.3f} s, {s['gflops_per_s']/1e3:.1f} TFLOP/s, process − step {t1-t0-step:.2f} s, "
      f"{s['write_mode']}, peak RSS {s['peak_rss_bytes']/2**30:.1f} GiB, table {crc[:8]}; {top}")
PY
}

# ab NAME OUT [N_VARIANTS]: one untimed warm-up run, then RUNS rounds over the variants.
ab() {
  local n=$1 o=$2 nv=${3:-${#VARS[@]}} i j
  log "$n"
  one "$n" "$o" "${VARS[0]}" warm > /dev/null
  for i in $(seq 1 "$RUNS"); do
    for j in $(seq 0 $((nv - 1))); do one "$n" "$o" "${VARS[$j]}" "${VARS[$j]%%=*}_$i"; done
  done
  rm -f "$o" "$o.journal" "$o.crc32c"
}

case_sq() {
  gen_matrix A.mgt 32768 32768 1; gen_matrix B.mgt 32768 32768 2; cat A.mgt B.mgt > /dev/null
  local p
  for p in tf32 bf16 fp32; do
    plan "sq_${p}_g$NGPU" A.mgt B.mgt C.mgt "A @ B" $p '"all"' 'host_memory = "16GiB"'
    ab "sq_${p}_g$NGPU" C.mgt
  done
  if [ "$NGPU" -ge 2 ]; then
    plan sq_tf32_g1 A.mgt B.mgt C.mgt "A @ B" tf32 '[0]' 'host_memory = "16GiB"'; ab sq_tf32_g1 C.mgt
  fi
  rm -f A.mgt B.mgt A.mgt.gen B.mgt.gen
}

case_chain() {
  [ -f cA.mgt ] || "$MGMM" gen cA.mgt --rows 3000 --cols 100 --seed 11 2>&1 | tail -1
  [ -f cB.mgt ] || "$MGMM" gen cB.mgt --rows 100 --cols 100 --seed 12 2>&1 | tail -1
  [ -f cC.mgt ] || "$MGMM" gen cC.mgt --rows 100 --cols 3600000 --seed 13 --tile 4096 2>&1 | tail -1
  printf '[matrices.A]\npath = "cA.mgt"\n[matrices.B]\npath = "cB.mgt"\n[matrices.C]\npath = "cC.mgt"\n[[step]]\noutput = "D.mgt"\nexpr = "(A @ B @ C).T"\n[engine]\nbackend = "cuda"\ndevices = "all"\ndurable = false\nhost_memory = "16GiB"\n' > chain.toml
  ab chain D.mgt
}

case_fp64() {
  local n=60000; [ "$NGPU" -ge 2 ] || n=45000
  GEN_DTYPE=f64 gen_matrix A64.mgt $n $n 3; GEN_DTYPE=f64 gen_matrix B64.mgt $n $n 4
  cat A64.mgt B64.mgt > /dev/null
  local hm=${FP64_HOST:-32GiB}
  plan fp64 A64.mgt B64.mgt C64.mgt "A @ B" fp64 '"all"' "host_memory = \"$hm\""; ab fp64 C64.mgt
  plan fp64_20g A64.mgt B64.mgt C64.mgt "A @ B" fp64 '"all"' "host_memory = \"$hm\"" 'device_memory = "20GiB"'
  RUNS=1 ab fp64_20g C64.mgt 2
  rm -f A64.mgt B64.mgt A64.mgt.gen B64.mgt.gen
}

case_big() {
  [ "$NGPU" -ge 2 ] || { log "big: needs 2 GPUs"; return; }
  gen_matrix Ab.mgt 100000 100000 1; gen_matrix Bb.mgt 100000 100000 2; cat Ab.mgt Bb.mgt > /dev/null
  plan big_tf32 Ab.mgt Bb.mgt Cb.mgt "A @ B" tf32 '"all"' 'host_memory = "32GiB"'; ab big_tf32 Cb.mgt
  rm -f Ab.mgt Bb.mgt Ab.mgt.gen Bb.mgt.gen
}

for c in "$@"; do log "case $c ($(date +%T))"; "case_$c"; done

log "table: median [min–max] over $RUNS runs"
python3 - "$OUT" <<'PY' | tee -a "$LOG"
import glob, json, os, re, statistics as st, sys
runs = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*_*_[0-9]*.json"))):
    m = re.match(r"(.+)_([^_]+)_(\d+)\.json$", os.path.basename(f))
    r = json.load(open(f))
    if not m or not r.get("steps"):
        continue
    s = max(r["steps"], key=lambda s: s["wall_s"]); step = sum(x["wall_s"] for x in r["steps"])
    runs.setdefault((m[1], m[2]), []).append((step, s["gflops_per_s"] / 1e3, r["outer_wall_s"] - step,
                                              s["peak_rss_bytes"] / 2**30, s["bottleneck"], s["write_mode"], r["table_md5"]))
print(f"{'job':<14} {'variant':<8} {'step s':<22} {'TFLOP/s':<20} {'process − step s':<18} {'RSS GiB':<8} mode    bottleneck")
f = lambda a, d=3: f"{st.median(a):.{d}f} [{min(a):.{d}f}–{max(a):.{d}f}]"
for (job, v), x in sorted(runs.items()):
    print(f"{job:<14} {v:<8} {f([a[0] for a in x]):<22} {f([a[1] for a in x], 1):<20} {f([a[2] for a in x], 2):<18} "
          f"{max(a[3] for a in x):<8.1f} {x[0][5]:<7} {','.join(sorted(set(a[4] for a in x)))}")
for job in sorted({j for j, _ in runs}):
    t = {a[6] for (j, _), x in runs.items() if j == job for a in x}
    print(f"{job}: {'all outputs identical' if len(t) == 1 else 'OUTPUTS DIFFER: ' + ' '.join(sorted(t))}")
PY
