"""Helpers shared by the vLLM tests: CPU-friendly params and a check that no server process survives."""

from __future__ import annotations

import os

import psutil

from dsr1kit.params import InferenceParams

CPU_SERVER = dict(
    enforce_eager=True,
    dtype="bfloat16",
    max_model_len=512,
    max_num_seqs=16,
    max_num_batched_tokens=2048,
    server_env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    ready_timeout_s=240,
    max_new_tokens=16,
    concurrency=8,
    retries=2,
    max_lora_rank=8,
)


def cpu_params(**overrides) -> InferenceParams:
    return InferenceParams(**{**CPU_SERVER, **overrides})


def vllm_processes() -> list[psutil.Process]:
    """vLLM processes started by this test process (children at any depth)."""
    out = []
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if "vllm" in " ".join(child.cmdline()) or child.name().startswith(("VLLM", "EngineCore")):
                out.append(child)
        except psutil.Error:
            continue
    return out


def server_family(server) -> list[psutil.Process]:
    """The server process and all its descendants (call while it runs)."""
    root = psutil.Process(server.pid)
    return [root, *root.children(recursive=True)]


def assert_gone(procs: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(procs, timeout=30)  # a loaded 2-core host takes a while to reap them
    assert not alive, f"vLLM processes outlived their server: {[p.pid for p in alive]}"


def assert_no_server_left() -> None:
    gone, alive = psutil.wait_procs(vllm_processes(), timeout=10)
    assert not alive, f"vLLM processes outlived the test: {[p.pid for p in alive]}"


def files_holding(folder, text: str) -> list[str]:
    """Files under ``folder`` whose bytes contain ``text`` (a secret that must be in none)."""
    from pathlib import Path

    needle = text.encode()
    return [str(f) for f in Path(folder).rglob("*") if f.is_file() and needle in f.read_bytes()]
