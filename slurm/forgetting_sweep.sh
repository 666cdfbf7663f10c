#!/usr/bin/env bash
# The forgetting sweep (notebook 40) as two chained jobs; run on the login node from the project root:
#   bash slurm/forgetting_sweep.sh params/tiny/40_forgetting_sweep.yaml [-p KEY VALUE ...]
# 1. a job array of slurm/forgetting_sweep.sbatch, one task per (λ, seed) point (--array=0-<N-1>, N from
#    `python -m dsr1kit sweep-point ... --count`, run here, which also checks the params);
#    each task trains and measures its point in <run>/points/lambda<λ>-seed<s>/ (result.json);
# 2. the same script without an array id, --dependency=afterok:<job 1>: the notebook once, which finds
#    every point measured and only reports (<run>/report.html, <run>/summary.json).
# Both get the same params and the same run folder (runs/forgetting-<job 1>, or $DSR1KIT_RUN_DIR). If a
# point fails, the report job is cancelled (--kill-on-invalid-dep); a requeued point keeps it waiting.
# Submitting again with the same DSR1KIT_RUN_DIR redoes only the points without a result.json.
# Environment (all optional):
#   GPUS_PER_TASK=1     GPUs per point (--gpus-per-node of each array task; 0: none, a CPU cluster;
#                       R1: 8, the whole NF4 model on one node, with SBATCH_ARGS="--exclusive --mem=0")
#   CPUS_PER_TASK       --cpus-per-task of each point (default the script's 8)
#   MAX_PARALLEL        at most this many points at once (--array=0-<N-1>%MAX_PARALLEL)
#   REPORT_GPUS=0, REPORT_CPUS_PER_TASK   the report job's GPUs and CPUs (it trains nothing)
#   PYTHON              the Python that counts the points here (default .venv/bin/python, else python)
#   SBATCH_ARGS         more sbatch options for both jobs, e.g. "--partition=gpu --account=me"
#                       (Slurm's own SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT work too)
set -euo pipefail

usage="usage: bash slurm/forgetting_sweep.sh PARAMS.yaml [-p KEY VALUE ...]"
PARAMS=${1:?$usage}
shift
if [ ! -f slurm/forgetting_sweep.sbatch ] || [ ! -d dsr1kit ]; then
  echo "error: run from the dsr1kit project root (jobs start in the submit dir)" >&2
  exit 2
fi
[ -f "$PARAMS" ] || { echo "error: params file not found: $PARAMS" >&2; exit 2; }

params=()
while [ $# -gt 0 ]; do
  case $1 in
    -p | --param)
      [ $# -ge 3 ] || { echo "error: $1 needs KEY VALUE; $usage" >&2; exit 2; }
      params+=(-p "$2" "$3"); shift 3 ;;
    *) echo "error: unknown argument $1; $usage" >&2; exit 2 ;;
  esac
done

python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python; fi
fi
# The number of points (and a check of the params before anything is queued); nothing is created.
n=$("$python" -m dsr1kit sweep-point -f "$PARAMS" ${params[@]+"${params[@]}"} --count) || {
  echo "error: counting the sweep's points failed (see above); nothing submitted" >&2
  exit 2
}
if ! [[ $n =~ ^[1-9][0-9]*$ ]]; then
  echo "error: the sweep's point count is not a positive number: '$n'" >&2
  exit 2
fi

gpus=${GPUS_PER_TASK:-1}
read -ra extra <<<"${SBATCH_ARGS:-}"
array_opts=(--array="0-$((n - 1))${MAX_PARALLEL:+%$MAX_PARALLEL}" --gpus-per-node="$gpus")
report_opts=(--job-name=forgetting-report --output=%x-%j.out --gpus-per-node="${REPORT_GPUS:-0}")
[ -n "${CPUS_PER_TASK:-}" ] && array_opts+=(--cpus-per-task="$CPUS_PER_TASK")
[ -n "${REPORT_CPUS_PER_TASK:-}" ] && report_opts+=(--cpus-per-task="$REPORT_CPUS_PER_TASK")

# The array names the run folder after itself unless DSR1KIT_RUN_DIR is set (its tasks default to the same
# name); the report job is then given that same folder.
array_job=$(sbatch --parsable "${array_opts[@]}" ${extra[@]+"${extra[@]}"} \
  slurm/forgetting_sweep.sbatch "$PARAMS" ${params[@]+"${params[@]}"})
array_job=${array_job%%;*}  # --parsable: "jobid[;cluster]"
export DSR1KIT_RUN_DIR=${DSR1KIT_RUN_DIR:-${DSR1KIT_RUNS_DIR:-runs}/forgetting-$array_job}
report_job=$(sbatch --parsable --dependency=afterok:"$array_job" --kill-on-invalid-dep=yes "${report_opts[@]}" \
  ${extra[@]+"${extra[@]}"} slurm/forgetting_sweep.sbatch "$PARAMS" ${params[@]+"${params[@]}"}) || {
  echo "error: submitting the report job failed; cancelling array job $array_job" >&2
  scancel "$array_job"
  exit 1
}
report_job=${report_job%%;*}

echo "array job: $array_job ($n points, tasks 0-$((n - 1))${MAX_PARALLEL:+, at most $MAX_PARALLEL at once}, $gpus GPU(s) each)"
echo "report job: $report_job (starts after every task of $array_job completes)"
echo "run folder: $DSR1KIT_RUN_DIR"
echo "points: $DSR1KIT_RUN_DIR/points/lambda<λ>-seed<s>/result.json"
echo "report: $DSR1KIT_RUN_DIR/report.html"
log_of() { scontrol show job -o "$1" 2>/dev/null | sed -n '1s/.* StdOut=\([^ ]*\).*/\1/p'; }
echo "logs: $(log_of "${array_job}_0") (task 0; one per task) $(log_of "$report_job")"
echo "follow: squeue -j $array_job,$report_job"
