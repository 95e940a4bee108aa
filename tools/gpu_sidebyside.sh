#!/usr/bin/env bash
# BENCHMARKS.md's GPU table, side by side in one run on nvidia-h200-x2 (repo root, .dev/bin
# carried): host fill strategies; mgmm-stream on 1 and 2 GPUs (fp32, tf32, bf16); cuBLASXt on
# 1 and 2 GPUs and torch on the same data; a cold-cache run against the disk's measured speed.
set -uo pipefail
B=$PWD/.dev/bin; T=$PWD/tools
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/sidebyside.log"
W=/tmp/sbs; mkdir -p $W; cd $W
log() { echo "### $*" | tee -a "$L"; }
nvidia-smi --query-gpu=index,name,memory.used --format=csv | tee -a "$L"
$B/mgmm-stream gen A.mgt --rows 32768 --cols 32768 --seed 1 2>&1 | tee -a "$L"
$B/mgmm-stream gen B.mgt --rows 32768 --cols 32768 --seed 2 2>&1 | tee -a "$L"
log "host fill strategies (A.mgt warm)"; python3 $T/register_probe.py A.mgt 8 2>&1 | tee -a "$L"
mk() { # name precision devices
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
run() { rm -f C_$1.mgt*; log "mgmm $1"; $B/mgmm-stream run $1.toml --report "$OUT/$1.json" 2>&1 | tee -a "$L" | grep -E "wall|busy|bottleneck|error"; }
mk g1 fp32 "[0]"; mk g2 fp32 '"all"'; mk g1_tf32 tf32 "[0]"; mk g2_tf32 tf32 '"all"'; mk g2_bf16 bf16 '"all"'
run g1; run g1; run g1; run g2; run g2; run g2; run g1_tf32; run g2_tf32; run g2_bf16
rm -f C_*.mgt*
log "export for peers"
$B/mgmm-stream export A.mgt A.npy --force && $B/mgmm-stream export B.mgt B.npy --force
$B/mgmm-stream run g2.toml --quiet && $B/mgmm-stream export C_g2.mgt C_g2.npy --force && rm -f C_g2.mgt*
log "peers"
python3 $T/peers.py --a A.npy --b B.npy --out peer_C.bin --ngpu 1 --which cublasxt --check C_g2.npy 2>&1 | grep peer | tee -a "$L"
python3 $T/peers.py --a A.npy --b B.npy --out peer_C.bin --ngpu 2 --which cublasxt,torch_fp32,torch_tf32 2>&1 | grep peer | tee -a "$L"
rm -f *.npy peer_C.bin
drop() { python3 -c "
import os,sys
for p in sys.argv[1:]:
    fd=os.open(p,os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED); os.close(fd)" "$@"; }
sync; drop A.mgt B.mgt
log "disk: cold read of A.mgt"; dd if=A.mgt of=/dev/null bs=16M 2>&1 | tail -1 | tee -a "$L"
sync; drop A.mgt B.mgt
run g1
sync; drop A.mgt B.mgt
run g2
