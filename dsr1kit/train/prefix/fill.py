"""Filling a run's cache: each task its share (shard i to task i % tasks), the full model loaded only when one
of its shards is missing.

Tasks do not meet in a collective while they fill it (the pass can outlast a collective's timeout): a task
whose share fails writes ``failed-task<r>`` so that the tasks polling for the whole cache stop instead of
hanging, and each task appends what its pass cost to ``passes-task<r>.jsonl``.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...data.labels import Encoded
from ...model.load import LoadConfig, load_model, local_checkpoint
from .. import dist
from .digest import PrefixConfig, fingerprint, fingerprint_id
from .layout import CacheLayout, PrefixCacheError, check_disk, missing_shards, prepare_layout
from .shards import failure_marker, reported_failure
from .writer import build


@dataclass(frozen=True)
class FillConfig:
    """Where the cache lives and how the pass batches and stores (notebook 20's prefix_* parameters)."""

    folder: str  # prefix_cache: auto (one folder per fingerprint) or a folder; not "off"
    tokens_per_batch: int  # padded tokens per micro-batch of the pass
    shard_mib: float  # MiB per shard: a killed pass redoes only the missing ones
    pipeline: bool  # the pass as a wavefront over the node's GPUs


def prefix_cache_folder(setting: str, fp: dict[str, str]) -> Path:
    """auto: one folder per fingerprint under the kit's cache (DSR1KIT_CACHE), so runs on the same inputs share it."""
    from ...embedded.tiny import cache_root
    from ...run.paths import PROJECT_ROOT

    if setting == "auto":
        return cache_root() / "prefix" / fingerprint_id(fp)
    folder = Path(setting).expanduser()
    # papermill runs in notebooks/: one meaning
    return folder if folder.is_absolute() else PROJECT_ROOT / folder


def locate(
    setting: str, cfg: PrefixConfig, model: str, tokenizer, examples: list[Encoded], first_layer: int
) -> tuple[Path, dict[str, str]]:
    """(folder, fingerprint) of the cache these inputs would use; nothing is read from it."""
    fp = fingerprint(cfg, local_checkpoint(model), tokenizer, examples, first_layer)
    return prefix_cache_folder(setting, fp), fp


def fill_prefix_cache(
    fill: FillConfig,
    load: LoadConfig,
    cfg: PrefixConfig,
    info: dist.DistInfo,
    examples: list[Encoded],
    tokenizer,
    first_layer: int,
    check_plan: Callable[[], object],
) -> tuple[Path, dict[str, str], dict | None]:
    """This task's missing shards (task = rank): the full model is loaded only when one is missing, after
    ``check_plan`` (the prefix pass's memory plan) says it fits. Returns (folder, fingerprint, stats)."""
    from ...plan.inventory import resolve_config

    folder, fp = locate(fill.folder, cfg, load.model, tokenizer, examples, first_layer)
    hidden = resolve_config(load.model, load.trust_remote_code).hidden_size
    layout = prepare_layout(folder, fp, examples, hidden, cfg.dtype, fill.tokens_per_batch, fill.shard_mib)
    mine = [s for k, s in enumerate(layout.shards) if k % info.world_size == info.rank]
    missing = missing_shards(folder, layout)
    if torch.cuda.is_available() and dist.any_rank(bool(missing) and info.local_rank > 0):
        raise PrefixCacheError(
            f"{folder} misses {len(missing)} of {len(layout.shards)} shards, and this job runs several ranks per node: "
            f"each would load the whole model to fill its share. Fill it first with one task per node "
            f"(slurm/hari_prefix.sbatch, or slurm/hari_cached.sh which chains both jobs)"
        )
    if all((folder / s.file).is_file() for s in mine):
        return folder, fp, None
    check_disk(folder, layout, missing)  # every task's share: they may all write to this one disk
    check_plan()
    loaded = load_model(load, rank=info.rank, tokenizer=tokenizer)
    try:
        with failure_marker(folder, info.rank, "prefix pass"):  # ranks waiting for this share stop
            stats = build(
                loaded.model,
                examples,
                folder,
                layout,
                first_layer,
                tokenizer.pad_token_id,
                task=info.rank,
                tasks=info.world_size,
                pipeline=fill.pipeline,
                progress=info.is_main,
            )
    finally:
        del loaded
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    row = {
        **stats.to_dict(),
        "task": info.rank,
        "tasks": info.world_size,
        "host": socket.gethostname(),
        "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    with (folder / f"passes-task{info.rank}.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    return folder, fp, row


def prefix_passes(folder: Path) -> list[dict[str, Any]]:
    """Every recorded pass over ``folder`` that built something, task by task."""
    rows = []
    for path in sorted(folder.glob("passes-task*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("shards_built")]


def wait_for_shards(folder: Path, poll_s: float = 2.0) -> None:
    """Until every task's shards exist (the pass can outlast a collective's timeout, so no barrier), or a task
    reports that its share failed."""
    layout = CacheLayout.read(folder)
    # a marker older than this wait is from an earlier job; its task is redoing its share
    since = time.time() - 60
    while missing_shards(folder, layout):
        failure = reported_failure(folder, since)
        if failure:
            raise PrefixCacheError(f"{failure} (see that rank's log)")
        time.sleep(poll_s)
