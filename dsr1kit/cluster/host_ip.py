"""Before vLLM starts on Ray across nodes: every node's ``VLLM_HOST_IP`` is the address Ray has for that node.

vLLM's workers announce ``VLLM_HOST_IP`` to each other, while Ray places them by the address its raylet
registered. When the two differ on a node (a ``VLLM_HOST_IP`` exported for the whole job, which is right on
one node at most; or a Ray that registered another address than it was given), the engine fails only after
the weights are loaded, or hangs in its first collective. The sbatch script runs this once per node (srun)
after Ray is up: a mismatch stops the job in seconds, naming the node and both addresses.

    python -m dsr1kit.cluster.host_ip RUN_DIR/ray_state.json    # on every node, after `ray ... state`
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def problems(state: dict, vllm_host_ip: str, node_ip: str, node: str) -> list[str]:
    """What is wrong on ``node``: its ``VLLM_HOST_IP`` against the address its raylet was started with
    (``node_ip``) and the addresses Ray registered (``state``, as ``dsr1kit.cluster.ray state`` writes it)."""
    registered = sorted(n["ip"] for n in state.get("nodes", []))
    out = []
    if not vllm_host_ip:
        out.append(f"{node}: VLLM_HOST_IP is not set (slurm/prelude.sh sets it to this node's address)")
    elif vllm_host_ip != node_ip:
        out.append(
            f"{node}: VLLM_HOST_IP={vllm_host_ip}, but this node's Ray runs at {node_ip}; vLLM's workers here "
            f"would announce another address than Ray's. Unset VLLM_HOST_IP in the job's environment (the kit "
            f"sets it on each node to the address of the interface NCCL_SOCKET_IFNAME names)"
        )
    if node_ip not in registered:
        out.append(
            f"{node}: Ray registered {', '.join(registered) or 'no node'}, not this node's address {node_ip}: "
            f"start Ray with --node-ip-address={node_ip} (slurm/ray_cluster.sh does)"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m dsr1kit.cluster.host_ip RAY_STATE.json", file=sys.stderr)
        return 2
    state = json.loads(Path(argv[0]).read_text())
    node = os.environ.get("SLURMD_NODENAME", os.uname().nodename)
    found = problems(state, os.environ.get("VLLM_HOST_IP", ""), os.environ.get("NODE_IP", ""), node)
    for line in found:
        print(f"error: {line}", file=sys.stderr)
    if not found:
        print(f"{node}: VLLM_HOST_IP {os.environ['VLLM_HOST_IP']} is Ray's address for this node")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
