"""HARI end to end, in the steps notebook 20 shows: data → model + LoRA → train → outputs.

Each step is a function the notebook calls (and tables/plots its result);
``run`` chains them for ``python -m dsr1kit.train`` and the tests.
Rank 0 writes; every rank computes.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..data.labels import EncodedSet, encode_rows
from ..data.plan import load_rows
from ..model.load import LoadedModel, load_model
from ..model.lora import LoraPlan, apply_lora, first_adapted_layer, lora_summary  # noqa: F401 (notebook API)
from ..train import dist
from ..train.loop import TrainResult, train


@dataclass
class Prepared:
    loaded: LoadedModel
    model: Any  # the PeftModel
    plan: LoraPlan
    data: EncodedSet
    sources: list[dict[str, Any]]
    info: dist.DistInfo


def setup_dist() -> dist.DistInfo:
    return dist.init(dist.from_env())


def prepare_data(p, tokenizer) -> tuple[EncodedSet, list[dict[str, Any]]]:
    loaded = load_rows(p.dataset, p.splits, p.sample_limit)
    encoded = encode_rows(tokenizer, loaded.rows, p.max_len, p.system_prompt)
    if not encoded.examples:
        raise ValueError(f"no trainable example: {encoded.skipped} rows lacked a question or answer and "
                         f"{encoded.no_target} lost every assistant token to max_len={p.max_len}")
    sources = [asdict(r) for r in loaded.report]
    return encoded, sources


def memory_plan(p):
    """Bytes per GPU and host for loading the model and one HARI step, on this node (nothing loaded)."""
    from ..plan import Machine, hari_plan

    return hari_plan(p, Machine.detect())


def prepare_model(p, info: dist.DistInfo, plan=None) -> tuple[LoadedModel, Any, LoraPlan]:
    """Load + LoRA, after the memory plan says it fits (PlanError with the table and what to change if not)."""
    (plan or memory_plan(p)).check()
    loaded = load_model(p, rank=info.rank)
    torch.manual_seed(p.seed)  # identical LoRA init on every rank
    model, plan = apply_lora(loaded.model, p)
    return loaded, model, plan


def prepare(p) -> Prepared:
    info = setup_dist()
    loaded, model, plan = prepare_model(p, info)
    data, sources = prepare_data(p, loaded.tokenizer)
    return Prepared(loaded, model, plan, data, sources, info)


def run_training(prep: Prepared, p) -> TrainResult:
    return train(prep.model, prep.loaded.tokenizer, prep.data.examples, p, p.run_dir,
                 first_adapted_layer(prep.plan), prep.info)


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


def save_outputs(prep: Prepared, p, result: TrainResult, started: float) -> dict[str, Any]:
    """Adapter (PEFT format) + tokenizer + run_info.json, by rank 0 after a barrier."""
    hosts = dist.gather_hostnames()
    digests = dist.gather_strings(trainable_digest(prep.model))
    run_dir = Path(p.run_dir)
    info = {
        "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "name": f"{_slug(p.dataset)}-n{len(prep.data.examples)}",
        "dataset": p.dataset, "sources": prep.sources, "samples": len(prep.data.examples),
        "skipped_rows": prep.data.skipped, "truncated": prep.data.truncated, "no_target": prep.data.no_target,
        "epochs": p.epochs, "batch_size": p.batch_size, "grad_accum": p.grad_accum, "max_len": p.max_len,
        "world_size": prep.info.world_size, "hosts": hosts, "rank_digests": digests,
        "ranks_agree": len(set(digests)) == 1, "steps_done": result.steps_done,
        "total_steps": result.total_steps, "preempted": result.preempted, "resumed_from": result.resumed_from,
        "wall_s": round(time.monotonic() - started, 1), "lora": lora_summary(prep.model, prep.plan),
        "model": prep.loaded.info,
    }
    dist.barrier()
    if prep.info.is_main and not result.preempted:
        adapter_dir = run_dir / "adapter"
        prep.model.save_pretrained(adapter_dir)
        prep.loaded.tokenizer.save_pretrained(adapter_dir)
        info["adapter_dir"] = str(adapter_dir)
    if prep.info.is_main:
        (run_dir / "run_info.json").write_text(json.dumps(info, indent=2, default=str))
    dist.barrier()
    return info


def lora_b_norms(model) -> dict[str, float]:
    """‖lora_B‖ per adapted module: non-zero is the recipe's proof that it learned."""
    return {n.removeprefix("base_model.model.").removesuffix(".lora_B.default.weight"): float(q.detach().float().norm())
            for n, q in model.named_parameters() if "lora_B" in n}


def run(p) -> dict[str, Any]:
    started = time.monotonic()
    Path(p.run_dir).mkdir(parents=True, exist_ok=True)
    prep = prepare(p)
    try:
        result = run_training(prep, p)
        return save_outputs(prep, p, result, started)
    finally:
        dist.shutdown()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []


def verdict(result: TrainResult, model, outputs: dict[str, Any], history: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """ok when every step ran, every adapted module's lora_B is non-zero and the adapter was written."""
    norms = lora_b_norms(model)
    zero = [m for m, v in norms.items() if v == 0.0]
    lines = [f"steps done: {result.steps_done} of {result.total_steps}"
             + (f" (resumed from step {result.resumed_from})" if result.resumed_from else "")]
    if history:
        lines.append(f"loss {history[0]['loss']:.4f} → {history[-1]['loss']:.4f} (CE {history[0]['ce']:.4f} → "
                     f"{history[-1]['ce']:.4f}, KL {history[-1]['kl']:.2e} at the end)")
    lines += [f"‖lora_B‖ {m}: {v:.3e}" for m, v in norms.items()]
    if result.preempted:
        lines.append("preempted: checkpoint saved; requeue the job (same run folder) to resume")
        return "warn", lines
    if not outputs.get("ranks_agree", True):
        lines.append(f"ranks ended with different adapters: {outputs.get('rank_digests')}")
        return "fail", lines
    if zero:
        lines.append(f"lora_B is still zero in {zero}: nothing was learned there (raise lr or steps)")
        return "fail", lines
    lines.append(f"adapter: {outputs.get('adapter_dir')}")
    return ("ok" if result.steps_done == result.total_steps else "fail"), lines


class TrainingFailed(RuntimeError):
    """The verdict is fail: raised so the run's status is failed."""


def finish(status: str, lines: list[str]) -> None:
    dist.shutdown()
    if status == "fail":
        raise TrainingFailed("; ".join(lines))
