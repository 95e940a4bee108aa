#!/usr/bin/env bash
# Main's head on one GPU, in one call of under ten minutes: the CUDA test twins
# (tools/checks/cuda_tests.sh), the Python package's GPU-array twins with the 30000² request on
# an 8 GiB device_memory (python/tests/test_gpu_arrays.py, MGMM_GPU_BIG=1), the GPU-array
# benchmark against torch (python/bench/gpu_arrays_vs_torch.py --n 30000 --reps 3) and Dask
# against Dask + CuPy (tools/bench/dask_gpu.sh, REPS=2), and verify against the product with a
# traced verify (tools/bench/verify_vs_product.sh, N=32768). What a session owes after changing the
# lanes, the pipeline or the Python package without a GPU (docs/GPU.md, "Owed on the GPU").
# GPU machine, repository root; carry .dev (bin/ from .dev/rebuild.sh or: release binary,
# `it` test binary; wheels-dask/ for the Dask part, see tools/bench/dask_gpu.sh) and .whl (the
# wheel: maturin build --release -m python/Cargo.toml -o .whl). Env: SKIP="tests pytest bench
# verify dask" (any of them). Log: $OUT/one_gpu_head.log; a summary at the end.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to one_gpu_head.log
SKIP=${SKIP:-}
skip() { case " $SKIP " in *" $1 "*) return 0 ;; esac; return 1; }
summary=()
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$LOG"
SITE=$OUT/site
python3 -m pip install -q --no-deps --target "$SITE" .whl/*.whl 2>&1 | tail -2

if ! skip tests; then
  log "CUDA test twins"
  OUT=$OUT bash "$TOOLS/checks/cuda_tests.sh" > /dev/null 2>&1
  r=$(grep -c "test result: ok" "$OUT/gpu_tests.log"); f=$(grep -c "FAILED\|panicked" "$OUT/gpu_tests.log")
  grep -E "test result" "$OUT/gpu_tests.log" | tee -a "$LOG"
  summary+=("CUDA twins: $r suites ok, $f failures")
fi
if ! skip pytest; then
  log "GPU-array twins (MGMM_GPU_BIG=1)"
  out=$(cd python && PYTHONPATH=$SITE MGMM_GPU_BIG=1 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_arrays.py 2>&1 | tail -3)
  echo "$out" | tee -a "$LOG"
  summary+=("GPU-array twins: $(echo "$out" | tail -1)")
fi
if ! skip bench; then
  log "GPU arrays against torch, 30000² f32"
  out=$(PYTHONPATH=$SITE python3 python/bench/gpu_arrays_vs_torch.py --n 30000 --reps 3 2>&1 | sed -n '1,9p')
  echo "$out" | tee -a "$LOG"
  summary+=("GPU arrays: $(echo "$out" | grep -E 'pinned tensor' | head -1 | tr -s ' ')")
fi
if ! skip verify; then
  log "verify against the product, 32768² f32, and a traced verify"
  OUT=$OUT N=32768 bash "$TOOLS/bench/verify_vs_product.sh" > /dev/null 2>&1
  grep -E "^RESULT|verify: |^verify " "$OUT/verify_vs_product.log" | tee -a "$LOG"
  summary+=("verify: $(grep '^RESULT' "$OUT/verify_vs_product.log" | head -1)")
  rm -rf "${W:-/tmp/vt}"
fi
if ! skip dask; then
  log "Dask against Dask + CuPy, 32768² f32"
  OUT=$OUT REPS=2 bash "$TOOLS/bench/dask_gpu.sh" > /dev/null 2>&1
  grep -v "^$" "$OUT/dask_gpu.log" | tail -4 | tee -a "$LOG"
  summary+=("Dask: $(grep '^median' "$OUT/dask_gpu.log" | tail -1)")
  rm -rf /tmp/dask_gpu
fi
log "summary"
printf '%s\n' "${summary[@]}" | tee -a "$LOG"
