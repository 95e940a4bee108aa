#!/usr/bin/env bash
# End to end from files to a file, side by side in one run: mgmm-stream, cuBLASXt and torch on the same
# N×N f32 data (N default 32768), end to end. GPU machine (nvidia-h200-x2 for the 2-GPU cases;
# with one GPU they are skipped), repository root, .dev/bin carried (docs/GPU.md).
#   bash tools/bench/end_to_end_peers.sh [CASE...]      default: fill fp32 lowprec peers cold
# Cases, run in the order given:
#   fill      host fill strategies for H2D (tools/probes/h2d_fill_strategies.py), A.mgt warm
#   fp32      mgmm-stream fp32, REPEAT runs (default 3) on GPU 0, then on all GPUs
#   lowprec   tf32 on 1 and all GPUs, bf16 on all
#   variants  on GPU 0: checksum verification speed, output by pwrite (MGMM_WRITE=pwrite),
#             verify_inputs = false, compute tile [8192, 8192, 16384], bf16
#   peers     cuBLASXt on 1 and all GPUs, torch fp32/tf32 (tools/peers/cublasxt_torch.py),
#             cuBLASXt's result compared with mgmm-stream's
#   cold      the disk's cold read speed (dd), then fp32 with a cold page cache on 1 and all GPUs
# Log: $OUT/end_to_end_peers.log; every run's report in $OUT/NAME.json.
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
log_to end_to_end_peers.log
N=${N:-32768}; REPEAT=${REPEAT:-3}; NGPU=$(gpu_count)
W=${W:-/tmp/sbs}; mkdir -p "$W"; cd "$W"
[ $# -gt 0 ] || set -- fill fp32 lowprec peers cold
for c in "$@"; do
  case $c in fill|fp32|lowprec|variants|peers|cold) ;;
  *) echo "unknown case '$c': use fill fp32 lowprec variants peers cold" >&2; exit 2;; esac
done
nvidia-smi --query-gpu=index,name,memory.used --format=csv | tee -a "$LOG"
gen_matrix A.mgt "$N" "$N" 1
gen_matrix B.mgt "$N" "$N" 2
cuda_plan g1 fp32 "[0]"; cuda_plan g2 fp32 '"all"'
cuda_plan g1_tf32 tf32 "[0]"; cuda_plan g2_tf32 tf32 '"all"'; cuda_plan g2_bf16 bf16 '"all"'
# multi NAME...: run each NAME.toml that uses every GPU only when there are at least two.
multi() { if [ "$NGPU" -ge 2 ]; then local n; for n in "$@"; do run_step "$n"; done; else log "one GPU: $* skipped"; fi; }
repeat() { local i; for i in $(seq 1 "$REPEAT"); do run_step "$1"; done; }
case_fill() { log "host fill strategies (A.mgt warm)"; logged python3 "$TOOLS/probes/h2d_fill_strategies.py" A.mgt 8; }
case_fp32() { repeat g1; if [ "$NGPU" -ge 2 ]; then repeat g2; fi; }
case_lowprec() { run_step g1_tf32; multi g2_tf32 g2_bf16; }
case_variants() {
  log "checksum verification speed"; "$MGMM" info A.mgt --check 2>&1 | tail -1 | tee -a "$LOG"
  cp g1.toml g1_pwrite.toml; sed -i 's/C_g1.mgt/C_g1_pwrite.mgt/' g1_pwrite.toml
  MGMM_WRITE=pwrite run_step g1_pwrite
  cuda_plan g1_noverify fp32 "[0]" "verify_inputs = false"; run_step g1_noverify
  cuda_plan g1_k16 fp32 "[0]" "tile = [8192, 8192, 16384]"; run_step g1_k16; run_step g1_k16
  cuda_plan g1_bf16 bf16 "[0]"; run_step g1_bf16
}
case_peers() {
  local all=g1; [ "$NGPU" -ge 2 ] && all=g2
  rm -f C_*.mgt*
  log "export for peers"
  export_npy A.mgt A.npy; export_npy B.mgt B.npy
  "$MGMM" run $all.toml --quiet && "$MGMM" export C_$all.mgt C_$all.npy --force && rm -f C_$all.mgt*
  log "peers"
  python3 "$TOOLS/peers/cublasxt_torch.py" --a A.npy --b B.npy --out peer_C.bin --ngpu 1 --which cublasxt --check C_$all.npy 2>&1 | grep peer | tee -a "$LOG"
  python3 "$TOOLS/peers/cublasxt_torch.py" --a A.npy --b B.npy --out peer_C.bin --ngpu "$NGPU" --which cublasxt,torch_fp32,torch_tf32 2>&1 | grep peer | tee -a "$LOG"
  rm -f ./*.npy peer_C.bin
}
case_cold() {
  rm -f C_*.mgt*
  disk_read A.mgt
  drop_cache A.mgt B.mgt; run_step g1
  if [ "$NGPU" -ge 2 ]; then drop_cache A.mgt B.mgt; run_step g2; fi
}
for c in "$@"; do "case_$c"; done
