"""One process per node: ranks from Slurm or torchrun, and an explicit LoRA-gradient all-reduce.

Inside a node the model spans the GPUs with a device_map; across nodes only
the trainable (LoRA) gradients travel — a few MB — so instead of wrapping a
device_map'd model in DDP (a known trap) we all-reduce those gradients
ourselves after backward. On CPU the same code runs with gloo.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from ..cluster.rendezvous import job_master_endpoint, process_ranks
from ..cluster.rendezvous import stop_process_group as shutdown  # noqa: F401  (the HARI run and its step call it)


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    source: str = "single"  # "torchrun" | "slurm" | "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_env(env: dict[str, str] | None = None) -> DistInfo:
    """Ranks from torchrun or srun; the rendezvous from MASTER_ADDR/PORT, else the job's first host and id."""
    env = dict(os.environ if env is None else env)
    rank, world, local, source = process_ranks(env)
    if source == "torchrun":
        return DistInfo(
            rank,
            world,
            local,
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env.get("MASTER_PORT", 29500)),
            source,
        )
    if source == "slurm":
        addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        if not (addr and port):
            default_addr, default_port = job_master_endpoint(env)
            addr, port = addr or default_addr, port or default_port
        return DistInfo(rank, world, local, addr, int(port), source)
    return DistInfo()


def init(info: DistInfo, timeout_s: float = 1800) -> DistInfo:
    """Join the process group (no-op for a single process)."""
    if info.world_size > 1 and not tdist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":  # before the first collective, so NCCL does not guess this rank's GPU
            torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        tdist.init_process_group(
            backend,
            init_method=f"tcp://{info.master_addr}:{info.master_port}",
            rank=info.rank,
            world_size=info.world_size,
            timeout=dt.timedelta(seconds=timeout_s),
        )
    return info


def _comm_device() -> torch.device:
    if tdist.is_initialized() and tdist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def allreduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Average the gradients of ``params`` over all ranks, in one flat buffer."""
    if not (tdist.is_initialized() and tdist.get_world_size() > 1):
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    dev = _comm_device()
    flat = torch.cat([g.detach().float().reshape(-1).to(dev) for g in grads])
    tdist.all_reduce(flat, op=tdist.ReduceOp.SUM)
    flat /= tdist.get_world_size()
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).to(device=p.device, dtype=p.dtype)
        offset += n


def allreduce_scalar(value: float, op: str = "sum") -> float:
    if not (tdist.is_initialized() and tdist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_comm_device())
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX if op == "max" else tdist.ReduceOp.SUM)
    return float(t.item())


def any_rank(flag: bool) -> bool:
    """True on every rank if it is True on any rank (e.g. a stop request seen by one node)."""
    return allreduce_scalar(1.0 if flag else 0.0, "max") > 0


def gather_objects(value):
    """Every rank's (picklable) value, in rank order."""
    if not (tdist.is_initialized() and tdist.get_world_size() > 1):
        return [value]
    out = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, value)
    return out


def gather_strings(value: str) -> list[str]:
    """Every rank's value, in rank order."""
    return gather_objects(value)


def gather_hostnames() -> list[str]:
    return gather_strings(socket.gethostname())


def barrier() -> None:
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.barrier()
