#!/usr/bin/env bash
# First look at a GPU machine: device listing, the CUDA test twins on every GPU, and a first
# end-to-end product of N×N inputs (N default 16384), twice. Repository root, .dev/bin carried
# (docs/GPU.md). Test output in $OUT/test_*.log, the first run's report in $OUT/smoke.json.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv
"$MGMM" devices
for t in correctness pipeline; do
  echo "== $t --ignored"
  "$DEV/it" --ignored --test-threads=1 "$t::cuda::" 2>&1 | tee "$OUT/test_$t.log" | grep -E "^test |test result|panicked|error" | head -40
done
W=${W:-/tmp/w}; mkdir -p "$W"; cd "$W"
N=${N:-16384}
gen_matrix A.mgt "$N" "$N" 1 normal
gen_matrix B.mgt "$N" "$N" 2 normal
write_plan plan.toml A.mgt B.mgt C.mgt 'backend = "cuda"' 'host_memory = "8GiB"' 'durable = false'
"$MGMM" plan plan.toml
rm -f C.mgt C.mgt.journal
"$MGMM" run plan.toml --report "$OUT/smoke.json" 2>&1 | tail -20
rm -f C.mgt C.mgt.journal
"$MGMM" run plan.toml 2>&1 | tail -12
