# USR1 → requeue for the preemptible sbatch scripts (--signal=B:USR1@120 --requeue), written once.
# Slurm sends USR1 to the batch shell 120 s before the time limit; the job requeues itself (same job id,
# so the same run folder) and the requeued job continues from what the step left. In the batch script:
#   source slurm/requeue.sh
#   requeue_on_usr1 WHEN MESSAGE [ACTION ...]   # before the step starts
#   srun ... &                                  # the step, in the background
#   wait_step $!                                # sets rc (a USR1 interrupts `wait`: it waits again)
#   requeue_if_due REASON                       # "REASON; requeueing job <id>" when WHEN says so
# WHEN: ok     ACTION asks the step to checkpoint and stop; requeue once it exited 0 (checkpoint written)
#       failed ACTION asks the step to stop; requeue once it exited non-zero (stopped before its result)
#       now    stop the step (TERM) and requeue at once: what it wrote so far is the checkpoint
# MESSAGE is logged as "USR1 at <time>: MESSAGE". Sourced after slurm/prelude.sh (set -euo pipefail).

step=
rc=0
_usr1=0
_requeue_when=
_usr1_message=
_usr1_action=()

requeue_on_usr1() {
  _requeue_when=$1 _usr1_message=$2
  shift 2
  _usr1_action=("$@")
  trap _on_usr1 USR1
}

_on_usr1() {
  if [ "$_requeue_when" = now ]; then
    if [ -n "$step" ] && kill -0 "$step" 2>/dev/null; then  # no requeue when the step has already finished
      echo "USR1 at $(date -Is): $_usr1_message"
      # Stop the step first: it writes nothing more while slurmctld (slow under load) ends the job, so
      # the requeued job starts from what was kept at USR1. A failed requeue leaves that for a resubmit.
      kill -TERM "$step" 2>/dev/null || true
      scontrol requeue "$SLURM_JOB_ID"
    fi
    return 0
  fi
  echo "USR1 at $(date -Is): $_usr1_message"
  _usr1=1
  if [ "${#_usr1_action[@]}" -gt 0 ]; then "${_usr1_action[@]}"; fi
}

wait_step() {
  step=$1
  while :; do  # `wait` returns early when USR1 arrives; wait again while the step runs
    wait "$step" && rc=0 || rc=$?
    kill -0 "$step" 2>/dev/null || break
  done
}

requeue_if_due() {
  [ "$_usr1" = 1 ] || return 0
  case $_requeue_when in
    ok) [ "$rc" = 0 ] || return 0 ;;
    failed) [ "$rc" != 0 ] || return 0 ;;
    *) return 0 ;;
  esac
  echo "$1; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
}
