"""HLE's judge without a model: its JSON read, its metrics recomputed independently, and the judge client
against a stand-in endpoint (tests/http_stub.py) that refuses a request, wants a key or is not there."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from benchmark_rows import HLE
from conftest import run_cli

from dsr1kit.benchmarks import adapt
from dsr1kit.cluster.rendezvous import free_port
from dsr1kit.infer import evaluate as ev
from dsr1kit.infer import judge as J
from dsr1kit.infer.client import RequestRefused, read_answers

STUB = Path(__file__).with_name("http_stub.py")


@pytest.fixture
def stub(tmp_path):
    """start(mode) → base URL of a stand-in endpoint; every request it was sent is in tmp_path/asked-MODE.jsonl."""
    procs = []

    def start(mode: str) -> str:
        port = free_port()
        procs.append(
            subprocess.Popen(
                [sys.executable, str(STUB), str(port), mode, str(tmp_path / f"asked-{mode}.jsonl")]
            )
        )
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                return url
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("stub did not start")

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(10)


def _prompts(n: int = 6):
    """n HLE exact-match rows asked of a model (tokens do not matter to the judge)."""
    rows = [dict(HLE["test"][0], id=f"h{i}", answer=str(i)) for i in range(n)]
    return [
        ev.Prompt(i.id, [1], i.gold, i.category, i.kind, question=i.question)
        for i in adapt([("cais/hle", rows)]).items
    ]


def _config(url: str, key_env: str = "") -> J.JudgeConfig:
    return J.JudgeConfig(url, "judge", key_env, concurrency=2, timeout_s=10, retries=0, max_tokens=64)


def test_the_kits_all_bins_calibration_error_equals_a_recomputation_by_hand():
    confidence = [(i % 10) / 10 for i in range(250)]
    correct = [i % 3 == 0 for i in range(250)]
    got, note = J.rms_calibration_error(confidence, correct)
    order = sorted(range(250), key=lambda i: confidence[i])
    bins = [order[0:100], order[100:250]]  # bins of 100, the last takes the remainder
    expected = math.sqrt(
        sum(
            len(b) / 250 * (sum(confidence[i] for i in b) / len(b) - sum(correct[i] for i in b) / len(b)) ** 2
            for b in bins
        )
    )
    assert got == pytest.approx(expected) and note == "2 bin(s) of 100"
    assert J.rms_calibration_error([0.7] * 10, [True] * 7 + [False] * 3) == (
        pytest.approx(0.0),
        ("one bin: only 10 judged answers (HLE bins by 100)"),
    )


def _hle_script_calib_err(confidence, correct, beta=100):
    """HLE's judge script's calib_err(p='2', beta=100), transcribed statement by statement (the reference)."""
    import numpy as np

    idxs = np.argsort(confidence)
    confidence = confidence[idxs]
    correct = correct[idxs]
    bins = [[i * beta, (i + 1) * beta] for i in range(len(confidence) // beta)]
    bins[-1] = [bins[-1][0], len(confidence)]
    cerr = 0
    total_examples = len(confidence)
    for i in range(len(bins) - 1):
        bin_confidence = confidence[bins[i][0] : bins[i][1]]
        bin_correct = correct[bins[i][0] : bins[i][1]]
        num_examples_in_bin = len(bin_confidence)
        if num_examples_in_bin > 0:
            difference = np.abs(np.nanmean(bin_confidence) - np.nanmean(bin_correct))
            cerr += num_examples_in_bin / total_examples * np.square(difference)
    return np.sqrt(cerr)


@pytest.mark.parametrize("n", [250, 1000, 2500])
def test_hles_calibration_error_is_its_scripts_to_1e9(n):
    """Constructed judgments: integer confidences 0-100 with many ties (the script's argsort orders them) and
    correctness that rises with confidence but not perfectly; the kit's number equals the script's."""
    import numpy as np

    rng = np.random.default_rng(n)
    conf_int = rng.integers(0, 101, n)
    correct = rng.random(n) < 0.2 + 0.6 * conf_int / 100
    expected = float(_hle_script_calib_err(np.array(conf_int) / 100, np.array(correct)))
    got, note = J.hle_calibration_error([c / 100 for c in conf_int.tolist()], correct.tolist())
    assert abs(got - expected) <= 1e-9 and expected > 0.01
    assert note == f"HLE's: {n // 100} bins of 100, the last ({100 + n % 100} most confident) left out"
    kits, _ = J.rms_calibration_error([c / 100 for c in conf_int.tolist()], correct.tolist())
    assert abs(kits - expected) > 1e-6  # the all-bins variant is another number


def test_below_two_bins_hles_script_gives_no_calibration_error_and_the_note_says_what_it_does():
    assert J.hle_calibration_error([0.5] * 150, [True] * 150) == (
        None,
        "none: 150 judged answers make one bin, the one HLE's script leaves out (it prints 0)",
    )
    assert J.hle_calibration_error([0.5] * 99, [True] * 99) == (
        None,
        "none: 99 judged answers, under one bin of 100 (HLE's script fails here)",
    )
    assert float(_hle_script_calib_err(*map(__import__("numpy").array, ([0.5] * 150, [True] * 150)))) == 0.0


def test_hles_accuracy_divides_by_every_question_missing_and_unreadable_judgments_wrong():
    prompts = _prompts(5)
    answers = {p.id: {"text": f"Exact Answer: {p.gold}"} for p in prompts}
    judgments = {"h0": J.Judgment("0", True, 80, ""), "h1": J.Judgment("1", True, 60, ""), "h2": None}
    per_example, _ = ev.score(prompts, answers, judgments=judgments)  # h3, h4 never judged
    metrics = J.hle_metrics(per_example, judgments)
    assert (metrics["n"], metrics["correct"], metrics["judged"], metrics["unreadable_judgments"]) == (
        5,
        2,
        2,
        1,
    )
    assert metrics["accuracy"] == 2 / 5
    assert metrics["ci95_half_width"] == 1.96 * math.sqrt(0.4 * 0.6 / 5)  # the script's 1.96
    assert metrics["calibration_error"] is None and metrics["calibration_note"].startswith("none: 2 judged")
    assert metrics["calibration_error_all_bins"] == pytest.approx(1 - 0.7)


def test_a_judgment_must_hold_the_schemas_fields():
    good = {"extracted_final_answer": "2", "reasoning": "same", "correct": "yes", "confidence": 90}
    assert J.parse(json.dumps(good)) == J.Judgment("2", True, 90, "same")
    assert J.parse(json.dumps({**good, "confidence": 250})).confidence == 100
    assert J.parse("{not json") is None and J.parse(json.dumps({"correct": "yes"})) is None


def test_only_answers_whose_reasoning_closed_are_sent_with_hles_prompt():
    prompts = _prompts(3)
    answers = {"h0": {"text": "<think>x</think>Exact Answer: 0"}, "h1": {"text": "<think>still thinking"}}
    (request,) = J.requests_for(prompts, answers)
    assert request.id == "h0"
    content = request.prompt[0]["content"]
    assert content.startswith("Judge whether the following [response] to [question] is correct")
    assert "[response]: Exact Answer: 0\n" in content and "[correct_answer]: 0\n" in content
    assert "<think>" not in content  # the reasoning is not judged


def test_a_refused_judgment_loses_nothing_and_a_rerun_judges_only_what_is_missing(stub, tmp_path):
    prompts = _prompts(6)
    answers = {p.id: {"text": f"Exact Answer: {p.gold}" + (" BAD" if p.id == "h3" else "")} for p in prompts}
    out = tmp_path / "judgments" / "base.jsonl"
    with pytest.raises(RequestRefused, match="HTTP 400"):
        J.judge(prompts, answers, out, _config(stub("refuse-BAD")), progress=False)
    kept = set(read_answers(out))
    assert "h3" not in kept and kept  # what was judged is kept
    J.judge(prompts, answers, out, _config(stub("ok")), progress=False)
    asked = (tmp_path / "asked-ok.jsonl").read_text().splitlines()
    assert len(asked) == 6 - len(kept)  # only the missing ones
    judgments = J.read_judgments(out)
    assert set(judgments) == {p.id for p in prompts} and all(j.correct for j in judgments.values())
    per_example, _ = ev.score(prompts, answers, judgments=judgments)
    metrics = J.hle_metrics(per_example, judgments)
    assert (metrics["n"], metrics["correct"], metrics["accuracy"]) == (6, 6, 1.0)
    assert metrics["calibration_error"] is None  # six answers: under one of HLE's bins
    assert metrics["calibration_error_all_bins"] == pytest.approx(0.3)  # confidence 70% on answers all right


def test_a_judge_that_wants_a_key_says_which_variable_was_read(stub, tmp_path, monkeypatch):
    url = stub("key-s3cret")
    prompts, out = _prompts(2), tmp_path / "j.jsonl"
    answers = {p.id: {"text": f"Exact Answer: {p.gold}"} for p in prompts}
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    with pytest.raises(
        RequestRefused, match=r"sent the key from \$JUDGE_KEY, which is not set in this environment"
    ):
        J.judge(prompts, answers, out, _config(url, "JUDGE_KEY"), progress=False)
    with pytest.raises(J.JudgeUnreachable, match=r"\$JUDGE_KEY, which is not set"):
        J.check_endpoint(url, "judge", "JUDGE_KEY")
    monkeypatch.setenv("JUDGE_KEY", "s3cret")
    J.check_endpoint(url, "judge", "JUDGE_KEY")
    J.judge(prompts, answers, out, _config(url, "JUDGE_KEY"), progress=False)
    assert len(read_answers(out)) == 2 and "s3cret" not in out.read_text()


def test_a_judge_that_is_not_there_or_lacks_the_model_is_named():
    with pytest.raises(J.JudgeUnreachable, match="is not reachable"):
        J.check_endpoint(f"http://127.0.0.1:{free_port()}", "judge")


def test_a_judge_that_is_down_stops_the_run_before_any_run_folder(tmp_path):
    runs = tmp_path / "runs"
    url = f"http://127.0.0.1:{free_port()}"
    proc = run_cli(
        "run",
        "notebooks/10_vllm_inference.ipynb",
        "-p",
        "judge_url",
        url,
        "-p",
        "judge_model",
        "judge",
        "--runs-dir",
        str(runs),
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"error: judge_url: the judge at {url} is not reachable" in proc.stderr
    assert not runs.exists()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("judge_api_key", "sk-" + "a" * 30, "judge_api_key"),
        ("judge_key_env", "sk-" + "a" * 30, "judge_key_env"),
        ("judge_key_env", "my key", "names the environment variable that holds the key"),
    ],
)
def test_a_judge_key_given_as_a_parameter_is_refused(tmp_path, key, value, message):
    proc = run_cli(
        "run", "notebooks/10_vllm_inference.ipynb", "-p", key, value, "--runs-dir", str(tmp_path / "r")
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert message in proc.stderr
    assert not value.startswith("sk-") or value not in proc.stderr + proc.stdout
    assert not (tmp_path / "r").exists()


def test_the_step_builds_the_judge_from_the_parameters():
    from dsr1kit.infer.serve_spec import server_spec
    from dsr1kit.params import InferenceParams
    from dsr1kit.steps.serve_configs import judge_config, serve_settings

    assert judge_config(InferenceParams()) is None
    served = InferenceParams(judge_url="served")
    config = J.on_server(judge_config(served), "http://s:1", "adapter")
    assert (config.base_url, config.model, config.max_chars) == (
        "http://s:1",
        "adapter",
        J.SERVED_JUDGE_MAX_CHARS,
    )
    # whitespace-free JSON
    assert server_spec(serve_settings(served), "m").extra_args[-2:] == J.SERVED_JUDGE_ARGS
    assert J.SERVED_JUDGE_ARGS[0] not in server_spec(serve_settings(InferenceParams()), "m").extra_args
    endpoint = InferenceParams(
        judge_url="https://judge.example:8443/", judge_model="j", judge_key_env="JUDGE_KEY"
    )
    config = J.on_server(judge_config(endpoint), "http://s:1", "model")
    assert (config.base_url, config.model, config.api_key_env, config.max_chars) == (
        "https://judge.example:8443",
        "j",
        "JUDGE_KEY",
        0,
    )
    schema = J.response_format(config.max_chars)["json_schema"]["schema"]
    assert (
        "maxLength" not in schema["properties"]["reasoning"]
        and "maximum" not in schema["properties"]["confidence"]
    )
    bounded = J.response_format(200)["json_schema"]["schema"]["properties"]
    assert bounded["reasoning"]["maxLength"] == 200 and bounded["confidence"]["maximum"] == 100
