#!/bin/bash
# One job, one process per GPU: 16 nodes × 8 GPUs = 128 tasks over 512 shards (4 per task by
# default). Each task gets its own GPU (--gpus-per-task=1 sets CUDA_VISIBLE_DEVICES); without
# it, SLURM_LOCALID picks the GPU. The task that records the last shard finalizes the step.
#   mgmm-stream plan examples/cluster/plan_400k.toml --nodes 16 --gpus-per-node 8   # predict first
#   mgmm-stream prepare examples/cluster/plan_400k.toml                               # optional
#   sbatch examples/cluster/sbatch.sh
#SBATCH --job-name=mgmm
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-task=1
#SBATCH --cpus-per-task=12
#SBATCH --time=02:00:00
#SBATCH --output=mgmm-%j.log
set -euo pipefail
PLAN=${PLAN:-examples/cluster/plan_400k.toml}
# Resubmitting the same script after a failure resumes: finished tiles are kept.
srun --kill-on-bad-exit=0 mgmm-stream run "$PLAN" --log-every 60
mgmm-stream status "$PLAN"
