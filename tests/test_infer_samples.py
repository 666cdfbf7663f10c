"""k samples per question: each its own request and seed, pass@1 over them with the question as the unit,
cons@k, the judge on every sample, HLE's numbers per sample index, and the paired test on fractions."""

import math
from statistics import stdev

import pytest

from dsr1kit.infer import evaluate as ev
from dsr1kit.infer import judge as J
from dsr1kit.infer import paired
from dsr1kit.params import InferenceParams, ParamsError
from dsr1kit.steps.serve_configs import client_config


def _choice(n: int):
    return [
        ev.Prompt(f"q{i}", [1, 2], "ABCD"[i % 4], "cat", "choice", ["a", "b", "c", "d"]) for i in range(n)
    ]


def _answer(prompt, right: bool) -> dict:
    letter = prompt.gold if right else "ABCD"[("ABCD".index(prompt.gold) + 1) % 4]
    return {"text": f"The answer is ({letter})"}


def test_each_sample_is_its_own_request_with_its_own_seed():
    p = InferenceParams(temperature=0.6, top_p=0.95, samples_per_question=3, sample_seed=10)
    requests = ev.sample_requests(_choice(2), client_config(p))
    assert [r.id for r in requests] == ["q0#0", "q0#1", "q0#2", "q1#0", "q1#1", "q1#2"]
    assert [r.params for r in requests[:3]] == [{"seed": s, "top_p": 0.95} for s in (10, 11, 12)]
    assert requests[4].record == {"question": "q1", "sample": 1, "seed": 11}
    greedy = ev.sample_requests(_choice(2), client_config(InferenceParams()))
    assert [(r.id, r.params, r.record) for r in greedy] == [("q0", {}, {}), ("q1", {}, {})]  # as before


def test_k_greedy_samples_are_refused_before_anything_starts():
    with pytest.raises(
        ParamsError, match="samples_per_question 4 at temperature 0 asks the same greedy answer"
    ):
        InferenceParams.validate_dict({"samples_per_question": 4})


def test_pass_at_1_is_the_mean_of_per_question_fractions_with_the_question_as_the_unit():
    prompts, k = _choice(10), 4
    right = {f"q{i}#{j}": (i + j) % 3 != 0 for i in range(10) for j in range(k)}
    answers = {key: _answer(prompts[int(key[1 : key.index("#")])], ok) for key, ok in right.items()}
    del answers["q9#3"]  # never answered: wrong, as in the accuracy
    per_sample, table = ev.score(prompts, answers, samples=k)
    assert len(per_sample) == 40 and set(per_sample["sample"]) == set(range(k))
    fractions = [sum(right[f"q{i}#{j}"] and f"q{i}#{j}" != "q9#3" for j in range(k)) / k for i in range(10)]
    mean = sum(fractions) / 10
    half = 1.959964 * stdev(fractions) / math.sqrt(10)
    row = table.iloc[0]
    assert row["accuracy"] == pytest.approx(mean) and row["scored_on"] == "10 of 10 × 4 samples"
    assert (row["ci95_low"], row["ci95_high"]) == (pytest.approx(mean - half), pytest.approx(mean + half))
    assert paired.pass_at_1(per_sample)["q0"] == pytest.approx(fractions[0])
    assert paired.pass_at_1(per_sample)["q9"] == pytest.approx(2 / 3)  # q9's unanswered sample is no pair


def test_cons_at_k_takes_each_questions_most_common_read_answer():
    prompts = _choice(3)
    answers = {
        **{f"q0#{j}": _answer(prompts[0], ok) for j, ok in enumerate([True, True, False])},  # majority right
        **{f"q1#{j}": _answer(prompts[1], ok) for j, ok in enumerate([True, False, False])},  # majority wrong
        "q2#0": {"text": "no letter here"},  # unread: no vote
        "q2#1": _answer(prompts[2], True),
    }
    _, table = ev.score(prompts, answers, samples=3)
    assert table.iloc[0]["cons_at_k"] == pytest.approx(2 / 3)  # q0 and q2 (its only read vote) right
    assert table.iloc[0]["samples"] == 3


def _hle(n: int):
    return [ev.Prompt(f"h{i}", [1], str(i), "hle", "judged", question=f"q{i}") for i in range(n)]


def test_the_judge_sees_every_sample_and_hles_numbers_are_averaged_over_sample_indices():
    prompts, k = _hle(3), 2
    answers = {f"h{i}#{j}": {"text": f"Exact Answer: {i}"} for i in range(3) for j in range(k)}
    assert [r.id for r in J.requests_for(prompts, answers, k)] == [
        "h0#0",
        "h0#1",
        "h1#0",
        "h1#1",
        "h2#0",
        "h2#1",
    ]
    judgments = {
        "h0#0": J.Judgment("0", True, 90, ""),
        "h1#0": J.Judgment("1", True, 70, ""),
        "h2#0": J.Judgment("9", False, 50, ""),
        "h0#1": J.Judgment("0", True, 80, ""),
        "h1#1": None,  # unreadable: wrong
    }  # h2#1 never judged: wrong
    per_sample, _ = ev.score(prompts, answers, judgments=judgments, samples=k)
    metrics = J.hle_metrics(per_sample, judgments)
    one = J.hle_metrics(
        per_sample[per_sample["sample"] == 0].assign(sample=0),
        {k_[:2]: v for k_, v in judgments.items() if k_.endswith("#0")},
    )
    assert metrics["accuracy"] == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert metrics["ci95_half_width"] == pytest.approx(
        (one["ci95_half_width"] + 1.96 * math.sqrt(2 / 9 / 3)) / 2
    )
    assert (metrics["n"], metrics["judged"], metrics["correct"], metrics["unreadable_judgments"]) == (
        3,
        4,
        3,
        1,
    )
    assert metrics["samples"] == 2 and metrics["calibration_error"] is None
