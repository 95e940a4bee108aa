#!/usr/bin/env bash
# One-run comparison on the two-GPU machine (nvidia-h200-x2), from the repo root with .dev/bin
# carried:  bash tools/gpu_bench2.sh
#  - the CUDA test twins (they use every visible GPU, so here: two lanes)
#  - an injected GPU fault mid-run must stop the run cleanly with a message
#  - mgmm-stream on 1 and 2 GPUs, fp32 (and tf32, bf16), n = 32768, inputs in the page cache
#  - cuBLASXt (1 and 2 GPUs) and torch on the same data, same end-to-end definition
set -uo pipefail
B=$PWD/.dev/bin; T=$PWD/tools
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=${N:-32768}; W=/tmp/bench2; mkdir -p $W
log() { echo "### $*" | tee -a "$OUT/bench2.log"; }
nvidia-smi --query-gpu=index,name,memory.used --format=csv | tee -a "$OUT/bench2.log"
for t in correctness pipeline; do
  log "$t --ignored (all GPUs)"
  $B/$t --ignored --test-threads=1 2>&1 | tee "$OUT/test_$t.log" | grep -E "^test |test result" | tee -a "$OUT/bench2.log"
done
cd $W
$B/mgmm-stream gen A.mgt --rows $N --cols $N --seed 1 2>&1 | tee -a "$OUT/bench2.log"
$B/mgmm-stream gen B.mgt --rows $N --cols $N --seed 2 2>&1 | tee -a "$OUT/bench2.log"
plan() { # name precision devices
cat > $1.toml <<PLAN
[matrices.A]
path = "A.mgt"
[matrices.B]
path = "B.mgt"
[[step]]
output = "C_$1.mgt"
expr = "A @ B"
[engine]
backend = "cuda"
precision = "$2"
devices = $3
host_memory = "16GiB"
durable = false
PLAN
}
run() { rm -f C_$1.mgt; log "mgmm $1"; $B/mgmm-stream run $1.toml --report "$OUT/$1.json" 2>&1 | tee -a "$OUT/bench2.log" | grep -E "wall|busy|bottleneck|error"; }
plan g1 fp32 "[0]"; run g1; run g1
plan g2 fp32 '"all"'; run g2; run g2; run g2
plan g1_tf32 tf32 "[0]"; run g1_tf32
plan g2_tf32 tf32 '"all"'; run g2_tf32
plan g2_bf16 bf16 '"all"'; run g2_bf16
log "injected GPU fault after 10 GEMMs (expect a clean failure)"
rm -f C_g2.mgt; MGMM_FAULT_GEMM_AFTER=10 timeout 120 $B/mgmm-stream run g2.toml; echo "exit status $?" | tee -a "$OUT/bench2.log"
rm -f C_*.mgt
log "export for peers"
$B/mgmm-stream export A.mgt A.npy --force && $B/mgmm-stream export B.mgt B.npy --force
$B/mgmm-stream run g2.toml --quiet && $B/mgmm-stream export C_g2.mgt C_g2.npy --force && rm -f C_g2.mgt
log "peers"
python3 $T/peers.py --a A.npy --b B.npy --out peer_C.bin --ngpu 1 --which cublasxt --check C_g2.npy 2>&1 | grep peer | tee -a "$OUT/bench2.log"
python3 $T/peers.py --a A.npy --b B.npy --out peer_C.bin --ngpu 2 --which cublasxt,torch_fp32,torch_tf32 2>&1 | grep peer | tee -a "$OUT/bench2.log"
