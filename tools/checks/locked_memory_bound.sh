#!/usr/bin/env bash
# Issue 33 item 12: page-locked input pages count against host_memory. 65536² f32 (17.2 GB per
# input) on one GPU with host_memory = "8GiB" and staging = "direct" (every block from the files'
# pages, page-locked by the driver), while an anonymous-memory balloon holds all but KEEP_GB
# (default 24) GB of RAM, so the inputs (34 GB) do not fit in what is left. Records the process's
# peak RSS (/usr/bin/time's max RSS and the report's peak_rss_bytes), the report's
# peak_locked_bytes, direct_budget_bytes and host_pool_bytes, and checks
#   host_pool_bytes + peak_locked_bytes <= host_memory        (the rule, as the engine counts it)
#   peak RSS <= host_memory + 2 GiB                           (the goal, as the kernel counts it)
# and, against a run without the balloon, that the output is bitwise the same (sha256). Before the rule
# this case locked 19.9 GB (budget 15.4 GB) and peaked at 23.1 GiB RSS.
# GPU machine with one H200 (nvidia-h200: 128 GiB RAM, 64 GiB disk holds A, B and C), repository
# root, .dev/bin carried. Log: $OUT/locked.log, reports $OUT/locked_*.json.
#   bash tools/checks/locked_memory_bound.sh          N=65536 HOST=8GiB KEEP_GB=24 by default
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to locked.log
N=${N:-65536}; KEEP_GB=${KEEP_GB:-24}; HOST=${HOST:-8GiB}; SLACK_GIB=${SLACK_GIB:-2}
W=${W:-$ROOT/.locked}; mkdir -p "$W"; cd "$W"
df -h . | tee -a "$LOG"; free -g | tee -a "$LOG"
gen_matrix A.mgt "$N" "$N" 1
gen_matrix B.mgt "$N" "$N" 2
for o in ref bound; do
  write_plan $o.toml A.mgt B.mgt C_$o.mgt 'backend = "cuda"' 'devices = [0]' \
    "host_memory = \"$HOST\"" 'staging = "direct"' 'durable = false'
done
"$MGMM" plan bound.toml 2>&1 | tee -a "$LOG" | grep -E "compute tile|host pools|staging|inputs"

trap hog_stop EXIT

one() { # NAME: run NAME.toml, the report in $OUT/locked_NAME.json, max RSS in NAME.time
  rm -f "C_$1.mgt" "C_$1.mgt.journal"
  log "run $1"
  /usr/bin/env time -f "max RSS %M KiB, wall %e s" -o "$1.time" \
    "$MGMM" run "$1.toml" --report "$OUT/locked_$1.json" 2>&1 | tee -a "$LOG" | grep -E "wall|staging|host pools|error"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$LOG"; cat "$1.time" | tee -a "$LOG"
}

drop_cache A.mgt B.mgt
hog_start
one bound
hog_stop
# Two 17 GB outputs and the inputs do not fit on the 64 GiB disk together: keep a digest.
sha256sum < C_bound.mgt > bound.sha; rm -f C_bound.mgt
one ref
python3 - "$OUT/locked_bound.json" "$(sed -E 's/max RSS ([0-9]+) KiB.*/\1/' bound.time)" "$HOST" "$SLACK_GIB" <<'PY' | tee -a "$LOG"
import json, re, sys
r = json.load(open(sys.argv[1]))["steps"][0]
rss = int(sys.argv[2]) * 1024
m = re.fullmatch(r"(\d+)GiB", sys.argv[3]); host = int(m[1]) << 30
slack = int(sys.argv[4]) << 30
g = 2**30
locked, pools, budget = r["peak_locked_bytes"], r["host_pool_bytes"], r["direct_budget_bytes"]
print(f"RESULT: peak RSS {rss/g:.2f} GiB (report {r['peak_rss_bytes']/g:.2f}), peak locked {locked/g:.2f} GiB, "
      f"lock budget {budget/g:.2f} GiB, pools {pools/g:.2f} GiB, host_memory {host/g:.0f} GiB; "
      f"{r['direct_bytes']/g:.1f} GiB direct, {r['direct_full_blocks']} blocks copied while the budget was full, "
      f"wall {r['wall_s']:.1f} s")
print("PASS rule: pools + peak locked <= host_memory" if pools + locked <= host else "FAIL rule: pools + peak locked > host_memory")
print(f"PASS goal: peak RSS <= host_memory + {slack//g} GiB" if rss <= host + slack else f"FAIL goal: peak RSS > host_memory + {slack//g} GiB")
PY
if [ "$(sha256sum < C_ref.mgt)" = "$(cat bound.sha)" ]; then
  echo "PASS: output bitwise identical with and without the balloon" | tee -a "$LOG"
else
  echo "FAIL: outputs differ with and without the balloon" | tee -a "$LOG"
fi
grep -E "RESULT|PASS|FAIL" "$LOG"
