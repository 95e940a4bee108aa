#!/usr/bin/env bash
# Issue 9's out-of-core benchmark: N×N f32 (default 100000, 40 GB per matrix) on all GPUs,
# durable = true, each case against the disk bound measured with dd in the same run:
#   bound = bytes that must be read (each input once) / dd cold read speed
#         + output bytes / dd O_DIRECT write speed
#   ram_gt  cold page cache, RAM larger than the inputs
#   ram_lt  cold page cache, and an anonymous-memory hog holding all but KEEP_GB (default 60) GB
#           of RAM, so the page cache cannot hold the inputs (the case people buy this for)
#   warm    inputs in the page cache (after ram_gt/ram_lt they are partly; this reads them first)
# Prints a table: wall, bound, ratio, bytes read vs predicted vs minimum, shared between GPUs,
# first GEMM, peak RSS. GPU machine (nvidia-h200-x2: 128 GB disk holds A, B and C), repository
# root, .dev/bin carried. Log: $OUT/ooc.log, reports $OUT/ooc_*.json.
#   bash tools/bench/ooc_disk_bound.sh [CASE...]      default: ram_gt ram_lt
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to ooc.log
N=${N:-100000}; KEEP_GB=${KEEP_GB:-60}; HOST=${HOST:-16GiB}
W=${W:-$ROOT/.ooc}; mkdir -p "$W"; cd "$W"
[ $# -gt 0 ] || set -- ram_gt ram_lt
df -h . | tee -a "$LOG"; free -g | tee -a "$LOG"
gen_matrix A.mgt "$N" "$N" 1
gen_matrix B.mgt "$N" "$N" 2
write_plan ooc.toml A.mgt B.mgt C.mgt 'backend = "cuda"' 'devices = "all"' \
  "host_memory = \"$HOST\"" 'durable = true'
"$MGMM" plan ooc.toml 2>&1 | tee -a "$LOG" | grep -E "traffic|lower bound|compute tile"

# Disk speeds, same run: cold sequential read of 8 GiB of A, O_DIRECT write of 8 GiB.
drop_cache A.mgt
RD=$(dd if=A.mgt of=/dev/null bs=16M count=512 2>&1 | tail -1)
WR=$(dd if=/dev/zero of=dd.tmp bs=16M count=512 oflag=direct 2>&1 | tail -1); rm -f dd.tmp
drop_cache A.mgt
log "dd read: $RD"; log "dd write: $WR"
rate() { python3 -c "import re,sys; m=re.search(r'([\d.]+) ([GM])B/s', sys.argv[1]); print(float(m[1])*(1e9 if m[2]=='G' else 1e6))" "$1"; }
RDR=$(rate "$RD"); WRR=$(rate "$WR")

trap hog_stop EXIT

one() { # NAME
  rm -f C.mgt C.mgt.journal
  log "ooc $1"
  /usr/bin/env time -f "process wall %e s, max RSS %M KiB" "$MGMM" run ooc.toml --report "$OUT/ooc_$1.json" 2>&1 \
    | tee -a "$LOG" | grep -E "wall|inputs:|busy|bottleneck|process|error"
  python3 - "$OUT/ooc_$1.json" "$1" "$RDR" "$WRR" <<'PY' | tee -a "$LOG"
import json, sys
r = json.load(open(sys.argv[1]))["steps"][0]
rd, wr = float(sys.argv[3]), float(sys.argv[4])
bound = r["min_read_bytes"] / rd + r["write_bytes"] / wr
g = 2**30
print(f"RESULT {sys.argv[2]}: wall {r['wall_s']:.1f} s, disk bound {bound:.1f} s, ratio {r['wall_s']/bound:.2f}; "
      f"read {r['read_bytes']/g:.1f} GiB (predicted {r['predicted_read_bytes']/g:.1f}, minimum {r['min_read_bytes']/g:.1f}, "
      f"ratio to minimum {r['read_bytes']/r['min_read_bytes']:.3f}), shared {r['shared_read_bytes']/g:.1f} GiB; "
      f"first GEMM {r['first_gemm_s']} s; peak RSS {r['peak_rss_bytes']/g:.1f} GiB; bottleneck {r['bottleneck']}")
PY
}
for c in "$@"; do
  case $c in
    ram_gt) drop_cache A.mgt B.mgt; one ram_gt ;;
    ram_lt) hog_start; drop_cache A.mgt B.mgt; one ram_lt; hog_stop ;;
    warm) cat A.mgt B.mgt > /dev/null; one warm ;;
    *) echo "unknown case $c" >&2 ;;
  esac
done
grep RESULT "$LOG"
