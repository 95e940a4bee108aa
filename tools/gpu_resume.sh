#!/usr/bin/env bash
# GPU fault and SIGKILL mid-run on CUDA lanes, then resume; compared bitwise with an
# uninterrupted run. From the repo root on the GPU machine with .dev/bin carried.
set -uo pipefail
B=$PWD/.dev/bin; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/resume.log"
W=/tmp/res; mkdir -p $W; cd $W
$B/mgmm-stream gen A.mgt --rows 8192 --cols 8192 --seed 5 2>&1 | tail -1
$B/mgmm-stream gen B.mgt --rows 8192 --cols 8192 --seed 6 2>&1 | tail -1
for o in ref res; do cat > $o.toml <<PLAN
[matrices.A]
path = "A.mgt"
[matrices.B]
path = "B.mgt"
[[step]]
output = "C_$o.mgt"
expr = "A @ B"
[engine]
backend = "cuda"
devices = "all"
tile = 1024
PLAN
done
$B/mgmm-stream run ref.toml --quiet
echo "### injected fault after 100 GEMMs on every lane: nothing left to fail over to, so the run stops" | tee -a $L
MGMM_FAULT_GEMM_AFTER=100 $B/mgmm-stream run res.toml 2>&1 | tail -2 | tee -a $L; echo "exit ${PIPESTATUS[0]}" | tee -a $L
$B/mgmm-stream run res.toml 2>&1 | grep -E "resuming|wall" | tee -a $L
cmp C_ref.mgt C_res.mgt && echo "fault, then resume: bitwise identical to an uninterrupted run" | tee -a $L
echo "### GPU 1 fails after 50 GEMMs: its unfinished tiles are redone on GPU 0 in the same run" | tee -a $L
rm -f C_res.mgt C_res.mgt.journal
MGMM_FAULT_LANE=1 MGMM_FAULT_GEMM_AFTER=50 $B/mgmm-stream run res.toml 2>&1 | grep -E "failed|wall|error|done" | tee -a $L; echo "exit ${PIPESTATUS[0]}" | tee -a $L
cmp C_ref.mgt C_res.mgt && echo "failover: bitwise identical to an uninterrupted run" | tee -a $L
echo "### SIGKILL once the journal has records, 3 times" | tee -a $L
rm -f C_res.mgt C_res.mgt.journal
for i in 1 2 3; do
  $B/mgmm-stream run res.toml --quiet & p=$!
  s=$(stat -c %s C_res.mgt.journal 2>/dev/null || echo 0)
  for t in $(seq 1 400); do n=$(stat -c %s C_res.mgt.journal 2>/dev/null || echo 0); [ "$n" -gt "$((s+200))" ] && break; sleep 0.01; done
  kill -9 $p 2>/dev/null && echo "killed run $i with journal at $(stat -c %s C_res.mgt.journal) bytes" | tee -a $L; wait $p 2>/dev/null
done
$B/mgmm-stream run res.toml 2>&1 | grep -E "resuming|wall" | tee -a $L
cmp C_ref.mgt C_res.mgt && echo "3 SIGKILLs, then resume: bitwise identical to an uninterrupted run" | tee -a $L
