"""What an evaluation costs before it runs: answers and generated tokens (k samples included), and hours at the
rate an earlier run measured; `dsr1kit plan` prints it for notebook 10."""

import json

import pytest

from dsr1kit.infer.client import Stats
from dsr1kit.plan.eval_cost import EvalCost, MeasuredRate, measured_rate


def _earlier_run(folder, answered=40, completion_tokens=1200, wall_s=8.0):
    """A run folder as notebook 10 leaves it: summary.json's throughput is each model's client Stats."""
    folder.mkdir(parents=True, exist_ok=True)
    stats = Stats(answered=answered, completion_tokens=completion_tokens, wall_s=wall_s)
    (folder / "summary.json").write_text(json.dumps({"throughput": {"base": stats.summary()}}))
    return folder


def test_the_cost_counts_every_sample_of_every_question_for_each_model(tmp_path):
    rate = measured_rate(_earlier_run(tmp_path / "earlier"))
    assert (rate.tokens_per_answer, rate.tokens_per_s) == (30.0, 150.0)
    cost = EvalCost(models=2, questions=4183, samples=4, max_new_tokens=8192, measured=rate)
    assert cost.answers == 2 * 4183 * 4 and cost.tokens_at_most == 2 * 4183 * 4 * 8192
    assert cost.tokens_expected == 2 * 4183 * 4 * 30.0
    assert cost.hours_expected == pytest.approx(2 * 4183 * 4 * 30.0 / 150.0 / 3600)
    assert "33,464 answers" in cost.text() and f"≈ {cost.hours_expected:.2f} h" in cost.text()
    unpriced = EvalCost(1, 10, 1, 48)
    assert unpriced.hours_expected is None and "no earlier run to price it" in unpriced.text()
    assert EvalCost(1, 0, 1, 48, not_counted="no data here").text().endswith("(no data here)")
    assert (
        MeasuredRate(1.0, 0.0, "x")
        and EvalCost(1, 1, 1, 1, MeasuredRate(1.0, 0.0, "x")).hours_expected is None
    )


def test_a_run_without_throughput_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no measured throughput"):
        measured_rate(tmp_path)
    with pytest.raises(ValueError, match="answered nothing"):
        measured_rate(_earlier_run(tmp_path / "idle", answered=0, completion_tokens=0))


def test_dsr1kit_plan_prints_the_evaluations_tokens_and_hours(cli, tmp_path):
    earlier = _earlier_run(tmp_path / "earlier")
    res = cli(
        "plan", "params/tiny/10_vllm_inference.yaml", "-p", "samples_per_question", "4", "-p", "temperature",
        "0.6", "-p", "eval_limit", "10", "--rate-from", str(earlier),
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    # base and adapter (the tiny set compares the latest HARI adapter with the base), 10 rows, k = 4
    assert "evaluation cost: 2 model(s) × 10 questions × 4 sample(s) = 80 answers" in res.stdout
    assert "at most 3,840 generated tokens (max_new_tokens 48 each)" in res.stdout
    assert f"at 150.0 tokens/s ≈ {80 * 30 / 150 / 3600:.2f} h, measured in {earlier}" in res.stdout
    assert (
        "2 model(s) × 10 rows × 4 samples × (max_new_tokens" in res.stdout
    )  # the answers' disk write counts k
    bad = cli("plan", "params/tiny/10_vllm_inference.yaml", "--rate-from", str(tmp_path / "none"))
    assert bad.returncode == 2 and "no measured throughput" in bad.stderr
