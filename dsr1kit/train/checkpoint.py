"""Checkpoints that survive preemption: one object with everything needed to resume exactly.

``checkpoints/step-<N>/state.pt`` holds the trainable (LoRA) weights,
optimizer and scheduler state, every rank's RNG state and the data position; it is
written to a temp folder and renamed, and ``checkpoints/latest`` (also
replaced atomically) names the newest complete one. A process killed at any
moment leaves either the previous or the new checkpoint, never half of one.
"""

from __future__ import annotations

import json
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


def rank_rng_state(saved: dict[str, Any] | list[dict[str, Any]], rank: int) -> dict[str, Any]:
    """This rank's RNG state from a checkpoint: each rank's is saved (their dropout masks differ, since
    their batches do); a checkpoint of one state (older, or one rank) gives that one to every rank."""
    if isinstance(saved, dict):
        return saved
    if rank >= len(saved):  # another world size: its data order differs anyway, so this resume is not exact
        import warnings

        warnings.warn(
            f"the checkpoint holds the RNG states of {len(saved)} ranks; rank {rank} takes rank "
            f"{rank % len(saved)}'s (a resume with another number of ranks is not bit-identical)",
            stacklevel=2,
        )
    return saved[rank % len(saved)]


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
    if "params" in state:  # readable without torch.load, before any model is loaded
        (tmp / "params.json").write_text(json.dumps(state["params"], indent=1, sort_keys=True))
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


# What a resumed run may change: where and how often it writes, where layers sit. Anything else (data,
# model, LoRA shape, optimisation, loss) would mix two runs in one adapter or fail on a shape mismatch.
MAY_CHANGE_ON_RESUME = frozenset(
    {
        "run_dir",
        "resume",
        "log_every",
        "save_every",
        "snapshot_every",
        "snapshot_steps",
        "offload_dir",
        "device_map",
        "max_memory_gib_per_gpu",
        "cpu_max_memory_gib",
        "grad_checkpointing",
        # how the prefix pass batches and stores (prefix_cache itself may not change:
        # on GPUs it changes the number of ranks and the adapted layer's precision)
        "prefix_tokens_per_batch",
        "prefix_shard_mib",
        "prefix_pipeline",
        "reference_cache",
    }
)


class ResumeMismatch(ValueError):
    """The run folder's checkpoint was made with other parameters than this run's."""


def saved_params(path: str | Path) -> dict[str, Any] | None:
    """The parameters a checkpoint (its state.pt path) was written with, None when it predates them."""
    path = Path(path)
    side = path.parent / "params.json"
    if side.is_file():
        return json.loads(side.read_text())
    saved = load(path).get("params")
    return dict(saved) if saved is not None else None


def check_resumable(run_dir: str | Path, params: dict[str, Any]) -> Path | None:
    """The checkpoint to resume from, after checking it was made by these parameters; ResumeMismatch names
    every difference (saved → now) and what to do, before anything is loaded."""
    ckpt = latest(run_dir)
    if ckpt is None:
        return None
    saved = saved_params(ckpt)
    if saved is None:
        return ckpt
    diff = [
        f"{k}: {saved.get(k)!r} → {params.get(k)!r}"
        for k in sorted(set(saved) | set(params))
        if k not in MAY_CHANGE_ON_RESUME and saved.get(k) != params.get(k)
    ]
    if diff:
        raise ResumeMismatch(
            f"{ckpt.parent} was written with other parameters: {'; '.join(diff)}. Resuming would mix two runs. "
            f"Start a new run folder (run_dir '' or another --run-dir), or put the old values back to resume "
            f"(the checkpoint stays as it is)"
        )
    return ckpt


def load(path: str | Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


SNAPSHOTS = "snapshots"


def save_snapshot(model, tokenizer, run_dir: str | Path, step: int, cost: dict[str, Any]) -> Path:
    """The adapter at ``step`` in PEFT format under ``snapshots/step-NNNNNNN`` with ``cost.json`` (tokens,
    seconds, peak memory so far): a point of the training trajectory that early stopping could have kept.
    Written to a temp folder and renamed, so a listed snapshot is whole."""
    root = Path(run_dir) / SNAPSHOTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:07d}"
    tmp = root / f".tmp-step-{step:07d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "cost.json").write_text(json.dumps(cost, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def snapshots(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every whole snapshot of a run, by step."""
    root = Path(run_dir) / SNAPSHOTS
    found = [
        (int(p.name.removeprefix("step-")), p) for p in root.glob("step-*") if (p / "cost.json").is_file()
    ]
    return sorted(found)
