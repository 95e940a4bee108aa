#!/usr/bin/env bash
# Issue 11's goals, measured: data where users keep it (.npy in, .npy out) and whole expressions
# in one step. GPU machine (nvidia-h200-x2 for the 2-GPU figures), repository root, .dev/bin
# carried (docs/GPU.md).
#   bash tools/bench/npy_and_chain.sh [CASE...]      default: warm cold chain
# Cases:
#   warm   N×N f32 (N default 32768) A.npy @ B.npy → C.npy against the same job on .mgt files,
#          REPEAT runs each (default 3) with the inputs in the page cache; goal ≤ 1.10×. Beside
#          it the old route: import both inputs, run on .mgt, export the result.
#   cold   the .npy job with a cold page cache against the disk bound (input bytes at the dd
#          speed of A.npy); goal ≤ 1.15×.
#   chain  the 43 GB request D = (A·B·C)ᵀ, A 3000×100, B 100×100, C 100×3 600 000, as .npy
#          inputs: one step `expr = "(A @ B @ C).T"` → D.npy against the two-step .mgt plan
#          (X = A @ B, then (X @ C).T); goal: no slower, and the data bit-identical.
#   big    the largest n ≤ 100 000 whose inputs and output fit on the disk: two .npy inputs,
#          cold, on every GPU, against the disk bound.
# Log: $OUT/npy_and_chain.log; every run's report in $OUT/NAME.json.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to npy_and_chain.log
N=${N:-32768}; REPEAT=${REPEAT:-3}
W=${W:-/tmp/npygoals}; mkdir -p "$W"; cd "$W"
[ $# -gt 0 ] || set -- warm cold chain
for c in "$@"; do
  case $c in warm|cold|chain|big) ;;
  *) echo "unknown case '$c': use warm cold chain big" >&2; exit 2;; esac
done
ENGINE=('backend = "cuda"' 'devices = "all"' 'host_memory = "16GiB"' 'durable = false')

# plan_ab NAME A B OUT: NAME.toml computing OUT = A @ B with the benchmark engine settings.
plan_ab() { write_plan "$1.toml" "$2" "$3" "$4" "${ENGINE[@]}"; }
# run_to NAME OUT: run NAME.toml after removing OUT and its journal/sidecar; prints the wall.
run_to() {
  rm -f "$2" "$2.journal" "$2.crc32c"
  log "mgmm $1"
  "$MGMM" run "$1.toml" --report "$OUT/$1.json" 2>&1 | tee -a "$LOG" | grep -E "wall|bottleneck|error"
}
# wall NAME: the summed step wall time of $OUT/NAME.json.
wall() { python3 -c "import json,sys; print(sum(s['wall_s'] for s in json.load(open(sys.argv[1]))['steps']))" "$OUT/$1.json"; }
# npy_input NAME ROWS COLS SEED: NAME.npy made once (generated as .mgt, exported, .mgt removed).
npy_input() {
  [ -f "$1.npy" ] && [ "$(cat "$1.npy.gen" 2>/dev/null)" = "$2 $3 $4" ] && return 0
  gen_matrix "$1.tmp.mgt" "$2" "$3" "$4" && export_npy "$1.tmp.mgt" "$1.npy" && rm -f "$1.tmp.mgt" "$1.tmp.mgt.gen"
  echo "$2 $3 $4" > "$1.npy.gen"
}
# data_bytes FILE.npy: FILE's data from its header end (python, no numpy needed), to stdout.
npy_data() {
  python3 - "$1" <<'PY'
import sys
f = open(sys.argv[1], 'rb'); h = f.read(12)
n = 10 + int.from_bytes(h[8:10], 'little') if h[6] == 1 else 12 + int.from_bytes(h[8:12], 'little')
f.seek(n)
while True:
    b = f.read(1 << 24)
    if not b: break
    sys.stdout.buffer.write(b)
PY
}

# npy_crcs FILE.npy: the CRC-32 of every 256 MiB of FILE's data (after the header), computed
# by 16 threads, as one line of hex words; equal lines mean equal data.
npy_crcs() {
  python3 - "$1" <<'PY'
import os, sys, zlib
from concurrent.futures import ThreadPoolExecutor
fd = os.open(sys.argv[1], os.O_RDONLY); h = os.pread(fd, 12, 0)
start = 10 + int.from_bytes(h[8:10], 'little') if h[6] == 1 else 12 + int.from_bytes(h[8:12], 'little')
size, chunk = os.fstat(fd).st_size, 256 << 20
def crc(o):
    return f"{zlib.crc32(os.pread(fd, min(chunk, size - o), o)):08x}"
with ThreadPoolExecutor(16) as ex:
    print(" ".join(ex.map(crc, range(start, size, chunk))))
PY
}

case_warm() {
  gen_matrix A.mgt "$N" "$N" 1; gen_matrix B.mgt "$N" "$N" 2
  export_npy A.mgt A.npy; export_npy B.mgt B.npy
  plan_ab mgt A.mgt B.mgt C_mgt.mgt; plan_ab npy A.npy B.npy C_npy.npy
  cat A.mgt B.mgt A.npy B.npy > /dev/null   # warm the page cache
  local i
  for i in $(seq 1 "$REPEAT"); do
    run_to mgt C_mgt.mgt; local tm; tm=$(wall mgt)
    run_to npy C_npy.npy; local tn; tn=$(wall npy)
    log "warm run $i: .mgt $tm s, .npy $tn s, ratio $(python3 -c "print(f'{$tn/$tm:.3f}')") (goal ≤ 1.10)"
  done
  log "old route: import + run + export"
  rm -f Ai.mgt Bi.mgt C_old.mgt C_old.npy
  plan_ab old Ai.mgt Bi.mgt C_old.mgt
  local t0; t0=$(date +%s.%N)
  logged "$MGMM" import A.npy Ai.mgt --tile 1024 && logged "$MGMM" import B.npy Bi.mgt --tile 1024
  run_to old C_old.mgt
  logged "$MGMM" export C_old.mgt C_old.npy --force
  log "old route total $(python3 -c "import time; print(f'{time.time()-$t0:.2f}')") s"
  cmp <(npy_data C_old.npy) <(npy_data C_npy.npy) && log "old route and direct .npy output: identical data"
  rm -f Ai.mgt Bi.mgt C_old.mgt C_old.mgt.journal
}

# cold_rate FILE: the disk's cold sequential read rate in bytes/s (dd on FILE, evicted first).
cold_rate() {
  drop_cache "$1"
  local secs; secs=$(dd if="$1" of=/dev/null bs=16M 2>&1 | tail -1 | awk -F', ' '{print $2}' | awk '{print $1}')
  drop_cache "$1"
  python3 -c "print($(stat -c %s "$1")/$secs)"
}

case_cold() {
  gen_matrix A.mgt "$N" "$N" 1; gen_matrix B.mgt "$N" "$N" 2
  export_npy A.mgt A.npy; export_npy B.mgt B.npy
  plan_ab npy_cold A.npy B.npy C_npy.npy
  local rate; rate=$(cold_rate A.npy)
  drop_cache A.npy B.npy
  run_to npy_cold C_npy.npy
  local bytes; bytes=$(( $(stat -c %s A.npy) + $(stat -c %s B.npy) ))
  log "cold .npy run $(wall npy_cold) s; disk bound $bytes bytes at $rate B/s = $(python3 -c "print(f'{$bytes/$rate:.2f}')") s; ratio $(python3 -c "print(f'{$(wall npy_cold)*$rate/$bytes:.3f}')") (goal ≤ 1.15)"
}

case_chain() {
  # Its own folder: the other cases leave 32768² A/B files that the chain's names would pick up.
  mkdir -p chain && cd chain || return
  npy_input A 3000 100 11; npy_input B 100 100 12; npy_input C 100 3600000 13
  for m in A B C; do [ -f "$m.mgt" ] || "$MGMM" import "$m.npy" "$m.mgt" --tile 4096 2>&1 | tail -1; done
  {
    printf '[matrices.A]\npath = "A.npy"\n[matrices.B]\npath = "B.npy"\n[matrices.C]\npath = "C.npy"\n'
    printf '[[step]]\noutput = "D.npy"\nexpr = "(A @ B @ C).T"\n[engine]\n'
    printf '%s\n' "${ENGINE[@]}"
  } > chain1.toml
  {
    printf '[matrices.A]\npath = "A.mgt"\n[matrices.B]\npath = "B.mgt"\n[matrices.C]\npath = "C.mgt"\n'
    printf '[[step]]\noutput = "X.mgt"\nexpr = "A @ B"\nname = "X"\n'
    printf '[[step]]\noutput = "D2.mgt"\nexpr = "(X @ C).T"\n[engine]\n'
    printf '%s\n' "${ENGINE[@]}"
  } > chain2.toml
  # The same two steps writing D2.npy, for the byte comparison (the .mgt output's layout is tiled).
  sed 's/D2.mgt/D2.npy/' chain2.toml > chain2n.toml
  logged "$MGMM" plan chain1.toml | grep -E "chain|part"
  local i
  # One 43 GB output on the disk at a time (the one-GPU machine has 64 GB): each is removed
  # after its run, and the bytes are compared through per-chunk CRCs of the data.
  for i in $(seq 1 "$REPEAT"); do
    rm -f X.mgt X.mgt.journal; run_to chain2 D2.mgt; rm -f D2.mgt D2.mgt.journal
    run_to chain1 D.npy
    log "chain run $i: one step $(wall chain1) s, two-step .mgt plan $(wall chain2) s (goal: one step no slower)"
    [ "$i" = "$REPEAT" ] || rm -f D.npy D.npy.journal D.npy.crc32c
  done
  ls D.npy.part* 2>/dev/null && log "chain: intermediates left behind" || log "chain: intermediates removed"
  local h1 h2
  h1=$(npy_crcs D.npy); rm -f D.npy D.npy.journal D.npy.crc32c
  rm -f X.mgt X.mgt.journal; run_to chain2n D2.npy
  h2=$(npy_crcs D2.npy); rm -f D2.npy D2.npy.journal D2.npy.crc32c X.mgt
  log "chain: data CRCs per 256 MiB, one step ${h1:0:40}…, two steps ${h2:0:40}…"
  if [ -n "$h1" ] && [ "$h1" = "$h2" ]; then log "chain: D.npy bit-identical to the two-step plan (every 256 MiB chunk's CRC equal)"
  else log "chain: D.npy DIFFERS from the two-step plan"; fi
  cd ..
}

case_big() {
  local free n=100000
  free=$(df -B1 --output=avail . | tail -1)
  # Two inputs and the output, plus one input's .mgt while it is generated.
  for n in 100000 90000 80000 70000 65536 50000; do
    [ $(( 4 * n * n * 4 )) -lt $(( free * 9 / 10 )) ] && break
  done
  log "big: n = $n ($free bytes free)"
  npy_input P "$n" "$n" 21; npy_input Q "$n" "$n" 22
  plan_ab big P.npy Q.npy R.npy
  local rate; rate=$(cold_rate P.npy)
  drop_cache P.npy Q.npy
  run_to big R.npy
  local bytes=$(( 2 * n * n * 4 ))
  log "big: $(wall big) s; disk bound $bytes bytes at $rate B/s = $(python3 -c "print(f'{$bytes/$rate:.2f}')") s"
  rm -f R.npy R.npy.journal R.npy.crc32c
}

for c in "$@"; do "case_$c"; done
