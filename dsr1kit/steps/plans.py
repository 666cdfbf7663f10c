"""Every memory plan a notebook's run makes, from its parameters: for `dsr1kit plan` and notebook 00's look ahead.

Each step module that loads a model has ``memory_plan(p, machine)``; this module only finds the right one.
"""

from __future__ import annotations

from pathlib import Path

from ..plan import Machine, Plan

PLANNED = {
    "10_vllm_inference": "vllm_inference",
    "20_hari_training": "hari_training",
    "30_adapter_inspection": "adapter_inspection",
}


def plans_for(notebook: str, p, machine: Machine) -> list[Plan]:
    """The plans of notebook ``notebook`` run with parameters ``p`` on ``machine``; [] for a step that loads no
    model."""
    import importlib

    name = PLANNED.get(Path(notebook).stem)
    if name is None:
        return []
    return importlib.import_module(f"{__package__}.{name}").memory_plan(p, machine)


def plans_for_files(specs: list[str], machine: Machine) -> list[tuple[str, Plan]]:
    """(name, plan) for each params spec, 'STEP.yaml' or layered 'R1.yaml+REHEARSAL.yaml', on ``machine``.

    The notebook is the first file's name (e.g. 20_hari_training.yaml), as for ``dsr1kit plan``; notebook
    00 calls this to plan the steps an allocation is about to run against the GPUs it found.
    """
    from .. import params
    from ..run.paths import resolve

    out = []
    for spec in specs:
        files = [resolve(f.strip()) for f in spec.split("+")]
        notebook = Path(files[0]).stem
        for plan in plans_for(notebook, params.load(notebook, files), machine):
            out.append((f"{notebook}: {plan.step}", plan))
    return out
