#!/usr/bin/env bash
# The CUDA test twins on one GPU (CUDA_VISIBLE_DEVICES=0) and on every GPU, from the repo root
# with .dev/bin carried (docs/GPU.md).
set -uo pipefail
B=$PWD/.dev/bin; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name --format=csv,noheader
for vis in 0 all; do
  for t in correctness pipeline; do
    echo "== $t --ignored, GPUs: $vis"
    if [ $vis = all ]; then $B/$t --ignored --test-threads=1; else CUDA_VISIBLE_DEVICES=0 $B/$t --ignored --test-threads=1; fi 2>&1 | tee -a "$OUT/gpu_tests.log" | grep -E "^test |test result"
  done
done
