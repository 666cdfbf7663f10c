#!/usr/bin/env bash
# Ray across a Slurm allocation: a head with an explicit IP on the first node, a worker on every
# other node, a wait until all of them joined, and a stop that always cleans this job's temp dirs.
#
# In an sbatch script (after `source slurm/prelude.sh`, from the project root):
#   slurm/ray_cluster.sh up      # head here + workers via srun; prints RAY_ADDRESS=IP:PORT last
#   slurm/ray_cluster.sh down    # stop Ray on every node of the job, remove its temp dirs
# One node at a time (what `up`/`down` run; the Ray tests call these too):
#   slurm/ray_cluster.sh head   NODE_IP PORT TEMP_DIR [ray start args...]        # returns once up
#   slurm/ray_cluster.sh worker NODE_IP HEAD_IP:PORT TEMP_DIR [ray start args...] # blocks while alive
#   slurm/ray_cluster.sh stop   TEMP_DIR
#
# Environment knobs:
#   RAY_PORT                 head (GCS) port, set by slurm/prelude.sh to 20000 + JOBID % 2000 * 5
#   RAY_AGENT_PORT           this node's dashboard-agent port; default RAY_PORT + 3 + NODE_INDEX
#   RAY_TMP_ROOT             where per-node temp dirs go (default /tmp: socket paths must stay short)
#   RAY_WAIT_S               how long `up` waits for every node (default 300)
#   DSR1KIT_RAY_OBJECT_STORE_BYTES  cap the object store (default: Ray's 30% of RAM)
#   DSR1KIT_RAY_WORKER_TRIES 3 (default): starts of a worker whose raylet failed to register in time
#   DSR1KIT_RAY_STOP_ALL     1 (default): also `ray stop --force`, the recipe's reset, right on whole
#                            nodes; 0: only this job's Ray processes (a node shared with other Ray users)
set -euo pipefail

usage() { sed -n '2,20p' "$0" >&2; exit 2; }
[ $# -ge 1 ] || usage
role=$1; shift
PY=${PYTHON:-python}

stop_leftover() {  # $1 = temp dir. A requeued job keeps its id, so its port and temp dir: a Ray that an
  # earlier run of it left on this node (its cleanup cut short) would hold them and refuse the new start.
  if [ -d "$1" ]; then
    echo "a Ray node of an earlier run of this job is left at $1: stopping it first" >&2
    "$PY" -m dsr1kit.cluster.ray stop --temp-dir "$1" >&2 || true
  fi
}

common_args() {  # flags shared by head and worker; $1 = temp dir
  local args=(
    --temp-dir="$1"                      # this job's own dir: logs, sockets; removed by `stop`
    --dashboard-agent-listen-port="${RAY_AGENT_PORT}"  # fixed 52365 by default: clashes on shared hosts
    --disable-usage-stats                # no phone-home from cluster nodes
  )
  if [ -n "${DSR1KIT_RAY_OBJECT_STORE_BYTES:-}" ]; then
    args+=(--object-store-memory="${DSR1KIT_RAY_OBJECT_STORE_BYTES}")  # lives in /dev/shm
  fi
  printf '%s\n' "${args[@]}"
}

case "$role" in
  head)
    [ $# -ge 3 ] || usage
    ip=$1 port=$2 tmp=$3; shift 3
    : "${RAY_AGENT_PORT:=$((port + 3))}"
    stop_leftover "$tmp"
    mapfile -t common < <(common_args "$tmp")
    args=(
      --head
      --node-ip-address="$ip"              # explicit: never let Ray guess (it rewrites 127.0.0.1)
      --port="$port"                       # GCS; workers join HEAD_IP:PORT
      --ray-client-server-port=$((port + 1))  # default 10001 clashes between jobs on one host
      --dashboard-port=$((port + 2))       # default 8265 clashes too
      --include-dashboard=false            # vLLM and the checks need only the GCS
    )
    ray start "${args[@]}" "${common[@]}" "$@"
    ;;
  worker)
    [ $# -ge 3 ] || usage
    ip=$1 head=$2 tmp=$3; shift 3
    : "${RAY_AGENT_PORT:=$((${head##*:} + 3 + ${NODE_INDEX:-1}))}"
    mapfile -t common < <(common_args "$tmp")
    stop_leftover "$tmp"
    # --block: under srun the step must live as long as the worker, or Slurm reaps its processes.
    # A worker whose raylet does not register with the head in time (Ray waits a fixed 30 s; seen on
    # loaded hosts) exits at once: stop what it left under its temp dir and start it again, up to
    # DSR1KIT_RAY_WORKER_TRIES times. One that had started ("Ray runtime started") ended for another
    # reason (stopped by `down`, however soon after its start, or lost): it is not restarted.
    tries=${DSR1KIT_RAY_WORKER_TRIES:-3}
    for ((try = 1; ; try++)); do
      up=0 rc=1
      while IFS= read -r line; do  # Ray's output passes through; its exit code comes last
        if [[ $line == __ray_start_rc=* ]]; then rc=${line#__ray_start_rc=}; continue; fi
        printf '%s\n' "$line"
        if [[ $line == *"Ray runtime started"* ]]; then up=1; fi
      done < <(ray start --address="$head" --node-ip-address="$ip" --block "${common[@]}" "$@" 2>&1 &&
                 echo "__ray_start_rc=0" || echo "__ray_start_rc=$?")  # (errexit holds in here too)
      if [ "$rc" = 0 ]; then exit 0; fi
      if (( up || try >= tries )); then
        exit "$rc"
      fi
      echo "warning: the Ray worker on $ip did not start (rc=$rc, try $try of $tries): stopping its" \
           "processes and starting it again" >&2
      "$PY" -m dsr1kit.cluster.ray stop --temp-dir "$tmp" >&2 || true
      sleep 2
    done
    ;;
  stop)
    [ $# -eq 1 ] || usage
    stop_all=()
    [ "${DSR1KIT_RAY_STOP_ALL:-1}" = 1 ] && stop_all=(--all)
    "$PY" -m dsr1kit.cluster.ray stop --temp-dir "$1" "${stop_all[@]}"
    ;;
  up)
    : "${SLURM_JOB_ID:?up/down run inside a Slurm job}" "${NODE_IP:?source slurm/prelude.sh first}"
    : "${RAY_PORT:?source slurm/prelude.sh first}"
    tmp_root=${RAY_TMP_ROOT:-/tmp}
    "$0" head "$NODE_IP" "$RAY_PORT" "$tmp_root/ray-$SLURM_JOB_ID-$NODE_INDEX"
    if [ "$SLURM_JOB_NUM_NODES" -gt 1 ]; then
      # One worker per other node, in the background for the rest of the job. bash -c so that
      # NODE_IP/NODE_INDEX come from the prelude on *that* node ($1 = head, $2 = temp root).
      # --overlap: the step shares the job's CPUs/GPUs with later steps;
      # --kill-on-bad-exit=0: a worker that dies is reported by `wait`, not by killing the job.
      srun --nodes=$((SLURM_JOB_NUM_NODES - 1)) --ntasks=$((SLURM_JOB_NUM_NODES - 1)) --ntasks-per-node=1 \
        --exclude="$SLURMD_NODENAME" --overlap --kill-on-bad-exit=0 \
        bash -c 'source slurm/prelude.sh && exec slurm/ray_cluster.sh worker "$NODE_IP" "$1" \
                 "$2/ray-$SLURM_JOB_ID-$NODE_INDEX"' _ "$NODE_IP:$RAY_PORT" "$tmp_root" &
      echo $! > "$tmp_root/ray-$SLURM_JOB_ID.workers.pid"
    fi
    "$PY" -m dsr1kit.cluster.ray wait --address "$NODE_IP:$RAY_PORT" --nodes "$SLURM_JOB_NUM_NODES" \
      --timeout "${RAY_WAIT_S:-300}"
    echo "RAY_ADDRESS=$NODE_IP:$RAY_PORT"
    ;;
  down)
    : "${SLURM_JOB_ID:?up/down run inside a Slurm job}" "${NODE_INDEX:?source slurm/prelude.sh first}"
    tmp_root=${RAY_TMP_ROOT:-/tmp}
    if [ "$SLURM_JOB_NUM_NODES" -gt 1 ]; then
      # Workers first, while the head still answers, so they leave cleanly. Each node stops its
      # own Ray (bash -c: NODE_INDEX of that node); --overlap: runs beside the worker step.
      srun --nodes=$((SLURM_JOB_NUM_NODES - 1)) --ntasks=$((SLURM_JOB_NUM_NODES - 1)) --ntasks-per-node=1 \
        --exclude="$SLURMD_NODENAME" --overlap \
        bash -c 'source slurm/prelude.sh && exec slurm/ray_cluster.sh stop "$1/ray-$SLURM_JOB_ID-$NODE_INDEX"' \
        _ "$tmp_root" || echo "warning: ray stop failed on some worker node" >&2
    fi
    "$0" stop "$tmp_root/ray-$SLURM_JOB_ID-$NODE_INDEX"  # the head, here
    pidfile="$tmp_root/ray-$SLURM_JOB_ID.workers.pid"
    if [ -f "$pidfile" ]; then
      kill "$(cat "$pidfile")" 2>/dev/null || true  # the worker step, should it still be alive
      rm -f "$pidfile"
    fi
    ;;
  *) usage ;;
esac
