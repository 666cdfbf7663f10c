#!/usr/bin/env bash
# The forgetting sweep (notebook 40) as two chained jobs; run on the login node from the project root:
#   bash slurm/forgetting_sweep.sh params/tiny/40_forgetting_sweep.yaml [-p KEY VALUE ...]
# 1. a job array of slurm/forgetting_sweep.sbatch, one task per (λ, seed) point (--array=0-<N-1>, N from
#    `python -m dsr1kit sweep-point ... --count`, run here, which also checks the params);
#    each task trains and measures its point in <run>/points/lambda<λ>-seed<s>/ (result.json);
# 2. the same script without an array id, --dependency=afterok:<job 1>: the notebook once, which finds
#    every point measured and only reports (<run>/report.html, <run>/summary.json); with measure_with:
#    server it serves the base and measures every trained adapter through it.
# 0. only when the sweep's replay answers come from a served base (measure_with: server and the replay
#    baseline) and are not made yet: a replay job before the array (the array waits for it), which serves
#    the base and makes them once for every replay task.
# Both get the same params and the same run folder (runs/forgetting-<job 1>, or $DSR1KIT_RUN_DIR). If a
# point fails, the report job is cancelled (--kill-on-invalid-dep); a requeued point keeps it waiting.
# Submitting again with the same DSR1KIT_RUN_DIR redoes only the points without a result.json.
# Environment (all optional):
#   GPUS_PER_TASK=1     GPUs per point (--gpus-per-node of each array task; 0: none, a CPU cluster;
#                       R1: 8, the whole NF4 model on one node, with SBATCH_ARGS="--exclusive --mem=0")
#   CPUS_PER_TASK       --cpus-per-task of each point (default the script's 8)
#   MAX_PARALLEL        at most this many points at once (--array=0-<N-1>%MAX_PARALLEL)
#   REPORT_NODES=1, REPORT_GPUS=0, REPORT_CPUS_PER_TASK   nodes, GPUs per node and CPUs of the report job
#                       (it trains nothing) and of the replay job; with measure_with: server both serve the
#                       base (R1: REPORT_NODES=2 REPORT_GPUS=8, Ray across the nodes)
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
# The replay and report jobs serve the base when the sweep measures through it (measure_with: server).
serving_opts=(--output=%x-%j.out --nodes="${REPORT_NODES:-1}" --gpus-per-node="${REPORT_GPUS:-0}")
[ -n "${CPUS_PER_TASK:-}" ] && array_opts+=(--cpus-per-task="$CPUS_PER_TASK")
[ -n "${REPORT_CPUS_PER_TASK:-}" ] && serving_opts+=(--cpus-per-task="$REPORT_CPUS_PER_TASK")

# Must the served base make the replay answers first, in a job of their own (R1 served across nodes cannot
# be served inside a one-node array task)? Asked of the run folder when it is given (answers made by an
# earlier submission are kept), else of a folder not made yet.
replay_first=$("$python" -m dsr1kit sweep-point -f "$PARAMS" ${params[@]+"${params[@]}"} --replay-first \
  --run-dir "${DSR1KIT_RUN_DIR:-${TMPDIR:-/tmp}/dsr1kit-sweep-not-made-$$}") || {
  echo "error: asking whether the replay answers come first failed (see above); nothing submitted" >&2
  exit 2
}
replay_job=""
if [ "$replay_first" = 1 ]; then
  replay_job=$(sbatch --parsable --job-name=forgetting-replay --export=ALL,SWEEP_JOB=replay \
    "${serving_opts[@]}" ${extra[@]+"${extra[@]}"} slurm/forgetting_sweep.sbatch "$PARAMS" ${params[@]+"${params[@]}"})
  replay_job=${replay_job%%;*}
  # the array and the report use the replay job's run folder, and the array waits for its answers
  export DSR1KIT_RUN_DIR=${DSR1KIT_RUN_DIR:-${DSR1KIT_RUNS_DIR:-runs}/forgetting-$replay_job}
  array_opts+=(--dependency=afterok:"$replay_job" --kill-on-invalid-dep=yes)
fi

# The array names the run folder after itself unless DSR1KIT_RUN_DIR is set (its tasks default to the same
# name); the report job is then given that same folder.
array_job=$(sbatch --parsable "${array_opts[@]}" ${extra[@]+"${extra[@]}"} \
  slurm/forgetting_sweep.sbatch "$PARAMS" ${params[@]+"${params[@]}"}) || {
  [ -n "$replay_job" ] && { echo "error: submitting the array failed; cancelling replay job $replay_job" >&2
                             scancel "$replay_job"; }
  exit 1
}
array_job=${array_job%%;*}  # --parsable: "jobid[;cluster]"
export DSR1KIT_RUN_DIR=${DSR1KIT_RUN_DIR:-${DSR1KIT_RUNS_DIR:-runs}/forgetting-$array_job}
report_job=$(sbatch --parsable --dependency=afterok:"$array_job" --kill-on-invalid-dep=yes \
  --job-name=forgetting-report --export=ALL,SWEEP_JOB=report "${serving_opts[@]}" \
  ${extra[@]+"${extra[@]}"} slurm/forgetting_sweep.sbatch "$PARAMS" ${params[@]+"${params[@]}"}) || {
  echo "error: submitting the report job failed; cancelling array job $array_job ${replay_job}" >&2
  scancel "$array_job" ${replay_job:+"$replay_job"}
  exit 1
}
report_job=${report_job%%;*}

[ -n "$replay_job" ] && echo "replay job: $replay_job (the served base answers the replay prompts first;" \
  "${REPORT_NODES:-1} node(s), ${REPORT_GPUS:-0} GPU(s) each)"
echo "array job: $array_job ($n points, tasks 0-$((n - 1))${MAX_PARALLEL:+, at most $MAX_PARALLEL at once}, $gpus GPU(s) each)"
echo "report job: $report_job (starts after every task of $array_job completes; ${REPORT_NODES:-1} node(s)," \
  "${REPORT_GPUS:-0} GPU(s) each)"
echo "run folder: $DSR1KIT_RUN_DIR"
echo "points: $DSR1KIT_RUN_DIR/points/lambda<λ>-seed<s>/result.json"
echo "report: $DSR1KIT_RUN_DIR/report.html"
log_of() { scontrol show job -o "$1" 2>/dev/null | sed -n '1s/.* StdOut=\([^ ]*\).*/\1/p'; }
echo "logs: $(log_of "${array_job}_0") (task 0; one per task) $(log_of "$report_job")"
echo "follow: squeue -j $array_job,$report_job"
