"""The method comparison's arithmetic on constructed frontiers: the Pareto frontier, A kept at a matched B
gain, and the verdict's three outcomes (HARI better, another method better, no difference)."""

from __future__ import annotations

import math

import pytest

from dsr1kit.measure.frontier import (
    a_kept_at,
    comparison_verdict,
    cost_table,
    matched_gains,
    method_of,
    pareto,
    seed_frontiers,
    versus_hari,
)
from dsr1kit.measure.sweep import PointResult

BASE_A, BASE_B = 0.9, 0.2


def point(
    method: str, seed: int, b_gain: float, acc_a: float, lam: float = 0.0, step: int = 10
) -> PointResult:
    return PointResult(
        lam, seed, acc_a, BASE_B + b_gain, 0.0, 0.0, BASE_A, BASE_B, method=method, step=step, total_steps=10
    )


def curve(method: str, lam: float, a_at_half: dict[int, float]) -> list[PointResult]:
    """Per seed, a trajectory from (0.2 gain, 0.85 A) through (0.4, a_at_half[seed]) to (0.6, 0.1 A)."""
    out = []
    for seed, mid in a_at_half.items():
        out += [
            point(method, seed, 0.2, 0.85, lam, step=3),
            point(method, seed, 0.4, mid, lam, step=6),
            point(method, seed, 0.6, 0.1, lam, step=10),
        ]
    return out


def test_pareto_keeps_only_points_no_other_beats_on_both_axes():
    pts = [(0.0, 0.9), (0.2, 0.5), (0.3, 0.6), (0.5, 0.1), (0.5, 0.2), (0.1, 0.95)]
    assert pareto(pts) == [(0.1, 0.95), (0.3, 0.6), (0.5, 0.2)]


def test_a_kept_is_interpolated_on_the_frontier_and_none_past_it():
    f = [(0.0, 0.9), (0.4, 0.5), (0.8, 0.1)]
    assert a_kept_at(f, 0.2) == pytest.approx(0.7)
    assert a_kept_at(f, 0.4) == pytest.approx(0.5)
    assert a_kept_at(f, 0.6) == pytest.approx(0.3)
    assert a_kept_at(f, -0.1) == pytest.approx(0.9)  # below the first point: it learns at least as much
    assert a_kept_at(f, 0.81) is None  # past the largest gain: not reached
    assert a_kept_at([], 0.1) is None


def test_lambda_zero_is_plain_sft_and_every_seed_frontier_starts_at_the_base():
    results = [point("hari", 0, 0.5, 0.2, lam=0.0), point("hari", 0, 0.4, 0.6, lam=0.9)]
    assert [method_of(r) for r in results] == ["sft", "hari"]
    frontiers = seed_frontiers(results)
    assert [x for pt in frontiers["sft"][0] for x in pt] == pytest.approx([0.0, BASE_A, 0.5, 0.2])
    assert [x for pt in frontiers["hari"][0] for x in pt] == pytest.approx([0.0, BASE_A, 0.4, 0.6])


def test_hari_better_when_it_keeps_more_a_beyond_the_seed_spreads():
    results = curve("hari", 0.9, {0: 0.70, 1: 0.72, 2: 0.71}) + curve("sft", 0.0, {0: 0.30, 1: 0.35, 2: 0.32})
    levels = matched_gains(results, [2 / 3])  # reference gain 0.6: matched at 0.4, the middle points
    assert levels[0].gain == pytest.approx(0.4)
    by = {m.method: m for m in levels[0].methods}
    assert by["hari"].mean == pytest.approx(0.71) and by["sft"].mean == pytest.approx(0.3233, abs=1e-3)
    assert levels[0].outcome == "hari"
    v = comparison_verdict(levels)
    assert v.status == "ok" and v.headline.startswith("HARI wins")


def test_another_method_better_says_hari_loses():
    results = curve("hari", 0.9, {0: 0.40, 1: 0.42, 2: 0.41}) + curve(
        "replay", 0.0, {0: 0.80, 1: 0.78, 2: 0.79}
    )
    levels = matched_gains(results, [2 / 3, 1.0])
    assert [lv.outcome for lv in levels] == ["replay", "none"]  # at 0.6 both end at A 0.1
    v = comparison_verdict(levels)
    assert v.status == "warn"
    assert v.headline.startswith("HARI loses: SFT + replay of base answers keeps more A")


def test_no_difference_within_the_seed_spread():
    results = curve("hari", 0.9, {0: 0.50, 1: 0.70, 2: 0.60}) + curve("sft", 0.0, {0: 0.45, 1: 0.65, 2: 0.55})
    levels = matched_gains(results, [2 / 3])
    assert levels[0].outcome == "none" and "no difference" in levels[0].text
    assert comparison_verdict(levels).headline.startswith("no difference beyond the seed spread")


def test_a_method_that_does_not_reach_the_gain_in_every_seed_is_not_ranked():
    results = curve("hari", 0.9, {0: 0.5, 1: 0.5}) + [
        point("small_adapter", 0, 0.5, 0.8),
        point("small_adapter", 1, 0.3, 0.85),  # this seed stops short of 0.4
    ]
    levels = matched_gains(results, [2 / 3])
    small = next(m for m in levels[0].methods if m.method == "small_adapter")
    assert len(small.values) == 1 and not small.reached_by_all
    assert levels[0].outcome == "hari" and "did not reach it in every seed" in levels[0].text


def test_the_verdict_needs_hari_and_another_method():
    levels = matched_gains(curve("sft", 0.0, {0: 0.3}), [0.5])
    assert comparison_verdict(levels).status == "fail"
    assert comparison_verdict([]).status == "fail"


def test_cost_table_counts_end_points_only_and_relates_time_to_plain_sft():
    results = [
        point("hari", 0, 0.5, 0.2, lam=0.0),
        point("hari", 0, 0.4, 0.6, lam=0.9),
        point("hari", 0, 0.3, 0.7, lam=0.9, step=5),  # a snapshot: not a run's cost
    ]
    results[0].train_s, results[1].train_s, results[2].train_s = 10.0, 15.0, 7.0
    rows = {r["method"]: r for r in cost_table(results)}
    assert rows["plain SFT, early-stopped"]["runs"] == 1 and rows["HARI (λ > 0)"]["runs"] == 1
    assert rows["HARI (λ > 0)"]["× plain SFT time"] == pytest.approx(1.5)
    assert not math.isnan(rows["HARI (λ > 0)"]["train s per run"])


def test_hari_is_set_against_each_method_at_each_gain():
    results = (
        curve("hari", 0.9, {0: 0.70, 1: 0.72, 2: 0.71})
        + curve("sft", 0.0, {0: 0.30, 1: 0.35, 2: 0.32})
        + curve("replay", 0.0, {0: 0.90, 1: 0.91, 2: 0.92})
        + curve("small_adapter", 0.0, {0: 0.5, 1: 0.9, 2: 0.7})
    )
    (level,) = matched_gains(results, [2 / 3])
    said = {m.method: versus_hari(level, m) for m in level.methods}
    assert said["sft"].startswith("HARI keeps more (+0.387")
    assert said["replay"].startswith("HARI keeps less (-0.200")
    assert said["small_adapter"].startswith("no difference (+0.010")
    assert said["hari"] == ""
    lines = comparison_verdict([level]).lines
    assert any(line.startswith("  HARI vs plain SFT, early-stopped: HARI keeps more") for line in lines)


def test_no_gain_on_b_is_a_failed_comparison_not_a_tie():
    """Every method at or below the base on B (a model that learned nothing): no gain to match A at."""
    results = [
        point(m, s, g, 0.9, lam)
        for m, lam in (("hari", 0.9), ("replay", 0.0))
        for s in (0, 1)
        for g in (0.0, -0.1)
    ]
    verdict = comparison_verdict(matched_gains(results, [0.5, 0.9]))
    assert verdict.status == "warn" and "no method gained on B" in verdict.headline
