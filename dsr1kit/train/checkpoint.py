"""Checkpoints that survive preemption: one object with everything needed to resume exactly.

``checkpoints/step-<N>/state.pt`` holds the trainable (LoRA) weights,
optimizer and scheduler state, RNG states and the data position; it is
written to a temp folder and renamed, and ``checkpoints/latest`` (also
replaced atomically) names the newest complete one. A process killed at any
moment leaves either the previous or the new checkpoint, never half of one.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

KEEP = 2


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run_dir: str | Path, step: int, state: dict[str, Any]) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:07d}"
    tmp = root / f".tmp-step-{step:07d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(state, tmp / "state.pt")
    with open(tmp / "state.pt", "rb") as f:
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / ".latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")
    older = sorted(p for p in root.glob("step-*") if p != final)
    for old in older[: max(0, len(older) - (KEEP - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(run_dir: str | Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip() / "state.pt"
    return path if path.is_file() else None


def load(path: str | Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)
