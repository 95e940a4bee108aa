#!/usr/bin/env bash
# Four short two-GPU benchmarks in one call (nvidia-h200-x2; first run as one session's checks), each with its own log under
# $OUT, cleaning each one's data before the next so the disk holds the largest:
#   python_vs_torch (issue 13; needs the wheel carried in .whl), verify_timing (issue 8),
#   cluster_two_procs (issue 12), npy_goals warm and chain (issue 11).
# Repository root, .dev/bin and .whl carried. Prints the RESULT-like lines of each.
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/out}
step() { echo "### $* ($(date +%T))"; }
step python; python3 -m pip install -q --no-deps --target /tmp/py .whl/mgmm_stream-*.whl 2>&1 | tail -2
PYTHONPATH=/tmp/py timeout 140 python3 tools/bench/python_vs_torch.py --n 30000 --devices 0,1 --reps 2 > "$OUT/python_vs_torch.log" 2>&1
tail -12 "$OUT/python_vs_torch.log"
step verify; timeout 90 bash tools/bench/verify_vs_product.sh > /dev/null 2>&1; grep RESULT "$OUT/verify_vs_product.log"; rm -rf /tmp/vt
step cluster; ROUNDS=2 timeout 110 bash tools/bench/two_procs_vs_one.sh > /dev/null 2>&1; tail -6 "$OUT/two_procs_vs_one.log"; rm -rf /tmp/c2
step npy; REPEAT=2 CHAIN_CMP=0 timeout 230 bash tools/bench/npy_and_chain.sh warm chain > /dev/null 2>&1; grep -E "###|goal|chain" "$OUT/npy_and_chain.log" | tail -16
step done
