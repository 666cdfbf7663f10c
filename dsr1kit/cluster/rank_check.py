"""The per-rank half of the cluster check: node checks, GPU visibility and the all-reduce.

Under Slurm, one task per node (the sbatch script runs it through srun):

    python -m dsr1kit rank-check --out RUN/ranks -f params/<set>/00_cluster_check.yaml

Outside Slurm the notebook starts ``local_ranks`` of these on this machine with
explicit ``--rank/--world-size/--init-method``. Each rank writes
``rank-NNNN.json`` (its rows and measurements); the notebook gathers them.
Node-level checks run once per node (local rank 0); a failing check is a row,
never a crash, so every rank reports.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from . import allreduce, checks, net, slurm
from .checks import FAIL, Row
from .rendezvous import ResolveError, free_port


@dataclass(frozen=True)
class RankCheckConfig:
    """What one rank checks and measures (the names are notebook 00's parameters)."""

    expected_gpus_per_node: int  # 0: a CPU node (gloo)
    shm_min_free_gib: float  # /dev/shm free space below this fails
    scratch_dir: str  # node-local scratch ('': $NVME_DIR, $TMPDIR or /tmp)
    scratch_min_free_gib: float
    allreduce_sizes_mib: tuple[float, ...]  # message sizes of the all-reduce sweep
    allreduce_timeout_s: float
    expected_busbw_gbps: float  # 0: no target
    local_ranks: int  # outside Slurm: processes started on this machine
    staged_model: str = ""  # repo id or folder every node must hold complete ('': not checked)
    staged_model_dir: str = ""  # the hub cache (repo id) it is staged in; '': $HF_HUB_CACHE; {node}: per node

    def to_params(self) -> dict[str, Any]:
        """As notebook 00's parameters (a YAML file the rank processes read)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def collect(
    cfg: RankCheckConfig,
    rank: int,
    world_size: int,
    local_rank: int,
    init_method: str,
    job: slurm.SlurmJob | None,
    loopback_ok: bool,
) -> dict[str, Any]:
    """Everything one rank reports: rows plus raw measurements for the plots."""
    ar = allreduce.run(
        rank, world_size, init_method, list(cfg.allreduce_sizes_mib), cfg.allreduce_timeout_s, local_rank
    )
    rows: list[Row] = []
    ip = None
    if local_rank == 0:  # node-level checks: once per node
        rows += checks.local_checks(
            cfg.expected_gpus_per_node,
            cfg.shm_min_free_gib,
            cfg.scratch_dir,
            cfg.scratch_min_free_gib,
            cfg.staged_model,
            cfg.staged_model_dir,
        )
        rows.append(net.check_interface(cfg.expected_gpus_per_node > 0, loopback_ok))
        try:
            ip = slurm.node_ip(job)
            rows.append(net.check_advertised_ip(ip))
        except (ValueError, ResolveError) as err:
            rows.append(
                Row(
                    "advertised ip",
                    FAIL,
                    str(err),
                    "an IPv4 of this node",
                    "set the node IP explicitly (NODE_IP)",
                    checks.node_name(),
                )
            )
        if job:
            rows.append(net.check_resolution(job.hostnames))
    rows.append(slurm.gpu_visibility(job, cfg.expected_gpus_per_node))
    rows.append(allreduce.correctness_row(ar))
    if rank == 0:
        rows.append(allreduce.bandwidth_row(ar, cfg.expected_busbw_gbps))
    return {
        "rank": rank,
        "world_size": world_size,
        "local_rank": local_rank,
        "node": checks.node_name(),
        "hostname": socket.gethostname(),
        "node_ip": ip,
        "slurm": job.to_dict() if job else None,
        "gpus": checks.gpu_inventory(),
        "allreduce": ar,
        "rows": [r.to_dict() for r in rows],
    }


def write(payload: dict[str, Any], out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rank-{payload['rank']:04d}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)  # the notebook never reads half a file
    return path


def run_rank(
    cfg: RankCheckConfig,
    out_dir: str | Path,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
) -> Path:
    """One rank's checks, written to out_dir: the rank given (a local run), else this Slurm task's."""
    if rank is not None:
        world, local, init, job, loopback_ok = world_size or 1, rank, init_method, None, True
    else:
        job = slurm.SlurmJob.from_env()
        if job is None:
            raise ValueError("not inside a Slurm job: pass --rank, --world-size and --init-method")
        addr, port = slurm.rendezvous(job)
        world = int(os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ["SLURM_NTASKS"])
        rank, local, init = job.proc_id, job.local_id, f"tcp://{addr}:{port}"
        loopback_ok = job.num_nodes == 1 or _is_loopback(addr)  # all "nodes" on one host (test cluster)
    path = write(collect(cfg, rank, world, local, init, job, loopback_ok), out_dir)
    print(f"rank {rank}/{world} on {checks.node_name()}: {path}")
    return path


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.IPv4Address(addr).is_loopback
    except ValueError:
        return False


def run_local(
    cfg: RankCheckConfig, out_dir: str | Path, world_size: int | None = None, timeout_s: float | None = None
) -> Path:
    """Run the per-rank check as `world_size` local processes (gloo over 127.0.0.1); returns out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params_file = out / "params.yaml"
    params_file.write_text(yaml.safe_dump(cfg.to_params()))
    n = world_size or cfg.local_ranks
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("SLURM_")
    }  # a local run, even on a login node
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dsr1kit",
                "rank-check",
                "--out",
                str(out),
                "-f",
                str(params_file),
                "--rank",
                str(r),
                "--world-size",
                str(n),
                "--init-method",
                init,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(n)
    ]
    limit = (timeout_s or cfg.allreduce_timeout_s) + 120
    for r, proc in enumerate(procs):
        try:
            text, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
        if proc.returncode != 0:
            print(f"rank {r} exited {proc.returncode}:\n{text[-2000:]}", file=sys.stderr)
    return out
