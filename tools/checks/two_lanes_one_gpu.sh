#!/usr/bin/env bash
# The multi-GPU code paths on one GPU: two lanes on the same device (`devices = [0, 0]`; they
# share its memory, or take DEVMEM each when set, e.g. DEVMEM=60GiB), each on its own thread with
# its own streams and cuBLAS handle, as two GPUs would be. For each precision (PRECISIONS, default
# "fp32 tf32") and `staging` auto and copy: one lane and two lanes, outputs compared with cmp
# (each tile is computed the same way on any lane, so they must be identical). Then, with the
# fault-injection build (.dev/bin/mgmm-stream-faults, as tools/checks/fault_resume.sh): lane 1
# failing after 20 GEMMs, its tiles redone on lane 0 in the same run; every lane failing, then a
# resume. Everything compared with the one-lane output. N×N inputs, N default 16384, tile 4096.
# GPU machine, repository root, .dev/bin carried (docs/GPU.md). Log: $OUT/two_lanes_one_gpu.log.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to two_lanes_one_gpu.log
N=${N:-16384}; DEVMEM=${DEVMEM:-}; PRECISIONS=${PRECISIONS:-fp32 tf32}
FAULTS=${FAULTS:-$DEV/mgmm-stream-faults}
W=${W:-/tmp/two}; mkdir -p "$W"; cd "$W"
gen_matrix A.mgt "$N" "$N" 1; gen_matrix B.mgt "$N" "$N" 2
# plan NAME PRECISION DEVICES STAGING
plan() {
  write_plan "$1.toml" A.mgt B.mgt "C_$1.mgt" 'backend = "cuda"' "precision = \"$2\"" \
    "devices = $3" "${DEVMEM:+device_memory = \"$DEVMEM\"}" 'durable = false' 'host_memory = "8GiB"' \
    "staging = \"$4\"" 'tile = 4096'
}
fails=0
for p in $PRECISIONS; do for st in auto copy; do
  for n in one two; do
    d='[0]'; [ $n = two ] && d='[0, 0]'
    plan "${n}_${p}_$st" "$p" "$d" "$st"; rm -f "C_${n}_${p}_$st.mgt"*
    "$MGMM" plan "${n}_${p}_$st.toml" 2>&1 | grep -oE "device budget [^|]*" | head -1 | sed "s/^/$n lane(s): /" | tee -a "$LOG"
    rm -f "$OUT/two_${n}_${p}_$st.json"
    "$MGMM" run "${n}_${p}_$st.toml" -q --report "$OUT/two_${n}_${p}_$st.json" >> "$LOG" 2>&1 \
      || { log "$n lane(s), $p, $st: FAILED"; fails=$((fails + 1)); continue; }
    python3 - "$OUT/two_${n}_${p}_$st.json" "$n lane(s), $p, staging $st" <<'PY' | tee -a "$LOG"
import json, sys
s = json.load(open(sys.argv[1]))["steps"][0]
print(f"{sys.argv[2]}: step {s['wall_s']:.3f} s, GEMMs per lane {[l['gemms'] for l in s['lanes']]}, "
      f"read {s['read_bytes'] >> 20} MiB (direct {s.get('direct_bytes', 0) >> 20}, shared {s.get('shared_read_bytes', 0) >> 20}), "
      f"bottleneck {s['bottleneck']}")
PY
  done
  # (a run that failed is counted above; nothing to compare then)
  if [ -f "C_one_${p}_$st.mgt" ] && [ -f "C_two_${p}_$st.mgt" ]; then
    if cmp "C_one_${p}_$st.mgt" "C_two_${p}_$st.mgt"; then log "$p $st: one lane and two lanes identical"
    else log "$p $st: one lane and two lanes DIFFER"; fails=$((fails + 1)); fi
  fi
done; done
ref=C_one_$(echo $PRECISIONS | cut -d' ' -f1)_auto.mgt
p0=$(echo $PRECISIONS | cut -d' ' -f1)
if [ ! -f "$ref" ]; then
  log "no one-lane output $ref to compare with: failover and resume not tried"
elif [ -x "$FAULTS" ]; then
  plan res "$p0" '[0, 0]' auto
  rm -f C_res.mgt*
  # expect CMD_STATUS WHAT PATTERN FILE: the fault run ended as WHAT says (status 0 or not) and
  # printed PATTERN; else it counts as a failure (a fault hook that never fired proves nothing).
  expect() {
    if [ "$1" = "$2" ] || { [ "$2" = fail ] && [ "$1" != 0 ]; }; then :; else
      log "expected exit $2, got $1"; fails=$((fails + 1)); fi
    grep -qE "$3" "$4" || { log "expected output matching '$3'"; fails=$((fails + 1)); }
  }
  log "lane 1 fails after 20 GEMMs: its tiles are redone on lane 0 in the same run"
  MGMM_FAULT_LANE=1 MGMM_FAULT_GEMM_AFTER=20 "$FAULTS" run res.toml > "$OUT/two_failover.txt" 2>&1
  expect $? 0 "redoing its unfinished tiles" "$OUT/two_failover.txt"
  grep -iE "failed|wall" "$OUT/two_failover.txt" | tee -a "$LOG"
  cmp "$ref" C_res.mgt && log "failover: identical to one lane" || { log "failover: DIFFERS"; fails=$((fails + 1)); }
  rm -f C_res.mgt*
  log "every lane fails after 20 GEMMs: the run stops; a resume finishes it"
  MGMM_FAULT_GEMM_AFTER=20 "$FAULTS" run res.toml > "$OUT/two_stop.txt" 2>&1
  expect $? fail "injected fault" "$OUT/two_stop.txt"
  tail -1 "$OUT/two_stop.txt" | tee -a "$LOG"
  "$MGMM" run res.toml > "$OUT/two_resume.txt" 2>&1
  expect $? 0 "resuming at" "$OUT/two_resume.txt"
  grep -E "resuming|wall" "$OUT/two_resume.txt" | tee -a "$LOG"
  cmp "$ref" C_res.mgt && log "resume: identical to one lane" || { log "resume: DIFFERS"; fails=$((fails + 1)); }
else
  log "no fault-injection build at $FAULTS: failover and resume not tried"
fi
rm -f C_*.mgt* ./*.toml
log "two_lanes: $fails failure(s)"
[ "$fails" = 0 ]
