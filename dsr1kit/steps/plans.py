"""Every plan a notebook's run makes, from its parameters: for `dsr1kit plan` and notebook 00's look ahead.

Each step module that loads a model has ``memory_plan(p, machine)``, and each that writes much has
``disk_plan(p, run_dir, free)``; this module finds the right ones, and counts the one write several steps
share (a merged checkpoint).
"""

from __future__ import annotations

from pathlib import Path

from ..plan import Machine, Plan
from ..plan.disk import DiskPlan

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
