#!/usr/bin/env bash
# Registering input ranges ahead of staging (`MGMM_LOCK_AHEAD=1`, pipeline::direct::lock_ahead)
# against the default, one binary, runs interleaved: 32768² (N) fp64 from .npy with
# host_memory 16 and 32 GiB (where the GPU waited 140–170 ms at each new A band, HISTORY §34),
# fp32 and tf32 from .mgt (where staging's registrations are the limit: is anything slower?),
# RUNS runs each; one traced run of each variant of fp64 at 16 GiB (tools/trace_gaps.py), and
# the fp64 outputs of both compared byte for byte. GPU machine (one GPU), repository root,
# .dev/bin/mgmm-stream carried (docs/GPU.md); BACKEND=sim N=600 with a test build (cargo build
# --features fault-injection) tries it without a GPU.
# Disk: 2·N²·8 + 2·N²·4 bytes of inputs and two f64 outputs (43 GB at 32768). Log:
# $OUT/lock_ahead.log (traces gzipped beside it); the RUN lines say step, process, first GEMM,
# bytes released and locked.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to lock_ahead.log
N=${N:-32768}; RUNS=${RUNS:-2}; W=${W:-/tmp/lock_ahead}; mkdir -p "$W"; cd "$W"
log "$(date +%T) $(nvidia-smi --query-gpu=name --format=csv,noheader) N=$N RUNS=$RUNS"
GEN_DTYPE=f64 gen_matrix A64.npy "$N" "$N" 3; GEN_DTYPE=f64 gen_matrix B64.npy "$N" "$N" 4
gen_matrix A.mgt "$N" "$N" 1; gen_matrix B.mgt "$N" "$N" 2
cat A64.npy B64.npy A.mgt B.mgt > /dev/null
E=("backend = \"${BACKEND:-cuda}\"" 'devices = [0]' 'durable = false')
write_plan fp64_16.toml A64.npy B64.npy C.npy "${E[@]}" 'precision = "fp64"' 'host_memory = "16GiB"'
write_plan fp64_32.toml A64.npy B64.npy C.npy "${E[@]}" 'precision = "fp64"' 'host_memory = "32GiB"'
write_plan fp32_mgt.toml A.mgt B.mgt C.mgt "${E[@]}" 'host_memory = "16GiB"'
write_plan tf32_mgt.toml A.mgt B.mgt C.mgt "${E[@]}" 'precision = "tf32"' 'host_memory = "16GiB"'
one() { # VARIANT(default|ahead) JOB TAG [env...]
  local v=$1 j=$2 t=$3; shift 3; rm -rf C.*
  local ahead=(); [ "$v" = ahead ] && ahead=(MGMM_LOCK_AHEAD=1)
  local s rc; s=$(date +%s%N); rm -f "$W/r.json"
  env "${ahead[@]}" "$@" "$MGMM" run "$j.toml" --quiet --report "$W/r.json" > /dev/null 2>>"$LOG"
  rc=$?
  local ms=$(( ($(date +%s%N) - s) / 1000000 ))
  if [ "$rc" != 0 ] || [ ! -f "$W/r.json" ]; then
    echo "RUN $j $v $t FAILED (exit $rc; the log has its message)" | tee -a "$LOG"; return
  fi
  python3 - "$W/r.json" "$j" "$t" "$ms" "$v" <<'PY' | tee -a "$LOG"
import json, sys
s = json.load(open(sys.argv[1]))["steps"][0]
print(f"RUN {sys.argv[2]:8} {sys.argv[5]:7} {sys.argv[3]:2} step {s['wall_s']:.3f} s  process {int(sys.argv[4]) / 1e3:.3f} s  "
      f"first GEMM {s.get('first_gemm_s') or 0:.3f} s  released {s.get('direct_released_bytes', 0) / 2**30:.1f} GiB  "
      f"locked {s.get('direct_registered_bytes', 0) / 2**30:.1f} GiB in {s.get('direct_register_s', 0):.2f} s  "
      f"failed {s.get('direct_failed')}  bottleneck {s['bottleneck']}")
PY
}
for j in fp64_16 fp64_32 fp32_mgt tf32_mgt; do
  for i in $(seq 1 "$RUNS"); do one default "$j" "$i"; one ahead "$j" "$i"; done
done
for v in default ahead; do
  one "$v" fp64_16 tr "MGMM_TRACE=$OUT/lock_ahead_$v.trace.json"
  [ "$v" = default ] && mv C.npy o.npy
  python3 "$TOOLS/trace_gaps.py" "$OUT/lock_ahead_$v.trace.json" --top 3 2>&1 | grep -E "^cuda:0 gemm|gap " | sed "s/^/GAPS $v: /" | tee -a "$LOG"
  gzip -f "$OUT/lock_ahead_$v.trace.json"
done
if cmp -s C.npy o.npy; then r=identical; else r=DIFFER; fi
echo "RESULT fp64 outputs of the two variants: $r" | tee -a "$LOG"
cd / && rm -rf "$W"
