"""Shared fixtures: the embedded tiny model, and running the CLI as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _offline_hub() -> None:
    """Tests never download: the hub is offline and its cache is the R1 rehearsal's (set before any HF import)."""
    from dsr1kit.embedded.r1_format import offline_env

    os.environ.update(offline_env())


_offline_hub()


def pytest_collection_modifyitems(config, items):
    """GPU tests skip without CUDA, so CI (no GPU) stays green and fast."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    from dsr1kit.embedded.tiny import resolve_model

    return Path(resolve_model("tiny"))


def run_cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`dsr1kit ARGS` in a subprocess, from the project root."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "dsr1kit.cli", *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def cli():
    return run_cli
