#!/usr/bin/env bash
# A split step under a real SLURM (one-node cluster from ../shared/tools/slurm_local.sh):
#   1. `srun -n 4 mgmm-stream run PLAN`                       -> bytes of a one-process run
#   2. `sbatch --array=0-7%4` (one array task per shard)      -> same bytes
#   3. a 4-task job SIGKILLed mid-run by `scancel`, then resubmitted as `srun -n 2` -> same bytes
#   4. a job whose `--time=1` limit ends mid-step: SLURM sends SIGTERM (SIGKILL KillWait = 5 s
#      later), the run stops, saying so, before the SIGKILL; resubmitted, it finishes -> the
#      bytes of an uninterrupted run (the step is slowed by the test build's slow-disk hook,
#      MGMM_FAULT_WRITE_DELAY_MS, so that it outlasts the limit without using the CPU)
# and nothing left in the queue. Run from the repository root (.ci/run does); about 2.5 minutes
# after the first SLURM install, most of it the minute-long time limit and SLURM's 30 s check
# of it (docs/CLUSTER.md gives the measured time).
# Env: MGMM_BIN (default: build and use target/debug/mgmm-stream, the test build with the
# fault-injection hooks), SLURM_LOCAL (the script).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

if [ "${1:-}" != "--inner" ]; then
    SL=${SLURM_LOCAL:-}
    for c in "$ROOT/../shared/tools/slurm_local.sh" "$ROOT/../../shared/tools/slurm_local.sh" /work/shared/tools/slurm_local.sh; do
        [ -z "$SL" ] && [ -x "$c" ] && SL=$c
    done
    if [ -z "$SL" ]; then
        if [ ! -d "$ROOT/../shared" ]; then
            echo "SKIP tests/slurm.sh: no ../shared directory beside the repository, so no slurm_local.sh to start a SLURM cluster with"
            exit 0
        fi
        echo "tests/slurm.sh: ../shared exists but has no tools/slurm_local.sh" >&2
        exit 1
    fi
    if [ -z "${MGMM_BIN:-}" ]; then
        # The binary `cargo test` just built (.ci/run runs this after it), if no source is newer.
        MGMM_BIN="${CARGO_TARGET_DIR:-$ROOT/target}/debug/mgmm-stream"
        if [ ! -x "$MGMM_BIN" ] || [ -n "$(find src Cargo.toml -newer "$MGMM_BIN" -print -quit)" ]; then
            cargo build --quiet --bin mgmm-stream --features fault-injection
        fi
    fi
    export MGMM_BIN
    start=$(date +%s)
    "$SL" --exec "$ROOT/tests/slurm.sh" --inner
    echo "tests/slurm.sh: passed in $(( $(date +%s) - start )) s (including SLURM start and stop)"
    exit 0
fi

# ---- inside the running cluster ----
BIN=$MGMM_BIN
W=$(mktemp -d /tmp/mgmm-slurm.XXXXXX)
JOBS=()
cleanup() {
    for j in "${JOBS[@]}"; do scancel "$j" 2>/dev/null || true; done
    rm -rf "$W"
}
trap cleanup EXIT

plan() {  # plan DIR [TILE]
    mkdir -p "$1"
    cat > "$1/plan.toml" <<TOML
[matrices.A]
path = "A.mgt"
generate = { rows = 768, cols = 2048, dist = "normal", seed = 1 }
[matrices.B]
path = "B.mgt"
generate = { rows = 2048, cols = 768, dist = "normal", seed = 2 }
[[step]]
output = "C.mgt"
expr = "A @ B"
[engine]
backend = "cpu"
threads = 1
tile = ${2:-48}
host_memory = "64MiB"
TOML
}
same() {  # same DIR WHAT [REFERENCE DIR]
    cmp -s "${3:-$W/ref}/C.mgt" "$1/C.mgt" || { echo "FAIL: $2: output differs from one process" >&2; exit 1; }
    "$BIN" info "$1/C.mgt" --check >/dev/null
    echo "ok: $2: bit-identical to one process"
}
wait_gone() {  # wait until job $1 has left the queue
    for _ in $(seq 600); do
        [ -z "$(squeue -h -j "$1" 2>/dev/null)" ] && return 0
        sleep 0.2
    done
    echo "FAIL: job $1 still queued" >&2; exit 1
}

plan "$W/ref"
t=$(date +%s%N)
(cd "$W/ref" && env -u SLURM_PROCID -u SLURM_NTASKS "$BIN" run plan.toml -q)
echo "one process: $(( ($(date +%s%N) - t) / 1000000 )) ms"

# 1. srun -n 4
plan "$W/srun"
t=$(date +%s%N)
(cd "$W/srun" && srun -n 4 "$BIN" run plan.toml -q)
echo "srun -n 4: $(( ($(date +%s%N) - t) / 1000000 )) ms"
same "$W/srun" "srun -n 4"

# 2. an array job, one task per shard, at most 4 at once
plan "$W/array"
cat > "$W/array.sh" <<SH
#!/bin/bash
cd "$W/array" && exec "$BIN" run plan.toml -q --shards 8
SH
t=$(date +%s%N)
sbatch --wait --array=0-7%4 -o "$W/array-%a.log" "$W/array.sh" >/dev/null
echo "sbatch --array=0-7%4: $(( ($(date +%s%N) - t) / 1000000 )) ms"
same "$W/array" "sbatch --array=0-7%4"

# 3. kill a 4-task job mid-run, resubmit with 2 tasks
plan "$W/kill"
cat > "$W/kill.sh" <<SH
#!/bin/bash
cd "$W/kill" && srun -n 4 "$BIN" run plan.toml -q --shards 12
SH
job=$(sbatch --parsable -n 4 -o "$W/kill.log" "$W/kill.sh")
JOBS+=("$job")
for _ in $(seq 600); do  # until some shard has recorded a tile
    ls "$W"/kill/C.mgt.shards/*.journal >/dev/null 2>&1 && break
    sleep 0.05
done
sleep 0.3
scancel --signal=KILL --full "$job"
wait_gone "$job"
if [ -e "$W/kill/C.mgt.journal" ]; then
    echo "FAIL: the job finished before it was killed; nothing was tested" >&2; exit 1
fi
echo "killed job $job mid-run: $(cd "$W/kill" && "$BIN" status plan.toml | head -1)"
(cd "$W/kill" && srun -n 2 "$BIN" run plan.toml -q --shards 5 --claim-timeout 5)
same "$W/kill" "killed mid-run, resubmitted with 2 tasks"

# 4. a time limit that ends mid-step: SIGTERM, a clean stop, a resubmission that finishes.
# 1024 output tiles of 24², each recorded 150 ms late: 150 s in all, where SLURM ends the job
# 60-90 s after its start (it checks time limits every 30 s).
plan "$W/ref24" 24
(cd "$W/ref24" && env -u SLURM_PROCID -u SLURM_NTASKS "$BIN" run plan.toml -q)
plan "$W/time" 24
cat > "$W/time.sh" <<SH
#!/bin/bash
cd "$W/time" && MGMM_FAULT_WRITE_DELAY_MS=150 exec "$BIN" run plan.toml --log-every 10
SH
t=$(date +%s%N)
job=$(sbatch --parsable --time=1 -o "$W/time.log" "$W/time.sh")
JOBS+=("$job")
wait_gone "$job"
state=$(scontrol show job "$job" 2>/dev/null | grep -o 'JobState=[A-Z_]*' || true)
echo "job $job with --time=1 ended after $(( ($(date +%s%N) - t) / 1000000 )) ms ($state): $(grep "^interrupted" "$W/time.log" || tail -1 "$W/time.log")"
[ "$state" = JobState=TIMEOUT ] || { echo "FAIL: the job was not ended by its time limit ($state; finished first, nothing tested?)" >&2; cat "$W/time.log" >&2; exit 1; }
grep -q "^interrupted by SIGTERM; run the same command again to resume" "$W/time.log" \
    || { echo "FAIL: SIGTERM at the time limit did not stop the run cleanly within KillWait:" >&2; cat "$W/time.log" >&2; exit 1; }
[ -e "$W/time/C.mgt.journal" ] || { echo "FAIL: no journal kept after SIGTERM" >&2; exit 1; }
tmp=$(find "$W/time" -name '*.tmp*' -o -name '*.partial' -type f)
[ -z "$tmp" ] || { echo "FAIL: temporaries left after SIGTERM: $tmp" >&2; exit 1; }
echo "stopped by the time limit: $("$BIN" info "$W/time/C.mgt" --check 2>&1 | grep -m1 unfinished)"
cat > "$W/time2.sh" <<SH
#!/bin/bash
cd "$W/time" && exec "$BIN" run plan.toml -q
SH
sbatch --wait -o "$W/time2.log" "$W/time2.sh" >/dev/null || { cat "$W/time2.log" >&2; exit 1; }
same "$W/time" "time limit (SIGTERM) mid-step, resubmitted" "$W/ref24"

left=$(squeue -h | wc -l)
[ "$left" = 0 ] || { echo "FAIL: $left jobs left in the queue" >&2; squeue >&2; exit 1; }
echo "ok: nothing left in the queue"
