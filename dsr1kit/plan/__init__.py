"""Memory plan: the bytes each heavy step needs per GPU and on the host, checked before anything loads.

A wasted multi-node allocation is the expensive failure, so each step asks
first: from the model's config (no weights), its quantization and placement,
the sequence length, batch and step, what will each GPU and the host hold,
and does it fit this machine? A plan that does not fit stops the step with
the table and what to change. ``dsr1kit plan PARAMS.yaml`` prints the same
plan without running anything (``--gpus/--gpu-gib/--host-gib`` for another
machine than this one).

Modules: ``inputs`` (what each planner reads, built by the step modules),
``inventory`` (parameters per unit from the model's config), ``devices``
(bytes per device for a workload), ``planners`` (one per step), ``advice``
(settings that would fit, each tried), ``result`` (the plan and its table),
``machine`` (what a node offers), ``disk`` (the bytes each step writes against the free space where it
writes them).
"""

from .devices import GIB, Device
from .disk import DiskPlan, DiskPlanError, Write
from .inputs import InspectionInputs, ServingInputs, TrainingInputs
from .machine import Machine
from .planners import (
    hari_plan,
    hari_plan_for_config,
    inspect_plan,
    inspection_plans,
    prefix_pass_plan,
    reference_plan,
    serve_plan,
)
from .result import Plan, PlanError

__all__ = [
    "GIB",
    "Device",
    "DiskPlan",
    "DiskPlanError",
    "InspectionInputs",
    "Machine",
    "Plan",
    "PlanError",
    "ServingInputs",
    "TrainingInputs",
    "Write",
    "hari_plan",
    "hari_plan_for_config",
    "inspect_plan",
    "inspection_plans",
    "prefix_pass_plan",
    "reference_plan",
    "serve_plan",
]
