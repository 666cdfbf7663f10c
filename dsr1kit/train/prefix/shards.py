"""Writing a cache's shards, shared by the prefix pass and the reference pass.

A shard is whole or absent (written under a temp name, then renamed), so a
killed pass redoes only its missing shards. A task whose share fails leaves a
``failed-task<r>`` marker naming the pass, so that the tasks waiting for the
whole cache stop with that error instead of hanging.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.std import tqdm

from .layout import ShardPlan


def shard_progress(todo: list[ShardPlan], what: str, task: int, progress: bool) -> tqdm:
    """A bar over the tokens of the shards this task writes."""
    return tqdm(
        total=sum(s.tokens for s in todo),
        desc=f"{what} (task {task})",
        unit="tok",
        unit_scale=True,
        disable=not progress,
        mininterval=2,
    )


def remove_stale(directory: Path, todo: list[ShardPlan]) -> None:
    """Temp files of shards a killed pass of this task had half written."""
    for shard in todo:
        for stale in directory.glob(f".{shard.file}.*.tmp"):
            stale.unlink(missing_ok=True)


def write_shard(
    directory: Path, shard: ShardPlan, tensors: dict[str, torch.Tensor], first_layer: int
) -> None:
    tmp = directory / f".{shard.file}.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata={"first_adapted_layer": str(first_layer)})
    tmp.replace(directory / shard.file)  # whole or absent: a kill before this line redoes the shard


@contextmanager
def failure_marker(directory: Path, task: int, what: str) -> Iterator[None]:
    """Clears this task's old marker; an error inside writes a new one (the pass's name, then the error)."""
    marker = directory / f"failed-task{task}"
    marker.unlink(missing_ok=True)
    try:
        yield
    except BaseException as err:
        # whole or absent: a waiting task may read it at any moment
        tmp = directory / f".{marker.name}.{os.getpid()}.tmp"
        tmp.write_text(f"{what}\n{type(err).__name__}: {err}\n")
        tmp.replace(marker)
        raise


def reported_failure(directory: Path, since: float) -> str | None:
    """'the <pass> failed on task<r>: <error>' for the first marker written after ``since``, else None."""
    for marker in sorted(directory.glob("failed-task*")):
        try:  # a restarting task removes its old marker: gone between the listing and the read is no failure
            if marker.stat().st_mtime < since:
                continue
            text = marker.read_text().strip()
        except FileNotFoundError:
            continue
        what, _, error = text.partition("\n")
        task = marker.name.removeprefix("failed-")
        if not error:  # a marker written before markers named their pass
            return f"a pass failed on {task}: {what}"
        return f"the {what} failed on {task}: {error}"
    return None


__all__ = ["failure_marker", "remove_stale", "reported_failure", "shard_progress", "write_shard"]
