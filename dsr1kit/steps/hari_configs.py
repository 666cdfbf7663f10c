"""Notebook 20's parameters → the typed configs of a HARI run: the one walk of them, used by notebook 20,
``dsr1kit train``, notebook 40's points and notebook 00's plans.

The model's config is read once here (to resolve the prefix pass's precision); every config below is built
from the parameters and that answer, and handed down as a whole (``train.hari_run.HariRun``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..model.load import LoadConfig
from ..model.lora import LoraConfig
from ..plan import TrainingInputs
from ..train import prefix
from ..train.hari import HariLoss
from ..train.hari_state import DataSpec, HariRun, PrefixSetup
from ..train.loop import TrainConfig
from ..train.prefix import precision


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


def data_spec(p) -> DataSpec:
    return DataSpec(p.dataset, tuple(p.splits), p.sample_limit, p.max_len, p.system_prompt)


def prefix_setup(p) -> PrefixSetup:
    """The prefix cache's configs; prefix_precision made concrete on this node (auto: FP8 as stored for an
    FP8 checkpoint on GPUs with FP8 units, else as training loads it), reading the model's config once."""
    from ..plan.inventory import resolve_config

    chosen = precision.resolve(p.prefix_precision, p.model, p.trust_remote_code)
    model_type = resolve_config(p.model, p.trust_remote_code).model_type if chosen == "nf4" else ""
    load = precision.prefix_load(load_config(p), chosen, model_type)
    key = prefix.PrefixConfig(
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
    fill = prefix.FillConfig(p.prefix_cache, p.prefix_tokens_per_batch, p.prefix_shard_mib, p.prefix_pipeline)
    pass_inputs = replace(
        plan_inputs(p),
        quantization=load.quantization,
        quantize_experts=load.quantize_experts,
        prefix_fp8=load.fp8_compute,
    )
    layers = "nf4" if p.cached_layers_nf4 else p.dtype
    adapted = f"adapted layers {layers}, linears {p.quantization}, dtype {p.dtype}, remote code {p.trust_remote_code}"
    reference = p.prefix_cache != "off" and p.reference_cache and p.lambda_kl > 0
    return PrefixSetup(fill, key, load, pass_inputs, reference, adapted)


def hari_run(p) -> HariRun:
    """Every config of one run, from notebook 20's parameters (``run_dir`` set)."""
    return HariRun(
        run_dir=Path(p.run_dir),
        model=p.model,
        trust_remote_code=p.trust_remote_code,
        seed=p.seed,
        data=data_spec(p),
        load=load_config(p),
        lora=lora_config(p),
        train=train_config(p),
        plan_inputs=plan_inputs(p),
        prefix=prefix_setup(p) if p.prefix_cache != "off" else None,
    )
