"""The HARI run as one pipeline behind one typed config: data → prefix cache → model + LoRA → reference
cache → loop → outputs.

``HariRun`` holds every config the phases read (built once from notebook 20's parameters at the seam, or by
a benchmark or a sweep without a notebook). Each phase is a function the notebook calls in its own cell and
``run`` chains them for ``python -m dsr1kit train`` and the sweep. Rank 0 writes; every rank computes.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..benchmarks.registry import training_rows
from ..data.labels import encode_rows
from ..data.plan import load_rows
from ..model.load import load_adapted, load_model
from ..model.lora import LoraPlan, apply_lora, first_adapted_layer
from ..plan import Machine, Plan, prefix_pass_plan
from . import dist, prefix
from .hari_state import (  # noqa: F401 (the run's types, where its phases are)
    DataSpec,
    HariRun,
    PrefixCacheReady,
    PrefixSetup,
    Prepared,
    ReferenceReady,
    TrainingData,
)
from .loop import TrainResult, train
from .outputs import save_outputs
from .prefix.reference import fill_reference_cache


def load_tokenizer(run: HariRun):
    """The model's tokenizer, loaded once: the data is encoded with it and the model load reuses it."""
    from ..embedded.tiny import resolve_model
    from ..model.load import load_tokenizer as load

    return load(resolve_model(run.model), run.trust_remote_code)


def data_rows(data: DataSpec) -> list[dict]:
    return load_rows(data.dataset, list(data.splits), data.sample_limit).rows


def prepare_data(run: HariRun, tokenizer) -> TrainingData:
    """The dataset plan's rows, each read by its benchmark's adapter (a hub MedMCQA row trains as question +
    options → the answer letter, its explanation as the reasoning), encoded as notebook 10 prompts."""
    d = run.data
    loaded = load_rows(d.dataset, list(d.splits), d.sample_limit)
    encoded = encode_rows(tokenizer, training_rows(loaded.rows), d.max_len, d.system_prompt)
    if not encoded.examples:
        raise ValueError(
            f"no trainable example: {encoded.skipped} rows lacked a question or answer and "
            f"{encoded.no_target} lost every assistant token to max_len={d.max_len}"
        )
    return TrainingData(encoded, [asdict(r) for r in loaded.report])


def first_layer(run: HariRun) -> int:
    """The first adapted layer, from the model's config (nothing loaded)."""
    from ..model.lora import LoraTargetError
    from ..plan.inventory import resolve_config

    n = resolve_config(run.model, run.trust_remote_code).num_hidden_layers
    if run.lora.last_k_layers > n:
        raise LoraTargetError(f"lora_last_k_layers={run.lora.last_k_layers} but the model has {n} layers")
    return n - run.lora.last_k_layers


def _need_prefix(run: HariRun, why: str) -> PrefixSetup:
    if run.prefix is None:
        raise prefix.PrefixCacheError(why)
    return run.prefix


def fill_prefix_cache(
    run: HariRun, info: dist.DistInfo, data: TrainingData, tokenizer
) -> tuple[Path, dict[str, str], dict | None]:
    """This task's missing shards; the full model is loaded only when one is missing, after the prefix pass's
    memory plan says it fits. Returns (folder, fingerprint, stats)."""
    setup = _need_prefix(run, "prefix_cache is off")
    return prefix.fill_prefix_cache(
        setup.fill,
        setup.load,
        setup.key,
        info,
        data.encoded.examples,
        tokenizer,
        first_layer(run),
        lambda: prefix_pass_plan(setup.plan_inputs, Machine.detect()).check(),
    )


def prefix_only(run: HariRun) -> dict[str, Any]:
    """This task's share of the prefix pass, ranks from Slurm or torchrun, no process group: for the prefix job."""
    _need_prefix(run, "--prefix-only needs prefix_cache: auto or a folder (it is off)")
    info = dist.from_env()
    tokenizer = load_tokenizer(run)
    folder, _, built = fill_prefix_cache(run, info, prepare_data(run, tokenizer), tokenizer)
    return {
        "folder": str(folder),
        "task": info.rank,
        "tasks": info.world_size,
        "built": built or "nothing missing for this task",
    }


def check_prefix_cache(run: HariRun) -> dict[str, Any]:
    """The complete cache this run would train from, described; PrefixCacheError naming what is missing or
    differs. Nothing is loaded but the tokenizer and the data: a job of one process per GPU checks this once
    before starting them."""
    setup = _need_prefix(
        run,
        "prefix_cache is off: training one process per GPU needs a prefix cache. Pass the prefix job's "
        "-p prefix_cache (auto or a folder), or train with slurm/hari_train.sbatch (one process per node)",
    )
    tokenizer = load_tokenizer(run)
    examples = prepare_data(run, tokenizer).encoded.examples
    folder, fp = prefix.locate(setup.fill.folder, setup.key, run.model, tokenizer, examples, first_layer(run))
    return prefix.PrefixCache(folder, fp).describe()


def open_prefix_cache(
    run: HariRun, info: dist.DistInfo, data: TrainingData, tokenizer
) -> PrefixCacheReady | None:
    """prefix_cache off: None. Else every rank fills its share of the cache, then opens the whole of it
    (PrefixCacheError when it belongs to other inputs or a share is still missing)."""
    if run.prefix is None:
        return None
    folder, fp, built = fill_prefix_cache(run, info, data, tokenizer)
    prefix.wait_for_shards(folder)
    return PrefixCacheReady(prefix.PrefixCache(folder, fp), built, prefix.prefix_passes(folder))


def prefix_table(cache: PrefixCacheReady | None) -> dict[str, Any]:
    if cache is None:
        return {"prefix cache": "off: every step also runs the frozen layers below the adapted ones"}
    return cache.table()


def prepare_model(
    run: HariRun,
    info: dist.DistInfo,
    data: TrainingData,
    plan: Plan,
    tokenizer=None,
    cache: PrefixCacheReady | None = None,
) -> Prepared:
    """Load + LoRA, after the memory plan says it fits (PlanError with the table and what to change if not).
    From a prefix cache, only the adapted layers, norm and lm_head are loaded, on this rank's own device."""
    plan.check()
    if cache is not None:
        first = int(cache.cache.layout.fingerprint["first_adapted_layer"])
        loaded = load_adapted(run.load, first, info.local_rank, tokenizer)
    else:
        loaded = load_model(run.load, rank=info.rank, tokenizer=tokenizer)
    torch.manual_seed(run.seed)  # identical LoRA init on every rank
    model, lora_plan = apply_lora(loaded.model, run.lora)
    reference = open_reference_cache(run, info, data, model, lora_plan, loaded.tokenizer, cache)
    return Prepared(loaded, model, lora_plan, data, info, cache, reference)


def open_reference_cache(
    run: HariRun, info: dist.DistInfo, data: TrainingData, model, lora_plan: LoraPlan, tokenizer, cache
) -> ReferenceReady | None:
    """With a prefix cache and a KL term: every rank computes its share of the reference's last hidden states
    (reference_cache), then opens the whole of them. None when there is nothing to cache."""
    if cache is None or run.prefix is None or not run.prefix.reference:
        return None
    folder, fp, built = fill_reference_cache(
        model,
        cache.cache,
        data.encoded.examples,
        first_adapted_layer(lora_plan),
        tokenizer.pad_token_id,
        run.prefix.adapted_load,
        run.train.batch_size
        * run.data.max_len,  # a training micro-batch at most: what the memory plan checked
        task=info.rank,
        tasks=info.world_size,
        progress=info.is_main,
    )
    prefix.wait_for_shards(folder)
    return ReferenceReady(prefix.PrefixCache(folder, fp), built)


def run_training(prep: Prepared, run: HariRun) -> TrainResult:
    return train(
        prep.model,
        prep.loaded.tokenizer,
        prep.data.encoded.examples,
        run.train,
        run.run_dir,
        first_adapted_layer(prep.plan),
        prep.info,
        prefix=prep.prefix.cache if prep.prefix else None,
        reference=prep.reference.cache if prep.reference else None,
    )


def check_resume(run: HariRun):
    """With resume on, the run folder's checkpoint must have been made by these settings: checked before
    loading anything (ResumeMismatch lists each difference). Returns the checkpoint, or None."""
    from .checkpoint import check_resumable

    return check_resumable(run.run_dir, run.train.settings) if run.train.resume else None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    from .loop import read_metric_lines

    return read_metric_lines(Path(run_dir) / "metrics.jsonl")


def run(config: HariRun, plan: Plan) -> dict[str, Any]:
    """The whole run, ``plan`` (the training memory plan) checked before the model loads; returns run_info."""
    started = time.monotonic()
    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    check_resume(config)  # before loading anything
    info = dist.init(dist.from_env())
    try:
        tokenizer = load_tokenizer(config)
        data = prepare_data(config, tokenizer)
        cache = open_prefix_cache(config, info, data, tokenizer)
        prep = prepare_model(config, info, data, plan, tokenizer, cache)
        result = run_training(prep, config)
        return save_outputs(prep, config, result, started)
    finally:
        dist.shutdown()
