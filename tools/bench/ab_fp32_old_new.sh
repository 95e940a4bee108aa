#!/usr/bin/env bash
# An older binary against the current one (first written for issue 7's refactor): the same n = 32768 fp32 job (16 GiB host budget, durable = false) with
# the binary of an older commit ($OLD, default .dev/bin/mgmm-stream-old) and the current one,
# alternating old/new REPEAT times (default 3) on GPU 0 and then on all GPUs, so both see the
# same machine state. Prints each run's step wall time and the medians.
# GPU machine, repository root, .dev/bin carried. Log: $OUT/ab_fp32_old_new.log.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to ab_fp32_old_new.log
OLD=${OLD:-$DEV/mgmm-stream-old}; NEW=$MGMM
[ -x "$OLD" ] || { echo "no old binary at $OLD" >&2; exit 2; }
N=${N:-32768}; REPEAT=${REPEAT:-3}; NGPU=$(gpu_count)
W=${W:-/tmp/rc}; mkdir -p "$W"; cd "$W"
gen_matrix A.mgt "$N" "$N" 1
gen_matrix B.mgt "$N" "$N" 2
cuda_plan g1 fp32 "[0]"; cuda_plan g2 fp32 '"all"'
one() { # BIN LABEL PLAN
  rm -f "C_$3.mgt" "C_$3.mgt.journal"
  "$1" run "$3.toml" --quiet --report "$OUT/$2_$3.json" 2>&1 | tail -2 | tee -a "$LOG"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['steps'][0]; print(f\"$2 $3 wall {r['wall_s']:.3f} s bottleneck {r['bottleneck']}\")" "$OUT/$2_$3.json" | tee -a "$LOG"
}
plans=g1; [ "$NGPU" -ge 2 ] && plans="g1 g2"
for p in $plans; do
  for i in $(seq 1 "$REPEAT"); do one "$OLD" old "$p"; one "$NEW" new "$p"; done
done
python3 - "$LOG" <<'PY' | tee -a "$LOG"
import re, sys, statistics as st
runs = {}
for line in open(sys.argv[1]):
    m = re.match(r"(old|new) (g\d) wall ([\d.]+) s", line)
    if m: runs.setdefault((m[2], m[1]), []).append(float(m[3]))
for g in sorted({k[0] for k in runs}):
    o, n = runs.get((g, "old"), []), runs.get((g, "new"), [])
    if o and n:
        print(f"{g}: old {o} median {st.median(o):.3f} s | new {n} median {st.median(n):.3f} s | new/old {st.median(n)/st.median(o):.3f}")
PY
