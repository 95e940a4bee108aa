#!/usr/bin/env bash
# Out-of-core CPU benchmark (BENCHMARKS.md): 4 GiB of f32 inputs read with a cold page cache,
# mgmm-stream (CPU backend) against numpy row panels over np.memmap of the same data, one run.
#   cargo build --release && bash tools/cpu_ooc_bench.sh
set -euo pipefail
B=$PWD/target/release/mgmm-stream; T=$PWD/tools
W=${W:-/tmp/ooc}; mkdir -p $W; cd $W
M=${M:-8192}; K=${K:-65536}; N=${N:-8192}
[ -f A.mgt ] || $B gen A.mgt --rows $M --cols $K --seed 1 --dist uniform
[ -f B.mgt ] || $B gen B.mgt --rows $K --cols $N --seed 2 --dist uniform
[ -f A.npy ] || $B export A.mgt A.npy
[ -f B.npy ] || $B export B.mgt B.npy
drop() { python3 -c "
import os,sys
for p in sys.argv[1:]:
    fd=os.open(p,os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED); os.close(fd)" "$@"; }
cat > plan.toml <<PLAN
[matrices.A]
path = "A.mgt"
[matrices.B]
path = "B.mgt"
[[step]]
output = "C.mgt"
expr = "A @ B"
[engine]
backend = "cpu"
host_memory = "2GiB"
durable = false
PLAN
rm -f C.mgt C.mgt.journal C_np.npy; sync; drop A.mgt B.mgt A.npy B.npy
echo "== disk: cold read of A.npy"; dd if=A.npy of=/dev/null bs=16M 2>&1 | tail -1; drop A.npy
echo "== mgmm-stream (cold inputs)"
/usr/bin/env time -f "wall %e s, max RSS %M KiB" $B run plan.toml --report ooc_mgmm.json 2>&1 | tail -9
sync; drop A.mgt B.mgt A.npy B.npy
echo "== numpy row panels over np.memmap (cold inputs)"
/usr/bin/env time -f "wall %e s, max RSS %M KiB" python3 $T/numpy_panels.py A.npy B.npy C_np.npy 1024
python3 - <<'PY'
import json, numpy as np
r = json.load(open("ooc_mgmm.json"))["steps"][0]
print(f"mgmm-stream: {r['wall_s']:.2f} s, {r['gflops_per_s']:.1f} GFLOP/s, bottleneck {r['bottleneck']}")
print("busy shares:", ", ".join(f"{n} {100*v:.0f}%" for n, v in r["busy_shares"]))
PY
$B export C.mgt C_mgmm.npy --force 2>/dev/null
python3 -c "
import numpy as np
a=np.load('C_mgmm.npy',mmap_mode='r')[:256].astype(np.float64); b=np.load('C_np.npy',mmap_mode='r')[:256].astype(np.float64)
print('first 256 rows, relative difference mgmm vs numpy: %.2e' % (np.linalg.norm(a-b)/np.linalg.norm(b)))"
