#!/usr/bin/env bash
# Each precision mode's relative error against an f64 reference (docs/GPU.md's precision table):
# normal(0, 1) inputs of N×N (default 8192) on GPU 0, the products exported to .npy and compared
# by tools/bench/precision_errors.py (f64 reference by torch on the GPU). GPU machine, repository
# root, .dev/bin carried. Log: $OUT/precision.log.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to precision.log
N=${N:-8192}
W=${W:-/tmp/prec}; mkdir -p "$W"; cd "$W"
gen_matrix A.mgt "$N" "$N" 5 normal
gen_matrix B.mgt "$N" "$N" 6 normal
log "precision errors at n = $N (one GPU)"
for p in fp32 tf32 bf16 fp16; do
  cuda_plan "$p" "$p" "[0]"
  run_step "$p"
  export_npy "C_$p.mgt" "C_$p.npy"
done
export_npy A.mgt A.npy; export_npy B.mgt B.npy
python3 "$TOOLS/bench/precision_errors.py" A.npy B.npy C_fp32.npy C_tf32.npy C_bf16.npy C_fp16.npy 2>&1 | tee -a "$LOG"
rm -f ./*.npy C_*.mgt*
