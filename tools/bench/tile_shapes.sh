#!/usr/bin/env bash
# Compute-tile shapes side by side on one GPU (issue 35's fp32/fp64 goals): the same N² job with
# `tile = "auto"` and with each shape in SHAPES, runs interleaved (auto, shape1, …, auto, …) so a
# host's drift hits all alike. An 8192³ tile's SGEMM runs at about 48 TFLOP/s where one 32768²
# call runs at 53 (BENCHMARKS.md); a deeper k (8192×8192×16384) was 5 % faster per GEMM in
# 2026-11 but lengthened the pipeline's head (HISTORY §3) — since then the head has shortened
# (start group, growing squares), so the trade is measured again here.
#   JOBS="fp32_mgt fp64_npy" SHAPES="[8192,8192,16384] [8192,8192,32768]" RUNS=2 N=32768 \
#     bash tools/bench/tile_shapes.sh
# GPU machine, repository root, .dev/bin carried (docs/GPU.md); BACKEND=cpu runs it here (a smoke test). Inputs generated in W (default
# /tmp/tile_shapes; fp64 inputs as f64 .npy), read once, one untimed run first. Every plan
# `durable = false`, host_memory 32 GiB. Outputs of one shape are compared run to run (their CRC
# tables). Log $OUT/tile_shapes.log, reports $OUT/tile_<job>_<shape>_<i>.json,
# a table at the end: step wall median, TFLOP/s, first GEMM, GEMM busy share.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to tile_shapes.log
N=${N:-32768}; RUNS=${RUNS:-2}
JOBS=${JOBS:-fp32_mgt fp64_npy}
SHAPES=${SHAPES:-[8192,8192,16384] [8192,8192,32768]}
W=${W:-/tmp/tile_shapes}; mkdir -p "$W"; cd "$W"
nvidia-smi --query-gpu=index,name --format=csv,noheader | head -1 | tee -a "$LOG"
for job in $JOBS; do
  case $job in
    fp32_mgt) gen_matrix A.mgt "$N" "$N" 1; gen_matrix B.mgt "$N" "$N" 2; a=A.mgt; b=B.mgt; p=fp32; x=mgt ;;
    fp64_npy) GEN_DTYPE=f64 gen_matrix A64.npy "$N" "$N" 1; GEN_DTYPE=f64 gen_matrix B64.npy "$N" "$N" 2
              a=A64.npy; b=B64.npy; p=fp64; x=npy ;;
    *) echo "tile_shapes: unknown job $job (fp32_mgt, fp64_npy)" >&2; exit 2 ;;
  esac
  cat "$a" "$b" > /dev/null
  for s in auto $SHAPES; do
    tag=$(echo "$s" | tr -dc '0-9,' | tr , x); tag=${tag:-auto}
    t=$s; [ "$s" = auto ] && t='"auto"'
    write_plan "${job}_$tag.toml" "$a" "$b" "C_${job}_$tag.$x" "backend = \"${BACKEND:-cuda}\"" "precision = \"$p\"" \
      'devices = [0]' 'host_memory = "32GiB"' 'durable = false' "tile = $t"
  done
  log "$job: one untimed run"
  "$MGMM" run "${job}_auto.toml" --quiet > /dev/null 2>&1
  for i in $(seq 1 "$RUNS"); do
    for s in auto $SHAPES; do
      tag=$(echo "$s" | tr -dc '0-9,' | tr , x); tag=${tag:-auto}
      rm -rf "C_${job}_$tag.$x" "C_${job}_$tag.$x".*
      log "run $i: $job tile $s"
      timed "$MGMM" run "${job}_$tag.toml" --report "$OUT/tile_${job}_${tag}_$i.json" 2>&1 | tee -a "$LOG" \
        | grep -E "wall|bottleneck|tile|error"
      # The per-tile CRC-32C table: the .npy's sidecar, the .mgt's tail (docs/FORMAT.md).
      if [ "$x" = npy ]; then
        md5sum < "C_${job}_$tag.$x.crc32c" > "sum_${job}_${tag}_$i"
      else
        tail -c 65536 "C_${job}_$tag.$x" | md5sum > "sum_${job}_${tag}_$i"
      fi
      if [ "$i" -gt 1 ] && ! cmp -s "sum_${job}_${tag}_1" "sum_${job}_${tag}_$i"; then
        log "WARNING: $job tile $s wrote different bytes in run $i than in run 1"
      fi
    done
  done
  rm -rf C_"${job}"_*
done
log "table (median over runs)"
python3 - "$OUT" "$N" <<'PY' | tee -a "$LOG"
import glob, json, os, re, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
rows = {}
for f in sorted(glob.glob(os.path.join(out, "tile_*_*_*.json"))):
    m = re.match(r"tile_(.+?_(?:mgt|npy))_(.+)_(\d+)\.json$", os.path.basename(f))
    if not m:
        continue
    st = json.load(open(f))["steps"][0]
    gemm = [round(v, 2) for k, v in st.get("busy_shares", []) if k.endswith("gemm")]
    rows.setdefault((m[1], m[2]), []).append((st["wall_s"], st.get("first_gemm_s"), gemm[0] if gemm else None,
                                              st.get("tile")))
print("| job | tile | step s (runs) | TFLOP/s | first GEMM s | GEMM busy | tile used |")
print("|---|---|---|---|---|---|---|")
for (job, tag), r in sorted(rows.items()):
    w = statistics.median(x[0] for x in r)
    fg = statistics.median(x[1] for x in r if x[1] is not None) if any(x[1] is not None for x in r) else None
    print(f"| {job} | {tag} | {w:.3f} ({', '.join(f'{x[0]:.3f}' for x in r)}) | {2 * n**3 / w / 1e12:.1f} | "
          f"{fg if fg is None else round(fg, 3)} | {r[0][2]} | {r[0][3]} |")
PY
cd / && { [ -n "${KEEP:-}" ] || rm -rf "$W"; }
