"""The time plan: R1's HARI parts at the benchmarks' measured rates, and a Slurm job whose time left cannot
cover what it could not resume stopped before the load (the time left is read from the suite's real Slurm in
tests/test_slurm_cluster_check.py)."""

from __future__ import annotations

import pytest

from dsr1kit.cluster.slurm import parse_time_left
from dsr1kit.plan.timing import Rates, TimeRefused, hari_time


@pytest.mark.parametrize(
    "text, seconds",
    [("1-02:03:04", 93784.0), ("02:03:04", 7384.0), ("03:04", 184.0), ("UNLIMITED", None), ("NOT_SET", None)],
)
def test_squeue_time_left_is_read_in_each_of_its_forms(text, seconds):
    assert parse_time_left(text) == seconds


def r1_plan(prefix_cache: bool):
    rates = Rates.measured()
    return rates, hari_time("HARI", 7168, 625.0, 10e6, 2, 2, 8, prefix_cache, 1e6, rates)


def test_r1_parts_follow_the_measured_rates():
    rates, plan = r1_plan(prefix_cache=True)
    parts = {p.what: p for p in plan.parts}
    assert parts["load the model"].seconds == pytest.approx(625.0 / rates.load_gib_per_s)
    assert parts["prefix pass (once)"].seconds == pytest.approx(
        10e6 / (16 * rates.prefix_tokens_per_s_per_gpu)
    )
    cached = 16 * rates.cached_tokens_per_s_per_gpu
    assert parts["one checkpoint interval"].seconds == pytest.approx(1e6 / cached)
    assert parts["training, 2 epoch(s)"].seconds == pytest.approx((2 * 10e6 - 1e6) / cached)
    assert plan.not_resumable == pytest.approx(625.0 / rates.load_gib_per_s + 1e6 / cached)
    _, whole = r1_plan(prefix_cache=False)  # every step through 61 layers: the same tokens take far longer
    assert whole.total > 5 * plan.total


def test_a_job_too_short_for_the_load_and_a_checkpoint_stops_with_the_estimate():
    _, plan = r1_plan(prefix_cache=True)
    with pytest.raises(TimeRefused, match="submit with a longer --time") as err:
        plan.check(plan.not_resumable - 60)
    assert "load the model" in str(err.value) and f"{plan.not_resumable / 60:.1f} min" in str(err.value)
    plan.check(plan.not_resumable + 60)
    plan.check(None)  # no limit: nothing to check


def test_no_estimate_without_measured_rates_for_the_model():
    plan = hari_time("HARI", 256, 0.01, 1e4, 1, 1, 0, False, 1e3)
    assert plan.parts == [] and "not estimated" in plan.text()
    plan.check(1.0)  # never refuses what it cannot estimate
