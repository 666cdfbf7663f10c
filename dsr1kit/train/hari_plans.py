"""A HARI run's plans before anything loads: memory (``plan.hari_plan``), disk and time, from its config and
the data plan's row count (``plan.hari_run`` holds the arithmetic; this module finds what it reads)."""

from __future__ import annotations

from pathlib import Path

from ..plan import DiskPlan, Machine, Plan, hari_plan
from ..plan.hari_run import CacheFootprint, hari_disk_plan, hari_time_plan
from ..plan.timing import TimePlan
from .hari_run import HariRun, data_rows


def memory_plan(run: HariRun, machine: Machine | None = None) -> Plan:
    """Bytes per GPU and host for loading the model and one HARI step, on this node unless ``machine`` says
    otherwise (nothing loaded). With a prefix cache: one rank's adapted layers and step."""
    return hari_plan(run.plan_inputs, machine or Machine.detect())


def data_tokens_bound(run: HariRun) -> tuple[int, str]:
    """(tokens per epoch at most, how counted): every row of the data plan at max_len."""
    rows, max_len = len(data_rows(run.data)), run.data.max_len
    return rows * max_len, f"at most {rows:,} rows × max_len {max_len:,}"


def cache_footprint(run: HariRun, tokens: tuple[int, str]) -> CacheFootprint | None:
    """Where the prefix cache goes and what of it is there already (None: no cache)."""
    from ..embedded.tiny import cache_root
    from .prefix import prefix_cache_folder
    from .prefix.layout import ELEMENT_BYTES

    if run.prefix is None:
        return None
    setting = run.prefix.fill.folder
    if setting == "auto":  # one folder per fingerprint under this one: a new one is empty
        folder, held = cache_root() / "prefix", 0
    else:  # a named folder may hold part of this cache already (a pass cut short)
        folder = prefix_cache_folder(setting, {})
        held = sum(f.stat().st_size for f in folder.rglob("*.safetensors")) if folder.is_dir() else 0
    dtype = run.load.dtype
    copies = 2 if run.prefix.reference else 1
    return CacheFootprint(str(folder), tokens[0], tokens[1], dtype, ELEMENT_BYTES.get(dtype, 4), copies, held)


def disk_plan(run: HariRun, free: float | None = None, tokens: tuple[int, str] | None = None) -> DiskPlan:
    """Checkpoints and the adapter into the run folder, the prefix cache into its folder (``tokens``:
    data_tokens_bound's, read here when not given), against each filesystem's free space."""
    from .checkpoint import KEEP

    cache = cache_footprint(run, tokens or data_tokens_bound(run)) if run.prefix else None
    return hari_disk_plan(run.plan_inputs, str(Path(run.run_dir)), KEEP, cache, free)


def time_plan(
    run: HariRun, machine: Machine | None = None, nodes: int = 1, tokens: tuple[int, str] | None = None
) -> TimePlan:
    """The run's load, prefix pass and training at the benchmarks' measured rates, on ``nodes`` × this node's
    GPUs; ``tokens``: data_tokens_bound's, read when needed."""
    from ..model import staging
    from ..plan.inventory import resolve_config
    from ..plan.timing import unmeasured

    machine = machine or Machine.detect()
    hidden = resolve_config(run.model, run.trust_remote_code).hidden_size
    if why := unmeasured(hidden, machine.gpus):
        return TimePlan("HARI training", note=why)
    local = staging.locate(run.model)
    stored = staging.check_folder(local).bytes if local is not None else None
    t = run.train
    per_save = t.save_every * t.batch_size * t.grad_accum * run.data.max_len * nodes
    tokens_per_epoch, _ = tokens or data_tokens_bound(run)
    return hari_time_plan(run.plan_inputs, machine, nodes, tokens_per_epoch, t.epochs, per_save, stored)
