# Shared prelude of every dsr1kit sbatch script; source it from the project root, in the batch
# script and again inside `srun bash -c '...'` tasks (so per-node values come from that node):
#   source slurm/prelude.sh
# It sets: the Python env, node-local scratch and caches, NCCL/Gloo interface and settings, open
# file limit, and the rendezvous (MASTER_ADDR, MASTER_PORT, RAY_PORT, NODE_IP, NODE_INDEX).
# Every variable already set in the environment wins, so a site or a test can override any of them.
set -euo pipefail

if [ ! -f slurm/prelude.sh ] || [ ! -d dsr1kit ]; then
  echo "error: run from the dsr1kit project root (cd there before sbatch; jobs start in the submit dir)" >&2
  exit 2
fi

# -- Python: the project's .venv when present, else whatever env the job inherited (conda activate).
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f "${DSR1KIT_VENV:-.venv}/bin/activate" ]; then
  # shellcheck disable=SC1091
  source "${DSR1KIT_VENV:-.venv}/bin/activate"
fi

# -- Node-local scratch (NVMe): caches and temp files off the shared filesystem. Edit the default
#    to your site's local disk; it persists across jobs so the HF cache is reused.
export NVME_DIR=${NVME_DIR:-${SLURM_TMPDIR:-/tmp}/dsr1kit-${USER:-$(id -un)}}
mkdir -p "$NVME_DIR" 2>/dev/null || echo "warning: cannot create NVME_DIR=$NVME_DIR on $(hostname)" >&2
export TMPDIR=${DSR1KIT_TMPDIR:-$NVME_DIR/tmp}
export HF_HOME=${HF_HOME:-$NVME_DIR/hf}
export HF_HUB_CACHE=${HF_HUB_CACHE:-$HF_HOME/hub}
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-$NVME_DIR/cuda-cache}
mkdir -p "$TMPDIR" 2>/dev/null || export TMPDIR=/tmp

# -- Network: InfiniBand when the node has it, else anything but loopback and docker.
if [ -z "${NCCL_SOCKET_IFNAME:-}" ]; then
  if [ -d /sys/class/net/ib0 ]; then export NCCL_SOCKET_IFNAME=ib0; else export NCCL_SOCKET_IFNAME='^lo,docker0'; fi
fi
if [ -z "${GLOO_SOCKET_IFNAME:-}" ]; then  # Gloo wants one exact name: ib0, else the default route's
  if [ -d /sys/class/net/ib0 ]; then
    export GLOO_SOCKET_IFNAME=ib0
  else
    GLOO_SOCKET_IFNAME=$(awk '$2 == "00000000" { print $1; exit }' /proc/net/route)
    export GLOO_SOCKET_IFNAME
  fi
fi
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # fail fast, not hang
export NCCL_ASYNC_ERROR_HANDLING=$TORCH_NCCL_ASYNC_ERROR_HANDLING              # its pre-2.2 name
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}                                          # INFO to see NET/IB vs NET/Socket
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

# -- Open files: Ray, vLLM and NCCL hold many sockets; raise the soft limit as far as allowed.
ulimit -n 131072 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

# -- Rendezvous: first host of the node list as IPv4, port 15000 + JOBID % 10000; Ray's port; this node's IP
#    on the interface above (what Ray and vLLM advertise) and its index in the node list.
if [ -n "${SLURM_JOB_ID:-}" ]; then
  slurm_env=$(python -m dsr1kit.cluster.slurm env)  # export MASTER_ADDR= MASTER_PORT= NODE_IP= NODE_INDEX=
  eval "$slurm_env"
  export RAY_PORT=${RAY_PORT:-$((20000 + SLURM_JOB_ID % 2000 * 5))}  # a block of 5 per job: GCS, client, dashboard, agents
  # vLLM's address on this node: NODE_IP, unless the submitter exported VLLM_HOST_IP (kept from the batch
  # shell's first prelude, so srun tasks on other nodes see the submitter's value, not the head's own);
  # dsr1kit.cluster.host_ip then checks it against Ray's address for every node before vLLM starts.
  if [ -z "${DSR1KIT_PRELUDE_SEEN:-}" ]; then
    export DSR1KIT_PRELUDE_SEEN=1 DSR1KIT_SUBMITTED_VLLM_HOST_IP=${VLLM_HOST_IP:-}
  fi
  export VLLM_HOST_IP=${DSR1KIT_SUBMITTED_VLLM_HOST_IP:-$NODE_IP}
fi
