"""Notebook 20, HARI end to end: plan → data → model + LoRA → train → outputs → verdict.

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
from ..model.lora import LoraPlan, apply_lora, first_adapted_layer, lora_summary
from ..train import dist
from ..train.loop import TrainResult, train
from . import FAIL, OK, WARN, StepFailed, Verdict


class TrainingFailed(StepFailed):
    """A step did not run, ranks disagree, or nothing was learned."""


@dataclass
class TrainingData:
    """The encoded examples and, per source of the dataset plan, what was read and kept."""

    encoded: EncodedSet
    sources: list[dict[str, Any]]

    def describe(self) -> str:
        e = self.encoded
        return f"{len(e.examples)} training examples; {e.skipped} rows skipped, {e.truncated} truncated"


@dataclass
class Prepared:
    loaded: LoadedModel
    model: Any  # the PeftModel
    plan: LoraPlan
    data: TrainingData
    info: dist.DistInfo

    def model_table(self) -> dict[str, Any]:
        """Quantization, placement, memory and exactly which modules carry adapters."""
        lora = lora_summary(self.model, self.plan)
        return {**{k: v for k, v in self.loaded.info.items() if k != "path"},
                "adapted modules": ", ".join(lora["modules"]),
                "trainable parameters": f"{lora['trainable_params']:,} ({lora['trainable_share']:.4%})"}


def setup_dist() -> dist.DistInfo:
    return dist.init(dist.from_env())


def load_tokenizer(p):
    """The model's tokenizer, loaded once: the data is encoded with it and the model load reuses it."""
    from ..model.load import load_tokenizer as load
    from ..tiny import resolve_model

    return load(resolve_model(p.model), p.trust_remote_code)


def prepare_data(p, tokenizer) -> TrainingData:
    loaded = load_rows(p.dataset, p.splits, p.sample_limit)
    encoded = encode_rows(tokenizer, loaded.rows, p.max_len, p.system_prompt)
    if not encoded.examples:
        raise ValueError(f"no trainable example: {encoded.skipped} rows lacked a question or answer and "
                         f"{encoded.no_target} lost every assistant token to max_len={p.max_len}")
    return TrainingData(encoded, [asdict(r) for r in loaded.report])


def memory_plan(p):
    """Bytes per GPU and host for loading the model and one HARI step, on this node (nothing loaded)."""
    from ..plan import Machine, hari_plan

    return hari_plan(p, Machine.detect())


def prepare_model(p, info: dist.DistInfo, data: TrainingData, plan=None, tokenizer=None) -> Prepared:
    """Load + LoRA, after the memory plan says it fits (PlanError with the table and what to change if not)."""
    (plan or memory_plan(p)).check()
    loaded = load_model(p, rank=info.rank, tokenizer=tokenizer)
    torch.manual_seed(p.seed)  # identical LoRA init on every rank
    model, lora_plan = apply_lora(loaded.model, p)
    return Prepared(loaded, model, lora_plan, data, info)


def prepare(p) -> Prepared:
    info = setup_dist()
    tokenizer = load_tokenizer(p)
    return prepare_model(p, info, prepare_data(p, tokenizer), tokenizer=tokenizer)


def run_training(prep: Prepared, p) -> TrainResult:
    return train(prep.model, prep.loaded.tokenizer, prep.data.encoded.examples, p, p.run_dir,
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
    data = prep.data.encoded
    run_dir = Path(p.run_dir)
    info = {
        "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "name": f"{_slug(p.dataset)}-n{len(data.examples)}",
        "dataset": p.dataset, "sources": prep.data.sources, "samples": len(data.examples),
        "skipped_rows": data.skipped, "truncated": data.truncated, "no_target": data.no_target,
        "epochs": p.epochs, "batch_size": p.batch_size, "grad_accum": p.grad_accum, "max_len": p.max_len,
        "world_size": prep.info.world_size, "hosts": hosts, "rank_digests": digests,
        "ranks_agree": len(set(digests)) == 1, "steps_done": result.steps_done, "optimizer": result.optimizer,
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
    check_resume(p)  # before loading anything
    prep = prepare(p)
    try:
        result = run_training(prep, p)
        return save_outputs(prep, p, result, started)
    finally:
        dist.shutdown()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    from ..train.loop import read_metric_lines

    return read_metric_lines(Path(run_dir) / "metrics.jsonl")


def check_resume(p):
    """With resume on, the run folder's checkpoint must have been made by these parameters: checked before
    loading anything (ResumeMismatch lists each difference). Returns the checkpoint, or None."""
    from ..train import checkpoint

    return checkpoint.check_resumable(p.run_dir, p.to_dict()) if p.resume else None


def verdict(result: TrainResult, prep: Prepared, outputs: dict[str, Any], history: list[dict[str, Any]]) -> Verdict:
    """ok when every step ran, every adapted module's lora_B is non-zero and the adapter was written."""
    norms = lora_b_norms(prep.model)
    zero = [m for m, v in norms.items() if v == 0.0]
    steps_line = (f"steps done: {result.steps_done} of {result.total_steps}"
                  + (f" (resumed from step {result.resumed_from})" if result.resumed_from else ""))
    lines = [steps_line]
    if history:
        headline = (f"loss {history[0]['loss']:.4f} → {history[-1]['loss']:.4f} (CE {history[0]['ce']:.4f} → "
                    f"{history[-1]['ce']:.4f}, KL {history[-1]['kl']:.2e} at the end)")
    else:
        headline, lines = steps_line, []
    lines += [f"‖lora_B‖ {m}: {v:.3e}" for m, v in norms.items()]

    def done(status: str, *more: str) -> Verdict:
        return Verdict(status, headline, lines + list(more), TrainingFailed)

    if result.preempted:
        return done(WARN, "preempted: checkpoint saved; requeue the job (same run folder) to resume")
    if not outputs.get("ranks_agree", True):
        return done(FAIL, f"ranks ended with different adapters: {outputs.get('rank_digests')}")
    if zero:
        return done(FAIL, f"lora_B is still zero in {zero}: nothing was learned there (raise lr or steps)")
    return done(OK if result.steps_done == result.total_steps else FAIL, f"adapter: {outputs.get('adapter_dir')}")


def close() -> None:
    """Leave the process group (before finish() may fail the run, so no rank waits on it)."""
    dist.shutdown()
