"""Data parallel HARI is exact: two gloo ranks on different data end with the gradient a single rank gets
from the same data as two accumulated micro-batches (the mean), not merely with equal gradients."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from dsr1kit.cluster.rendezvous import free_port
from dsr1kit.model.lora import first_adapted_layer
from dsr1kit.params import HariParams
from dsr1kit.steps.hari_configs import loss_config
from dsr1kit.train import dist
from dsr1kit.train.hari import hari_loss

sys.path.insert(0, str(Path(__file__).parent))
from hari_support import adapted_model_and_batch  # noqa: E402

P = HariParams(lambda_kl=0.5)
ROWS = 4


def _grads_of(model, batch, rows: slice, scale: float = 1.0) -> None:
    sub = {k: v[rows] for k, v in batch.items()}
    (hari_loss(model, sub, loss_config(P), first_adapted_layer(_grads_of.plan)).loss * scale).backward()


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: q.grad.detach().clone() for n, q in model.named_parameters() if q.requires_grad}


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    dist.init(dist.from_env(), timeout_s=120)
    try:
        model, plan, batch = adapted_model_and_batch(P, ROWS, 96)
        _grads_of.plan = plan
        _grads_of(model, batch, slice(2 * rank, 2 * rank + 2))  # each rank its own half of the data
        own = _lora_grads(model)
        dist.allreduce_grads([q for q in model.parameters() if q.requires_grad])
        torch.save({"own": own, "synced": _lora_grads(model)}, f"{out}/rank{rank}.pt")
    finally:
        dist.shutdown()


def test_two_ranks_average_to_the_single_rank_gradient_of_the_union(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    model, plan, batch = adapted_model_and_batch(P, ROWS, 96)
    _grads_of.plan = plan
    _grads_of(model, batch, slice(0, 2), 0.5)  # grad_accum 2 over the same two halves, as the loop divides
    _grads_of(model, batch, slice(2, 4), 0.5)
    single = _lora_grads(model)

    assert single.keys() == ranks[0]["synced"].keys()
    for name, g in single.items():
        a, b = ranks[0]["own"][name], ranks[1]["own"][name]
        assert (a - b).norm() > 0.1 * g.norm()  # the ranks really saw different data
        for r in ranks:
            torch.testing.assert_close(r["synced"][name], g, rtol=1e-5, atol=1e-8)
