#!/usr/bin/env bash
# Two builds on one job, runs interleaved (A, B, A, B, ...) so that a machine's drift or a noisy
# neighbour hits both alike, with in-core cuBLAS measured before and after in the same call.
# GPU machine, repository root, binaries carried (docs/GPU.md).
#   A=.dev/bin/mgmm-stream-old B=.dev/bin/mgmm-stream [RUNS=5 N=32768 PRECISION=fp32] \
#     bash tools/bench/ab_square.sh
# One build, two settings: A=B=.dev/bin/mgmm-stream A_ARGS="--set engine.staging=copy" (extra
# arguments of `run` for A's runs; B_ARGS likewise). GEN_DTYPE=f64: inputs stored as f64 (e.g. for
# PRECISION=fp64 without a conversion on the host). CMP=1: keep each A run's output and compare
# the B run after it with it byte for byte (`cmp`; one more output's worth of disk).
# Log: $OUT/ab.log (one line per run: step wall, TFLOP/s, process wall measured around the
# process, process − step); reports in $OUT/ab_{A,B}_i.json; a MGMM_TRACE timeline of B's last
# run in $OUT/trace_B.json with tools/trace_gaps.py's summary in $OUT/gaps.log.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to ab.log
A=$(realpath "${A:?set A to the first binary}"); B=$(realpath "${B:?set B to the second binary}")
RUNS=${RUNS:-5}; N=${N:-32768}; PRECISION=${PRECISION:-fp32}
read -r -a A_ARGS <<< "${A_ARGS:-}"; read -r -a B_ARGS <<< "${B_ARGS:-}"
W=${W:-/tmp/ab}; mkdir -p "$W"; cd "$W"
gen_matrix A.mgt "$N" "$N" 1; gen_matrix B.mgt "$N" "$N" 2; cat A.mgt B.mgt > /dev/null
printf '[matrices.A]\npath = "A.mgt"\n[matrices.B]\npath = "B.mgt"\n[[step]]\noutput = "C.mgt"\nexpr = "A @ B"\n[engine]\nbackend = "cuda"\nprecision = "%s"\ndevices = [0]\ndurable = false\nhost_memory = "16GiB"\n' "$PRECISION" > p.toml
peer() {
  python3 - "$PRECISION" <<'PY' 2>&1 | tee -a "$LOG"
import sys, time, torch
p = sys.argv[1]; n = 8192
torch.backends.cuda.matmul.allow_tf32 = p == "tf32"
dt = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[p]
a = torch.randn(n, n, device="cuda").to(dt); b = torch.randn(n, n, device="cuda").to(dt)
for _ in range(3): a @ b
torch.cuda.synchronize(); t = time.perf_counter(); r = 10
for _ in range(r): a @ b
torch.cuda.synchronize(); s = (time.perf_counter() - t) / r
print(f"peer cuBLAS in-core {p} 8192^2: {2*n**3/s/1e12:.2f} TFLOP/s")
PY
}
peer
for i in $(seq 1 "$RUNS"); do
  for which in A B; do
    bin=$A; args=("${A_ARGS[@]}"); [ $which = B ] && { bin=$B; args=("${B_ARGS[@]}"); }
    rm -f C.mgt C.mgt.journal C.mgt.crc32c
    tr=(); [ $which = B ] && [ "$i" = "$RUNS" ] && tr=(env "MGMM_TRACE=$OUT/trace_B.json")
    t0=$(date +%s.%N)
    if ! "${tr[@]}" "$bin" run p.toml "${args[@]}" -q --report "$OUT/ab_${which}_$i.json" > "$OUT/ab_${which}_$i.err" 2>&1; then
      log "$which run $i failed:"; tail -5 "$OUT/ab_${which}_$i.err" | tee -a "$LOG"; continue
    fi
    t1=$(date +%s.%N)
    python3 - "$OUT/ab_${which}_$i.json" "$t0" "$t1" "$which" "$i" <<'PY' | tee -a "$LOG"
import json, sys
r = json.load(open(sys.argv[1])); s = r["steps"][0]; proc = float(sys.argv[3]) - float(sys.argv[2])
print(f"{sys.argv[4]} run {sys.argv[5]}: step {s['wall_s']:.3f} s, {s['gflops_per_s']/1e3:.1f} TFLOP/s, "
      f"process {proc:.2f} s, process-step {proc - s['wall_s']:.2f} s, bottleneck {s.get('bottleneck', '?')}")
PY
    if [ "${CMP:-0}" = 1 ]; then
      if [ $which = A ]; then mv C.mgt C_A.mgt
      elif [ -f C_A.mgt ]; then
        if cmp -s C_A.mgt C.mgt; then log "run $i: A and B outputs identical"
        else log "run $i: A and B outputs DIFFER"; fi
        rm -f C_A.mgt
      else log "run $i: not compared (A's run $i left no output)"
      fi
    fi
  done
done
peer
rm -f C.mgt C_A.mgt C.mgt.journal C.mgt.crc32c
[ -f "$OUT/trace_B.json" ] && python3 "$TOOLS/trace_gaps.py" "$OUT/trace_B.json" --top 6 > "$OUT/gaps.log" 2>&1
