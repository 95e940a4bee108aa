#!/usr/bin/env bash
# Run on the GPU machine from the repository root, with .dev/bin carried (see docs/GPU.md):
# device listing, the CUDA test twins, and a first end-to-end product.
set -uo pipefail
B=$PWD/.dev/bin
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv
$B/mgmm-stream devices
for t in correctness pipeline; do
  echo "== $t --ignored"
  $B/$t --ignored --test-threads=1 2>&1 | tee "$OUT/test_$t.log" | grep -E "^test |test result|panicked|error" | head -40
done
W=/tmp/w; mkdir -p $W; cd $W
N=${N:-16384}
cat > plan.toml <<PLAN
[matrices.A]
path = "A.mgt"
generate = { rows = $N, cols = $N, dist = "normal", seed = 1 }
[matrices.B]
path = "B.mgt"
generate = { rows = $N, cols = $N, dist = "normal", seed = 2 }
[[step]]
output = "C.mgt"
expr = "A @ B"
[engine]
backend = "cuda"
host_memory = "8GiB"
durable = false
PLAN
$B/mgmm-stream plan plan.toml
$B/mgmm-stream run plan.toml --report "$OUT/smoke.json" 2>&1 | tail -20
rm -f C.mgt
$B/mgmm-stream run plan.toml 2>&1 | tail -12
