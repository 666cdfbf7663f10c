"""Notebook 30, adapter inspection: load → weights → probes → generations → merge → verdict."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data.plan import load_rows
from ..inspection import merge_check
from ..inspection.adapter import (  # noqa: F401 (the notebook's calls)
    Adapter,
    AdapterError,
    ModuleStats,
    find_adapter,
    inspect_adapter,
    read_adapter,
    stats_frame,
)
from ..inspection.merge_plan import merged_checkpoint_write
from ..measure.compare import ProbeResult, compare_on, encode_probe, generations
from ..measure.training_run import training_slices
from ..model.load import LoadConfig, load_with_adapter
from ..plan import DiskPlan, InspectionInputs, Machine, Plan, inspection_plans
from . import FAIL, OK, WARN, StepFailed, Verdict


class InspectionFailed(StepFailed):
    """The adapter holds nothing: lora_B is zero in an adapted module."""


@dataclass
class Inspection:
    """What the verdict and inspection.json read: the adapter's modules, the probe sets, the merge check."""

    stats: list[ModuleStats]
    probes: list[ProbeResult]
    merge_check: dict[str, Any] | None = None  # None: no merged checkpoint written


def open_adapter(p, run_dir: str | Path) -> Adapter:
    """The adapter named by adapter_dir ('latest': the newest beside this run), read and checked."""
    return read_adapter(find_adapter(p.adapter_dir, Path(run_dir).parent))


def describe(adapter: Adapter) -> str:
    return f"adapter: {adapter.path} (r={adapter.config.get('r')}, alpha={adapter.config.get('lora_alpha')})"


def base_model_name(p, adapter: Adapter) -> str:
    base = p.base_model or adapter.config.get("base_model_name_or_path")
    if not base:
        raise AdapterError(f"{adapter.path}: adapter_config.json names no base model; set base_model")
    return base


def plan_inputs(p) -> InspectionInputs:
    """What the inspection planner reads of notebook 30's parameters."""
    return InspectionInputs(
        quantization=p.quantization,
        quantize_experts=p.quantize_experts,
        max_len=p.max_len,
        merge=bool(p.merge_out),
    )


def memory_plan(p, machine: Machine | None = None, adapter: Adapter | None = None) -> list[Plan]:
    """The inspection's load + probes, then (with merge_out) the merge's fp32 logits check, on ``machine``
    (this node by default). Without an adapter (the look-ahead, before training) base_model is planned,
    or the embedded model."""
    base = base_model_name(p, adapter) if adapter else (p.base_model or "tiny")
    return list(inspection_plans(plan_inputs(p), base, machine or Machine.detect()).values())


def disk_plan(p, run_dir: Path, free: float | None = None, adapter: Adapter | None = None) -> DiskPlan:
    """With merge_out, the merged checkpoint: only the shards the adapter changes are written, the others
    linked to the base's."""
    writes = []
    if p.merge_out:
        if adapter is None:
            try:
                adapter = open_adapter(p, run_dir)
            except (AdapterError, FileNotFoundError):
                adapter = None  # before training: the last layer's shards are counted
        base = base_model_name(p, adapter) if adapter else (p.base_model or "tiny")
        fix = (
            "merge_out: '' (no merged copy; the adapter is checked against base + ΔW), or a run_dir with room"
        )
        writes.append(
            merged_checkpoint_write(base, adapter.path if adapter else None, Path(run_dir) / p.merge_out, fix)
        )
    return DiskPlan("adapter inspection", writes, free)


def load_config(p, adapter: Adapter) -> LoadConfig:
    """The adapter's base as notebook 30 loads it: bf16 over the GPUs (fp32 on a CPU), NF4 if asked."""
    return LoadConfig.for_evaluation(base_model_name(p, adapter), p.quantization, p.quantize_experts)


def load_adapted(p, adapter: Adapter, plan=None):
    """The base through the training loader (NF4 if asked), the adapter attached, once the plan fits."""
    if plan is not None:
        plan.check()
    return load_with_adapter(load_config(p, adapter), adapter.path)


def probe_sets(p, adapter_dir: Path) -> dict[str, list[dict]]:
    rows = load_rows(p.probe_dataset).rows
    sets = training_slices(rows, adapter_dir, p.n_probe)
    sets["retain"] = load_rows(p.retain_dataset).rows[: p.n_probe]
    return sets


def compare_all(model, tokenizer, sets: dict[str, list[dict]], p) -> list[ProbeResult]:
    return [
        compare_on(model, encode_probe(tokenizer, rows, p.max_len, p.system_prompt), name)
        for name, rows in sets.items()
    ]


def probe_frame(results: list[ProbeResult]):
    """One row per probe set: KL(base‖adapted), top-1 agreement, CE of both models."""
    import pandas as pd

    return pd.DataFrame([r.row() for r in results])


def side_by_side(model, tokenizer, sets: dict[str, list[dict]], p):
    """Greedy answers of base and adapted model to the first n_generate rows of the first probe set."""
    import pandas as pd

    rows = next(iter(sets.values()))[: p.n_generate]
    return pd.DataFrame(generations(model, tokenizer, rows, p.max_new_tokens, p.system_prompt))


def merge_and_verify(
    model, tokenizer, loaded, adapter: Adapter, out_dir: Path, sets, logits_check: bool = True
):
    """Merged checkpoint in out_dir, checked on the first probe row (``inspection.merge_check``)."""
    ids, _ = encode_probe(tokenizer, next(iter(sets.values()))[:1], 256, "")[0]
    return merge_check.merge_and_verify(model, loaded.path, adapter, out_dir, ids, logits_check)


def verdict(result: Inspection) -> Verdict:
    """Did it learn (B ≠ 0, else fail; training-slice CE down, else warn) and how far did it move."""
    stats = result.stats
    by_name = {r.name: r for r in result.probes}
    lines, status = [], OK
    zero_b = [s.module for s in stats if s.norm_b == 0]
    headline = "lora_B is non-zero in every module" if not zero_b else f"lora_B is all zero in {zero_b}"
    if zero_b:
        status = FAIL
    train = by_name.get("training slice") or by_name.get("probe")
    if train:
        went_down = train.ce_adapted < train.ce_base
        line = (
            f"CE on the {train.name}: {train.ce_base:.4f} → {train.ce_adapted:.4f} "
            f"({'down' if went_down else 'NOT down'})"
        )
        headline, lines = (line, [headline]) if not zero_b else (headline, [line])
        if not went_down and status == OK:
            status = WARN
    if "held-out" in by_name:
        h = by_name["held-out"]
        lines.append(f"CE on held-out rows: {h.ce_base:.4f} → {h.ce_adapted:.4f}")
    if "retain" in by_name:
        r = by_name["retain"]
        lines.append(
            f"moved on unrelated text: mean KL(base‖adapted) {r.kl_mean:.3e}, top-1 agreement "
            f"{r.top1_agreement:.1%}, CE {r.ce_base:.4f} → {r.ce_adapted:.4f}"
        )
    ratios = [s.ratio for s in stats if s.ratio is not None]
    if ratios:
        lines.append(f"‖ΔW‖/‖W‖ from {min(ratios):.2e} to {max(ratios):.2e} over {len(stats)} modules")
    return Verdict(status, headline, lines, InspectionFailed)


def write_summary(run_dir: str | Path, result: Inspection) -> Path:
    """inspection.json: every module's numbers, every probe set's, and the merge check."""
    path = Path(run_dir) / "inspection.json"
    path.write_text(
        json.dumps(
            {
                "modules": [s.to_dict() for s in result.stats],
                "probes": [r.row() for r in result.probes],
                "merge": result.merge_check,
            },
            indent=2,
            default=str,
        )
    )
    return path
