# shellcheck shell=bash
# Shared shell functions for the scripts in tools/bench/, tools/checks/ and tools/cpu/ (sourced, never run):
# finding the binaries, logging, writing plans, generating inputs once, dropping the page cache,
# measuring the disk, running a plan and summarising its report. Every script used to carry its
# own copy of these; a fix here now reaches all of them.
#
# A script sources it from the repository root:  . "$(dirname "$0")/../lib.sh"
# and gets ROOT, TOOLS, MGMM (the mgmm-stream binary), DEV (folder of carried test binaries),
# OUT (where logs and reports go) and LOG (its log file, set by `log_to`).

ROOT=${ROOT:-$PWD}
TOOLS=$ROOT/tools
DEV=${DEV:-$ROOT/.dev/bin}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG=${LOG:-/dev/null}

# The mgmm-stream binary: $MGMM if set, else the release build of this checkout (honouring
# CARGO_TARGET_DIR), else the carried .dev/bin copy (the GPU machine, where nothing is built).
# The build comes first so that a stale carried copy on the development machine is not used.
if [ -z "${MGMM:-}" ]; then
  MGMM=${CARGO_TARGET_DIR:-$ROOT/target}/release/mgmm-stream
  [ -x "$MGMM" ] || MGMM=$DEV/mgmm-stream
fi
[ -x "$MGMM" ] || { echo "no mgmm-stream binary at $MGMM: run 'cargo build --release' or set MGMM" >&2; exit 2; }

# log_to FILE: append everything `log` and `logged` print to $OUT/FILE as well.
log_to() { LOG=$OUT/$1; }
# log MSG...: a section header, on stdout and in the log.
log() { echo "### $*" | tee -a "$LOG"; }
# logged CMD...: run CMD, its stdout and stderr shown and appended to the log; returns CMD's status.
logged() { "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"; }

# gen_matrix FILE ROWS COLS SEED [DIST]: generate an input (f32, or GEN_DTYPE; DIST default normal, as `gen`),
# unless FILE already holds exactly this one (a FILE.gen stamp records the arguments), so a rerun
# in the same work folder skips it.
gen_matrix() {
  local f=$1 spec="$2 $3 $4 ${5:-normal}${GEN_DTYPE:+ $GEN_DTYPE}"
  if [ -f "$f" ] && [ "$(cat "$f.gen" 2>/dev/null)" = "$spec" ]; then return 0; fi
  rm -f "$f" "$f.gen"
  "$MGMM" gen "$f" --rows "$2" --cols "$3" --seed "$4" --dist "${5:-normal}" ${GEN_DTYPE:+--dtype "$GEN_DTYPE"} 2>&1 | tail -1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] && echo "$spec" > "$f.gen"
}

# write_plan FILE A B OUTPUT [ENGINE_LINE...]: a one-step plan computing OUTPUT = A @ B, each
# ENGINE_LINE written verbatim under [engine], e.g. 'backend = "cpu"' 'host_memory = "2GiB"'.
write_plan() {
  local f=$1 a=$2 b=$3 c=$4; shift 4
  {
    printf '[matrices.A]\npath = "%s"\n[matrices.B]\npath = "%s"\n' "$a" "$b"
    printf '[[step]]\noutput = "%s"\nexpr = "A @ B"\n[engine]\n' "$c"
    local l; for l in "$@"; do printf '%s\n' "$l"; done
  } > "$f"
}

# cuda_plan NAME PRECISION DEVICES [ENGINE_LINE...]: NAME.toml computing C_NAME.mgt = A.mgt @
# B.mgt on the GPUs with the benchmarks' settings (16 GiB host budget, durable = false).
# DEVICES is a TOML value: '[0]' or '"all"'.
cuda_plan() {
  local n=$1 p=$2 d=$3; shift 3
  write_plan "$n.toml" A.mgt B.mgt "C_$n.mgt" 'backend = "cuda"' "precision = \"$p\"" \
    "devices = $d" 'host_memory = "16GiB"' 'durable = false' "$@"
}

# run_step NAME: run NAME.toml (output C_NAME.mgt removed first), full output in the log, the
# report in $OUT/NAME.json; shows the summary's wall, busy and bottleneck lines.
run_step() {
  rm -f "C_$1.mgt" "C_$1.mgt.journal"
  log "mgmm $1"
  "$MGMM" run "$1.toml" --report "$OUT/$1.json" 2>&1 | tee -a "$LOG" | grep -E "wall|busy|bottleneck|error"
}

# summarize_report JSON: one line per step of a --report file: wall, GFLOP/s, bottleneck, shares.
summarize_report() {
  python3 - "$1" <<'PY' | tee -a "$LOG"
import json, sys
for r in json.load(open(sys.argv[1]))["steps"]:
    print(f"mgmm-stream step {r['step']}: {r['wall_s']:.2f} s, {r['gflops_per_s']:.1f} GFLOP/s, bottleneck {r['bottleneck']}")
    print("busy shares:", ", ".join(f"{n} {100*v:.0f}%" for n, v in r["busy_shares"]))
PY
}

# drop_cache FILE...: write back and evict FILEs from the page cache (fsync, then
# posix_fadvise(DONTNEED)), so the next read comes from the disk. Needs no root.
drop_cache() {
  sync
  python3 -c "
import os, sys
for p in sys.argv[1:]:
    fd = os.open(p, os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)" "$@"
}

# disk_read FILE: the disk's cold sequential read speed, measured with dd on FILE (evicted
# before and after).
disk_read() {
  drop_cache "$1"
  log "disk: cold read of $1 with dd"
  dd if="$1" of=/dev/null bs=16M 2>&1 | tail -1 | tee -a "$LOG"
  drop_cache "$1"
}

# timed CMD...: run CMD and print its wall time and peak RSS (GNU time).
timed() { /usr/bin/env time -f "wall %e s, max RSS %M KiB" "$@"; }

# gpu_count: how many GPUs nvidia-smi lists.
gpu_count() { nvidia-smi -L 2>/dev/null | grep -c '^GPU'; }

# export_npy SRC.mgt DST.npy: export for the python peers, unless DST is newer than SRC.
export_npy() { [ "$2" -nt "$1" ] || "$MGMM" export "$1" "$2" --force 2>&1 | tail -1; }

# Hold all but KEEP_GB (default 60) GB of RAM in another process (anonymous memory, every page
# touched), so the inputs no longer fit in the page cache: `hog_start`, then `hog_stop` (also
# on exit, through the trap the caller sets: `trap hog_stop EXIT`).
hog_pid=
hog_start() {
  local total keep
  total=$(awk '/MemTotal/ {print int($2/1048576)}' /proc/meminfo)
  keep=$((total - ${KEEP_GB:-60}))
  log "memory hog: holding $keep GB of $total GB as anonymous memory, leaving ${KEEP_GB:-60} GB"
  python3 -c "
import mmap, signal, sys
n = int(sys.argv[1]) << 30
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(0, n, 4096):
    m[i] = 1
print('hog ready', n >> 30, 'GiB', flush=True)
signal.pause()" "$keep" > hog.out 2>&1 &
  hog_pid=$!
  for _ in $(seq 1 1200); do grep -q ready hog.out 2>/dev/null && break; sleep 0.5; done
  cat hog.out | tee -a "$LOG"; free -g | tee -a "$LOG"
}
hog_stop() { [ -n "$hog_pid" ] && kill "$hog_pid" 2>/dev/null; wait "$hog_pid" 2>/dev/null; hog_pid=; }
