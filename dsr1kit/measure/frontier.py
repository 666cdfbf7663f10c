"""Methods on one learning–forgetting frontier: at the same gain on B, which keeps the most of A?

A method's points of one seed (every λ > 0 for HARI, every snapshot along training, and the base model
itself at no gain) give that seed's frontier: the points no other point beats on both B gain and A
accuracy, joined by straight lines. The A a method keeps at a matched B gain is read off each seed's
frontier, and a method whose frontier stops short of that gain in some seed has not reached it. The
verdict at each matched gain names the method that keeps the most A by more than the two seed spreads
(sample stds) added together, or says there is no difference; it can say that HARI loses.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..run.verdict import FAIL, OK, WARN, Verdict
from .sweep import PointResult, mean_std

METHODS = ("hari", "sft", "replay", "small_adapter")
LABELS = {
    "hari": "HARI (λ > 0)",
    "sft": "plain SFT, early-stopped",
    "replay": "SFT + replay of base answers",
    "small_adapter": "smaller adapter",
}

Frontier = list[tuple[float, float]]  # (B gain, A accuracy), gain ascending, A descending


def label(method: str) -> str:
    return LABELS.get(method, method)


def pareto(points: Iterable[tuple[float, float]]) -> Frontier:
    """The points no other point beats on both coordinates (gain, A), by gain ascending."""
    out: Frontier = []
    best_a = float("-inf")
    for gain, acc in sorted(set(points), key=lambda pt: (-pt[0], -pt[1])):
        if acc > best_a:
            out.append((gain, acc))
            best_a = acc
    return out[::-1]


def a_kept_at(frontier: Frontier, gain: float) -> float | None:
    """A accuracy on the frontier at B gain ``gain``: linear between its points; the first point's A below
    it (that point learns at least as much); None past its largest gain (not reached)."""
    if not frontier or gain > frontier[-1][0] + 1e-12:
        return None
    if gain <= frontier[0][0]:
        return frontier[0][1]
    for (g0, a0), (g1, a1) in zip(frontier, frontier[1:]):
        if g0 <= gain <= g1:
            return a0 + (a1 - a0) * (gain - g0) / (g1 - g0)
    return frontier[-1][1]


def method_of(result: PointResult) -> str:
    return result.method if result.method != "hari" or result.lambda_kl > 0 else "sft"


def seed_frontiers(results: list[PointResult]) -> dict[str, dict[int, Frontier]]:
    """Per method and seed, the frontier of its points with the base (0 gain, base A) among them."""
    points: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for r in results:
        per_seed = points.setdefault(method_of(r), {})
        per_seed.setdefault(r.seed, [(0.0, r.base_acc_a)]).append((r.b_gain, r.acc_a))
    return {m: {s: pareto(pts) for s, pts in sorted(by_seed.items())} for m, by_seed in points.items()}


@dataclass
class AtGain:
    """One method at one matched B gain: the A it keeps in each seed that reached the gain."""

    method: str
    values: list[float]
    seeds: int  # seeds the method has
    mean: float
    std: float

    @property
    def reached_by_all(self) -> bool:
        return len(self.values) == self.seeds


@dataclass
class MatchedGain:
    """The methods at one B gain, and which keeps the most A (outcome: a method, "none", or "unreached")."""

    gain: float
    fraction: float  # of the reference gain
    methods: list[AtGain]
    outcome: str
    text: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def reference_gain(frontiers: dict[str, dict[int, Frontier]]) -> float:
    """The largest B gain any method reaches on average over its seeds: matched gains are fractions of it."""
    return max(
        (statistics.fmean(f[-1][0] for f in by_seed.values()) for by_seed in frontiers.values()), default=0.0
    )


def judge(methods: list[AtGain]) -> tuple[str, str]:
    """(outcome, sentence): the method that keeps the most A by more than its and the runner-up's seed
    spreads together, "none" when the best two are within them, "unreached" when no method reaches."""
    full = sorted((m for m in methods if m.reached_by_all), key=lambda m: -m.mean)
    short = [label(m.method) for m in methods if not m.reached_by_all]
    tail = f"; {', '.join(short)} did not reach it in every seed" if short else ""
    if not full:
        return "unreached", "no method reaches this B gain in every seed"
    best = full[0]
    if len(full) == 1:
        return best.method, f"only {label(best.method)} reaches it (A {best.mean:.3f} ± {best.std:.3f}){tail}"
    runner = full[1]
    spread = best.std + runner.std
    lead = best.mean - runner.mean
    if lead > spread:
        return best.method, (
            f"{label(best.method)} keeps the most A: {best.mean:.3f} ± {best.std:.3f} vs "
            f"{label(runner.method)} {runner.mean:.3f} ± {runner.std:.3f} (lead {lead:.3f} > spread {spread:.3f})"
            f"{tail}"
        )
    return "none", (
        f"no difference: {label(best.method)} {best.mean:.3f} ± {best.std:.3f} and {label(runner.method)} "
        f"{runner.mean:.3f} ± {runner.std:.3f} are within the seed spread ({lead:.3f} ≤ {spread:.3f}){tail}"
    )


def versus_hari(level: MatchedGain, other: AtGain) -> str:
    """HARI against one other method at this gain: the A it keeps more (or less), and whether that is more
    than the two seed spreads together."""
    hari = next((m for m in level.methods if m.method == "hari"), None)
    if hari is None or other.method == "hari":
        return ""
    if not (hari.reached_by_all and other.reached_by_all):
        short = [label(m.method) for m in (hari, other) if not m.reached_by_all]
        return f"{' and '.join(short)} not reached in every seed"
    lead, spread = hari.mean - other.mean, hari.std + other.std
    word = "HARI keeps more" if lead > spread else "HARI keeps less" if -lead > spread else "no difference"
    return f"{word} ({lead:+.3f}, spread {spread:.3f})"


def matched_gains(results: list[PointResult], fractions: Iterable[float]) -> list[MatchedGain]:
    """Every method's A kept at each fraction of the reference gain, mean and seed spread, and who wins."""
    frontiers = seed_frontiers(results)
    ref = reference_gain(frontiers)
    out = []
    for fraction in fractions:
        gain = fraction * ref
        methods = []
        for method in [m for m in METHODS if m in frontiers] + sorted(set(frontiers) - set(METHODS)):
            by_seed = frontiers[method]
            values = [a for a in (a_kept_at(f, gain) for f in by_seed.values()) if a is not None]
            methods.append(AtGain(method, values, len(by_seed), *mean_std(values)))
        outcome, text = judge(methods)
        out.append(MatchedGain(gain, fraction, methods, outcome, text))
    return out


def comparison_verdict(levels: list[MatchedGain]) -> Verdict:
    """HARI against the cheaper methods over the matched gains: better, worse, or no different, as measured."""
    if not levels:
        return Verdict(FAIL, "no matched B gains to compare at")
    methods = {m.method for lv in levels for m in lv.methods}
    if "hari" not in methods or len(methods) < 2:
        return Verdict(
            FAIL,
            "the comparison needs HARI (some λ > 0) and at least one other method",
            [f"methods present: {', '.join(sorted(methods)) or 'none'}"],
        )
    if levels[0].gain <= 0:  # the reference gain is not positive: nothing was learned to match at (a warning:
        # every point is measured and reported; the sweep is not broken, its runs learned nothing)
        return Verdict(
            WARN,
            "no method gained on B (the largest mean B gain is not above 0): there is no learning to match "
            "forgetting at; train longer, or check task B's data and its evaluation",
            [f"B gain {lv.gain:.3f} ({lv.fraction:.0%} of the reference)" for lv in levels],
        )
    lines = []
    for lv in levels:
        lines.append(f"B gain {lv.gain:.3f} ({lv.fraction:.0%} of the reference): {lv.text}")
        lines += [
            f"  HARI vs {label(m.method)}: {versus_hari(lv, m)}" for m in lv.methods if m.method != "hari"
        ]
    wins = [lv for lv in levels if lv.outcome == "hari"]
    losses = [lv for lv in levels if lv.outcome not in ("hari", "none", "unreached")]
    ties = [lv for lv in levels if lv.outcome == "none"]
    single = sorted({m.method for lv in levels for m in lv.methods if m.seeds < 2})
    if single:
        lines.append(f"one seed only for {', '.join(single)}: the seed spread is unknown there")
    counts = f"HARI keeps the most A at {len(wins)} of {len(levels)} matched B gains, another method at " + (
        f"{len(losses)}, no difference at {len(ties)}"
    )
    if losses and not wins:
        beaten_by = sorted({label(lv.outcome) for lv in losses})
        headline = f"HARI loses: {', '.join(beaten_by)} keeps more A at the same B gain ({counts})"
    elif wins and not losses:
        headline = f"HARI wins: it keeps more A than every cheaper method at the same B gain ({counts})"
    elif wins and losses:
        headline = f"mixed: {counts}"
    else:
        headline = f"no difference beyond the seed spread ({counts})"
    status = OK if (wins and not losses and not single) else WARN
    return Verdict(status, headline, lines)


@dataclass
class MethodCost:
    """What a method's runs cost to the end of training, mean over its runs."""

    method: str
    runs: int
    tokens: float
    train_s: float
    peak_memory_gib: float
    per_run: list[dict[str, Any]] = field(default_factory=list)


def costs(results: list[PointResult]) -> list[MethodCost]:
    """Per method, the mean cost of its runs (their end points): tokens, seconds, peak memory."""
    out = []
    ends = [r for r in results if r.final]
    for method in [m for m in METHODS if any(method_of(r) == m for r in ends)]:
        runs = [r for r in ends if method_of(r) == method]
        out.append(
            MethodCost(
                method,
                len(runs),
                statistics.fmean(r.tokens for r in runs),
                statistics.fmean(r.train_s for r in runs),
                max(r.peak_memory_gib for r in runs),
                [
                    {"lambda_kl": r.lambda_kl, "seed": r.seed, "tokens": r.tokens, "train_s": r.train_s}
                    for r in runs
                ],
            )
        )
    return out


def matched_table(levels: list[MatchedGain]) -> list[dict[str, Any]]:
    """One row per matched gain and method: A kept, mean ± seed spread, seeds that reached it."""
    return [
        {
            "B gain": round(lv.gain, 3),
            "method": label(m.method),
            "A kept": f"{m.mean:.3f} ± {m.std:.3f}" if m.values else "not reached",
            "seeds reached": f"{len(m.values)}/{m.seeds}",
            "HARI against it": versus_hari(lv, m),
            "winner": label(lv.outcome) if lv.outcome not in ("none", "unreached") else lv.outcome,
        }
        for lv in levels
        for m in lv.methods
    ]


def cost_table(results: list[PointResult]) -> list[dict[str, Any]]:
    per_method = costs(results)
    sft = next((c for c in per_method if c.method == "sft"), None)
    return [
        {
            "method": label(c.method),
            "runs": c.runs,
            "tokens per run": int(c.tokens),
            "train s per run": round(c.train_s, 1),
            "× plain SFT time": round(c.train_s / sft.train_s, 2) if sft and sft.train_s else None,
            "peak memory GiB": round(c.peak_memory_gib, 2),
        }
        for c in per_method
    ]


def comparison_summary(results: list[PointResult], levels: list[MatchedGain]) -> dict[str, Any]:
    """What comparison.json keeps: the matched gains, the costs and the verdict (all recomputable)."""
    verdict = comparison_verdict(levels)
    return {
        "matched_gains": [lv.to_dict() for lv in levels],
        "costs": [asdict(c) for c in costs(results)],
        "verdict": verdict.to_dict(),
    }
