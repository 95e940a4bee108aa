#!/usr/bin/env bash
# Out-of-core CPU benchmark (BENCHMARKS.md, CPU table): C(M×N) = A(M×K) · B(K×N), f32, inputs read
# with a cold page cache; mgmm-stream (CPU backend, host_memory = HOST) against numpy row panels
# over np.memmap of the same data (tools/peers/numpy_memmap_panels.py), one after the other.
#   cargo build --release && bash tools/cpu/ooc_vs_numpy.sh
# Sizes: M, K, N (default 8192, 65536, 8192: 4 GiB of inputs), HOST (default 2GiB), W (work
# folder, default /tmp/ooc; inputs are kept there and reused). Log: $OUT/cpu_ooc.log.
# Needs python3 with numpy; without numpy only mgmm-stream runs.
set -euo pipefail
. "$(dirname "$0")/../lib.sh"
log_to cpu_ooc.log
M=${M:-8192}; K=${K:-65536}; N=${N:-8192}; HOST=${HOST:-2GiB}
W=${W:-/tmp/ooc}; mkdir -p "$W"; cd "$W"
gen_matrix A.mgt "$M" "$K" 1 uniform
gen_matrix B.mgt "$K" "$N" 2 uniform
numpy=$(python3 -c "import numpy" 2>/dev/null && echo yes || echo no)
if [ "$numpy" = yes ]; then export_npy A.mgt A.npy; export_npy B.mgt B.npy; fi
write_plan plan.toml A.mgt B.mgt C.mgt 'backend = "cpu"' "host_memory = \"$HOST\"" 'durable = false'
rm -f C.mgt C.mgt.journal C_np.npy
disk_read A.mgt
drop_cache A.mgt B.mgt
log "mgmm-stream (cold inputs), host_memory $HOST"
timed "$MGMM" run plan.toml --report "$OUT/cpu_ooc.json" 2>&1 | tail -9 | tee -a "$LOG"
summarize_report "$OUT/cpu_ooc.json"
[ "$numpy" = yes ] || { log "numpy not importable: peer skipped"; exit 0; }
drop_cache A.mgt B.mgt A.npy B.npy
log "numpy row panels over np.memmap (cold inputs)"
timed python3 "$TOOLS/peers/numpy_memmap_panels.py" A.npy B.npy C_np.npy 1024 2>&1 | tee -a "$LOG"
"$MGMM" export C.mgt C_mgmm.npy --force >/dev/null 2>&1
python3 -c "
import numpy as np
a=np.load('C_mgmm.npy',mmap_mode='r')[:256].astype(np.float64); b=np.load('C_np.npy',mmap_mode='r')[:256].astype(np.float64)
print('first 256 rows, relative difference mgmm vs numpy: %.2e' % (np.linalg.norm(a-b)/np.linalg.norm(b)))" | tee -a "$LOG"
