"""The cache on disk: which samples go to which shard, what ``cache.json`` holds, and what is missing.

Samples are sorted by length and packed into micro-batches of about
``tokens_per_batch`` padded tokens, and batches into shards of about
``shard_mib``. Shard ``i`` belongs to task ``i % tasks``. Samples are named by
position, not by their id: datasets often repeat ids across splits or files,
and the fingerprint pins the order anyway.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ...data.labels import Encoded
from .digest import differences

INDEX = "cache.json"
SHARD = "shard-{:05d}.safetensors"
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class PrefixCacheError(RuntimeError):
    """The cache does not belong to this run, is incomplete, or will not fit on its disk."""


def length_batches(lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Indices sorted by length (longest first) and packed so batch × longest ≤ tokens_per_batch.

    Sorting keeps padding small; a sample longer than the budget gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= tokens_per_batch:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@dataclass
class ShardPlan:
    file: str
    samples: list[int]  # positions in the encoded examples
    lengths: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def plan_shards(examples: list[Encoded], tokens_per_batch: int, shard_tokens: int) -> list[ShardPlan]:
    """Whole micro-batches, in length order, grouped into shards of about ``shard_tokens`` tokens."""
    lengths = [len(e.input_ids) for e in examples]
    shards: list[ShardPlan] = []
    current: list[int] = []
    for batch in length_batches(lengths, tokens_per_batch):
        current += batch
        if sum(lengths[i] for i in current) >= shard_tokens:
            shards.append(current)
            current = []
    if current:
        shards.append(current)
    return [ShardPlan(SHARD.format(k), list(idx), [lengths[i] for i in idx]) for k, idx in enumerate(shards)]


@dataclass
class CacheLayout:
    """What cache.json holds."""

    fingerprint: dict[str, str]
    hidden_size: int
    dtype: str
    tokens_per_batch: int
    shards: list[ShardPlan]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def bytes_per_token(self) -> int:
        return self.hidden_size * ELEMENT_BYTES[self.dtype]

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "tokens": self.tokens}, indent=1)

    @classmethod
    def read(cls, directory: Path) -> CacheLayout:
        raw = json.loads((directory / INDEX).read_text())
        raw.pop("tokens", None)
        raw["shards"] = [ShardPlan(**s) for s in raw["shards"]]
        return cls(**raw)


def missing_shards(directory: Path, layout: CacheLayout) -> list[ShardPlan]:
    return [s for s in layout.shards if not (directory / s.file).is_file()]


def check_disk(directory: Path, layout: CacheLayout, todo: list[ShardPlan]) -> int:
    """Bytes still to write; PrefixCacheError when the disk has less free space than that (plus 5%)."""
    need = sum(s.tokens for s in todo) * layout.bytes_per_token
    free = shutil.disk_usage(directory).free
    if need * 1.05 > free:
        raise PrefixCacheError(
            f"the prefix cache needs {need / 2**30:.2f} GiB more ({sum(s.tokens for s in todo):,} tokens × "
            f"{layout.bytes_per_token:,} B) but {directory} has {free / 2**30:.2f} GiB free. Point prefix_cache at a "
            f"larger disk (node-local or scratch), or lower sample_limit / max_len"
        )
    return need


def write_layout(directory: Path, layout: CacheLayout) -> None:
    """Whole or absent, and a private temp name: tasks on several nodes may write it at once (same content)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{INDEX}.", dir=directory)
    with os.fdopen(fd, "w") as f:
        f.write(layout.to_json())
    os.replace(tmp, directory / INDEX)


def open_layout(
    directory: Path, fp: dict[str, str], planned: Callable[[], CacheLayout], refusal: str
) -> CacheLayout:
    """The layout in ``directory`` when it has one (PrefixCacheError naming the fields if its fingerprint differs:
    ``refusal`` + the differences), else ``planned()``, written."""
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / INDEX).is_file():
        layout = CacheLayout.read(directory)
        diff = differences(layout.fingerprint, fp)
        if diff:
            raise PrefixCacheError(refusal.format(directory=directory, diff="; ".join(diff)))
        return layout
    layout = planned()
    write_layout(directory, layout)
    return layout


def prepare_layout(
    directory: str | Path,
    fp: dict[str, str],
    examples: list[Encoded],
    hidden_size: int,
    dtype: str,
    tokens_per_batch: int,
    shard_mib: float,
) -> CacheLayout:
    """The cache's layout: read when the folder has one (refused if its fingerprint differs), else planned
    and written. Every task plans the same layout from the same inputs, so none waits for another."""

    def planned() -> CacheLayout:
        shard_tokens = max(1, int(shard_mib * 2**20 / (hidden_size * ELEMENT_BYTES[dtype])))
        shards = plan_shards(examples, tokens_per_batch, shard_tokens)
        return CacheLayout(fp, hidden_size, dtype, tokens_per_batch, shards)

    return open_layout(
        Path(directory),
        fp,
        planned,
        "{directory} holds a prefix cache for other inputs: {diff}. Use another prefix_cache folder ('auto' "
        "picks one per fingerprint), or delete this one to rebuild it",
    )
