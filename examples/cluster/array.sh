#!/bin/bash
# An array job: one task per shard, 4 running at a time, each on one GPU. Tasks run whenever
# the queue lets them; a task that finds its shard done (or held by a live task) moves on to an
# unclaimed one, and the task that records the last shard finalizes.
#   sbatch --array=0-63%16 examples/cluster/array.sh
# Chained steps: a task of step 2 waits (with a message, up to --wait-timeout) for step 1 to be
# finalized; or submit one array job per step with --dependency=afterok:<previous job>.
#SBATCH --job-name=mgmm-array
#SBATCH --ntasks=1
#SBATCH --gpus=1
#SBATCH --time=01:00:00
#SBATCH --output=mgmm-%A_%a.log
set -euo pipefail
PLAN=${PLAN:-examples/cluster/plan_400k.toml}
# SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT say who this task is; --shards 64 keeps the
# split the same whatever the array's concurrency.
mgmm-stream run "$PLAN" --shards 64 --log-every 60
