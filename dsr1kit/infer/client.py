"""Async OpenAI-compatible completions client: bounded concurrency, retries, resumable JSONL.

Each answer is appended to a JSONL file as soon as it arrives, keyed by the
example id, so a run that dies (server killed, job preempted) keeps what it
got and a rerun asks only for the ids not answered yet. Connection errors,
timeouts and 5xx are retried with exponential backoff; when a request still
fails the whole call raises ``ClientError`` after cancelling the rest, naming
how many answers were kept.

Prompts are sent as token ids (``/v1/completions``), tokenized by the caller
with the model's chat template, so the server adds nothing (no second BOS) and
the prompt length is known exactly. A client with ``chat=True`` sends messages to
``/v1/chat/completions`` instead (a judge model behind any OpenAI-compatible
endpoint). A server's key is read from the environment variable the client is
given, at request time, and sent as a bearer token; it is never stored (``infer.auth``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from . import auth

RETRY_STATUS = {429, 500, 502, 503, 504}  # overload and server faults: worth another try after a pause


class ClientError(RuntimeError):
    """Requests failed after retries; answers already received are kept in the JSONL file."""


class RequestRefused(ClientError):
    """The server refused a request (HTTP 4xx): not an answer, so nothing is stored and a rerun asks again."""


@dataclass(frozen=True)
class ClientConfig:
    """How an evaluation asks the server: built from notebook 10's parameters by
    ``steps.serve_configs.client_config``."""

    concurrency: int  # requests in flight
    timeout_s: float  # per request
    retries: int  # per request, on connection errors, timeouts and 5xx (with backoff)
    max_tokens: int  # generated tokens per answer
    temperature: float  # 0: greedy
    key_env: str  # the environment variable holding the server's key ('' for none); never the key
    chat: bool  # ask /v1/chat/completions with messages (a reasoning parser applies), else token ids
    top_p: float  # nucleus sampling (sent only below 1)
    samples: int  # k answers per question, each its own request
    seed: int  # sample j is asked with seed + j (sent only when sampling)


@dataclass
class Request:
    id: str
    prompt: list[int] | str
    record: dict = field(
        default_factory=dict
    )  # kept beside the answer (e.g. the order options were asked in)
    params: dict = field(default_factory=dict)  # this request's own sampling fields (its seed)


@dataclass
class Stats:
    requested: list[str] = field(default_factory=list)  # ids sent in this call
    skipped: int = 0  # ids already answered in the file
    answered: int = 0
    failed: int = 0
    wall_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0

    def percentiles(self, qs: Iterable[float] = (50, 90, 99)) -> dict[str, float]:
        lat = sorted(self.latencies_s)
        if not lat:
            return {f"p{q:g}": float("nan") for q in qs}
        return {f"p{q:g}": lat[min(len(lat) - 1, int(round(q / 100 * (len(lat) - 1))))] for q in qs}

    def summary(self) -> dict[str, Any]:
        return {
            "answered": self.answered,
            "skipped": self.skipped,
            "failed": self.failed,
            "wall_s": round(self.wall_s, 3),
            "completion_tokens": self.completion_tokens,
            "prompt_tokens": self.prompt_tokens,
            "tokens_per_s": round(self.tokens_per_s, 2),
            "requests_per_s": round(self.answered / self.wall_s, 3) if self.wall_s else 0.0,
            **{f"latency_{k}_s": round(v, 4) for k, v in self.percentiles().items()},
        }


def read_answers(path: str | Path) -> dict[str, dict]:
    """id -> answer row from a results JSONL (later rows win; a torn last line, and an error row that an
    older version stored, are ignored: those ids are asked again)."""
    rows: dict[str, dict] = {}
    path = Path(path)
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "id" in row and not row.get("error"):
            rows[str(row["id"])] = row
    return rows


class CompletionClient:
    """Talks to one served model name on an OpenAI-compatible server."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        concurrency: int = 16,
        timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        chat: bool = False,
        key_env: str = "",
        key_param: str = "server_key_env",
        think_ids: tuple[int, int] | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.chat = chat
        # chat answers then record whether the model wrote <think> / </think> (a reasoning parser removes both)
        self.think_ids = think_ids if chat else None
        self.key_env = key_env
        self.key_param = key_param  # the parameter that names key_env, for a refusal's message
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s

    async def _post(self, http, payload: dict) -> dict:
        import aiohttp

        last: Exception | None = None
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        for attempt in range(self.retries + 1):
            try:
                async with http.post(
                    f"{self.base_url}{path}",
                    json=payload,
                    timeout=timeout,
                    headers=auth.headers(self.key_env),
                ) as resp:
                    text = await resp.text()
                if resp.status in RETRY_STATUS:
                    last = ClientError(f"HTTP {resp.status}: {text[:200]}")
                elif (
                    resp.status >= 400
                ):  # a refused request does not get better by retrying, nor is it an answer
                    note = (
                        "; " + auth.refused_note(self.key_env, self.key_param)
                        if resp.status in (401, 403)
                        else ""
                    )
                    raise RequestRefused(
                        f"the server refused a request for model '{self.model}' with HTTP "
                        f"{resp.status}: {text[:300]}{note}"
                    )
                else:
                    return json.loads(text)
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:  # connection refused/reset, timeout
                last = err
            if attempt < self.retries:
                await asyncio.sleep(min(self.max_backoff_s, self.backoff_s * 2**attempt))
        raise ClientError(f"request failed after {self.retries + 1} attempts: {type(last).__name__}: {last}")

    async def acomplete(
        self,
        requests: list[Request],
        out_path: str | Path,
        *,
        max_tokens: int,
        temperature: float = 0.0,
        extra: dict | None = None,
        on_result: Callable[[dict], None] | None = None,
    ) -> Stats:
        import aiohttp

        out_path = Path(out_path)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        _end_torn_line(out_path)
        done = read_answers(out_path)
        todo = [r for r in requests if r.id not in done]
        stats = Stats(skipped=len(requests) - len(todo), requested=[r.id for r in todo])
        sem = asyncio.Semaphore(self.concurrency)
        # aiohttp rather than httpx: a third to a tenth of the client CPU per request, which on a
        # small machine competes with the server (docs/benchmarks.md, evaluation throughput).
        connector = aiohttp.TCPConnector(limit=self.concurrency)

        async def one(http, req: Request, sink) -> None:
            payload = {
                "model": self.model,
                ("messages" if self.chat else "prompt"): req.prompt,
                "max_tokens": max_tokens,
                "temperature": temperature,
                **(extra or {}),
                **req.params,
                **({"return_token_ids": True} if self.think_ids else {}),
            }
            async with sem:
                t0 = time.perf_counter()
                body = await self._post(http, payload)
                latency = time.perf_counter() - t0
            row = {"id": req.id, "model": self.model, "latency_s": round(latency, 4), **req.record}
            if "error" in body:
                row.update(text="", error=body["error"], prompt_tokens=0, completion_tokens=0)
                stats.failed += 1
            else:
                usage = body.get("usage") or {}
                choice = body["choices"][0]
                if self.chat:  # the content; a reasoning parser's reasoning beside it
                    message = choice["message"]
                    row["reasoning"] = message.get("reasoning") or message.get("reasoning_content") or ""
                    if self.think_ids and choice.get("token_ids") is not None:
                        ids = set(choice["token_ids"])
                        row["opened_reasoning"] = self.think_ids[0] in ids
                        row["closed_reasoning"] = self.think_ids[1] in ids
                row.update(
                    text=(choice["message"]["content"] or "") if self.chat else choice["text"],
                    finish_reason=choice.get("finish_reason"),
                    prompt_tokens=usage.get("prompt_tokens", 0),
                    completion_tokens=usage.get("completion_tokens", 0),
                )
                stats.answered += 1
            stats.prompt_tokens += row["prompt_tokens"]
            stats.completion_tokens += row["completion_tokens"]
            stats.latencies_s.append(latency)
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            if on_result:
                on_result(row)

        t0 = time.perf_counter()
        async with aiohttp.ClientSession(connector=connector) as http:
            with open(out_path, "a") as sink:
                tasks = [asyncio.ensure_future(one(http, r, sink)) for r in todo]
                try:
                    await asyncio.gather(*tasks)
                except ClientError as err:
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    stats.wall_s = time.perf_counter() - t0
                    kept = len(read_answers(out_path))
                    fix = (
                        "fix what the server refused"
                        if isinstance(err, RequestRefused)
                        else "restart the server"
                    )
                    raise type(err)(
                        f"{err}; {kept} of {len(requests)} answers kept in {out_path}; {fix} and "
                        f"rerun to ask only the other {len(requests) - kept}"
                    ) from err
        stats.wall_s = time.perf_counter() - t0
        return stats

    def complete(self, requests: list[Request], out_path: str | Path, **kwargs) -> Stats:
        """Synchronous wrapper; works inside a running event loop (a Jupyter kernel) too."""
        return run_sync(self.acomplete(requests, out_path, **kwargs))


def _end_torn_line(path: Path) -> None:
    """A process killed mid-write leaves a last line without its newline: end it, so that the next answer
    appended starts a line of its own instead of being lost with the torn one."""
    if path.is_file() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def run_sync(coro):
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a kernel's loop is running: use another thread
        return pool.submit(asyncio.run, coro).result()
