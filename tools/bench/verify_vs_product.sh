#!/usr/bin/env bash
# Issue 8's (and 35's) verify goal: `verify` of an N×N (default 32768) f32 product on all GPUs
# takes at most 25 % of the product's time. Runs the product (durable = false, inputs warm), then
# `verify` twice with its products on the GPU and once on the CPU (`--set engine.backend=cpu`),
# interleaved, and prints the ratios. GPU machine, repository root, .dev/bin carried.
# SWEEP="1 4 8 16": then `verify` with its products on the GPU at each `engine.threads`, one line
# each (`SWEEP` passes and their rates: how the host's passes scale with threads).
# AB="NAME=BINARY ...": then `verify` (products on the GPU) by each binary in turn, REPEAT (2)
# rounds interleaved, one line each with its passes' times (an A/B of builds on the same files).
# Log: $OUT/verify_vs_product.log.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to verify_vs_product.log
N=${N:-32768}
W=${W:-/tmp/vt}; mkdir -p "$W"; cd "$W"
gen_matrix A.mgt "$N" "$N" 21
gen_matrix B.mgt "$N" "$N" 22
cuda_plan v fp32 '"all"'
cat A.mgt B.mgt > /dev/null
rm -f C_v.mgt C_v.mgt.journal
s=$(date +%s%N); "$MGMM" run v.toml --quiet --report "$OUT/v.json"; run_ms=$(( ($(date +%s%N) - s) / 1000000 ))
for i in gpu cpu gpu; do
  set_cpu=(); [ $i = cpu ] && set_cpu=(--set engine.backend=cpu)
  log "verify, products on the $i"
  s=$(date +%s%N); MGMM_VERIFY_TIMES=1 "$MGMM" verify v.toml "${set_cpu[@]}" 2>&1 | tail -12 | tee -a "$LOG"; v_ms=$(( ($(date +%s%N) - s) / 1000000 ))
  python3 -c "
import json,sys
st = json.load(open(sys.argv[1]))['steps'][0]['wall_s']
run, ver = int(sys.argv[2]) / 1e3, int(sys.argv[3]) / 1e3
print(f'RESULT verify {ver:.2f} s (process) against the product: step {st:.2f} s, process {run:.2f} s; verify/step {ver/st:.2f}, verify/process {ver/run:.2f}')
" "$OUT/v.json" "$run_ms" "$v_ms" | tee -a "$LOG"
done
for t in ${SWEEP:-}; do
  s=$(date +%s%N); rates=$(MGMM_VERIFY_TIMES=1 "$MGMM" verify v.toml --set engine.threads="$t" 2>&1 | grep -E '^verify: (scatter|dense)' | sed -E 's/^verify: ([a-z]+) [^ ]+ .*: ([0-9.]+ s, [0-9.]+ GB\/s)$/\1 \2/' | paste -sd';')
  echo "SWEEP threads $t: process $(( ($(date +%s%N) - s) / 1000000 )) ms; $rates" | tee -a "$LOG"
done
for r in $(seq "${REPEAT:-2}"); do
  for nb in ${AB:-}; do
    s=$(date +%s%N); rates=$(MGMM_VERIFY_TIMES=1 "${nb#*=}" verify v.toml 2>&1 | grep -E '^verify: (scatter|dense)' | sed -E 's/^verify: ([a-z]+) [^ ]+ .*: ([0-9.]+ s, [0-9.]+ GB\/s)$/\1 \2/' | paste -sd';')
    echo "AB ${nb%%=*} round $r: process $(( ($(date +%s%N) - s) / 1000000 )) ms; $rates" | tee -a "$LOG"
  done
done
# Where a GPU verify's time goes (issue 35: its dense pass over A bounds it): the passes, the band
# reads, the device's folds (to each band's copy's end) and cross-checks, the GPU's opening.
log "verify traced (MGMM_TRACE), products on the gpu"
MGMM_TRACE="$OUT/verify_trace.json" "$MGMM" verify v.toml > /dev/null 2>&1
python3 "$TOOLS/trace_sum.py" "$OUT/verify_trace.json" --within verify | tee -a "$LOG"
