"""How the processes of one job find each other: ranks, node list, master address and port.

Training, the cluster check and ``slurm/prelude.sh`` all need these facts, so
this module imports no other ``dsr1kit.cluster`` module (no checks, no rows)
and no torch at import time. The recipe's rendezvous: the first host of
``scontrol show hostnames $SLURM_JOB_NODELIST`` resolved to IPv4, port
``15000 + JOBID % 10000``.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import subprocess
from typing import Mapping

PORT_BASE, PORT_SPAN = 15000, 10000


class ResolveError(RuntimeError):
    """A host name that neither DNS nor Slurm can turn into an IPv4 address."""


# -- this process's place among several -----------------------------------------------------
def process_ranks(env: Mapping[str, str] | None = None) -> tuple[int, int, int, str]:
    """(rank, world size, local rank, launcher) from torchrun's or srun's variables.

    torchrun wins when both are set (torchrun inside an sbatch job); a job step of one task is a
    single process whatever SLURM_PROCID says.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun"
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), "slurm"
    return 0, 1, 0, "single"


# -- node list ------------------------------------------------------------------------------
def expand_nodelist(
    nodelist: str, env: Mapping[str, str] | None = None, use_scontrol: bool = True
) -> list[str]:
    """`scontrol show hostnames NODELIST`; the same expansion in Python where scontrol cannot run."""
    if use_scontrol:
        try:
            proc = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=20,
                env=dict(env) if env is not None else None,
            )
            if proc.returncode == 0 and proc.stdout.strip():
                return proc.stdout.split()
        except (OSError, subprocess.SubprocessError):
            pass
    return _expand_py(nodelist)


def _expand_py(nodelist: str) -> list[str]:
    """'gpu[01-02,7],login1' -> gpu01 gpu02 gpu7 login1 (zero padding kept, several brackets allowed)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    hosts: list[str] = []
    for item in filter(None, items):
        names = [""]
        for text, bracket in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            choices = [text + n for n in _expand_ranges(bracket)] if bracket else [text]
            names = [a + b for a in names for b in choices]
        hosts += names
    return hosts


def _expand_ranges(spec: str) -> list[str]:
    out = []
    for rng in spec.split(","):
        lo, _, hi = rng.partition("-")
        if not hi:
            out.append(lo)
            continue
        width = len(lo) if lo.startswith("0") else 0
        out += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return out


# -- host names to addresses ----------------------------------------------------------------
def resolve_ipv4(host: str, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(IPv4, how): DNS/hosts first, then Slurm's NodeAddr for the node of that name."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0], "dns"
    except (socket.gaierror, UnicodeError):
        pass
    addr = _slurm_node_addr(host, env)
    if addr:
        try:
            ipaddress.IPv4Address(addr)
            return addr, "slurm NodeAddr"
        except ValueError:
            try:
                return socket.getaddrinfo(addr, None, socket.AF_INET)[0][4][0], f"slurm NodeAddr {addr}"
            except socket.gaierror:
                pass
    raise ResolveError(
        f"cannot resolve {host!r} to IPv4: not in DNS or /etc/hosts"
        + (
            f", and Slurm's NodeAddr {addr!r} does not resolve either"
            if addr
            else " and Slurm knows no NodeAddr for it"
        )
    )


def _slurm_node_addr(host: str, env: Mapping[str, str] | None) -> str | None:
    try:
        proc = subprocess.run(
            ["scontrol", "show", "node", "-o", host],
            capture_output=True,
            text=True,
            timeout=10,
            env=dict(env) if env is not None else None,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"\bNodeAddr=(\S+)", proc.stdout)
    return m.group(1) if proc.returncode == 0 and m else None


# -- where the ranks meet -------------------------------------------------------------------
def rendezvous_port(job_id: int) -> int:
    """The recipe's MASTER_PORT: 15000 + JOBID % 10000 (distinct for concurrent jobs)."""
    return PORT_BASE + job_id % PORT_SPAN


def master_endpoint(
    job_id: int, hostnames: list[str], node_name: str = "", env: Mapping[str, str] | None = None
) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT): the job's first host (else this node) as IPv4, and the job's port."""
    first = hostnames[0] if hostnames else node_name or socket.gethostname()
    return resolve_ipv4(first, env)[0], rendezvous_port(job_id)


def job_master_endpoint(env: Mapping[str, str] | None = None) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) of the Slurm job that ``env`` describes (SLURM_JOB_ID, its node list)."""
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    hosts = expand_nodelist(nodelist, env=env) if nodelist else []
    return master_endpoint(int(env["SLURM_JOB_ID"]), hosts, env.get("SLURMD_NODENAME", ""), env)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, for a rendezvous or server on one machine."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -- leaving --------------------------------------------------------------------------------
def stop_process_group() -> None:
    """Destroy torch's default process group if this process joined one (torch imported only here)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
