"""The reference cache: the reference's last hidden states, computed once per sample beside the prefix cache.

HARI's KL pulls the adapted model towards its own base outputs: the adapted
layers run with the adapter off. Those states depend on the frozen weights and
the sample alone, yet without this cache every step of every epoch computes
them again, running the adapted layers a second time. This pass runs them once
per sample, forward only, from the prefix cache and with the model the run
trains (its adapted layers in the run's own precision, so the states are the
ones a step would compute), and stores them beside the prefix cache:

    <prefix cache>/reference/<id>/cache.json, shard-*.safetensors

The id covers the prefix cache's fingerprint and how the run loads its adapted
layers. Tasks fill shards i % tasks and wait for the others' shards, as in the
prefix pass; a killed pass redoes only its missing shards.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ...data.labels import Encoded, collate
from ..hari import reference_states
from .digest import fingerprint_id
from .layout import CacheLayout, check_disk, length_batches, open_layout
from .reader import PrefixCache
from .shards import failure_marker, remove_stale, shard_progress, write_shard


def reference_fingerprint(prefix_fp: dict[str, str], adapted: str) -> dict[str, str]:
    """The prefix cache's fingerprint plus how the run loads its adapted layers (their dtype and quantization)."""
    return {**prefix_fp, "reference_of_adapted_layers": adapted}


def reference_folder(prefix_folder: str | Path, fp: dict[str, str]) -> Path:
    return Path(prefix_folder) / "reference" / fingerprint_id(fp)


def prepare_reference_layout(folder: Path, fp: dict[str, str], like: CacheLayout) -> CacheLayout:
    """The prefix cache's shard plan under this fingerprint: read when present (refused if it differs)."""
    return open_layout(
        folder,
        fp,
        lambda: CacheLayout(fp, like.hidden_size, like.dtype, like.tokens_per_batch, like.shards),
        "{directory} holds reference states for other inputs: {diff}",
    )


def fill_reference_cache(
    model,
    prefix: PrefixCache,
    examples: list[Encoded],
    first_layer: int,
    pad_id: int,
    adapted: str,
    tokens_per_batch: int,
    *,
    task: int = 0,
    tasks: int = 1,
    progress: bool = True,
) -> tuple[Path, dict[str, str], dict | None]:
    """This task's missing shards of the reference cache (shard i belongs to task i % tasks), computed as a step
    computes the reference: micro-batches from the prefix cache, the adapted layers with the adapter off.
    ``tokens_per_batch`` caps a micro-batch's padded tokens: a training micro-batch's, which the memory plan
    has checked (its step runs the same forward), so the pass needs no plan of its own.
    Returns (folder, fingerprint, what the pass cost or None when nothing was missing)."""
    fp = reference_fingerprint(prefix.layout.fingerprint, adapted)
    folder = reference_folder(prefix.directory, fp)
    layout = prepare_reference_layout(folder, fp, prefix.layout)
    mine = [s for k, s in enumerate(layout.shards) if k % tasks == task]
    todo = [s for s in mine if not (folder / s.file).is_file()]
    if not todo:
        return folder, fp, None
    check_disk(folder, layout, todo)
    device = model.get_input_embeddings().weight.device
    vocab = model.get_input_embeddings().num_embeddings
    dtype = getattr(torch, layout.dtype)
    remove_stale(folder, todo)
    bar = shard_progress(todo, "reference pass", task, progress)
    started = time.monotonic()
    was_training = model.training
    model.train()  # the mode a step computes the reference in
    try:
        with failure_marker(folder, task, "reference pass"):  # tasks waiting for this share stop
            for shard in todo:
                tensors: dict[str, torch.Tensor] = {}
                for b in length_batches(shard.lengths, tokens_per_batch):
                    positions = [shard.samples[i] for i in b]
                    chosen = [examples[i] for i in positions]
                    batch = collate(chosen, pad_id, vocab)
                    batch["inputs_embeds"] = prefix.batch(positions, batch["input_ids"].shape[1])
                    batch = {k: v.to(device) for k, v in batch.items()}
                    states = reference_states(model, batch, first_layer)
                    for row, i in enumerate(positions):
                        n = len(examples[i].input_ids)
                        tensors[str(i)] = states[row, :n].to(device="cpu", dtype=dtype).contiguous()
                    bar.update(sum(len(e.input_ids) for e in chosen))
                write_shard(folder, shard, tensors, first_layer)
    finally:
        model.train(was_training)
        bar.close()
    seconds = time.monotonic() - started
    tokens = sum(s.tokens for s in todo)
    return (
        folder,
        fp,
        {"shards_built": len(todo), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)},
    )


__all__ = ["fill_reference_cache", "prepare_reference_layout", "reference_fingerprint", "reference_folder"]
