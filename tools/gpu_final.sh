#!/usr/bin/env bash
# Final GPU session script (nvidia-h200-x2), from the repo root with .dev/bin carried:
#   CUDA test twins on two GPUs; GPU fault and SIGKILL mid-run, then resume, compared bitwise
#   with an uninterrupted run; each precision's error against an f64 reference at n = 8192;
#   n = 32768 on one and two GPUs; a cold-cache run against the disk's own speed.
set -uo pipefail
B=$PWD/.dev/bin; T=$PWD/tools
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L="$OUT/final.log"
log() { echo "### $*" | tee -a "$L"; }
for t in correctness pipeline; do
  log "$t --ignored (both GPUs)"; $B/$t --ignored --test-threads=1 2>&1 | grep -E "^test |test result" | tee -a "$L"
done
W=/tmp/fin; mkdir -p $W; cd $W
mkplan() { # file out precision devices a b extra
cat > $1 <<PLAN
[matrices.A]
path = "$5"
[matrices.B]
path = "$6"
[[step]]
output = "$2"
expr = "A @ B"
[engine]
backend = "cuda"
precision = "$3"
devices = $4
host_memory = "16GiB"
$7
PLAN
}
$B/mgmm-stream gen A8.mgt --rows 8192 --cols 8192 --seed 5 2>&1 | tail -1
$B/mgmm-stream gen B8.mgt --rows 8192 --cols 8192 --seed 6 2>&1 | tail -1
log "resume after an injected GPU fault and after SIGKILL (2 GPUs, tile 2048, durable)"
mkplan ref.toml Cref.mgt fp32 '"all"' A8.mgt B8.mgt "tile = 2048"
mkplan res.toml Cres.mgt fp32 '"all"' A8.mgt B8.mgt "tile = 2048"
$B/mgmm-stream run ref.toml --quiet
MGMM_FAULT_GEMM_AFTER=40 $B/mgmm-stream run res.toml 2>&1 | tail -1 | tee -a "$L"
$B/mgmm-stream run res.toml 2>&1 | grep -E "resuming" | tee -a "$L"
cmp Cref.mgt Cres.mgt && echo "fault then resume: bitwise identical" | tee -a "$L"
rm -f Cres.mgt Cres.mgt.journal
for i in 1 2 3; do ( $B/mgmm-stream run res.toml --quiet & p=$!; sleep 0.$((3*i)); kill -9 $p; wait $p ) 2>/dev/null; done
$B/mgmm-stream run res.toml 2>&1 | grep -E "resuming" | tee -a "$L"
cmp Cref.mgt Cres.mgt && echo "3 SIGKILLs then resume: bitwise identical" | tee -a "$L"
log "precision errors at n = 8192 (one GPU)"
for p in fp32 tf32 bf16 fp16; do mkplan p_$p.toml C8_$p.mgt $p "[0]" A8.mgt B8.mgt "durable = false"; rm -f C8_$p.mgt*; $B/mgmm-stream run p_$p.toml 2>&1 | grep -E "^step|wall" | tee -a "$L"; $B/mgmm-stream export C8_$p.mgt C8_$p.npy --force 2>/dev/null; done
$B/mgmm-stream export A8.mgt A8.npy --force 2>/dev/null; $B/mgmm-stream export B8.mgt B8.npy --force 2>/dev/null
python3 $T/precision_errors.py A8.npy B8.npy C8_fp32.npy C8_tf32.npy C8_bf16.npy C8_fp16.npy 2>&1 | tee -a "$L"
rm -f *.npy C8_* Cref* Cres*
log "n = 32768"
$B/mgmm-stream gen A.mgt --rows 32768 --cols 32768 --seed 1 2>&1 | tail -1
$B/mgmm-stream gen B.mgt --rows 32768 --cols 32768 --seed 2 2>&1 | tail -1
run() { rm -f $2*; log "mgmm $1"; $B/mgmm-stream run $1 --report "$OUT/${1%.toml}.json" 2>&1 | tee -a "$L" | grep -E "wall|busy|bottleneck|error"; }
mkplan g1.toml C1.mgt fp32 "[0]" A.mgt B.mgt "durable = false"
mkplan g2.toml C2.mgt fp32 '"all"' A.mgt B.mgt "durable = false"
mkplan t1.toml Ct.mgt tf32 "[0]" A.mgt B.mgt "durable = false"
run g1.toml C1.mgt; run g1.toml C1.mgt; run g2.toml C2.mgt; run g2.toml C2.mgt; run g2.toml C2.mgt; run t1.toml Ct.mgt
drop() { python3 -c "
import os,sys
for p in sys.argv[1:]:
    fd=os.open(p,os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED); os.close(fd)" "$@"; }
rm -f C*.mgt*; sync; drop A.mgt B.mgt
log "disk: cold read of A.mgt"; dd if=A.mgt of=/dev/null bs=16M 2>&1 | tail -1 | tee -a "$L"
sync; drop A.mgt B.mgt
run g1.toml C1.mgt
