"""Notebook 40, the forgetting sweep: HARI on task B for every (λ, seed), each run measured on A and B.

A point is one HARI run (notebook 20's steps, with the sweep's λ and seed) in
``<run>/points/lambda<λ>-seed<s>/`` followed by its measurement
(``dsr1kit.measure.point``), written to ``result.json`` there. A point with a
result is never redone, so a rerun or a Slurm job array
(``slurm/forgetting_sweep.sh`` submits one point per task of a job array,
then this notebook once to report) does only what is missing. The base
model's accuracies are measured once (``base.json``) and shared by every
point. With ``hari: {prefix_cache: auto}`` every point trains from one prefix
cache (λ and seed are not part of its fingerprint); under a job array, fill
it first (``python -m dsr1kit train --prefix-only`` with the same settings)
so that the array's tasks do not all build it at once. ``python -m dsr1kit sweep-point`` runs one
point (a job array task) or counts them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..measure import point as measure
from ..measure.figures import frontier_figure, kl_figure  # noqa: F401 (the notebook's calls)
from ..measure.sweep import PointResult, lambda_table, results_table, summary, sweep_verdict  # noqa: F401
from . import StepFailed, Verdict


class SweepFailed(StepFailed):
    """A sweep point failed, or the results cannot show anything (no λ = 0, no λ > 0)."""


@dataclass(frozen=True)
class Point:
    index: int
    lambda_kl: float
    seed: int

    @property
    def name(self) -> str:
        return f"lambda{self.lambda_kl:g}-seed{self.seed}"


def points(p) -> list[Point]:
    """Every (λ, seed), λ-major; the index is the Slurm array task id."""
    pairs = ((lam, s) for lam in p.lambdas for s in p.seeds)
    return [Point(i, lam, seed) for i, (lam, seed) in enumerate(pairs)]


def point_dir(run_dir: str | Path, point: Point) -> Path:
    return Path(run_dir) / "points" / point.name


def point_params(p, point: Point, run_dir: str | Path):
    """Notebook 20's parameters for one point: the sweep's shared settings, then this λ and seed."""
    from ..params import load

    return load(
        "20_hari_training",
        overrides={
            **p.hari,
            "model": p.model,
            "dataset": p.task_b_train,
            "system_prompt": p.system_prompt,
            "max_len": p.max_len,
            "lambda_kl": point.lambda_kl,
            "seed": point.seed,
            "run_dir": str(point_dir(run_dir, point)),
        },
    )


def eval_rows(p) -> tuple[list[dict], list[dict]]:
    from ..data.plan import load_rows

    return (
        load_rows(p.task_a_eval, sample_limit=p.eval_limit).rows,
        load_rows(p.task_b_eval, sample_limit=p.eval_limit).rows,
    )


def plan_table(p, run_dir: str | Path) -> list[dict[str, Any]]:
    return [
        {
            "point": pt.index,
            "lambda_kl": pt.lambda_kl,
            "seed": pt.seed,
            "state": "done" if (point_dir(run_dir, pt) / "result.json").is_file() else "to run",
        }
        for pt in points(p)
    ]


def base_accuracy(p, run_dir: str | Path) -> tuple[float, float]:
    """The base model's accuracy on A and B, measured once per sweep (base.json)."""
    path = Path(run_dir) / "points" / "base.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        return saved["acc_a"], saved["acc_b"]
    rows_a, rows_b = eval_rows(p)
    acc = measure.base_accuracy(p.model, rows_a, rows_b, p.system_prompt, p.max_len)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".base.json.{os.getpid()}")  # array tasks may measure it at once: same numbers
    tmp.write_text(json.dumps({"acc_a": acc[0], "acc_b": acc[1], "n_a": len(rows_a), "n_b": len(rows_b)}))
    tmp.replace(path)
    return acc[0], acc[1]


def run_point(p, point: Point, run_dir: str | Path) -> PointResult:
    """Train (or resume) the point's adapter, then measure it; a point with a result.json is read back."""
    from .hari_training import run

    out = point_dir(run_dir, point) / "result.json"
    if out.is_file():
        return PointResult.from_dict(json.loads(out.read_text()))
    base = base_accuracy(p, run_dir)
    info = run(point_params(p, point, run_dir))
    if info.get("preempted") or not info.get("adapter_dir"):
        raise SweepFailed(
            f"point {point.name} stopped before its adapter was written (steps "
            f"{info.get('steps_done')} of {info.get('total_steps')}); rerun to resume it"
        )
    rows_a, rows_b = eval_rows(p)
    result = measure.evaluate_point(
        info["adapter_dir"],
        rows_a,
        rows_b,
        p.system_prompt,
        lambda_kl=point.lambda_kl,
        seed=point.seed,
        max_len=p.max_len,
        kl_span=p.kl_span,
        base_acc=base,
    )
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.to_dict(), indent=1))
    tmp.replace(out)
    return result


def run_missing(p, run_dir: str | Path) -> list[PointResult]:
    """Every point, in order; the ones already measured are read back (a job array may have done them)."""
    from tqdm.std import tqdm

    return [run_point(p, pt, run_dir) for pt in tqdm(points(p), desc="sweep points", mininterval=2)]


def verdict(results: list[PointResult]) -> Verdict:
    """The sweep's verdict (``measure.sweep.sweep_verdict``); no λ = 0 or no λ > 0 fails the run."""
    v = sweep_verdict(results)
    return Verdict(v.status, v.headline, v.lines, SweepFailed)
