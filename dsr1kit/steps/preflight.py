"""What a run can check from its parameters alone, before a run folder, a server or a load exists.

A step module with ``preflight(p)`` raises ``BadInput`` for input no run could use (a dataset no benchmark
adapter reads, a split that does not exist, ...); `dsr1kit run` and the sbatch scripts that call it stop
with the message and exit status 2, so a misconfigured allocation ends in seconds, not after the load.
"""

from __future__ import annotations

import importlib
from pathlib import Path


class BadInput(ValueError):
    """Input the run cannot use; the message says what to change."""


CHECKED = {"10_vllm_inference": "vllm_inference"}


def check(notebook: str | Path, p) -> None:
    """Run the step's preflight for notebook ``notebook`` (nothing for a step without one)."""
    name = CHECKED.get(Path(notebook).stem)
    if name is not None:
        importlib.import_module(f"{__package__}.{name}").preflight(p)
