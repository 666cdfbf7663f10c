"""Notebook 40, the forgetting sweep: HARI on task B for every (λ, seed), each run measured on A and B.

The parameters become one ``measure.sweep_run.SweepConfig``: each point's notebook 20 parameters (the
sweep's shared ``hari`` settings, then its λ and seed, and a baseline's own) walked into its ``HariRun`` by
``steps.hari_configs``, and the serving base's notebook 10 parameters into ``BaseServing`` by
``steps.serve_configs``. The pipeline (``measure.sweep_run``: train, measure, read back) does the rest; a
point with a result is never redone, so a rerun or a Slurm job array (``slurm/forgetting_sweep.sh``) does
only what is missing. ``python -m dsr1kit sweep-point`` runs one point (a job array task) or counts them.

The same sweep compares HARI with cheaper ways to forget less (``baselines``): a smaller adapter, and replay
of the base's own answers mixed into B at ``replay_ratio``, both at λ = 0 with B's steps budget; with
snapshots, plain SFT stopped early is traced as a curve (``measure.frontier``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..measure import frontier
from ..measure.figures import comparison_figure, frontier_figure, kl_figure  # noqa: F401 (the notebook's calls)
from ..measure.frontier import cost_table, matched_table  # noqa: F401
from ..measure.sweep import PointResult, lambda_table, results_table, summary, sweep_verdict  # noqa: F401
from ..measure.sweep_run import Point, ReplayConfig, SweepConfig, lambda_points, mix_path  # noqa: F401
from . import StepFailed, Verdict
from .hari_configs import hari_run


class SweepFailed(StepFailed):
    """A sweep point failed, or the results cannot show anything (no λ = 0, no λ > 0)."""


def points(p) -> list[Point]:
    """Every (λ, seed), λ-major, then each baseline's seeds; the index is the Slurm array task id."""
    runs = [("lambda", lam, s) for lam in p.lambdas for s in p.seeds]
    runs += [(family, 0.0, s) for family in p.baselines for s in p.seeds]
    return [Point(i, lam, seed, family) for i, (family, lam, seed) in enumerate(runs)]


def compares_methods(p) -> bool:
    """Does the sweep put other methods (baselines, or runs traced by snapshots) beside HARI's λ points?"""
    return bool(p.baselines) or p.snapshot_every > 0 or bool(p.snapshot_steps)


def b_training(p) -> tuple[Any, list[dict]]:
    """Notebook 20's parameters of a run on B alone, and B's training rows as that run reads them."""
    from ..data.plan import load_rows
    from ..params import load

    hp = load("20_hari_training", overrides={**p.hari, "dataset": p.task_b_train})
    return hp, load_rows(p.task_b_train, sample_limit=hp.sample_limit or None).rows


def b_steps(p, b_run: tuple[Any, list[dict]] | None = None) -> int:
    """Optimizer steps of a run on B alone (one rank): the replay runs train as many, on more rows."""
    from ..train.loop import schedule
    from .hari_configs import train_config

    hp, rows = b_run or b_training(p)
    return hp.max_steps or schedule(len(rows), train_config(hp), 1)[1]


def point_params(p, point: Point, run_dir: str | Path, b_run: tuple[Any, list[dict]] | None = None):
    """Notebook 20's parameters for one point: the sweep's shared settings, then this λ and seed (and the
    baseline's own: its smaller LoRA, or every row of the B + replay mix at B's steps budget)."""
    from ..params import load

    overrides = {
        **p.hari,
        "model": p.model,
        "dataset": p.task_b_train,
        "system_prompt": p.system_prompt,
        "max_len": p.max_len,
        "lambda_kl": point.lambda_kl,
        "seed": point.seed,
        "run_dir": str(Path(run_dir) / "points" / point.name),
        "snapshot_every": p.snapshot_every,
        "snapshot_steps": p.snapshot_steps,
    }
    if point.family == "small_adapter":
        overrides.update(p.small_adapter)
    if point.family == "replay":
        mix = mix_path(run_dir, p.replay_ratio)
        overrides.update(dataset=str(mix), sample_limit=0, max_steps=b_steps(p, b_run))
    return load("20_hari_training", overrides=overrides)


def serve_params(p, run_dir: str | Path):
    """Notebook 10's parameters of the server that measures the sweep (``serve``, then the sweep's model)."""
    from ..params import load

    overrides = {**p.serve, "model": p.model, "system_prompt": p.system_prompt, "host": p.serve_host}
    return load("10_vllm_inference", overrides={**overrides, "run_dir": str(run_dir)})


def configure(p, run_dir: str | Path | None = None) -> SweepConfig:
    """Every config of the sweep in ``run_dir`` (default: the parameters')."""
    from .serve_configs import base_serving

    run_dir = Path(run_dir or p.run_dir)
    b_run = b_training(p)
    pts = points(p)
    ip = serve_params(p, run_dir)
    replay = None
    if "replay" in p.baselines:
        replay = ReplayConfig(
            p.replay_prompts, p.replay_ratio, p.replay_limit, p.replay_max_new_tokens, tuple(b_run[1])
        )
    return SweepConfig(
        run_dir=run_dir,
        model=p.model,
        system_prompt=p.system_prompt,
        max_len=p.max_len,
        task_a_eval=p.task_a_eval,
        task_b_eval=p.task_b_eval,
        eval_limit=p.eval_limit,
        kl_span=p.kl_span,
        measure_with=p.measure_with,
        points=tuple(pts),
        runs=tuple(hari_run(point_params(p, pt, run_dir, b_run)) for pt in pts),
        replay=replay,
        serving=base_serving(ip),
        serve_as_lora=ip.adapter_mode == "lora",
    )


@dataclass
class SweepOutcome:
    """What the sweep measured: every point, and the methods at matched B gains (None: nothing compared)."""

    results: list[PointResult]
    levels: list[frontier.MatchedGain] | None


def outcome(p, results: list[PointResult]) -> SweepOutcome:
    levels = frontier.matched_gains(results, p.match_fractions) if compares_methods(p) else None
    return SweepOutcome(results, levels)


def verdict(result: SweepOutcome | list[PointResult]) -> Verdict:
    """The λ sweep's verdict (``measure.sweep.sweep_verdict``; no λ = 0 or no λ > 0 fails the run); when the
    sweep compares methods, the comparison's verdict decides and the λ sweep's follows."""
    if not isinstance(result, SweepOutcome):
        result = SweepOutcome(result, None)
    lam = sweep_verdict(lambda_points(result.results))
    if result.levels is None:
        return Verdict(lam.status, lam.headline, lam.lines, SweepFailed)
    cmp = frontier.comparison_verdict(result.levels)  # a λ sweep without λ = 0 still compares
    return Verdict(
        cmp.status, cmp.headline, [*cmp.lines, f"λ sweep: {lam.headline}", *lam.lines], SweepFailed
    )


def comparison_summary(result: SweepOutcome) -> dict:
    """What summary.json keeps of the comparison (empty when the sweep compares nothing)."""
    if result.levels is None:
        return {}
    return {"comparison": frontier.comparison_summary(result.results, result.levels)}
