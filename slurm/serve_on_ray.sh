#!/usr/bin/env bash
# Sourced by a batch script that serves a model with vLLM across the nodes of its allocation, after
# slurm/prelude.sh (NODE_IP, RAY_PORT, the node's environment); used by vllm_inference.sbatch and by the
# forgetting sweep's serving jobs:
#   ray_for_vllm RUN_DIR           Ray up on every node (head here, a worker on every other node), wait
#                                  until Ray sees every node and every GPU, record its state in
#                                  RUN_DIR/ray_state.json, check every node's VLLM_HOST_IP against it;
#                                  exports RAY_ADDRESS (vLLM's Ray executor joins that cluster)
#   stop_servers_and_ray RUN_DIR   the cleanup: a vLLM server of RUN_DIR the notebook could not stop (its
#                                  process group id is in a pid file), then Ray on every node and its temp dirs
# DSR1KIT_EXPECTED_GPUS: the GPUs Ray must report (default nodes x GPUs per node; the emulated GPUs of a
# test cluster are not real: 0). RAY_WAIT_S: how long to wait for them (default 300).

ray_for_vllm() {
  local run_dir=${1:?ray_for_vllm RUN_DIR}
  local gpus=${DSR1KIT_EXPECTED_GPUS:-$((SLURM_JOB_NUM_NODES * ${SLURM_GPUS_ON_NODE:-0}))}
  slurm/ray_cluster.sh up
  export RAY_ADDRESS=$NODE_IP:$RAY_PORT
  python -m dsr1kit.cluster.ray wait --address "$RAY_ADDRESS" --nodes "$SLURM_JOB_NUM_NODES" \
    --gpus "$gpus" --timeout "${RAY_WAIT_S:-300}"
  python -m dsr1kit.cluster.ray state --address "$RAY_ADDRESS" --node-ip "$NODE_IP" > "$run_dir/ray_state.json"
  # Every node's VLLM_HOST_IP is the address Ray has for it (else vLLM fails only after loading the weights).
  srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --overlap \
    bash -c 'source slurm/prelude.sh && exec python -m dsr1kit.cluster.host_ip "$0"' "$run_dir/ray_state.json"
}

stop_servers_and_ray() {
  local run_dir=${1:?stop_servers_and_ray RUN_DIR}
  python -m dsr1kit.infer.server stop-run "$run_dir" || true
  slurm/ray_cluster.sh down || true   # workers, then the head; removes this job's Ray temp dirs
}
