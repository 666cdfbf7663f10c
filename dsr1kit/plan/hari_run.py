"""A HARI run's disk and time plans: what it writes where (checkpoints, adapter, prefix and reference caches)
against each filesystem's free space, and how long its parts take at the measured rates."""

from __future__ import annotations

from dataclasses import dataclass

from .disk import DiskPlan, Write
from .inputs import TrainingInputs
from .inventory import config_stored_bytes, resolve_config
from .machine import Machine
from .planners import lora_parameter_count
from .timing import TimePlan, hari_time, unmeasured


@dataclass(frozen=True)
class CacheFootprint:
    """The prefix cache a run fills: where, how many tokens (and how counted), at how many bytes a value."""

    folder: str
    tokens: int
    how: str  # how the tokens were counted
    dtype: str
    element_bytes: int
    copies: int  # 2 with the KL reference's last states beside the prefix's
    held: int = 0  # bytes of it already there (a named folder a pass filled in part)


def _cache_write(inputs: TrainingInputs, cache: CacheFootprint) -> Write:
    hidden = resolve_config(inputs.model, inputs.trust_remote_code).hidden_size
    per_token = hidden * cache.element_bytes
    return Write(
        "prefix cache",
        cache.folder,
        max(0, cache.copies * cache.tokens * per_token - cache.held),
        f"{cache.how} = {cache.tokens:,} tokens × {per_token:,} B (hidden {hidden:,} in {cache.dtype})"
        + (
            " × 2 (the states entering the adapted layers, and the KL reference's)"
            if cache.copies == 2
            else ""
        )
        + (f", less {cache.held / 2**30:.1f} GiB already there" if cache.held else ""),
        "prefix_cache: a folder on a filesystem with room (node-local NVMe: the pass writes each "
        "shard once and every step reads them)",
    )


def hari_disk_plan(
    inputs: TrainingInputs, run_dir: str, keep: int, cache: CacheFootprint | None, free: float | None = None
) -> DiskPlan:
    """Checkpoints (``keep`` kept) and the adapter into the run folder, the prefix cache into its folder,
    against each filesystem's free space (or ``free`` bytes on every one)."""
    lora = lora_parameter_count(inputs)
    writes = [
        Write(
            "checkpoints",
            f"{run_dir}/checkpoints",
            keep * lora * 12,
            f"{keep} kept × {lora:,} LoRA parameters × (weight + 2 AdamW moments) in fp32",
            "run_dir on a filesystem with room (--run-dir, or DSR1KIT_RUNS_DIR)",
        ),
        Write("adapter", f"{run_dir}/adapter", lora * 4, f"{lora:,} parameters in fp32"),
    ]
    if cache is not None:
        writes.append(_cache_write(inputs, cache))
    return DiskPlan("HARI training", writes, free)


def hari_time_plan(
    inputs: TrainingInputs,
    machine: Machine,
    nodes: int,
    tokens_per_epoch: int,
    epochs: int,
    save_every_tokens: int,
    stored_bytes: int | None = None,
) -> TimePlan:
    """The run's load, prefix pass and training at the benchmarks' measured rates (models of R1's widths) on
    ``nodes`` × this machine's GPUs; ``stored_bytes``: the checkpoint's size on disk when it is here."""
    config = resolve_config(inputs.model, inputs.trust_remote_code)
    if why := unmeasured(config.hidden_size, machine.gpus):
        return TimePlan("HARI training", note=why)
    on_disk = stored_bytes if stored_bytes is not None else config_stored_bytes(config)
    return hari_time(
        "HARI training",
        config.hidden_size,
        on_disk / 2**30,
        tokens_per_epoch,
        epochs,
        nodes,
        machine.gpus,
        inputs.from_prefix_cache,
        save_every_tokens,
    )
