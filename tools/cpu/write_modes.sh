#!/usr/bin/env bash
# Output-bound runs on the CPU backend (docs/decisions/0003-write-auto.md): C = A(65536×16) · B(16×N) f32,
# N = 8192 (a 2 GiB output) and 20480 (5 GiB), durable = false, written with write = "mmap",
# "pwrite" and "auto", runs interleaved, each after `sync; sleep 2`; shows which mode `auto`
# chose and the kernel's dirty limit the report gives (docs/PLAN.md, `write` and `durable`).
#   cargo build --release && bash tools/cpu/write_modes.sh
# REPEAT (default 2), HOST (host_memory, default 8GiB), W (work folder, default /tmp/wmodes),
# NS (the N values, default "8192 20480"; 14336 = 3.5 GiB, 16384 = 4 GiB), MODES (default
# "mmap pwrite auto").
# Log: $OUT/write_modes.log; the output folder must be on disk (not tmpfs) to see the limit.
set -euo pipefail
. "$(dirname "$0")/../lib.sh"
log_to write_modes.log
REPEAT=${REPEAT:-2}; HOST=${HOST:-8GiB}; NS=${NS:-8192 20480}; MODES=${MODES:-mmap pwrite auto}
W=${W:-/tmp/wmodes}; mkdir -p "$W"; cd "$W"
gen_matrix A.mgt 65536 16 1
for n in $NS; do gen_matrix "B$n.mgt" 16 "$n" 2; done
sysctl vm.dirty_ratio vm.dirty_background_ratio vm.dirty_bytes 2>&1 | tee -a "$LOG"
for n in $NS; do
  for i in $(seq 1 "$REPEAT"); do
    for w in $MODES; do
      write_plan p.toml A.mgt "B$n.mgt" C.mgt 'backend = "cpu"' 'durable = false' \
        "host_memory = \"$HOST\"" "write = \"$w\""
      rm -f C.mgt C.mgt.journal; sync; sleep 2
      "$MGMM" run p.toml -q --restart --report "$OUT/wm.json"
      python3 - "$OUT/wm.json" "$n" "$w" "$i" <<'PY' | tee -a "$LOG"
import json, sys
s = json.load(open(sys.argv[1]))["steps"][0]
print(f"N={sys.argv[2]} ({s['write_bytes'] / 2**30:.1f} GiB) write={sys.argv[3]:6} run {sys.argv[4]}: "
      f"step {s['wall_s']:6.2f} s, {s['write_bytes'] / s['wall_s'] / 1e9:5.2f} GB/s, "
      f"wrote with {s['write_mode']}, dirty limit {s['dirty_limit_bytes']}, bottleneck {s['bottleneck']}")
PY
    done
  done
done
rm -f C.mgt C.mgt.journal
