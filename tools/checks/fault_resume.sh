#!/usr/bin/env bash
# Faults mid-run on CUDA lanes, each followed by a resume compared bitwise (cmp) with an
# uninterrupted run, n = 8192, tile 1024, durable (docs/RESILIENCE.md):
#   - an injected fault on every lane: nothing left to fail over to, so the run stops cleanly;
#   - GPU 1 fails: its unfinished tiles are redone on GPU 0 in the same run (needs 2 GPUs);
#   - SIGKILL three times once the journal has records.
# GPU machine, repository root, .dev/bin carried. Log: $OUT/resume.log. The injected faults
# need the test build (cargo build --release --features fault-injection, carried as
# .dev/bin/mgmm-stream-faults): release builds have no fault hooks.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to resume.log
FAULTS=${FAULTS:-$DEV/mgmm-stream-faults}
[ -x "$FAULTS" ] || { echo "no fault-injection build at $FAULTS" >&2; exit 2; }
W=${W:-/tmp/res}; mkdir -p "$W"; cd "$W"
gen_matrix A.mgt 8192 8192 5
gen_matrix B.mgt 8192 8192 6
for o in ref res; do
  write_plan $o.toml A.mgt B.mgt C_$o.mgt 'backend = "cuda"' 'devices = "all"' 'tile = 1024'
done
rm -f C_ref.mgt C_ref.mgt.journal C_res.mgt C_res.mgt.journal
"$MGMM" run ref.toml --quiet
log "injected fault after 100 GEMMs on every lane: nothing left to fail over to, so the run stops"
MGMM_FAULT_GEMM_AFTER=100 "$FAULTS" run res.toml 2>&1 | tail -2 | tee -a "$LOG"; echo "exit ${PIPESTATUS[0]}" | tee -a "$LOG"
"$MGMM" run res.toml 2>&1 | grep -E "resuming|wall" | tee -a "$LOG"
cmp C_ref.mgt C_res.mgt && echo "fault, then resume: bitwise identical to an uninterrupted run" | tee -a "$LOG"
if [ "$(gpu_count)" -ge 2 ]; then
  log "GPU 1 fails after 50 GEMMs: its unfinished tiles are redone on GPU 0 in the same run"
  rm -f C_res.mgt C_res.mgt.journal
  MGMM_FAULT_LANE=1 MGMM_FAULT_GEMM_AFTER=50 "$FAULTS" run res.toml 2>&1 | grep -E "failed|wall|error|done" | tee -a "$LOG"; echo "exit ${PIPESTATUS[0]}" | tee -a "$LOG"
  cmp C_ref.mgt C_res.mgt && echo "failover: bitwise identical to an uninterrupted run" | tee -a "$LOG"
fi
log "SIGKILL once the journal has records, 3 times"
rm -f C_res.mgt C_res.mgt.journal
for i in 1 2 3; do
  "$MGMM" run res.toml --quiet & p=$!
  s=$(stat -c %s C_res.mgt.journal 2>/dev/null || echo 0)
  for _ in $(seq 1 400); do n=$(stat -c %s C_res.mgt.journal 2>/dev/null || echo 0); [ "$n" -gt "$((s+200))" ] && break; sleep 0.01; done
  kill -9 $p 2>/dev/null && echo "killed run $i with journal at $(stat -c %s C_res.mgt.journal) bytes" | tee -a "$LOG"; wait $p 2>/dev/null
done
"$MGMM" run res.toml 2>&1 | grep -E "resuming|wall" | tee -a "$LOG"
cmp C_ref.mgt C_res.mgt && echo "3 SIGKILLs, then resume: bitwise identical to an uninterrupted run" | tee -a "$LOG"
