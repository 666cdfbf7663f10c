"""Notebook 20, HARI end to end: plan → data → model + LoRA → train → outputs → verdict.

Each step is a function the notebook calls (and tables/plots its result);
``run`` chains them for ``python -m dsr1kit train`` and the tests.
Rank 0 writes; every rank computes.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..benchmarks.registry import training_rows
from ..data.labels import EncodedSet, encode_rows
from ..data.plan import load_rows
from ..model.load import LoadConfig, LoadedModel, load_model
from ..model.lora import LoraConfig, LoraPlan, apply_lora, first_adapted_layer, lora_summary
from ..plan import DiskPlan, Machine, Plan, TrainingInputs, hari_plan, prefix_pass_plan
from ..plan.timing import TimePlan
from ..train import dist, prefix
from ..train.hari import HariLoss
from ..train.loop import TrainConfig, TrainResult, train
from ..train.prefix import precision
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
class PrefixCacheReady:
    """A complete prefix cache for this run, and what filling it cost (every recorded pass over the folder)."""

    cache: prefix.PrefixCache
    built_here: dict[str, Any] | None  # this rank's share, built now; None when every shard was there
    passes: list[dict[str, Any]]

    def table(self) -> dict[str, Any]:
        d = self.cache.describe()
        out = {
            "folder": d["folder"],
            "samples": d["samples"],
            "tokens": f"{d['tokens']:,}",
            "shards": d["shards"],
            "size": f"{d['size_gib']:.3f} GiB ({d['bytes_per_token']:,} B per token, {d['dtype']})",
            "first adapted layer": d["first_adapted_layer"],
            "this run": (
                "built " + f"{self.built_here['shards_built']} shard(s), reused "
                f"{self.built_here['shards_reused']}"
                if self.built_here and self.built_here["shards_built"]
                else "cache hit: every shard reused"
            ),
        }
        for row in self.passes:
            out[f"pass, task {row['task']} ({row['host']})"] = (
                f"{row['shards_built']} shard(s), {row['tokens_built']:,} tokens in {row['seconds']:.1f} s: "
                f"{row['tokens_per_s']:,.0f} tokens/s"
            )
        return out


@dataclass
class ReferenceReady:
    """The reference's last hidden states for every sample, and what computing this rank's share cost."""

    cache: prefix.PrefixCache
    built_here: dict[str, Any] | None  # None when every shard was there

    def describe(self) -> str:
        where = self.cache.directory
        if not self.built_here:
            return f"read from {where} (every shard reused)"
        b = self.built_here
        return f"{b['tokens']:,} tokens computed at {b['tokens_per_s']:,.0f} tokens/s into {where}"


@dataclass
class Prepared:
    loaded: LoadedModel
    model: Any  # the PeftModel
    plan: LoraPlan
    data: TrainingData
    info: dist.DistInfo
    prefix: PrefixCacheReady | None = None
    reference: ReferenceReady | None = None

    def model_table(self) -> dict[str, Any]:
        """Quantization, placement, memory and exactly which modules carry adapters."""
        lora = lora_summary(self.model, self.plan)
        table = {
            **{k: v for k, v in self.loaded.info.items() if k != "path"},
            "adapted modules": ", ".join(lora["modules"]),
            "trainable parameters": f"{lora['trainable_params']:,} ({lora['trainable_share']:.4%})",
        }
        if self.prefix is not None:
            table["KL reference"] = (
                self.reference.describe()
                if self.reference
                else "computed by every step (adapted layers twice)"
            )
        return table


def setup_dist() -> dist.DistInfo:
    return dist.init(dist.from_env())


def load_tokenizer(p):
    """The model's tokenizer, loaded once: the data is encoded with it and the model load reuses it."""
    from ..embedded.tiny import resolve_model
    from ..model.load import load_tokenizer as load

    return load(resolve_model(p.model), p.trust_remote_code)


def prepare_data(p, tokenizer) -> TrainingData:
    """The dataset plan's rows, each read by its benchmark's adapter (a hub MedMCQA row trains as question +
    options → the answer letter, its explanation as the reasoning), encoded as notebook 10 prompts."""
    loaded = load_rows(p.dataset, p.splits, p.sample_limit)
    encoded = encode_rows(tokenizer, training_rows(loaded.rows), p.max_len, p.system_prompt)
    if not encoded.examples:
        raise ValueError(
            f"no trainable example: {encoded.skipped} rows lacked a question or answer and "
            f"{encoded.no_target} lost every assistant token to max_len={p.max_len}"
        )
    return TrainingData(encoded, [asdict(r) for r in loaded.report])


def load_config(p) -> LoadConfig:
    """How notebook 20 loads the model (the whole of it, or from the cache only the adapted layers)."""
    return LoadConfig(
        model=p.model,
        dtype=p.dtype,
        quantization=p.quantization,
        quantize_experts=p.quantize_experts,
        device_map=p.device_map,
        trust_remote_code=p.trust_remote_code,
        grad_checkpointing=p.grad_checkpointing,
        offload_dir=p.offload_dir,
        max_memory_gib_per_gpu=p.max_memory_gib_per_gpu,
        cpu_max_memory_gib=p.cpu_max_memory_gib,
        cached_layers_nf4=p.cached_layers_nf4,
    )


def lora_config(p) -> LoraConfig:
    return LoraConfig(
        r=p.lora_r,
        alpha=p.lora_alpha,
        dropout=p.lora_dropout,
        last_k_layers=p.lora_last_k_layers,
        targets=tuple(p.lora_targets),
    )


def loss_config(p) -> HariLoss:
    return HariLoss(
        lambda_kl=p.lambda_kl,
        kl_temperature=p.kl_temperature,
        kl_tokens=p.kl_tokens,
        loss_chunk=p.loss_chunk,
        impl=p.hari_impl,
    )


def train_config(p) -> TrainConfig:
    """The loop's settings; ``settings`` (every parameter) is what a resumed run is checked against."""
    return TrainConfig(
        batch_size=p.batch_size,
        grad_accum=p.grad_accum,
        epochs=p.epochs,
        max_steps=p.max_steps,
        lr=p.lr,
        warmup_ratio=p.warmup_ratio,
        clip_norm=p.clip_norm,
        log_every=p.log_every,
        save_every=p.save_every,
        snapshot_every=p.snapshot_every,
        snapshot_steps=tuple(p.snapshot_steps),
        seed=p.seed,
        resume=p.resume,
        loss=loss_config(p),
        settings=p.to_dict(),
    )


def prefix_load_config(p) -> LoadConfig:
    """How the prefix pass loads the full model: prefix_precision made concrete on this node (auto: FP8 as
    stored for an FP8 checkpoint on GPUs with FP8 units, else as training loads it)."""
    from ..plan.inventory import resolve_config

    chosen = precision.resolve(p.prefix_precision, p.model, p.trust_remote_code)
    model_type = resolve_config(p.model, p.trust_remote_code).model_type if chosen == "nf4" else ""
    return precision.prefix_load(load_config(p), chosen, model_type)


def prefix_config(p) -> prefix.PrefixConfig:
    """What the prefix cache's fingerprint reads of the parameters (the model as the prefix pass loads it)."""
    load = prefix_load_config(p)
    return prefix.PrefixConfig(
        dataset=p.dataset,
        splits=tuple(p.splits),
        sample_limit=p.sample_limit,
        system_prompt=p.system_prompt,
        max_len=p.max_len,
        dtype=p.dtype,
        quantization=load.quantization,
        quantize_experts=load.quantize_experts,
        fp8=load.fp8_compute,
    )


def fill_config(p) -> prefix.FillConfig:
    return prefix.FillConfig(
        folder=p.prefix_cache,
        tokens_per_batch=p.prefix_tokens_per_batch,
        shard_mib=p.prefix_shard_mib,
        pipeline=p.prefix_pipeline,
    )


def plan_inputs(p) -> TrainingInputs:
    """What the planners read of notebook 20's parameters."""
    return TrainingInputs(
        model=p.model,
        trust_remote_code=p.trust_remote_code,
        dtype=p.dtype,
        quantization=p.quantization,
        quantize_experts=p.quantize_experts,
        device_map=p.device_map,
        batch_size=p.batch_size,
        max_len=p.max_len,
        loss_chunk=p.loss_chunk,
        lora_r=p.lora_r,
        lora_last_k_layers=p.lora_last_k_layers,
        lora_targets=tuple(p.lora_targets),
        from_prefix_cache=p.prefix_cache != "off",
        cached_layers_nf4=p.cached_layers_nf4,
        prefix_tokens_per_batch=p.prefix_tokens_per_batch,
    )


def prefix_plan_inputs(p) -> TrainingInputs:
    """What the prefix pass's planner reads: the training inputs with the model as the pass loads it."""
    load = prefix_load_config(p)
    return replace(
        plan_inputs(p),
        quantization=load.quantization,
        quantize_experts=load.quantize_experts,
        prefix_fp8=load.fp8_compute,
    )


def memory_plan(p, machine: Machine | None = None) -> list[Plan]:
    """Bytes per GPU and host for loading the model and one HARI step, on this node unless ``machine`` says
    otherwise (nothing loaded). With a prefix cache: one rank's adapted layers and step."""
    return [hari_plan(plan_inputs(p), machine or Machine.detect())]


def disk_plan(p, run_dir: Path, free: float | None = None, tokens: tuple[int, str] | None = None) -> DiskPlan:
    """What the run writes and where: checkpoints and the adapter into the run folder, the prefix cache
    into its folder (``tokens``: data_tokens_bound's, read here when not given), against each filesystem's
    free space (or ``free`` bytes on every one)."""
    from ..plan.disk import DiskPlan, Write
    from ..plan.inventory import resolve_config
    from ..plan.planners import lora_parameter_count
    from ..train.checkpoint import KEEP
    from ..train.prefix.layout import ELEMENT_BYTES

    lora = lora_parameter_count(plan_inputs(p))
    writes = [
        Write(
            "checkpoints",
            str(run_dir / "checkpoints"),
            KEEP * lora * 12,
            f"{KEEP} kept × {lora:,} LoRA parameters × (weight + 2 AdamW moments) in fp32",
            "run_dir on a filesystem with room (--run-dir, or DSR1KIT_RUNS_DIR)",
        ),
        Write("adapter", str(run_dir / "adapter"), lora * 4, f"{lora:,} parameters in fp32"),
    ]
    if p.prefix_cache != "off":
        hidden = resolve_config(p.model, p.trust_remote_code).hidden_size
        per_token = hidden * ELEMENT_BYTES.get(p.dtype, 4)
        tokens, how = tokens or data_tokens_bound(p)
        if p.prefix_cache == "auto":  # one folder per fingerprint under this one: a new one is empty
            from ..embedded.tiny import cache_root

            folder, held = cache_root() / "prefix", 0
        else:  # a named folder may hold part of this cache already (a pass cut short)
            folder = prefix.prefix_cache_folder(p.prefix_cache, {})
            held = sum(f.stat().st_size for f in folder.rglob("*.safetensors")) if folder.is_dir() else 0
        copies = 2 if uses_reference_cache(p) else 1  # the reference's last states beside the prefix's
        writes.append(
            Write(
                "prefix cache",
                str(folder),
                max(0, copies * tokens * per_token - held),
                f"{how} = {tokens:,} tokens × {per_token:,} B (hidden {hidden:,} in {p.dtype})"
                + (
                    " × 2 (the states entering the adapted layers, and the KL reference's)"
                    if copies == 2
                    else ""
                )
                + (f", less {held / 2**30:.1f} GiB already there" if held else ""),
                "prefix_cache: a folder on a filesystem with room (node-local NVMe: the pass writes each "
                "shard once and every step reads them)",
            )
        )
    return DiskPlan("HARI training", writes, free)


def data_tokens_bound(p) -> tuple[int, str]:
    """(tokens per epoch at most, how counted): every row of the data plan at max_len."""
    rows = len(load_rows(p.dataset, p.splits, p.sample_limit).rows)
    return rows * p.max_len, f"at most {rows:,} rows × max_len {p.max_len:,}"


def time_plan(
    p, machine: Machine | None = None, nodes: int | None = None, tokens: tuple[int, str] | None = None
) -> TimePlan:
    """The run's load, prefix pass and training at the benchmarks' measured rates (models of R1's widths),
    on ``nodes`` (the Slurm job's) × this node's GPUs; ``tokens``: data_tokens_bound's, read when needed."""
    from ..cluster.slurm import job_nodes
    from ..model import staging
    from ..plan.inventory import config_stored_bytes, resolve_config
    from ..plan.timing import hari_time, unmeasured

    machine = machine or Machine.detect()
    nodes = nodes or job_nodes()
    config = resolve_config(p.model, p.trust_remote_code)
    if why := unmeasured(config.hidden_size, machine.gpus):
        return TimePlan("HARI training", note=why)
    local = staging.locate(p.model)
    on_disk = staging.check_folder(local).bytes if local is not None else config_stored_bytes(config)
    tokens_per_epoch, _ = tokens or data_tokens_bound(p)
    per_save = p.save_every * p.batch_size * p.grad_accum * p.max_len * nodes
    return hari_time(
        "HARI training",
        config.hidden_size,
        on_disk / 2**30,
        tokens_per_epoch,
        p.epochs,
        nodes,
        machine.gpus,
        p.prefix_cache != "off",
        per_save,
    )


def check_time(plan: TimePlan) -> TimePlan:
    """Stop now (TimeRefused, with the estimate) when the Slurm job's time left cannot cover what no later
    job could resume; outside Slurm, or without a time limit, nothing is checked."""
    from ..cluster.slurm import remaining_seconds

    return plan.check(remaining_seconds())


def first_layer_of(p) -> int:
    """The first adapted layer, from the model's config (nothing loaded)."""
    from ..model.lora import LoraTargetError
    from ..plan.inventory import resolve_config

    n = resolve_config(p.model, p.trust_remote_code).num_hidden_layers
    if p.lora_last_k_layers > n:
        raise LoraTargetError(f"lora_last_k_layers={p.lora_last_k_layers} but the model has {n} layers")
    return n - p.lora_last_k_layers


def fill_prefix_cache(
    p, info: dist.DistInfo, data: TrainingData, tokenizer
) -> tuple[Path, dict[str, str], dict | None]:
    """This task's missing shards; the full model is loaded only when one is missing, after the prefix pass's
    memory plan says it fits. Returns (folder, fingerprint, stats)."""
    first = first_layer_of(p)

    def check_plan() -> None:
        prefix_pass_plan(prefix_plan_inputs(p), Machine.detect()).check()

    return prefix.fill_prefix_cache(
        fill_config(p),
        prefix_load_config(p),
        prefix_config(p),
        info,
        data.encoded.examples,
        tokenizer,
        first,
        check_plan,
    )


def prefix_only(p) -> dict[str, Any]:
    """This task's share of the prefix pass, ranks from Slurm or torchrun, no process group: for the prefix job."""
    if p.prefix_cache == "off":
        raise prefix.PrefixCacheError("--prefix-only needs prefix_cache: auto or a folder (it is off)")
    info = dist.from_env()
    tokenizer = load_tokenizer(p)
    folder, _, built = fill_prefix_cache(p, info, prepare_data(p, tokenizer), tokenizer)
    return {
        "folder": str(folder),
        "task": info.rank,
        "tasks": info.world_size,
        "built": built or "nothing missing for this task",
    }


def check_prefix_cache(p) -> dict[str, Any]:
    """The complete cache this run would train from, described; PrefixCacheError naming what is missing or
    differs. Nothing is loaded but the tokenizer and the data: a job of one process per GPU checks this once
    before starting them."""
    if p.prefix_cache == "off":
        raise prefix.PrefixCacheError(
            "prefix_cache is off: training one process per GPU needs a prefix cache. Pass the prefix job's "
            "-p prefix_cache (auto or a folder), or train with slurm/hari_train.sbatch (one process per node)"
        )
    tokenizer = load_tokenizer(p)
    examples = prepare_data(p, tokenizer).encoded.examples
    folder, fp = prefix.locate(
        p.prefix_cache, prefix_config(p), p.model, tokenizer, examples, first_layer_of(p)
    )
    return prefix.PrefixCache(folder, fp).describe()


def open_prefix_cache(p, info: dist.DistInfo, data: TrainingData, tokenizer) -> PrefixCacheReady | None:
    """prefix_cache off: None. Else every rank fills its share of the cache, then opens the whole of it
    (PrefixCacheError when it belongs to other inputs or a share is still missing)."""
    if p.prefix_cache == "off":
        return None
    folder, fp, built = fill_prefix_cache(p, info, data, tokenizer)
    prefix.wait_for_shards(folder)
    return PrefixCacheReady(prefix.PrefixCache(folder, fp), built, prefix.prefix_passes(folder))


def prefix_table(cache: PrefixCacheReady | None) -> dict[str, Any]:
    if cache is None:
        return {"prefix cache": "off: every step also runs the frozen layers below the adapted ones"}
    return cache.table()


def prepare_model(
    p,
    info: dist.DistInfo,
    data: TrainingData,
    plan=None,
    tokenizer=None,
    cache: PrefixCacheReady | None = None,
) -> Prepared:
    """Load + LoRA, after the memory plan says it fits (PlanError with the table and what to change if not).
    From a prefix cache, only the adapted layers, norm and lm_head are loaded, on this rank's own device."""
    (plan or memory_plan(p)[0]).check()
    if cache is not None:
        from ..model.load import load_adapted

        loaded = load_adapted(
            load_config(p),
            int(cache.cache.layout.fingerprint["first_adapted_layer"]),
            info.local_rank,
            tokenizer,
        )
    else:
        loaded = load_model(load_config(p), rank=info.rank, tokenizer=tokenizer)
    torch.manual_seed(p.seed)  # identical LoRA init on every rank
    model, lora_plan = apply_lora(loaded.model, lora_config(p))
    reference = open_reference_cache(p, info, data, model, lora_plan, loaded.tokenizer, cache)
    return Prepared(loaded, model, lora_plan, data, info, cache, reference)


def uses_reference_cache(p) -> bool:
    return p.prefix_cache != "off" and p.reference_cache and p.lambda_kl > 0


def adapted_layers_load(p) -> str:
    """How the run loads its adapted layers: what, besides the prefix cache, the reference's states depend on."""
    layers = "nf4" if p.cached_layers_nf4 else p.dtype
    return f"adapted layers {layers}, linears {p.quantization}, dtype {p.dtype}, remote code {p.trust_remote_code}"


def open_reference_cache(
    p, info: dist.DistInfo, data: TrainingData, model, lora_plan: LoraPlan, tokenizer, cache
) -> ReferenceReady | None:
    """With a prefix cache and a KL term: every rank computes its share of the reference's last hidden states
    (reference_cache), then opens the whole of them. None when there is nothing to cache."""
    if cache is None or not uses_reference_cache(p):
        return None
    from ..train.prefix.reference import fill_reference_cache

    folder, fp, built = fill_reference_cache(
        model,
        cache.cache,
        data.encoded.examples,
        first_adapted_layer(lora_plan),
        tokenizer.pad_token_id,
        adapted_layers_load(p),
        p.batch_size * p.max_len,  # a training micro-batch at most: what the memory plan checked
        task=info.rank,
        tasks=info.world_size,
        progress=info.is_main,
    )
    prefix.wait_for_shards(folder)
    return ReferenceReady(prefix.PrefixCache(folder, fp), built)


def prepare(p) -> Prepared:
    info = setup_dist()
    tokenizer = load_tokenizer(p)
    data = prepare_data(p, tokenizer)
    return prepare_model(
        p, info, data, tokenizer=tokenizer, cache=open_prefix_cache(p, info, data, tokenizer)
    )


def run_training(prep: Prepared, p) -> TrainResult:
    return train(
        prep.model,
        prep.loaded.tokenizer,
        prep.data.encoded.examples,
        train_config(p),
        p.run_dir,
        first_adapted_layer(prep.plan),
        prep.info,
        prefix=prep.prefix.cache if prep.prefix else None,
        reference=prep.reference.cache if prep.reference else None,
    )


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
        "dataset": p.dataset,
        "sources": prep.data.sources,
        "samples": len(data.examples),
        "skipped_rows": data.skipped,
        "truncated": data.truncated,
        "no_target": data.no_target,
        "epochs": p.epochs,
        "batch_size": p.batch_size,
        "grad_accum": p.grad_accum,
        "max_len": p.max_len,
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
    return {
        n.removeprefix("base_model.model.").removesuffix(".lora_B.default.weight"): float(
            q.detach().float().norm()
        )
        for n, q in model.named_parameters()
        if "lora_B" in n
    }


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


@dataclass
class TrainingRun:
    """What the verdict reads: the loop's result, the prepared model, the outputs written, the metric lines."""

    result: TrainResult
    prep: Prepared
    outputs: dict[str, Any]
    history: list[dict[str, Any]]


def verdict(run: TrainingRun) -> Verdict:
    """ok when every step ran, every adapted module's lora_B is non-zero and the adapter was written."""
    result, prep, outputs, history = run.result, run.prep, run.outputs, run.history
    norms = lora_b_norms(prep.model)
    zero = [m for m, v in norms.items() if v == 0.0]
    steps_line = f"steps done: {result.steps_done} of {result.total_steps}" + (
        f" (resumed from step {result.resumed_from})" if result.resumed_from else ""
    )
    lines = [steps_line]
    if history:
        headline = (
            f"loss {history[0]['loss']:.4f} → {history[-1]['loss']:.4f} (CE {history[0]['ce']:.4f} → "
            f"{history[-1]['ce']:.4f}, KL {history[-1]['kl']:.2e} at the end)"
        )
    else:
        headline, lines = steps_line, []
    lines += [f"‖lora_B‖ {m}: {v:.3e}" for m, v in norms.items()]
    if history:
        rates = [row["tokens_per_s"] for row in history if row.get("tokens_per_s")]
        where = "from the prefix cache" if prep.prefix else "whole model"
        lines.append(
            f"training throughput ({where}): {sum(rates) / max(len(rates), 1):,.0f} tokens/s per rank "
            f"× {prep.info.world_size} rank(s)"
        )
    if prep.prefix:
        passes = prep.prefix.passes
        pass_rate = sum(r["tokens_built"] for r in passes) / max(sum(r["seconds"] for r in passes), 1e-9)
        rate = f"; prefix pass {pass_rate:,.0f} tokens/s per task" if passes else ""
        hit = "built now" if prep.prefix.built_here and prep.prefix.built_here["shards_built"] else "reused"
        lines.append(f"prefix cache {hit}: {prep.prefix.cache.directory}{rate}")

    def done(status: str, *more: str) -> Verdict:
        return Verdict(status, headline, lines + list(more), TrainingFailed)

    if result.preempted:
        return done(WARN, "preempted: checkpoint saved; requeue the job (same run folder) to resume")
    if not outputs.get("ranks_agree", True):
        return done(FAIL, f"ranks ended with different adapters: {outputs.get('rank_digests')}")
    if zero:
        return done(FAIL, f"lora_B is still zero in {zero}: nothing was learned there (raise lr or steps)")
    return done(
        OK if result.steps_done == result.total_steps else FAIL, f"adapter: {outputs.get('adapter_dir')}"
    )


def close() -> None:
    """Leave the process group (before finish() may fail the run, so no rank waits on it)."""
    dist.shutdown()
