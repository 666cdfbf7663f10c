"""The pass that writes the shards: sequential, or as a wavefront over the node's GPUs.

Within a node, the frozen layers are cut into stages at the GPU boundaries of
the device_map and micro-batches flow through them as a wavefront: stage k
works on micro-batch t - k while stage k - 1 works on t - k + 1, so every GPU
is busy instead of one at a time. Each stage is a thread; the tensors cross
GPUs through the model's own dispatch hooks. A shard is written to a temporary
name and renamed when whole, so a killed or requeued pass redoes only the
shards that are missing.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...data.labels import Encoded, collate
from ...model.lora import decoder_layers
from ..hari import prefix_forward, run_layers
from .layout import CacheLayout, check_disk, length_batches
from .shards import remove_stale, shard_progress, write_shard


def stage_bounds(model, first_layer: int, stages: int | None = None) -> list[int]:
    """Layer indices where stages start, plus ``first_layer`` at the end.

    Default: a new stage wherever the device_map moves to another device, so
    each GPU is one stage. ``stages`` cuts the layers into that many even parts
    instead (how the wavefront is tested on one CPU).
    """
    if first_layer == 0:
        return [0, 0]
    if stages:
        stages = min(stages, first_layer)
        return sorted({round(k * first_layer / stages) for k in range(stages)}) + [first_layer]
    layers = decoder_layers(model)

    def device(i):
        return next((t.device for t in layers[i].parameters()), None)

    bounds = [0] + [i for i in range(1, first_layer) if device(i) != device(i - 1)]
    return bounds + [first_layer]


def _inputs(model, examples: list[Encoded], pad_id: int, vocab: int, device):
    batch = {k: v.to(device) for k, v in collate(examples, pad_id, vocab).items()}
    # embeddings, causal mask, rotary: layer 0's inputs
    hidden, args, kwargs = prefix_forward(model, batch, 0)
    return hidden, args, kwargs


def sequential_pass(
    model, batches: list[list[Encoded]], first_layer: int, pad_id: int
) -> Iterator[torch.Tensor]:
    """Hidden states entering ``first_layer``, one [B, S, H] tensor per batch, one batch at a time."""
    vocab = model.get_input_embeddings().num_embeddings
    device = model.get_input_embeddings().weight.device
    for examples in batches:
        batch = {k: v.to(device) for k, v in collate(examples, pad_id, vocab).items()}
        with torch.no_grad():
            hidden, _, _ = prefix_forward(model, batch, first_layer)
        yield hidden


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def wavefront_pass(
    model, batches: list[list[Encoded]], first_layer: int, pad_id: int, bounds: list[int]
) -> Iterator[torch.Tensor]:
    """The same tensors as ``sequential_pass``, with stage k on batch t - k while stage k - 1 is on t - k + 1.

    One thread feeds layer 0's inputs, one thread per stage runs its layers,
    and results come out in batch order. An error in any thread is raised here.
    """
    vocab = model.get_input_embeddings().num_embeddings
    device = model.get_input_embeddings().weight.device
    n = len(bounds) - 1
    links = [queue.Queue(maxsize=2) for _ in range(n + 1)]
    stop = threading.Event()

    def put(q, item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def feed():
        try:
            with torch.no_grad():
                for examples in batches:
                    if not put(links[0], _inputs(model, examples, pad_id, vocab, device)):
                        return
            put(links[0], None)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer
            put(links[0], _Failure(err))

    def stage(k: int):
        with torch.no_grad():
            while True:
                item = links[k].get()
                if item is None or isinstance(item, _Failure):
                    put(links[k + 1], item)
                    return
                try:
                    hidden, args, kwargs = item
                    item = (
                        run_layers(model, bounds[k], hidden, args, kwargs, end=bounds[k + 1]),
                        args,
                        kwargs,
                    )
                except BaseException as err:  # noqa: BLE001
                    put(links[k + 1], _Failure(err))
                    return
                if not put(links[k + 1], item):
                    return

    threads = [threading.Thread(target=feed, daemon=True, name="prefix-feed")]
    threads += [
        threading.Thread(target=stage, args=(k,), daemon=True, name=f"prefix-stage-{k}") for k in range(n)
    ]
    for t in threads:
        t.start()
    try:
        while True:
            item = links[n].get()
            if item is None:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item[0]
    finally:
        stop.set()
        for link in links:  # wake a stage blocked on an empty queue
            try:
                link.put_nowait(None)
            except queue.Full:
                pass
        for t in threads:
            t.join(timeout=5)


@dataclass
class BuildStats:
    directory: str
    shards: int
    shards_built: int = 0
    shards_reused: int = 0
    shards_other_tasks: int = 0
    tokens_built: int = 0
    padded_tokens: int = 0
    seconds: float = 0.0
    bytes_total: int = 0
    stages: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_built / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 1)}


def build(
    model,
    examples: list[Encoded],
    directory: str | Path,
    layout: CacheLayout,
    first_layer: int,
    pad_id: int,
    *,
    task: int = 0,
    tasks: int = 1,
    pipeline: bool = True,
    stages: int | None = None,
    progress: bool = True,
) -> BuildStats:
    """Write this task's missing shards (shard i belongs to task i % tasks); the others are left alone."""
    directory = Path(directory)
    mine = [s for k, s in enumerate(layout.shards) if k % tasks == task]
    todo = [s for s in mine if not (directory / s.file).is_file()]
    stats = BuildStats(
        str(directory),
        len(layout.shards),
        shards_reused=len(mine) - len(todo),
        shards_other_tasks=len(layout.shards) - len(mine),
        bytes_total=layout.tokens * layout.bytes_per_token,
    )
    if not todo:
        return stats
    remove_stale(directory, todo)
    check_disk(directory, layout, todo)
    bounds = stage_bounds(model, first_layer, stages)
    stats.stages = bounds
    dtype = getattr(torch, layout.dtype)
    # every micro-batch of every missing shard, in shard order, through one wavefront (no refill per shard)
    plan = [
        (k, [shard.samples[i] for i in b])
        for k, shard in enumerate(todo)
        for b in length_batches(shard.lengths, layout.tokens_per_batch)
    ]
    left = Counter(k for k, _ in plan)
    batches = [[examples[i] for i in positions] for _, positions in plan]
    run = (
        wavefront_pass(model, batches, first_layer, pad_id, bounds)
        if pipeline and len(bounds) > 2
        else sequential_pass(model, batches, first_layer, pad_id)
    )
    bar = shard_progress(todo, "prefix pass", task, progress)
    started = time.monotonic()
    model.eval()
    tensors: dict[str, torch.Tensor] = {}
    for (k, positions), hidden in zip(plan, run):
        stats.padded_tokens += hidden.shape[0] * hidden.shape[1]
        for row, i in enumerate(positions):
            tensors[str(i)] = (
                hidden[row, : len(examples[i].input_ids)].to(device="cpu", dtype=dtype).contiguous()
            )
        bar.update(sum(len(examples[i].input_ids) for i in positions))
        left[k] -= 1
        if left[k]:
            continue
        shard = todo[k]
        write_shard(directory, shard, tensors, first_layer)
        tensors = {}
        stats.shards_built += 1
        stats.tokens_built += shard.tokens
        stats.seconds = time.monotonic() - started
        bar.set_postfix(tok_s=f"{stats.tokens_per_s:,.0f}")
    bar.close()
    return stats
