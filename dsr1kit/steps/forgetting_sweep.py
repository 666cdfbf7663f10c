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

The same sweep compares HARI with cheaper ways to forget less (``baselines``): a smaller adapter, and
replay of the base's own answers (made once, ``replay/``) mixed into B at ``replay_ratio``, both at λ = 0
with B's steps budget. With ``snapshot_every`` (or ``snapshot_steps``) every run also keeps its adapter
along training and each snapshot is measured as a point (``snapshots/step-N/result.json``), so plain SFT
stopped early is traced as a curve; ``dsr1kit.measure.frontier`` reads every method's A kept at matched B gains.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..measure import frontier
from ..measure import point as measure
from ..measure.figures import comparison_figure, frontier_figure, kl_figure  # noqa: F401 (the notebook's calls)
from ..measure.frontier import cost_table, matched_table  # noqa: F401
from ..measure.sweep import PointResult, lambda_table, results_table, summary, sweep_verdict  # noqa: F401
from . import StepFailed, Verdict

FAMILY_METHOD = {"lambda": "hari", "replay": "replay", "small_adapter": "small_adapter"}


class SweepFailed(StepFailed):
    """A sweep point failed, or the results cannot show anything (no λ = 0, no λ > 0)."""


@dataclass(frozen=True)
class Point:
    """One training run of the sweep: a (λ, seed) of HARI, or a baseline's run for a seed (at λ = 0)."""

    index: int
    lambda_kl: float
    seed: int
    family: str = "lambda"  # lambda | replay | small_adapter

    @property
    def name(self) -> str:
        if self.family == "lambda":
            return f"lambda{self.lambda_kl:g}-seed{self.seed}"
        return f"{self.family}-seed{self.seed}"


def points(p) -> list[Point]:
    """Every (λ, seed), λ-major, then each baseline's seeds; the index is the Slurm array task id."""
    runs = [("lambda", lam, s) for lam in p.lambdas for s in p.seeds]
    runs += [(family, 0.0, s) for family in p.baselines for s in p.seeds]
    return [Point(i, lam, seed, family) for i, (family, lam, seed) in enumerate(runs)]


def compares_methods(p) -> bool:
    """Does the sweep put other methods (baselines, or runs traced by snapshots) beside HARI's λ points?"""
    return bool(p.baselines) or p.snapshot_every > 0 or bool(p.snapshot_steps)


def point_dir(run_dir: str | Path, point: Point) -> Path:
    return Path(run_dir) / "points" / point.name


def point_params(p, point: Point, run_dir: str | Path):
    """Notebook 20's parameters for one point: the sweep's shared settings, then this λ and seed (and the
    baseline's own: its smaller LoRA, or the B + replay mix at B's steps budget)."""
    from ..params import load

    overrides = {
        **p.hari,
        "model": p.model,
        "dataset": p.task_b_train,
        "system_prompt": p.system_prompt,
        "max_len": p.max_len,
        "lambda_kl": point.lambda_kl,
        "seed": point.seed,
        "run_dir": str(point_dir(run_dir, point)),
        "snapshot_every": p.snapshot_every,
        "snapshot_steps": p.snapshot_steps,
    }
    if point.family == "small_adapter":
        overrides.update(p.small_adapter)
    if point.family == "replay":
        rows = replay_mix(p, run_dir)
        overrides.update(dataset=str(mix_path(p, run_dir)), sample_limit=len(rows), max_steps=b_steps(p))
    return load("20_hari_training", overrides=overrides)


def mix_path(p, run_dir: str | Path) -> Path:
    return Path(run_dir) / "replay" / f"mix-ratio{p.replay_ratio:g}.jsonl"


def b_steps(p) -> int:
    """Optimizer steps of a run on B alone (one rank): the replay runs train as many, on more rows."""
    from ..params import load
    from ..train.loop import schedule
    from .hari_training import train_config

    hp = load("20_hari_training", overrides={**p.hari, "dataset": p.task_b_train})
    n = len(_b_rows(p, hp.sample_limit))
    return hp.max_steps or schedule(n, train_config(hp), 1)[1]


def _b_rows(p, sample_limit: int) -> list[dict]:
    from ..data.plan import load_rows

    return load_rows(p.task_b_train, sample_limit=sample_limit or None).rows


def base_fingerprint(model: str) -> str:
    """Name and digest of the base's files (``tiny`` resolves to its cached build; a hub id to its local
    snapshot when one is cached, else the id alone)."""
    from ..embedded.tiny import resolve_model
    from ..train.prefix.digest import model_digest

    path = resolve_model(model)
    if not Path(path).is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = snapshot_download(path, local_files_only=True)
        except Exception:
            return model
    return f"{model} {model_digest(path)}"


def replay_mix(p, run_dir: str | Path) -> list[dict]:
    """B's training rows mixed with the base's own answers on A-style prompts, written once per sweep."""
    from ..data import replay
    from ..model.load import load_model
    from ..params import load

    path = mix_path(p, run_dir)
    spec = replay.ReplaySpec(
        base=base_fingerprint(p.model),
        prompts=p.replay_prompts,
        held_out=(p.task_a_eval, p.task_b_eval),
        system_prompt=p.system_prompt,
        max_new_tokens=p.replay_max_new_tokens,
        limit=p.replay_limit,
    )

    def load_base():
        loaded = load_model(measure.on_cpu_fp32(p.model))
        return loaded.model, loaded.tokenizer

    answers = replay.replay_rows(path.parent, spec, load_base)
    hp = load("20_hari_training", overrides={**p.hari, "dataset": p.task_b_train})
    rows = replay.mix(_b_rows(p, hp.sample_limit), answers, p.replay_ratio)
    if not path.is_file():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)
    return rows


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
            "method": pt.family,
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


def _peak(memory: dict | float) -> float:
    return max(memory.values(), default=0.0) if isinstance(memory, dict) else float(memory or 0.0)


def _write(path: Path, result: PointResult) -> PointResult:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.to_dict(), indent=1))
    tmp.replace(path)
    return result


def run_point(p, point: Point, run_dir: str | Path) -> list[PointResult]:
    """Train (or resume) the point's run, then measure each snapshot along it and its adapter at the end:
    the results by step, the end's (``result.json``) last. Whatever was measured before is read back."""
    from ..train.checkpoint import snapshots
    from .hari_training import run

    folder = point_dir(run_dir, point)
    out = folder / "result.json"

    def measured() -> list[PointResult]:
        files = [snap / "result.json" for _, snap in snapshots(folder)] + [out]
        return [PointResult.from_dict(json.loads(f.read_text())) for f in files if f.is_file()]

    if out.is_file() and all((snap / "result.json").is_file() for _, snap in snapshots(folder)):
        return measured()
    base = base_accuracy(p, run_dir)
    info = run(point_params(p, point, run_dir))
    if info.get("preempted") or not info.get("adapter_dir"):
        raise SweepFailed(
            f"point {point.name} stopped before its adapter was written (steps "
            f"{info.get('steps_done')} of {info.get('total_steps')}); rerun to resume it"
        )
    rows_a, rows_b = eval_rows(p)
    method = FAMILY_METHOD[point.family]

    def evaluate(adapter_dir: Path, cost: dict) -> PointResult:
        result = measure.evaluate_point(
            adapter_dir,
            rows_a,
            rows_b,
            p.system_prompt,
            lambda_kl=point.lambda_kl,
            seed=point.seed,
            max_len=p.max_len,
            kl_span=p.kl_span,
            base_acc=base,
        )
        result.method = method
        result.step, result.total_steps = int(cost["step"]), int(cost["total_steps"])
        result.tokens, result.train_s = int(cost.get("tokens", 0)), float(cost.get("train_s", 0.0))
        result.peak_memory_gib = _peak(cost.get("peak_memory_gib", 0.0))
        return result

    for _, snap in snapshots(folder):
        if not (snap / "result.json").is_file():
            _write(snap / "result.json", evaluate(snap, json.loads((snap / "cost.json").read_text())))
    if not out.is_file():
        total = info["total_steps"]
        cost = {"step": total, "total_steps": total, "tokens": info.get("tokens", 0)}
        cost.update(train_s=info.get("train_s", 0.0), peak_memory_gib=info.get("peak_memory_gib", 0.0))
        _write(out, evaluate(Path(info["adapter_dir"]), cost))
    return measured()


def run_missing(p, run_dir: str | Path) -> list[PointResult]:
    """Every point, in order; the ones already measured are read back (a job array may have done them)."""
    from tqdm.std import tqdm

    return [
        r for pt in tqdm(points(p), desc="sweep points", mininterval=2) for r in run_point(p, pt, run_dir)
    ]


def lambda_points(results: list[PointResult]) -> list[PointResult]:
    """HARI's (λ, seed) points at the end of training: what the λ sweep's tables, figures and verdict read."""
    return [r for r in results if r.method == "hari" and r.final]


def matched(p, results: list[PointResult]) -> list[frontier.MatchedGain]:
    return frontier.matched_gains(results, p.match_fractions)


def verdict(results: list[PointResult], p=None) -> Verdict:
    """The λ sweep's verdict (``measure.sweep.sweep_verdict``; no λ = 0 or no λ > 0 fails the run); when the
    sweep compares methods (``compares_methods``), the comparison's verdict decides, the λ sweep's follows."""
    lam = sweep_verdict(lambda_points(results))
    if p is None or not compares_methods(p):
        return Verdict(lam.status, lam.headline, lam.lines, SweepFailed)
    cmp = frontier.comparison_verdict(matched(p, results))  # a λ sweep without λ = 0 still compares
    return Verdict(
        cmp.status, cmp.headline, [*cmp.lines, f"λ sweep: {lam.headline}", *lam.lines], SweepFailed
    )


def comparison_summary(p, results: list[PointResult]) -> dict:
    """What summary.json keeps of the comparison (empty when the sweep compares nothing)."""
    return (
        {"comparison": frontier.comparison_summary(results, matched(p, results))}
        if compares_methods(p)
        else {}
    )
