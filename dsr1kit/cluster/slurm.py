"""The Slurm job as this process sees it: layout, rendezvous, node IP, GPU visibility.

Everything comes from ``SLURM_*`` variables and ``scontrol``; nothing here
imports torch, so ``slurm/prelude.sh`` can call it on every node:

    eval "$(python -m dsr1kit.cluster.slurm env)"   # MASTER_ADDR MASTER_PORT NODE_INDEX NODE_IP

Node list expansion, host resolution and the rendezvous rule live in
`rendezvous` (training needs them without the checks).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Mapping

from . import net
from .checks import FAIL, PASS, Row, node_name
from .rendezvous import ResolveError, expand_nodelist, master_endpoint, resolve_ipv4

# Several "nodes" on one host (the test cluster): one IP per node index, space separated.
NODE_IPS_ENV = "DSR1KIT_NODE_IPS"


def _int(value: str | None) -> int | None:
    """'8', 'h100:8' or 'gres/gpu:h100=8' -> 8; '' or None -> None."""
    if not value:
        return None
    m = re.search(r"(\d+)\s*$", value.split(",")[0])
    return int(m.group(1)) if m else None


def _gpus_per_task(env: Mapping[str, str]) -> int | None:
    if env.get("SLURM_GPUS_PER_TASK"):
        return _int(env["SLURM_GPUS_PER_TASK"])
    for part in env.get("SLURM_TRES_PER_TASK", "").split(","):  # newer Slurm: cpu=4,gres/gpu=1
        if "gpu" in part:
            return _int(part.replace("=", ":"))
    return None


@dataclass
class SlurmJob:
    job_id: int
    nodelist: str
    num_nodes: int
    ntasks: int
    ntasks_per_node: int
    gpus_per_node: int | None = None
    gpus_per_task: int | None = None
    node_id: int = 0
    proc_id: int = 0
    local_id: int = 0
    node_name: str = ""
    job_name: str = ""
    hostnames: list[str] = field(default_factory=list)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, expand: bool = True) -> "SlurmJob | None":
        """The job of this process, or None outside Slurm."""
        env = os.environ if env is None else env
        if not env.get("SLURM_JOB_ID"):
            return None
        nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
        per_node = (
            _int(env.get("SLURM_NTASKS_PER_NODE"))
            or _int(env.get("SLURM_TASKS_PER_NODE", "1").split("(")[0])
            or 1
        )
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        job = cls(
            job_id=int(env["SLURM_JOB_ID"]),
            nodelist=nodelist,
            num_nodes=nodes,
            ntasks=int(env.get("SLURM_NTASKS") or nodes * per_node),
            ntasks_per_node=per_node,
            gpus_per_node=_int(env.get("SLURM_GPUS_PER_NODE")),
            gpus_per_task=_gpus_per_task(env),
            node_id=int(env.get("SLURM_NODEID", 0)),
            proc_id=int(env.get("SLURM_PROCID", 0)),
            local_id=int(env.get("SLURM_LOCALID", 0)),
            node_name=env.get("SLURMD_NODENAME", ""),
            job_name=env.get("SLURM_JOB_NAME", ""),
        )
        if expand and nodelist:
            job.hostnames = expand_nodelist(nodelist, env=env)
            # Inside an srun step SLURM_NTASKS_PER_NODE etc. describe the step; the job's own
            # request (the thing to fix) comes from the controller.
            job.apply_request(job_request(job.job_id, env))
        return job

    def apply_request(self, request: dict[str, int | None]) -> None:
        for key, value in request.items():
            if value is not None:
                setattr(self, key, value)

    def layout(self) -> str:
        """The job's request as sbatch options, e.g. '--nodes=2 --ntasks-per-node=8 --gpus-per-task=1'."""
        parts = [f"--nodes={self.num_nodes}", f"--ntasks-per-node={self.ntasks_per_node}"]
        if self.gpus_per_node is not None:
            parts.append(f"--gpus-per-node={self.gpus_per_node}")
        if self.gpus_per_task is not None:
            parts.append(f"--gpus-per-task={self.gpus_per_task}")
        return " ".join(parts)

    @property
    def node_index(self) -> int:
        """Position of this node in the job's node list (SLURM_NODEID is relative to the step)."""
        if self.node_name in self.hostnames:
            return self.hostnames.index(self.node_name)
        return self.node_id

    def to_dict(self) -> dict:
        return asdict(self)


def job_request(job_id: int, env: Mapping[str, str] | None = None) -> dict[str, int | None]:
    """The job's layout as submitted, from `scontrol show job -o`; {} when scontrol cannot tell."""
    try:
        proc = subprocess.run(
            ["scontrol", "show", "job", "-o", str(job_id)],
            capture_output=True,
            text=True,
            timeout=20,
            env=dict(env) if env is not None else None,
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    return parse_job_request(proc.stdout) if proc.returncode == 0 else {}


def parse_job_request(line: str) -> dict[str, int | None]:
    """ntasks_per_node, gpus_per_node, gpus_per_task from one `scontrol show job -o` line."""
    fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
    if "NumNodes" not in fields:
        return {}
    nodes = int(fields["NumNodes"].split("-")[0])
    per_node = int(fields.get("NtasksPerN:B:S:C", "0").split(":")[0] or 0)
    if not per_node and fields.get("NumTasks", "").isdigit():
        per_node = -(-int(fields["NumTasks"]) // nodes)

    def gpus(tres: str | None) -> int | None:
        m = re.search(r"gpu(?::[^,:=]+)?[:=](\d+)", tres or "")
        return int(m.group(1)) if m else None

    return {
        "ntasks_per_node": per_node or None,
        "gpus_per_node": gpus(fields.get("TresPerNode")),
        "gpus_per_task": gpus(fields.get("TresPerTask")),
    }


# -- rendezvous and node IP -----------------------------------------------------------------
def rendezvous(job: SlurmJob, env: Mapping[str, str] | None = None) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) for this job."""
    return master_endpoint(job.job_id, job.hostnames, job.node_name, env)


def node_ip(job: SlurmJob | None = None, env: Mapping[str, str] | None = None) -> str:
    """The IPv4 this node advertises to Ray and vLLM: the one on the interface NCCL/Gloo use."""
    env = os.environ if env is None else env
    override = env.get(NODE_IPS_ENV, "").split()
    if override:
        index = job.node_index if job else 0
        if index >= len(override):
            raise ValueError(f"{NODE_IPS_ENV} lists {len(override)} IPs, node index {index} has none")
        return override[index]
    chosen = net.chosen_interface(env)
    if chosen and chosen.ipv4:
        return chosen.ipv4
    return resolve_ipv4(job.node_name if job and job.node_name else socket.gethostname(), env)[0]


# -- GPU visibility -------------------------------------------------------------------------
def job_nodes(env: Mapping[str, str] | None = None) -> int:
    """Nodes of the Slurm job this runs in (1 outside one)."""
    env = os.environ if env is None else env
    return int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)


def parse_time_left(text: str) -> float | None:
    """Seconds in squeue's %L ('1-02:03:04', '02:03:04', '03:04'); None for UNLIMITED or NOT_SET."""
    text = text.strip()
    if not text or not text[0].isdigit():
        return None
    days, _, clock = text.rpartition("-")
    parts = [int(x) for x in clock.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return float((int(days or 0) * 24 + parts[0]) * 3600 + parts[1] * 60 + parts[2])


def remaining_seconds(env: Mapping[str, str] | None = None) -> float | None:
    """Time this Slurm job has left before its limit (squeue %L); None outside a job or without a limit."""
    import subprocess

    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%L"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_time_left(out.splitlines()[0]) if out.strip() else None


def trap_fix(gpus: int) -> str:
    return (
        f"use `#SBATCH --gpus-per-node={gpus}` and `#SBATCH --ntasks-per-node=1` (one process per node "
        f"sees all its GPUs); never --gpus-per-task=1, which shows each process only "
        f"CUDA_VISIBLE_DEVICES=0 so cuda:local_rank fails with 'invalid device ordinal'"
    )


def gpu_visibility(job: SlurmJob | None, expected_per_node: int, env: Mapping[str, str] | None = None) -> Row:
    """Judge from the job's request and CUDA_VISIBLE_DEVICES whether one process sees the node's GPUs."""
    env = os.environ if env is None else env
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    visible = None if cvd is None else [d for d in cvd.split(",") if d.strip()]
    measured = f"CUDA_VISIBLE_DEVICES={cvd if cvd is not None else '(unset)'}"
    if job:
        measured += f"; job {job.layout()}"
    want = expected_per_node or (job.gpus_per_node if job and job.gpus_per_node else 0)
    expected = f"one process per node sees all {want} GPUs" if want else "CPU run: any"
    name = "gpu visibility"
    if job and job.gpus_per_task and (job.ntasks_per_node > 1 or job.gpus_per_task < expected_per_node):
        return Row(
            name,
            FAIL,
            measured + f": each of the {job.ntasks_per_node} processes per node would see "
            f"{job.gpus_per_task} GPU",
            expected,
            trap_fix(want or 8),
            node_name(),
        )
    if expected_per_node and visible is not None and len(visible) < expected_per_node:
        return Row(
            name,
            FAIL,
            measured + f": {len(visible)} of {expected_per_node} GPUs visible",
            expected,
            trap_fix(expected_per_node) + "; and do not narrow CUDA_VISIBLE_DEVICES in the script",
            node_name(),
        )
    return Row(name, PASS, measured, expected, "", node_name())


# -- shell entry point ----------------------------------------------------------------------
def shell_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What slurm/prelude.sh exports on every node."""
    env = os.environ if env is None else env
    job = SlurmJob.from_env(env)
    out = {"NODE_IP": node_ip(job, env), "NODE_INDEX": str(job.node_index if job else 0)}
    if job:
        addr, port = rendezvous(job, env)
        out |= {"MASTER_ADDR": addr, "MASTER_PORT": str(port)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dsr1kit.cluster.slurm", description=__doc__.split("\n")[0]
    )
    parser.add_argument("what", choices=["env", "hostnames", "rendezvous", "node-ip"])
    args = parser.parse_args(argv)
    try:
        if args.what == "env":
            print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in shell_env().items()))
        elif args.what == "node-ip":
            print(node_ip(SlurmJob.from_env()))
        else:
            job = SlurmJob.from_env()
            if job is None:
                print("not inside a Slurm job (SLURM_JOB_ID unset)", file=sys.stderr)
                return 2
            print("\n".join(job.hostnames) if args.what == "hostnames" else "%s %d" % rendezvous(job))
    except (ResolveError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
