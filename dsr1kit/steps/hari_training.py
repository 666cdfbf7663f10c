"""Notebook 20, HARI end to end: the parameters become one ``HariRun`` (``steps.hari_configs``), whose phases
the notebook calls cell by cell from ``dsr1kit.train.hari_run`` (plan → data → prefix cache → model + LoRA
→ train → outputs); this module adds what needs the job around it (ranks, the Slurm job's nodes and time
left) and the verdict. ``run`` chains the phases for ``python -m dsr1kit train``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..plan import DiskPlan, Machine, Plan
from ..plan.timing import TimePlan
from ..train import dist, hari_plans, hari_run
from ..train.loop import TrainResult
from ..train.outputs import lora_b_norms
from . import FAIL, OK, WARN, StepFailed, Verdict
from .hari_configs import hari_run as configure


class TrainingFailed(StepFailed):
    """A step did not run, ranks disagree, or nothing was learned."""


def setup_dist() -> dist.DistInfo:
    return dist.init(dist.from_env())


def memory_plan(p, machine: Machine | None = None) -> list[Plan]:
    """Bytes per GPU and host for loading the model and one HARI step (nothing loaded)."""
    return [hari_plans.memory_plan(configure(p), machine)]


def disk_plan(p, run_dir: Path, free: float | None = None) -> DiskPlan:
    """What the run writes into ``run_dir`` and the prefix cache's folder, against the free space."""
    return hari_plans.disk_plan(replace(configure(p), run_dir=Path(run_dir)), free)


def time_plan(
    config: hari_run.HariRun,
    machine: Machine | None = None,
    tokens: tuple[int, str] | None = None,
    nodes: int | None = None,
) -> TimePlan:
    """The run's time plan on ``nodes`` (default: the Slurm job's, one outside a job)."""
    from ..cluster.slurm import job_nodes

    return hari_plans.time_plan(config, machine, nodes or job_nodes(), tokens)


def check_time(plan: TimePlan) -> TimePlan:
    """Stop now (TimeRefused, with the estimate) when the Slurm job's time left cannot cover what no later
    job could resume; outside Slurm, or without a time limit, nothing is checked."""
    from ..cluster.slurm import remaining_seconds

    return plan.check(remaining_seconds())


def run(p) -> dict[str, Any]:
    """The whole run (``python -m dsr1kit train``, notebook 40's points): run_info, as written."""
    config = configure(p)
    return hari_run.run(config, hari_plans.memory_plan(config))


def prefix_only(p) -> dict[str, Any]:
    return hari_run.prefix_only(configure(p))


def check_prefix_cache(p) -> dict[str, Any]:
    return hari_run.check_prefix_cache(configure(p))


def close() -> None:
    """Leave the process group (before finish() may fail the run, so no rank waits on it)."""
    dist.shutdown()


@dataclass
class TrainingRun:
    """What the verdict reads: the loop's result, the prepared model, the outputs written, the metric lines."""

    result: TrainResult
    prep: hari_run.Prepared
    outputs: dict[str, Any]
    history: list[dict[str, Any]]


def _headline(history: list[dict[str, Any]]) -> str:
    first, last = history[0], history[-1]
    return (
        f"loss {first['loss']:.4f} → {last['loss']:.4f} (CE {first['ce']:.4f} → "
        f"{last['ce']:.4f}, KL {last['kl']:.2e} at the end)"
    )


def _speed_lines(prep: hari_run.Prepared, history: list[dict[str, Any]]) -> list[str]:
    lines = []
    if history:
        rates = [row["tokens_per_s"] for row in history if row.get("tokens_per_s")]
        where = "from the prefix cache" if prep.prefix else "whole model"
        mean = sum(rates) / max(len(rates), 1)
        lines.append(
            f"training throughput ({where}): {mean:,.0f} tokens/s per rank × {prep.info.world_size} rank(s)"
        )
    if prep.prefix:
        passes = prep.prefix.passes
        pass_rate = sum(r["tokens_built"] for r in passes) / max(sum(r["seconds"] for r in passes), 1e-9)
        rate = f"; prefix pass {pass_rate:,.0f} tokens/s per task" if passes else ""
        hit = "built now" if prep.prefix.built_here and prep.prefix.built_here["shards_built"] else "reused"
        lines.append(f"prefix cache {hit}: {prep.prefix.cache.directory}{rate}")
    return lines


def verdict(run: TrainingRun) -> Verdict:
    """ok when every step ran, every adapted module's lora_B is non-zero and the adapter was written."""
    result, outputs = run.result, run.outputs
    norms = lora_b_norms(run.prep.model)
    steps_line = f"steps done: {result.steps_done} of {result.total_steps}" + (
        f" (resumed from step {result.resumed_from})" if result.resumed_from else ""
    )
    headline = _headline(run.history) if run.history else steps_line
    lines = [steps_line] if run.history else []
    lines += [f"‖lora_B‖ {m}: {v:.3e}" for m, v in norms.items()]
    lines += _speed_lines(run.prep, run.history)
    zero = [m for m, v in norms.items() if v == 0.0]
    if result.preempted:
        status, more = WARN, "preempted: checkpoint saved; requeue the job (same run folder) to resume"
    elif not outputs.get("ranks_agree", True):
        status, more = FAIL, f"ranks ended with different adapters: {outputs.get('rank_digests')}"
    elif zero:
        status, more = FAIL, f"lora_B is still zero in {zero}: nothing was learned there (raise lr or steps)"
    else:
        status = OK if result.steps_done == result.total_steps else FAIL
        more = f"adapter: {outputs.get('adapter_dir')}"
    return Verdict(status, headline, [*lines, more], TrainingFailed)
