#!/usr/bin/env bash
# GPU benchmarks, side by side in one run (docs/GPU.md, BENCHMARKS.md). From the repo root on
# the GPU machine, with .dev/bin carried:  N=32768 NGPU=1 bash tools/gpu_bench.sh
set -uo pipefail
B=$PWD/.dev/bin; T=$PWD/tools
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=${N:-32768}; NGPU=${NGPU:-1}; W=${W:-/tmp/bench}
mkdir -p $W; cd $W
log() { echo "### $*" | tee -a "$OUT/bench.log"; }
nvidia-smi --query-gpu=index,name,memory.used --format=csv | tee -a "$OUT/bench.log"
[ -f A.mgt ] || $B/mgmm-stream gen A.mgt --rows $N --cols $N --seed 1 2>&1 | tee -a "$OUT/bench.log"
[ -f B.mgt ] || $B/mgmm-stream gen B.mgt --rows $N --cols $N --seed 2 2>&1 | tee -a "$OUT/bench.log"
plan() { # name precision extra-engine-lines
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
host_memory = "16GiB"
durable = false
$3
PLAN
}
run() { # name
  rm -f C_$1.mgt
  log "mgmm $1"
  $B/mgmm-stream run $1.toml --report "$OUT/$1.json" 2>&1 | tee -a "$OUT/bench.log" | grep -E "wall|busy|bottleneck"
}
log "checksum verification speed"; $B/mgmm-stream info A.mgt --check 2>&1 | tail -1 | tee -a "$OUT/bench.log"
plan fp32 fp32 ""; run fp32; run fp32; run fp32
MGMM_WRITE=pwrite run fp32
plan fp32_noverify fp32 "verify_inputs = false"; run fp32_noverify
plan fp32_k16 fp32 "tile = [8192, 8192, 16384]"; run fp32_k16; run fp32_k16
plan tf32 tf32 ""; run tf32
plan bf16 bf16 ""; run bf16
# Cold page cache: measure the disk, then run cold.
drop() { python3 -c "
import os,sys
for p in sys.argv[1:]:
    fd=os.open(p,os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED); os.close(fd)" "$@"; }
sync; drop A.mgt B.mgt
log "disk: cold read of A.mgt with dd"
dd if=A.mgt of=/dev/null bs=16M 2>&1 | tail -1 | tee -a "$OUT/bench.log"
sync; drop A.mgt B.mgt
plan cold fp32 ""; run cold
# Peers on the same data.
[ -n "${SKIP_PEERS:-}" ] && exit 0
rm -f C_*.mgt
log "export for peers"
$B/mgmm-stream export A.mgt A.npy --force && $B/mgmm-stream export B.mgt B.npy --force
$B/mgmm-stream run fp32.toml --quiet && $B/mgmm-stream export C_fp32.mgt C_fp32.npy --force && rm -f C_fp32.mgt
log "peers"
python3 $T/peers.py --a A.npy --b B.npy --out peer_C.bin --ngpu $NGPU --check C_fp32.npy 2>&1 | tee -a "$OUT/bench.log"
rm -f C_fp32.npy
