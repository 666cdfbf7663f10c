"""The λ sweep's analysis, pure: one point's numbers, their per-λ mean and seed spread, forgetting against KL,
and the verdict.

The verdict says "helps" only when the best λ > 0 beats λ = 0 by more than the seed spread, and says so
plainly when it does not or when λ = 0 forgets nothing.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..run.verdict import FAIL, OK, WARN, Verdict


@dataclass
class PointResult:
    """One adapter of the sweep, measured: accuracies on A and B (adapted and base) and KL to the base."""

    lambda_kl: float
    seed: int
    acc_a: float
    acc_b: float
    kl_a: float
    kl_b: float
    base_acc_a: float
    base_acc_b: float
    n_a: int = 0  # rows judged on A / on B
    n_b: int = 0
    adapter_dir: str = ""
    method: str = "hari"  # the point family (dsr1kit.measure.frontier.METHODS); λ = 0 runs are "sft"
    step: int = 0  # optimizer steps the adapter had trained; == total_steps (or 0, older results): the end
    total_steps: int = 0
    tokens: int = 0  # what the adapter cost to train up to `step`: tokens, seconds, peak memory (GiB)
    train_s: float = 0.0
    peak_memory_gib: float = 0.0

    @property
    def a_drop(self) -> float:
        """Forgetting: base accuracy on A minus adapted accuracy on A."""
        return self.base_acc_a - self.acc_a

    @property
    def final(self) -> bool:
        """The end of its training run (not a snapshot along it)."""
        return self.step == 0 or self.step >= self.total_steps

    @property
    def b_gain(self) -> float:
        """Learning: adapted accuracy on B minus base accuracy on B."""
        return self.acc_b - self.base_acc_b

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PointResult":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class LambdaSummary:
    """One λ over its seeds: mean and sample std (0 with one seed) of each quantity."""

    lambda_kl: float
    n: int
    seeds: list[int]
    b_gain_mean: float
    b_gain_std: float
    a_drop_mean: float
    a_drop_std: float
    kl_a_mean: float
    kl_a_std: float
    kl_b_mean: float
    kl_b_std: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation over seeds (0 for one seed, nan for none)."""
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def by_lambda(results: list[PointResult]) -> list[LambdaSummary]:
    """Group the points by λ (ascending). The same (λ, seed) twice is an error: it would count a run twice."""
    seen: set[tuple[float, int]] = set()
    groups: dict[float, list[PointResult]] = {}
    for r in results:
        key = (float(r.lambda_kl), int(r.seed))
        if key in seen:
            raise ValueError(f"λ={r.lambda_kl:g}, seed {r.seed} appears twice in the results")
        seen.add(key)
        groups.setdefault(key[0], []).append(r)
    out = []
    for lam in sorted(groups):
        g = groups[lam]
        stats = [
            mean_std(vals)
            for vals in (
                [r.b_gain for r in g],
                [r.a_drop for r in g],
                [r.kl_a for r in g],
                [r.kl_b for r in g],
            )
        ]
        flat = [x for pair in stats for x in pair]
        out.append(LambdaSummary(lam, len(g), sorted(r.seed for r in g), *flat))
    return out


@dataclass
class LineFit:
    slope: float
    intercept: float
    r2: float
    note: str = ""  # why a value is NaN, "" when all are defined


def fit_line(xs: list[float], ys: list[float]) -> LineFit:
    """Least-squares y = slope·x + intercept, R² = 1 − SS_res/SS_tot.

    Never raises on degenerate data: fewer than two points or all x equal give a NaN slope; all y
    equal (SS_tot = 0) gives R² = NaN (nothing to explain). ``note`` says which.
    """
    if len(xs) != len(ys):
        raise ValueError(f"fit_line needs as many x as y ({len(xs)} vs {len(ys)})")
    n = len(xs)
    if n < 2:
        return LineFit(math.nan, math.nan if n == 0 else float(ys[0]), math.nan, f"{n} point(s): no line")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    ss_tot = sum((y - my) ** 2 for y in ys)
    if sxx == 0:
        return LineFit(math.nan, my, math.nan, "all x are equal: the slope is undefined")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    if ss_tot == 0:
        return LineFit(slope, intercept, math.nan, "all y are equal: R² is undefined")
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys))
    return LineFit(slope, intercept, 1.0 - ss_res / ss_tot)


def _pm(mean: float, std: float) -> str:
    return f"{mean:.3f} ± {std:.3f}"


def sweep_verdict(results: list[PointResult]) -> Verdict:
    """Does λ > 0 forget less of A than λ = 0, beyond the seed spread, and what did it cost on B?

    "Helps" when some λ > 0 has a mean A drop below λ = 0's by more than the two seed stds added
    together, while its B gain is not below λ = 0's by more than those two stds (of the gain). Less
    forgetting bought with clearly less learning is reported as a trade-off, not as help: stopping
    plain SFT earlier might buy the same (the sweep does not measure that). A λ = 0 that forgets
    nothing (mean A drop not above its seed std) leaves nothing to prevent: the sweep then says
    nothing about HARI.
    """
    if not results:
        return Verdict(FAIL, "no sweep results to judge")
    groups = by_lambda(results)
    zero = next((g for g in groups if g.lambda_kl == 0), None)
    others = [g for g in groups if g.lambda_kl > 0]
    if zero is None or not others:
        missing = "λ = 0 (plain LoRA, the baseline)" if zero is None else "any λ > 0"
        return Verdict(
            FAIL,
            f"the sweep has no run with {missing}: nothing to compare",
            [f"λ values present: {', '.join(f'{g.lambda_kl:g}' for g in groups)}"],
        )

    def reduction(g):
        return zero.a_drop_mean - g.a_drop_mean

    def cost(g):
        return zero.b_gain_mean - g.b_gain_mean

    def clear_cut(g):
        return reduction(g) > zero.a_drop_std + g.a_drop_std

    def affordable(g):
        return cost(g) <= zero.b_gain_std + g.b_gain_std

    helping = [g for g in others if clear_cut(g) and affordable(g)]
    best = (
        max(helping, key=reduction) if helping else min(others, key=lambda g: (g.a_drop_mean, -g.b_gain_mean))
    )
    lines = [
        f"λ = 0: A drop {_pm(zero.a_drop_mean, zero.a_drop_std)}, B gain "
        f"{_pm(zero.b_gain_mean, zero.b_gain_std)}, KL on A {zero.kl_a_mean:.4g} ({zero.n} seed(s))",
        f"{'best' if helping else 'least forgetting'} λ > 0 = {best.lambda_kl:g}: A drop "
        f"{_pm(best.a_drop_mean, best.a_drop_std)}, B gain {_pm(best.b_gain_mean, best.b_gain_std)}, "
        f"KL on A {best.kl_a_mean:.4g} ({best.n} seed(s))",
    ]
    if zero.b_gain_mean <= 0:
        lines.append(
            f"λ = 0 did not learn B (gain {zero.b_gain_mean:.3f}): the fine-tuning itself is not working"
        )
    if zero.a_drop_mean <= zero.a_drop_std:
        return Verdict(
            WARN,
            f"no forgetting at λ = 0 (A drop {_pm(zero.a_drop_mean, zero.a_drop_std)}): "
            "the sweep says nothing about whether HARI's KL term limits forgetting",
            lines,
        )
    spread = zero.a_drop_std + best.a_drop_std
    b_spread = zero.b_gain_std + best.b_gain_std
    cost_text = f"B gain {best.b_gain_mean:.3f} vs {zero.b_gain_mean:.3f} at λ = 0 " + (
        f"(costs {cost(best):.3f} on B)" if cost(best) > 0 else f"(no cost on B: {-cost(best):.3f} better)"
    )
    if helping:
        single = [f"{g.lambda_kl:g}" for g in (zero, best) if g.n < 2]
        status = OK
        if single:
            status = WARN
            lines.append(
                f"only one seed at λ = {' and '.join(single)}: the seed spread is unknown, "
                "so the difference is not confirmed"
            )
        return Verdict(
            status,
            f"HARI helps: λ = {best.lambda_kl:g} cuts the A drop from {zero.a_drop_mean:.3f} "
            f"to {best.a_drop_mean:.3f} (by {reduction(best):.3f}, more than the seed spread "
            f"{spread:.3f}); {cost_text}",
            lines,
        )
    lines.append(cost_text)
    if clear_cut(best):
        return Verdict(
            WARN,
            f"a trade-off, not a free gain: λ = {best.lambda_kl:g} cuts the A drop from "
            f"{zero.a_drop_mean:.3f} to {best.a_drop_mean:.3f} but learns less B "
            f"({best.b_gain_mean:.3f} vs {zero.b_gain_mean:.3f}, a cost of {cost(best):.3f}, more "
            f"than the seed spread {b_spread:.3f}); no λ > 0 forgets less at λ = 0's learning",
            lines,
        )
    return Verdict(
        WARN,
        f"the KL term does NOT help: the best λ = {best.lambda_kl:g} changes the A drop by "
        f"{-reduction(best):+.3f} ({zero.a_drop_mean:.3f} → {best.a_drop_mean:.3f}), not more than "
        f"the seed spread {spread:.3f}",
        lines,
    )


def results_table(results: list[PointResult]) -> list[dict[str, Any]]:
    """One row per point, rounded for the notebook's table."""
    return [
        {
            "method": r.method,
            "lambda_kl": r.lambda_kl,
            "seed": r.seed,
            "step": f"{r.step}/{r.total_steps}" if r.total_steps else "end",
            "acc_b": round(r.acc_b, 4),
            "b_gain": round(r.b_gain, 4),
            "acc_a": round(r.acc_a, 4),
            "a_drop": round(r.a_drop, 4),
            "kl_a": r.kl_a,
            "kl_b": r.kl_b,
        }
        for r in results
    ]


def lambda_table(results: list[PointResult]) -> list[dict[str, Any]]:
    """One row per λ: mean ± seed std of the B gain and the A drop, mean KL on A and B."""
    return [
        {
            "lambda_kl": s.lambda_kl,
            "runs": s.n,
            "B gain": f"{s.b_gain_mean:+.3f} ± {s.b_gain_std:.3f}",
            "A drop": f"{s.a_drop_mean:+.3f} ± {s.a_drop_std:.3f}",
            "KL on A": f"{s.kl_a_mean:.2e}",
            "KL on B": f"{s.kl_b_mean:.2e}",
        }
        for s in by_lambda(results)
    ]


def summary(results: list[PointResult]) -> dict[str, Any]:
    """What summary.json keeps: every point and the per-λ means (recomputable from each result.json)."""
    fit = fit_line([r.kl_a for r in results], [r.a_drop for r in results])
    return {
        "points": [r.to_dict() for r in results],
        "by_lambda": [s.to_dict() for s in by_lambda(results)],
        "forgetting_vs_kl": {"slope": fit.slope, "intercept": fit.intercept, "r2": fit.r2},
    }
