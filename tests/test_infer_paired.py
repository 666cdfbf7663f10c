"""Base vs adapter, paired: the verdict's three outcomes on constructed answer files, the detectable difference
and the interval against recomputations, and a case two Wilson intervals miss."""

import json
import math
import random
from statistics import NormalDist, stdev

import pytest

from dsr1kit.infer import evaluate as ev
from dsr1kit.infer import paired
from dsr1kit.infer.client import read_answers


def _prompts(n: int, categories=("algebra", "history")):
    return [
        ev.Prompt(
            f"q{i}", [1], "ABCD"[i % 4], categories[i % len(categories)], "choice", ["a", "b", "c", "d"]
        )
        for i in range(n)
    ]


def _answers_file(path, prompts, right: set[str]):
    """An answers file as the client writes it: one row per id, the gold letter where ``right`` holds it."""
    with open(path, "w") as f:
        for p in prompts:
            letter = p.gold if p.id in right else "ABCD"[("ABCD".index(p.gold) + 1) % 4]
            f.write(json.dumps({"id": p.id, "text": f"The answer is ({letter})"}) + "\n")
    return path


def _examples(tmp_path, prompts, base_right, adapter_right):
    out = {}
    for label, right in (("base", base_right), ("adapter", adapter_right)):
        answers = read_answers(_answers_file(tmp_path / f"{label}.jsonl", prompts, right))
        out[label], _ = ev.score(prompts, answers)
    return out


def _ids(prompts, pick):
    return {p.id for i, p in enumerate(prompts) if pick(i)}


@pytest.mark.parametrize(
    "adapter_pick, verdict",
    [
        (lambda i: i % 2 == 0 or i % 5 == 1, paired.BETTER),  # 20% of the base's misses now right
        (lambda i: i % 2 == 0 and i % 5 != 0, paired.WORSE),  # 20% of the base's hits now wrong
        (lambda i: (i % 2 == 0) != (i % 20 in (0, 1)), paired.NO_DIFFERENCE),  # as many gained as lost
    ],
)
def test_the_paired_verdicts_three_outcomes_on_answer_files(tmp_path, adapter_pick, verdict):
    prompts = _prompts(400)
    ex = _examples(tmp_path, prompts, _ids(prompts, lambda i: i % 2 == 0), _ids(prompts, adapter_pick))
    overall, *per_category = paired.compare_models(ex["base"], ex["adapter"])
    assert overall.scope == "all" and overall.questions == 400 and overall.verdict == verdict
    assert [r.scope for r in per_category] == ["algebra", "history"]
    base = ex["base"].set_index("id")["correct"].astype(float)
    adapter = ex["adapter"].set_index("id")["correct"].astype(float)
    assert overall.difference == pytest.approx(float((adapter - base).mean()))
    assert overall.verdict in overall.line()


def test_the_detectable_difference_and_the_interval_equal_recomputations():
    rng = random.Random(3)
    d = [rng.choice([-1.0, 0.0, 0.0, 0.0, 1.0, 1.0]) for _ in range(600)]
    z = NormalDist().inv_cdf(0.975) + NormalDist().inv_cdf(0.8)
    assert paired.detectable_difference(d) == pytest.approx(z * stdev(d) / math.sqrt(600), rel=1e-12)
    low, high = paired.bootstrap_interval(d)
    mean, se = sum(d) / 600, stdev(d) / math.sqrt(600)
    # the bootstrap's percentile interval against the normal interval of the mean, 600 questions
    assert low == pytest.approx(mean - 1.959964 * se, abs=0.01) and high == pytest.approx(
        mean + 1.959964 * se, abs=0.01
    )
    assert paired.bootstrap_interval(d) == (low, high)  # fixed seed: the same answers, the same interval


def test_overlapping_wilson_intervals_hide_what_the_paired_test_finds(tmp_path):
    prompts = _prompts(200)
    base_right = _ids(prompts, lambda i: i < 100)
    adapter_right = base_right | _ids(prompts, lambda i: 100 <= i < 112)  # 12 more right, none lost
    ex = _examples(tmp_path, prompts, base_right, adapter_right)
    base_ci, adapter_ci = ev.wilson(100, 200), ev.wilson(112, 200)
    assert adapter_ci[0] < base_ci[1]  # the two intervals overlap
    overall = paired.compare_models(ex["base"], ex["adapter"])[0]
    assert overall.verdict == paired.BETTER and overall.ci95_low > 0
    assert overall.sign_test_p == pytest.approx(2 * 0.5**12)  # McNemar's exact test: 12 discordant, all up


def test_a_handful_of_questions_names_no_side_and_unanswered_rows_are_no_pair(tmp_path):
    three = paired.compare("all", {"a": 0.0, "b": 0.0, "c": 0.0}, {"a": 1.0, "b": 1.0, "c": 1.0})
    assert (three.ci95_low, three.ci95_high) == (1.0, 1.0)  # the bootstrap alone would say "better"
    assert three.sign_test_p == 0.25 and three.verdict == paired.NO_DIFFERENCE
    prompts = _prompts(4)
    answers = {p.id: {"text": f"The answer is ({p.gold})"} for p in prompts[:3]}  # q3 never answered
    per_example, _ = ev.score(prompts, answers)
    assert paired.pass_at_1(per_example) == {"q0": 1.0, "q1": 1.0, "q2": 1.0}
    assert paired.compare("all", {}, {}).line() == "all: no question answered by both models"
