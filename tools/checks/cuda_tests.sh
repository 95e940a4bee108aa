#!/usr/bin/env bash
# The CUDA test twins (the `it` test binary's `MODULE::cuda::` tests of correctness, pipeline, kept,
# checkpoint, chain_memory and verify, --ignored) on one GPU (CUDA_VISIBLE_DEVICES=0) and then on every
# GPU (where there are several). GPU machine, repository root, .dev/bin carried (docs/GPU.md). Log: $OUT/gpu_tests.log.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to gpu_tests.log
# Twins that run the command line (`status` beside a killed run) use the carried release binary.
export MGMM_TEST_BIN="$MGMM"
nvidia-smi --query-gpu=index,name --format=csv,noheader | tee -a "$LOG"
# With one GPU the two passes would be the same run: once is enough.
passes="0 all"; [ "$(gpu_count)" -ge 2 ] || passes=0
for vis in $passes; do
  for t in correctness pipeline checkpoint chain_memory verify kept; do
    log "$t --ignored, GPUs: $vis"
    if [ $vis = all ]; then "$DEV/it" --ignored --test-threads=1 "$t::cuda::"
    else CUDA_VISIBLE_DEVICES=0 "$DEV/it" --ignored --test-threads=1 "$t::cuda::"; fi 2>&1 | tee -a "$LOG" | grep -E "^test |test result"
  done
done
