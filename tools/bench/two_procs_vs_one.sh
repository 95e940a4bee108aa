#!/usr/bin/env bash
# Issue 12's GPU check: one product computed by two processes with one GPU each
# (CUDA_VISIBLE_DEVICES=0 / =1, SLURM-style ranks, coordinating only through files) against one
# process driving both GPUs. Expect bit-identical output and time within 10 %.
# Size: N (default 32768), tile 4096 (fixed, so both runs use the same compute tiles), 3 rounds.
# SHARDS=S passes --shards S to both processes (default: the engine's default, 1 or 4 per
# process, docs/CLUSTER.md);
# with S = 2 each process reads B once, as the one-process run does per GPU.
# GPU machine with 2 GPUs, repository root, .dev/bin carried. Log: $OUT/two_procs_vs_one.log.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to two_procs_vs_one.log
N=${N:-32768}; ROUNDS=${ROUNDS:-3}
[ "$(gpu_count)" -ge 2 ] || { log "needs 2 GPUs, found $(gpu_count)"; exit 1; }
W=${W:-/tmp/c2}; mkdir -p "$W"; cd "$W"
gen_matrix A.mgt "$N" "$N" 11
gen_matrix B.mgt "$N" "$N" 12
write_plan one.toml A.mgt B.mgt C_one.mgt 'backend = "cuda"' 'devices = "all"' 'tile = 4096'
write_plan two.toml A.mgt B.mgt C_two.mgt 'backend = "cuda"' 'devices = "all"' 'tile = 4096'
ms() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }
for r in $(seq "$ROUNDS"); do
  rm -rf C_one.mgt C_one.mgt.journal C_two.mgt C_two.mgt.journal C_two.mgt.shards
  t=$(date +%s%N)
  "$MGMM" run one.toml --quiet --no-split --report "$OUT/c2_one_$r.json"
  one=$(ms "$t")
  "$MGMM" prepare two.toml >/dev/null
  t=$(date +%s%N)
  CUDA_VISIBLE_DEVICES=0 SLURM_PROCID=0 SLURM_NTASKS=2 "$MGMM" run two.toml --quiet ${SHARDS:+--shards $SHARDS} --report "$OUT/c2_p0_$r.json" & p0=$!
  CUDA_VISIBLE_DEVICES=1 SLURM_PROCID=1 SLURM_NTASKS=2 "$MGMM" run two.toml --quiet ${SHARDS:+--shards $SHARDS} --report "$OUT/c2_p1_$r.json" & p1=$!
  wait $p0; e0=$?; wait $p1; e1=$?
  two=$(ms "$t")
  same=no; cmp -s C_one.mgt C_two.mgt && same=yes
  log "round $r${SHARDS:+ (--shards $SHARDS)}: one process × 2 GPUs ${one} ms; two processes × 1 GPU ${two} ms (exit $e0 $e1, includes finalize); ratio $(awk "BEGIN{printf \"%.3f\", $two/$one}"); bit-identical: $same"
  # Where the time goes: each process's steps (shards), its start-up and its whole run.
  python3 - "$OUT/c2_one_$r.json" "$OUT/c2_p0_$r.json" "$OUT/c2_p1_$r.json" <<'PY' | tee -a "$LOG"
import json, sys
for f in sys.argv[1:]:
    r = json.load(open(f))
    steps = ", ".join(f"{s['wall_s']:.2f}" for s in r["steps"])
    print(f"  {f.split('/')[-1]}: run {r['wall_s']:.2f} s, process {r.get('process_wall_s') or 0:.2f} s; "
          f"shard/step walls [{steps}] (sum {sum(s['wall_s'] for s in r['steps']):.2f}); "
          + "start-up " + ", ".join(f"{n} {v:.2f}" for n, v in r.get("startup_s", [])))
PY
done
"$MGMM" status two.toml | tee -a "$LOG"
