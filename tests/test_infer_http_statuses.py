"""HTTP statuses a server answers: a 4xx fails at once with its status and body, is never stored as an answer,
and a rerun asks only what is missing (each prompt is asked once across both runs)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest

from dsr1kit.cluster.rendezvous import free_port
from dsr1kit.infer.client import ClientError, CompletionClient, Request, RequestRefused, read_answers
from dsr1kit.infer.server import PROBE_PROMPT, ServerError, ServerSpec, VLLMServer, rpc_base_env

STUB = Path(__file__).with_name("http_stub.py")


@dataclasses.dataclass(frozen=True)
class StubSpec(ServerSpec):
    """The server spec with the stub's command instead of `vllm serve`."""

    mode: str = "ok"
    log: str = ""

    def command(self, python: str = sys.executable) -> list[str]:
        return [python, str(STUB), str(self.port), self.mode, self.log]


def _asked(server: VLLMServer) -> list[str]:
    """The prompts the stub was sent, the readiness probe's left out."""
    lines = Path(server.spec.log).read_text().splitlines()
    return [p for p in map(json.loads, lines) if p != PROBE_PROMPT]


def _stub(tmp_path: Path, mode: str, timeout: float = 60) -> VLLMServer:
    spec = StubSpec(
        model="tiny",
        served_model_name="model",
        port=free_port(),
        mode=mode,
        log=str(tmp_path / f"asked-{mode}.jsonl"),
    )
    return VLLMServer(spec, tmp_path / f"{mode}.log", ready_timeout_s=timeout)


def test_a_4xx_to_the_readiness_probe_fails_at_once_with_status_and_body(tmp_path):
    server = _stub(tmp_path, "probe-404", timeout=600)
    t0 = time.monotonic()
    with pytest.raises(ServerError) as err:
        with server:
            pass
    assert time.monotonic() - t0 < 60  # not the whole ready_timeout_s
    msg = str(err.value)
    assert msg.startswith(
        'the server answers a one-token completion with HTTP 404: {"error": {"message": '
        '"The model `model` does not exist."'
    )
    assert "check served_model_name / lora_name" in msg
    assert not server.alive()


def test_a_server_that_never_gets_ready_says_what_it_last_answered(tmp_path):
    with pytest.raises(
        ServerError,
        match=r"not ready after 3 s \(no /health 200; last answer: HTTP 503 to "
        r"GET /health",
    ):
        with _stub(tmp_path, "loading", timeout=3):
            pass


def test_a_refused_request_is_not_stored_and_the_rerun_asks_only_the_missing(tmp_path):
    out = tmp_path / "answers.jsonl"
    requests = [Request(f"q{i}", f"question {i}") for i in range(6)] + [Request("q-bad", "question BAD")]
    with _stub(tmp_path, "refuse-BAD") as server:
        client = CompletionClient(server.base_url, "model", concurrency=1, retries=2, backoff_s=0.01)
        with pytest.raises(RequestRefused) as err:
            client.complete(requests, out, max_tokens=4)
    msg = str(err.value)
    assert (
        "the server refused a request for model 'model' with HTTP 400: " in msg
        and "max_tokens is too large" in msg
    )
    assert "answers kept in" in msg and "fix what the server refused and rerun to ask only the other" in msg
    kept = read_answers(out)
    assert "q-bad" not in kept and all(not row.get("error") for row in kept.values())
    asked_first = _asked(server)
    assert asked_first.count("question BAD") == 1  # never retried

    with _stub(tmp_path, "ok") as fixed:
        stats = CompletionClient(fixed.base_url, "model", concurrency=2).complete(requests, out, max_tokens=4)
    asked_again = _asked(fixed)
    assert sorted(asked_again) == sorted(r.prompt for r in requests if r.id not in kept)  # nothing twice
    assert stats.skipped == len(kept) and set(read_answers(out)) == {r.id for r in requests}


def test_error_rows_of_older_answer_files_are_asked_again(tmp_path):
    out = tmp_path / "answers.jsonl"
    rows = [{"id": "a", "text": "x"}, {"id": "b", "text": "", "error": "HTTP 400"}]
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert set(read_answers(out)) == {"a"}


def test_5xx_is_retried_then_fails_with_the_count_kept(tmp_path):
    port = free_port()  # nothing listens: connection refused on every attempt
    client = CompletionClient(f"http://127.0.0.1:{port}", "model", retries=1, backoff_s=0.01)
    with pytest.raises(
        ClientError,
        match=r"request failed after 2 attempts: .*; 0 of 1 answers kept in .*; restart "
        r"the server and rerun",
    ):
        client.complete([Request("a", "p")], tmp_path / "a.jsonl", max_tokens=1)


def test_a_deep_temp_dir_gets_a_short_socket_folder_for_the_server(tmp_path):
    """vLLM's IPC sockets live in its temp dir; past 107 characters it exits at start, so a short folder is used."""
    deep = tmp_path / ("scratch-" * 10)
    env, short = rpc_base_env({"TMPDIR": str(deep)})
    assert short is not None and short.is_dir() and env == {"VLLM_RPC_BASE_PATH": str(short)}
    assert len(str(short)) + 37 <= 107
    short.rmdir()
    assert rpc_base_env({"TMPDIR": "/tmp"}) == ({}, None)

    server = _stub(tmp_path, "ok")
    server.spec.env["TMPDIR"] = str(deep)
    with server:
        made = server._rpc_dir
        assert made is not None and made.is_dir()
    assert not made.exists()  # removed with the server


def test_an_answer_torn_by_a_kill_is_asked_again_and_the_next_one_is_not_lost(tmp_path):
    """A process killed mid-write leaves a last line without its newline: that id is asked again, and the
    first answer appended after it gets a line of its own (every id is in the file once, readable)."""
    out = tmp_path / "answers.jsonl"
    out.write_text(json.dumps({"id": "a", "text": "x"}) + "\n" + '{"id": "b", "te')
    with _stub(tmp_path, "ok") as server:
        stats = CompletionClient(server.base_url, "model", concurrency=1).complete(
            [Request(i, f"prompt {i}") for i in "abc"], out, max_tokens=4
        )
    assert (stats.skipped, stats.answered) == (1, 2)
    assert sorted(read_answers(out)) == ["a", "b", "c"]
    assert sorted(_asked(server)) == ["prompt b", "prompt c"]
