#!/usr/bin/env bash
# HARI with a prefix cache, as two chained jobs; run on the login node from the project root:
#   bash slurm/hari_cached.sh params/r1-671b-2x8h100/20_hari_training.yaml [-N NODES] [-p KEY VALUE ...]
# 1. slurm/hari_prefix.sbatch: one task per node, the full model over the node's GPUs, writes the cache
#    (the hidden states entering the first adapted layer);
# 2. slurm/hari_cached.sbatch, --dependency=afterok:<job 1>: one task per GPU trains the LoRA from it.
# Both get the same params, the same run folder (runs/hari-cached-<job 1>, or $DSR1KIT_RUN_DIR) and the same
# -p prefix_cache (default auto: both jobs name the same folder, the fingerprint of the same inputs, under
# $DSR1KIT_CACHE, default ~/.cache/dsr1kit, which every node must see; a folder on shared scratch is better
# for R1). If job 1 fails, job 2 is cancelled (--kill-on-invalid-dep); a requeued job 1 keeps job 2 waiting.
# Environment (all optional):
#   GPUS_PER_NODE=8     GPUs requested per node by both jobs (0: none, a CPU cluster)
#   TASKS_PER_NODE      training processes per node (default GPUS_PER_NODE: one per GPU)
#   PREFIX_CPUS_PER_TASK, CPUS_PER_TASK   --cpus-per-task of the prefix task / of each training task
#   SBATCH_ARGS         more sbatch options for both jobs, e.g. "--partition=gpu --account=me"
#                       (Slurm's own SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT work too)
set -euo pipefail

usage="usage: bash slurm/hari_cached.sh PARAMS.yaml [-N NODES] [-p KEY VALUE ...]"
PARAMS=${1:?$usage}
shift
if [ ! -f slurm/hari_prefix.sbatch ] || [ ! -d dsr1kit ]; then
  echo "error: run from the dsr1kit project root (jobs start in the submit dir)" >&2
  exit 2
fi
[ -f "$PARAMS" ] || { echo "error: params file not found: $PARAMS" >&2; exit 2; }

nodes=2
params=()
cache=
while [ $# -gt 0 ]; do
  case $1 in
    -N | --nodes) [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }; nodes=$2; shift 2 ;;
    -N* ) nodes=${1#-N}; shift ;;
    --nodes=*) nodes=${1#--nodes=}; shift ;;
    -p | --param)
      [ $# -ge 3 ] || { echo "error: $1 needs KEY VALUE; $usage" >&2; exit 2; }
      [ "$2" = prefix_cache ] && cache=$3
      params+=(-p "$2" "$3"); shift 3 ;;
    *) echo "error: unknown argument $1; $usage" >&2; exit 2 ;;
  esac
done
if [ "$cache" = off ]; then
  echo "error: -p prefix_cache off: these jobs need a cache (auto or a folder); slurm/hari_train.sbatch trains without" >&2
  exit 2
fi
if [ -z "$cache" ]; then
  cache=auto
  params+=(-p prefix_cache auto)
fi

gpus=${GPUS_PER_NODE:-8}
tasks=${TASKS_PER_NODE:-$gpus}
if [ "$tasks" -lt 1 ]; then
  echo "error: GPUS_PER_NODE=0 (no GPUs) needs TASKS_PER_NODE, the training processes per node" >&2
  exit 2
fi
read -ra extra <<<"${SBATCH_ARGS:-}"
prefix_opts=(--nodes="$nodes" --ntasks-per-node=1 --gpus-per-node="$gpus")
train_opts=(--nodes="$nodes" --ntasks-per-node="$tasks" --gpus-per-node="$gpus")
[ -n "${PREFIX_CPUS_PER_TASK:-}" ] && prefix_opts+=(--cpus-per-task="$PREFIX_CPUS_PER_TASK")
[ -n "${CPUS_PER_TASK:-}" ] && train_opts+=(--cpus-per-task="$CPUS_PER_TASK")

# The prefix job names the run folder after itself unless DSR1KIT_RUN_DIR is set; the training job is
# then given that same folder.
prefix_job=$(sbatch --parsable "${prefix_opts[@]}" ${extra[@]+"${extra[@]}"} slurm/hari_prefix.sbatch "$PARAMS" "${params[@]}")
prefix_job=${prefix_job%%;*}  # --parsable: "jobid[;cluster]"
export DSR1KIT_RUN_DIR=${DSR1KIT_RUN_DIR:-${DSR1KIT_RUNS_DIR:-runs}/hari-cached-$prefix_job}
train_job=$(sbatch --parsable --dependency=afterok:"$prefix_job" --kill-on-invalid-dep=yes "${train_opts[@]}" \
  ${extra[@]+"${extra[@]}"} slurm/hari_cached.sbatch "$PARAMS" "${params[@]}") || {
  echo "error: submitting the training job failed; cancelling prefix job $prefix_job" >&2
  scancel "$prefix_job"
  exit 1
}
train_job=${train_job%%;*}

echo "prefix job: $prefix_job ($nodes node(s) x 1 task, prefix_cache $cache)"
echo "training job: $train_job ($nodes node(s) x $tasks task(s), starts after $prefix_job completes)"
echo "run folder: $DSR1KIT_RUN_DIR"
echo "report: $DSR1KIT_RUN_DIR/report.html (rank 0; other ranks under ranks/rank<k>/)"
log_of() { scontrol show job -o "$1" 2>/dev/null | sed -n 's/.* StdOut=\([^ ]*\).*/\1/p'; }
echo "logs: $(log_of "$prefix_job") $(log_of "$train_job")"
echo "follow: squeue -j $prefix_job,$train_job"
