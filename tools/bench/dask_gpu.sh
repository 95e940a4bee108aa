#!/usr/bin/env bash
# Issue 36's Dask goal on the GPU machine, side by side in one call: mgmm_stream.dask.matmul
# against Dask + CuPy's `a @ b` on the same file-backed arrays (mgmm_stream.dask.from_npy) and
# the same workers, one worker per GPU (a Nanny each with its own CUDA_VISIBLE_DEVICES), file
# to file (python/bench/dask_vs_dask.py). That machine has CuPy but no Dask: carry the wheels.
#
# On the development machine (Python 3.12 wheels for the GPU machine, ~20 MB):
#   pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#     -d .dev/wheels-dask "dask[array]==2026.8.0" "distributed==2026.8.0" && rm .dev/wheels-dask/numpy-*
#   /tmp/v/bin/maturin build --release -m python/Cargo.toml -o .whl
# Then:  run(command="tools/bench/dask_gpu.sh", carry=[".dev/wheels-dask", ".whl"])
# Env: N (default 32768), GPUS (default: every GPU), CHUNK (Dask chunk edge, default 8192),
# REPS (default 2), HOST_MEMORY (also time ours with that host_memory, interleaved). Log: $OUT/dask_gpu.log.
set -uo pipefail
ROOT=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG=$OUT/dask_gpu.log
N=${N:-32768}
GPUS=${GPUS:-$(nvidia-smi -L | wc -l)}
CHUNK=${CHUNK:-8192}
REPS=${REPS:-2}
PY=$OUT/py
python3 -m pip install -q --no-index --no-deps --target "$PY" .dev/wheels-dask/*.whl .whl/mgmm_stream-*.whl 2>&1 | tail -2
export PYTHONPATH=$PY
python3 -c "import dask, distributed, cupy, mgmm_stream; print('dask', dask.__version__, 'cupy', cupy.__version__, 'mgmm_stream', mgmm_stream.__version__)" | tee -a "$LOG"
nvidia-smi --query-gpu=index,name --format=csv,noheader | tee -a "$LOG"
DIR=${DIR:-/tmp/dask_gpu}
python3 "$ROOT/python/bench/dask_vs_dask.py" --n "$N" --gpus "$GPUS" --threads 1 --chunk "$CHUNK" \
  --reps "$REPS" --backend cuda --dir "$DIR" ${HOST_MEMORY:+--host-memory "$HOST_MEMORY"} 2>&1 | grep -v "distributed\.\(nanny\|scheduler\|core\|worker\|http\)" | tee -a "$LOG"
rm -rf "$DIR"
