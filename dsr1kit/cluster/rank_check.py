"""The per-rank half of the cluster check: node checks, GPU visibility and the all-reduce.

Under Slurm, one task per node (the sbatch script runs it through srun):

    python -m dsr1kit.cluster.rank_check --out RUN/ranks -f params/<set>/00_cluster_check.yaml

Outside Slurm the notebook starts ``local_ranks`` of these on this machine with
explicit ``--rank/--world-size/--init-method``. Each rank writes
``rank-NNNN.json`` (its rows and measurements); the notebook gathers them.
Node-level checks run once per node (local rank 0); a failing check is a row,
never a crash, so every rank reports.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from .. import params as P
from . import allreduce, checks, net, slurm
from .checks import FAIL, Row
from .rendezvous import ResolveError, free_port


def collect(p: P.ClusterCheckParams, rank: int, world_size: int, local_rank: int, init_method: str,
            job: slurm.SlurmJob | None, loopback_ok: bool) -> dict[str, Any]:
    """Everything one rank reports: rows plus raw measurements for the plots."""
    ar = allreduce.run(rank, world_size, init_method, p.allreduce_sizes_mib, p.allreduce_timeout_s, local_rank)
    rows: list[Row] = []
    ip = None
    if local_rank == 0:  # node-level checks: once per node
        rows += checks.local_checks(p.expected_gpus_per_node, p.shm_min_free_gib, p.scratch_dir,
                                    p.scratch_min_free_gib)
        rows.append(net.check_interface(p.expected_gpus_per_node > 0, loopback_ok))
        try:
            ip = slurm.node_ip(job)
            rows.append(net.check_advertised_ip(ip))
        except (ValueError, ResolveError) as err:
            rows.append(Row("advertised ip", FAIL, str(err), "an IPv4 of this node",
                            "set the node IP explicitly (NODE_IP)", checks.node_name()))
        if job:
            rows.append(net.check_resolution(job.hostnames))
    rows.append(slurm.gpu_visibility(job, p.expected_gpus_per_node))
    rows.append(allreduce.correctness_row(ar))
    if rank == 0:
        rows.append(allreduce.bandwidth_row(ar, p.expected_busbw_gbps))
    return {"rank": rank, "world_size": world_size, "local_rank": local_rank, "node": checks.node_name(),
            "hostname": socket.gethostname(), "node_ip": ip, "slurm": job.to_dict() if job else None,
            "gpus": checks.gpu_inventory(), "allreduce": ar, "rows": [r.to_dict() for r in rows]}


def write(payload: dict[str, Any], out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rank-{payload['rank']:04d}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)  # the notebook never reads half a file
    return path


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.IPv4Address(addr).is_loopback
    except ValueError:
        return False


def run_local(p: P.ClusterCheckParams, out_dir: str | Path, world_size: int | None = None,
              timeout_s: float | None = None) -> Path:
    """Run the per-rank check as `world_size` local processes (gloo over 127.0.0.1); returns out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params_file = out / "params.yaml"
    params_file.write_text(yaml.safe_dump(p.to_dict()))
    n = world_size or p.local_ranks
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # a local run, even on a login node
    procs = [subprocess.Popen([sys.executable, "-m", "dsr1kit.cluster.rank_check", "--out", str(out),
                               "-f", str(params_file), "--rank", str(r), "--world-size", str(n),
                               "--init-method", init], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(n)]
    limit = (timeout_s or p.allreduce_timeout_s) + 120
    for r, proc in enumerate(procs):
        try:
            text, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
        if proc.returncode != 0:
            print(f"rank {r} exited {proc.returncode}:\n{text[-2000:]}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsr1kit.cluster.rank_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for rank-NNNN.json (shared by all nodes)")
    parser.add_argument("-f", "--params-file", action="append", default=[], help="00_cluster_check YAML")
    parser.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    parser.add_argument("--rank", type=int, help="local run: this rank (default: SLURM_PROCID)")
    parser.add_argument("--world-size", type=int, help="local run: ranks in all (default: SLURM_NTASKS)")
    parser.add_argument("--init-method", help="local run: tcp://HOST:PORT (default: the job's rendezvous)")
    args = parser.parse_args(argv)
    overrides = {k: P.parse_override(v) for k, v in args.param}
    p = P.load("00_cluster_check", args.params_file, overrides)
    if args.rank is not None:
        rank, world, local, init, job, loopback_ok = (args.rank, args.world_size or 1, args.rank,
                                                      args.init_method, None, True)
    else:
        job = slurm.SlurmJob.from_env()
        if job is None:
            parser.error("not inside a Slurm job: pass --rank, --world-size and --init-method")
        addr, port = slurm.rendezvous(job)
        world = int(os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ["SLURM_NTASKS"])
        rank, local, init = job.proc_id, job.local_id, f"tcp://{addr}:{port}"
        loopback_ok = job.num_nodes == 1 or _is_loopback(addr)  # all "nodes" on one host (test cluster)
    path = write(collect(p, rank, world, local, init, job, loopback_ok), args.out)
    print(f"rank {rank}/{world} on {checks.node_name()}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
