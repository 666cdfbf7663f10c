"""What a HARI run leaves behind: the adapter (PEFT format) with its tokenizer, and ``run_info.json``, the
record a sweep, notebook 30 and a teammate read (data, ranks and their agreement, steps, speed, caches)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

from ..model.lora import lora_summary
from . import dist
from .hari_state import HariRun, Prepared
from .loop import TrainResult


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[-40:] or "data"


def trainable_digest(model) -> str:
    """SHA-256 of the trainable weights: every rank must end with the same adapter."""
    h = hashlib.sha256()
    for name, q in model.named_parameters():
        if q.requires_grad:
            h.update(name.encode())
            h.update(q.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def lora_b_norms(model) -> dict[str, float]:
    """‖lora_B‖ per adapted module: non-zero is the recipe's proof that it learned."""
    return {
        n.removeprefix("base_model.model.").removesuffix(".lora_B.default.weight"): float(
            q.detach().float().norm()
        )
        for n, q in model.named_parameters()
        if "lora_B" in n
    }


def _caches(prep: Prepared) -> dict[str, Any]:
    return {
        "prefix_cache": (
            {
                **prep.prefix.cache.describe(),
                "built_here": prep.prefix.built_here,
                "passes": prep.prefix.passes,
            }
            if prep.prefix
            else None
        ),
        "reference_cache": (
            {**prep.reference.cache.describe(), "built_here": prep.reference.built_here}
            if prep.reference
            else None
        ),
    }


def run_info(prep: Prepared, run: HariRun, result: TrainResult, started: float) -> dict[str, Any]:
    """The run's record; gathers every rank's host and adapter digest (a collective: every rank calls it)."""
    hosts = dist.gather_hostnames()
    digests = dist.gather_strings(trainable_digest(prep.model))
    data, t = prep.data.encoded, run.train
    return {
        "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "name": f"{_slug(run.data.dataset)}-n{len(data.examples)}",
        "dataset": run.data.dataset,
        "sources": prep.data.sources,
        "samples": len(data.examples),
        "skipped_rows": data.skipped,
        "truncated": data.truncated,
        "no_target": data.no_target,
        "epochs": t.epochs,
        "batch_size": t.batch_size,
        "grad_accum": t.grad_accum,
        "max_len": run.data.max_len,
        "world_size": prep.info.world_size,
        "hosts": hosts,
        "rank_digests": digests,
        "ranks_agree": len(set(digests)) == 1,
        "steps_done": result.steps_done,
        "tokens": result.tokens,
        "train_s": round(result.wall_s, 2),
        "peak_memory_gib": result.history[-1]["peak_memory_gib"] if result.history else {},
        "optimizer": result.optimizer,
        "total_steps": result.total_steps,
        "preempted": result.preempted,
        "resumed_from": result.resumed_from,
        "wall_s": round(time.monotonic() - started, 1),
        "lora": lora_summary(prep.model, prep.plan),
        "model": prep.loaded.info,
        **_caches(prep),
    }


def save_outputs(prep: Prepared, run: HariRun, result: TrainResult, started: float) -> dict[str, Any]:
    """Adapter (PEFT format) + tokenizer + run_info.json, by rank 0 after a barrier; a preempted run writes
    its run_info only (its checkpoint is what resumes)."""
    info = run_info(prep, run, result, started)
    dist.barrier()
    run_dir = Path(run.run_dir)
    if prep.info.is_main and not result.preempted:
        adapter_dir = run_dir / "adapter"
        prep.model.save_pretrained(adapter_dir)
        prep.loaded.tokenizer.save_pretrained(adapter_dir)
        info["adapter_dir"] = str(adapter_dir)
    if prep.info.is_main:
        (run_dir / "run_info.json").write_text(json.dumps(info, indent=2, default=str))
    dist.barrier()
    return info
