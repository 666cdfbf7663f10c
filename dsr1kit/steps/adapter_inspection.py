"""Notebook 30, adapter inspection: load → weights → probes → generations → merge → verdict."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .. import params as P
from ..data.plan import load_rows
from ..plan import InspectionInputs, Machine, Plan, inspection_plans
from ..run.paths import PROJECT_ROOT, resolve
from ..inspection.adapter import (Adapter, AdapterError, ModuleStats, inspect_adapter,  # noqa: F401
                                  latest_adapter, read_adapter, stats_frame)
from ..measure.compare import ProbeResult, compare_on, encode_probe, generations, training_slices
from ..inspection.merge import merge_into_copy, verify_merge, verify_merged_weights
from . import FAIL, OK, WARN, StepFailed, Verdict


class InspectionFailed(StepFailed):
    """The adapter holds nothing: lora_B is zero in an adapted module."""


def find_adapter(value: str, runs_root: str | Path | None = None) -> Path:
    """'latest' → the newest adapter of a HARI run under runs/; else the given folder."""
    if value != "latest":
        return resolve(value)
    root = Path(runs_root or PROJECT_ROOT / "runs")
    found = latest_adapter(root)
    if found is None:
        raise AdapterError(f"no HARI adapter under {root}: run notebook 20 first or set adapter_dir")
    return found


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
    return InspectionInputs(quantization=p.quantization, quantize_experts=p.quantize_experts, max_len=p.max_len,
                            merge=bool(p.merge_out))


def memory_plans(p, adapter: Adapter, machine: Machine | None = None) -> dict[str, Plan]:
    """The inspection's load + probes, and (with merge_out) the fp32 logits check of the merge, on this node."""
    return inspection_plans(plan_inputs(p), base_model_name(p, adapter), machine or Machine.detect())


def memory_plan(p, machine: Machine | None = None) -> list[Plan]:
    """The plans of notebook 30 before its adapter exists (the look-ahead): base_model, or the embedded model."""
    return list(inspection_plans(plan_inputs(p), p.base_model or "tiny", machine or Machine.detect()).values())


def load_adapted(p, adapter: Adapter, plan=None):
    """Base model through the training loader (NF4 if asked), with the adapter attached, once the plan fits."""
    from peft import PeftModel

    from ..model.load import load_model, load_tokenizer

    if plan is not None:
        plan.check()
    base = base_model_name(p, adapter)
    on_gpu = torch.cuda.is_available()
    hp = P.HariParams(model=base, quantization=p.quantization, quantize_experts=p.quantize_experts,
                      dtype="bfloat16" if on_gpu else "float32", device_map="contiguous" if on_gpu else "cpu")
    loaded = load_model(hp)
    model = PeftModel.from_pretrained(loaded.model, str(adapter.path))
    model.eval()
    tok_dir = adapter.path if (adapter.path / "tokenizer_config.json").is_file() else loaded.path
    return model, load_tokenizer(str(tok_dir)), loaded


def probe_sets(p, adapter_dir: Path) -> dict[str, list[dict]]:
    rows = load_rows(p.probe_dataset).rows
    sets = training_slices(rows, adapter_dir, p.n_probe)
    sets["retain"] = load_rows(p.retain_dataset).rows[: p.n_probe]
    return sets


def compare_all(model, tokenizer, sets: dict[str, list[dict]], p) -> list[ProbeResult]:
    return [compare_on(model, encode_probe(tokenizer, rows, p.max_len, p.system_prompt), name)
            for name, rows in sets.items()]


def probe_frame(results: list[ProbeResult]):
    """One row per probe set: KL(base‖adapted), top-1 agreement, CE of both models."""
    import pandas as pd

    return pd.DataFrame([r.row() for r in results])


def side_by_side(model, tokenizer, sets: dict[str, list[dict]], p):
    """Greedy answers of base and adapted model to the first n_generate rows of the first probe set."""
    import pandas as pd

    rows = next(iter(sets.values()))[: p.n_generate]
    return pd.DataFrame(generations(model, tokenizer, rows, p.max_new_tokens, p.system_prompt))


def merge_and_verify(model, tokenizer, loaded, adapter: Adapter, out_dir: Path, sets,
                     logits_check: bool = True) -> dict[str, Any]:
    """Merged checkpoint in out_dir; its logits against base+adapter on a probe example, or, when the plan
    says an fp32 copy does not fit the host (R1), each merged weight against W + ΔW."""
    from transformers import AutoModelForCausalLM

    from ..model.load import local_checkpoint

    merge_into_copy(local_checkpoint(loaded.path), adapter, out_dir)
    if not logits_check:
        check = verify_merged_weights(loaded.path, out_dir, adapter)
        return {"checked": "weights: merged vs W + ΔW (an fp32 copy does not fit the host)", **check,
                "merged_dir": str(out_dir)}
    merged = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    ids, _ = encode_probe(tokenizer, next(iter(sets.values()))[:1], 256, "")[0]
    check = verify_merge(model, merged, torch.tensor([ids], device=model.get_input_embeddings().weight.device))
    check["merged_dir"] = str(out_dir)
    return {"checked": "logits: merged checkpoint vs base + adapter (fp32)", **check}


def verdict(stats: list[ModuleStats], results: list[ProbeResult]) -> Verdict:
    """Did it learn (B ≠ 0: fail otherwise; training-slice CE down: warn otherwise) and how far did it move."""
    by_name = {r.name: r for r in results}
    lines, status = [], OK
    zero_b = [s.module for s in stats if s.norm_b == 0]
    headline = "lora_B is non-zero in every module" if not zero_b else f"lora_B is all zero in {zero_b}"
    if zero_b:
        status = FAIL
    train = by_name.get("training slice") or by_name.get("probe")
    if train:
        went_down = train.ce_adapted < train.ce_base
        line = (f"CE on the {train.name}: {train.ce_base:.4f} → {train.ce_adapted:.4f} "
                f"({'down' if went_down else 'NOT down'})")
        headline, lines = (line, [headline]) if not zero_b else (headline, [line])
        if not went_down and status == OK:
            status = WARN
    if "held-out" in by_name:
        h = by_name["held-out"]
        lines.append(f"CE on held-out rows: {h.ce_base:.4f} → {h.ce_adapted:.4f}")
    if "retain" in by_name:
        r = by_name["retain"]
        lines.append(f"moved on unrelated text: mean KL(base‖adapted) {r.kl_mean:.3e}, top-1 agreement "
                     f"{r.top1_agreement:.1%}, CE {r.ce_base:.4f} → {r.ce_adapted:.4f}")
    ratios = [s.ratio for s in stats if s.ratio is not None]
    if ratios:
        lines.append(f"‖ΔW‖/‖W‖ from {min(ratios):.2e} to {max(ratios):.2e} over {len(stats)} modules")
    return Verdict(status, headline, lines, InspectionFailed)


def write_summary(run_dir: str | Path, stats, results, merge_check) -> Path:
    """inspection.json: every module's numbers, every probe set's, and the merge check."""
    path = Path(run_dir) / "inspection.json"
    path.write_text(summary_json(stats, results, merge_check))
    return path


def summary_json(stats, results, merge_check) -> str:
    return json.dumps({"modules": [s.to_dict() for s in stats], "probes": [r.row() for r in results],
                       "merge": merge_check}, indent=2, default=str)


__all__ = ["open_adapter", "describe", "write_summary", "find_adapter", "memory_plans", "read_adapter", "inspect_adapter", "load_adapted", "probe_sets", "compare_all",
           "side_by_side", "merge_and_verify", "verdict", "stats_frame"]
