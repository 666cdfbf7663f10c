"""Every plan a notebook's run makes, from its parameters: for `dsr1kit plan` and notebook 00's look ahead.

Each step module that loads a model has ``memory_plan(p, machine)``, and each that writes much has
``disk_plan(p, run_dir, free)``; this module finds the right ones, and counts the one write several steps
share (a merged checkpoint).
"""

from __future__ import annotations

from pathlib import Path

from ..plan import Machine, Plan
from ..plan.disk import DiskPlan, Write

PLANNED = {
    "10_vllm_inference": "vllm_inference",
    "20_hari_training": "hari_training",
    "30_adapter_inspection": "adapter_inspection",
}


def _module(notebook: str):
    import importlib

    name = PLANNED.get(Path(notebook).stem)
    return None if name is None else importlib.import_module(f"{__package__}.{name}")


def plans_for(notebook: str, p, machine: Machine) -> list[Plan]:
    """The memory plans of notebook ``notebook`` run with parameters ``p`` on ``machine``; [] for a step that
    loads no model."""
    module = _module(notebook)
    return [] if module is None else module.memory_plan(p, machine)


def disk_plan_for(
    notebook: str, p, run_dir: str | Path | None = None, free: float | None = None
) -> DiskPlan | None:
    """What notebook ``notebook`` writes with ``p`` (into ``run_dir``, or a fresh folder under the runs root),
    against each filesystem's free space (or ``free`` bytes on every one); None for a step that writes little."""
    module = _module(notebook)
    if module is None:
        return None
    return module.disk_plan(p, Path(run_dir) if run_dir else default_run_dir(p), free)


def default_run_dir(p) -> Path:
    """Where the run folder of ``p`` will be: its run_dir, else a new folder under $DSR1KIT_RUNS_DIR or runs/."""
    import os

    from ..run.paths import resolve

    if p.run_dir:
        return Path(resolve(p.run_dir))
    return Path(resolve(os.environ.get("DSR1KIT_RUNS_DIR", "runs"))) / "<new run>"


def plans_for_files(specs: list[str], machine: Machine) -> list[tuple[str, Plan | DiskPlan]]:
    """(name, plan) for each params spec, 'STEP.yaml' or layered 'R1.yaml+REHEARSAL.yaml', on ``machine``: its
    memory plans, then its disk plan against this node's filesystems.

    The notebook is the first file's name (e.g. 20_hari_training.yaml), as for ``dsr1kit plan``; notebook
    00 calls this to plan the steps an allocation is about to run against the GPUs and disks it found.
    """
    from .. import params
    from ..run.paths import resolve

    out: list[tuple[str, Plan | DiskPlan]] = []
    for spec in specs:
        files = [resolve(f.strip()) for f in spec.split("+")]
        notebook = Path(files[0]).stem
        p = params.load(notebook, files)
        for plan in plans_for(notebook, p, machine):
            out.append((f"{notebook}: {plan.step}", plan))
        disk = disk_plan_for(notebook, p)
        if disk is not None:
            out.append((notebook, disk))
    return out


def merged_checkpoint_write(base: str, adapter_path: Path | None, folder: Path, fix: str) -> Write:
    """The bytes a merge of the adapter at ``adapter_path`` into ``base`` writes into ``folder``: the shards it
    rewrites (read from the base's index and headers when the base is on this node), the rest linked."""
    from ..embedded.tiny import resolve_model
    from ..inspection.adapter import read_adapter
    from ..inspection.merge import merge_write_bytes
    from ..model import staging

    local = staging.locate(resolve_model(base))
    what = "merged checkpoint"
    if local is None:
        from ..plan.inventory import inventory, resolve_config

        inv = inventory(resolve_config(base))
        last = inv.layer_sizes()[-1] * 2
        return Write(what, str(folder), last, "the base is not on this node: its last layer in bf16", fix)
    if adapter_path is not None and (adapter_path / "adapter_config.json").is_file():
        modules = read_adapter(adapter_path).modules
        why = f"{len(modules)} adapted modules"
    else:
        from ..model.checkpoint_index import read_weight_map

        weight_map = read_weight_map(local)
        last = max(int(k.split(".")[2]) for k in weight_map if k.startswith("model.layers."))
        modules = sorted(
            k[: -len(".weight")]
            for k in weight_map
            if k.startswith(f"model.layers.{last}.self_attn.") and k.endswith("proj.weight")
        )
        why = "no adapter yet: the last layer's attention"
    size, shards = merge_write_bytes(local, modules)
    return Write(what, str(folder), size, f"{why}: {shards} shard(s) rewritten, the others linked", fix)
