"""One planner per heavy step: what the step's inputs put on each device of a machine, checked before loading.

``hari_plan`` (notebook 20: load + one HARI step; per rank when training from the prefix cache),
``prefix_pass_plan`` (the pass that fills the cache), ``inspection_plans`` (notebook 30: load + probe
forwards, and the merged checkpoint's logits in fp32 on the host), ``serve_plan`` (notebook 10: vLLM's
weights, activations and KV cache), ``reference_plan`` (a model in fp32 on the host, e.g. the PEFT copy the
parity check scores with). Each reads its step's input dataclass (``plan.inputs``), never a notebook's
parameters.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from .advice import serving_advice, training_advice
from .devices import GIB, Workload, lora_parameters, reference_devices, serving_devices, training_devices
from .inputs import InspectionInputs, ServingInputs, TrainingInputs
from .inventory import Inventory, checkpoint_is_fp8, inventory, resolve_config, strip_quantization
from .machine import Machine
from .result import Plan


def _inv(model: str, trust_remote_code: bool = False) -> Inventory:
    return inventory(resolve_config(model, trust_remote_code))


def _dtype_bytes(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def _devices(inv: Inventory, machine: Machine, work: Workload, gpus: int, scheme: str):
    return training_devices(
        inv, work, n_gpus=gpus, scheme=scheme, gpu_bytes=machine.gpu_bytes, host_bytes=machine.host_bytes
    )


def _facts(
    inv: Inventory,
    quantization: str,
    nf4_experts: bool,
    dtype: str,
    gpus: int,
    placement: str,
    tokens: str,
    machine: Machine,
) -> dict[str, str]:
    return {
        "model": f"{_count(inv.parameters)} parameters ({len(inv.layers)} layers)",
        "weights": f"{dtype}, linears {quantization}, experts {'nf4' if nf4_experts else dtype}",
        "placement": f"{placement} over {gpus} GPU(s)" if gpus else "host (no GPU)",
        "tokens per step": tokens,
        "machine": machine.describe(),
    }


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def hari_plan_for_config(config, machine: Machine, inputs: TrainingInputs) -> Plan:
    """The HARI plan of a config object (benchmarks build models from configs, not from files)."""
    return hari_plan(inputs, machine, inventory(strip_quantization(copy.deepcopy(config))), advise=False)


def hari_plan(
    inputs: TrainingInputs, machine: Machine, inv: Inventory | None = None, advise: bool = True
) -> Plan:
    """Notebook 20: load (as dsr1kit.model.load does) and one HARI step of batch_size × max_len tokens.

    From the prefix cache, the step's plan is per rank (one GPU each): only the adapted layers, the final
    norm and lm_head are loaded; ``prefix_pass_plan`` is the plan of the pass that fills the cache.
    """
    c = inputs
    inv = inv or _inv(c.model, c.trust_remote_code)
    if c.from_prefix_cache:
        return _cached_hari_plan(c, machine, inv)
    work = Workload(
        _dtype_bytes(c.dtype),
        c.quantization == "nf4",
        c.quantize_experts,
        c.batch_size * c.max_len,
        chunk=c.loss_chunk,
        last_k=c.lora_last_k_layers,
        lora_params=_lora(inv, c),
        from_pretrained=not c.quantize_experts,
    )
    return _whole_model_plan(
        "HARI load + step",
        c,
        machine,
        inv,
        work,
        f"{c.batch_size} x {c.max_len}",
        hari_plan if advise else None,
    )


def _whole_model_plan(
    title, c: TrainingInputs, machine: Machine, inv: Inventory, work: Workload, shape: str, planner=None
) -> Plan:
    """The model loaded whole as notebook 20 loads it, plus ``work``; ``planner`` advises when it does not fit."""
    gpus = 0 if c.device_map == "cpu" else machine.gpus
    devices = _devices(inv, machine, work, gpus, c.device_map if gpus else "contiguous")
    facts = _facts(inv, c.quantization, c.quantize_experts, c.dtype, gpus, c.device_map, shape, machine)
    plan = Plan(title, devices, facts)
    if planner is not None and not plan.fits:
        plan.advice = training_advice(c, machine, inv, planner)
    return plan


def _lora(inv: Inventory, c: TrainingInputs) -> int:
    return lora_parameters(inv, c.lora_r, c.lora_last_k_layers, list(c.lora_targets))


def lora_parameter_count(inputs: TrainingInputs) -> int:
    """LoRA parameters the run trains (its checkpoints and adapter hold these), from the config alone."""
    return _lora(_inv(inputs.model, inputs.trust_remote_code), inputs)


def adapted_only(inv: Inventory, last_k: int) -> Inventory:
    """The inventory with the frozen prefix and the embeddings emptied: what training from the cache loads."""
    keep = set(inv.layers[len(inv.layers) - last_k :])
    units = {
        u: (kinds if u in keep or not (u in inv.layers or u == "model.embed_tokens") else {})
        for u, kinds in inv.units.items()
    }
    return replace(inv, units=units)


def _cached_hari_plan(c: TrainingInputs, machine: Machine, inv: Inventory) -> Plan:
    gpus = 0 if c.device_map == "cpu" or not machine.gpus else 1
    work = Workload(
        _dtype_bytes(c.dtype),
        c.cached_layers_nf4,
        c.cached_layers_nf4,
        c.batch_size * c.max_len,
        chunk=c.loss_chunk,
        last_k=c.lora_last_k_layers,
        lora_params=_lora(inv, c),
        from_pretrained=False,
    )
    devices = _devices(adapted_only(inv, c.lora_last_k_layers), machine, work, gpus, "contiguous")
    facts = _facts(
        inv,
        "nf4" if c.cached_layers_nf4 else "none",
        c.cached_layers_nf4,
        c.dtype,
        gpus,
        "one GPU per rank",
        f"{c.batch_size} x {c.max_len}",
        machine,
    )
    facts["loaded"] = (
        f"the last {c.lora_last_k_layers} layer(s), norm and lm_head; the rest is read from the prefix cache"
    )
    return Plan("HARI step from the prefix cache (per rank)", devices, facts)


def prefix_pass_plan(
    inputs: TrainingInputs, machine: Machine, inv: Inventory | None = None, advise: bool = True
) -> Plan:
    """The prefix pass: the model loaded as for HARI, forward only, micro-batches of prefix_tokens_per_batch."""
    c = inputs
    inv = inv or _inv(c.model, c.trust_remote_code)
    work = Workload(
        _dtype_bytes(c.dtype),
        c.quantization == "nf4",
        c.quantize_experts,
        c.prefix_tokens_per_batch,
        from_pretrained=not (c.quantize_experts or c.prefix_fp8),  # the streaming loader reads the shards
        train=False,
        fp8=c.prefix_fp8,
    )
    plan = _whole_model_plan(
        "prefix pass (load + forward)",
        c,
        machine,
        inv,
        work,
        f"{c.prefix_tokens_per_batch} per micro-batch",
        prefix_pass_plan if advise else None,
    )
    if c.prefix_fp8:
        plan.facts["weights"] = (
            f"linears and experts fp8 as stored (e4m3, 128x128 blocks), the rest {c.dtype}"
        )
    return plan


def inspect_plan(
    inputs: InspectionInputs, model: str, machine: Machine, inv: Inventory | None = None, advise: bool = True
) -> Plan:
    """Notebook 30: the base loaded as notebook 30 loads it (bf16 on GPUs, fp32 on a CPU) and probe forwards."""
    c = inputs
    inv = inv or _inv(model)
    gpus = machine.gpus
    work = Workload(
        2 if gpus else 4,
        c.quantization == "nf4",
        c.quantize_experts,
        c.max_len,
        chunk=c.max_len,
        from_pretrained=not c.quantize_experts,
        train=False,
        probe_tokens=c.max_len,
    )
    devices = _devices(inv, machine, work, gpus, "contiguous")
    plan = Plan(
        "adapter inspection (load + probes)",
        devices,
        _facts(
            inv,
            c.quantization,
            c.quantize_experts,
            "bfloat16" if gpus else "float32",
            gpus,
            "contiguous",
            f"1 x {c.max_len}",
            machine,
        ),
    )
    if advise and not plan.fits:
        plan.advice = training_advice(
            c, machine, inv, lambda q, m, i, advise: inspect_plan(q, model, m, i, advise)
        )
    return plan


def inspection_plans(inputs: InspectionInputs, base: str, machine: Machine) -> dict[str, Plan]:
    """Notebook 30's load + probes, and (with a merge) the fp32 logits check of the merged checkpoint."""
    inv = _inv(base)
    plans = {"inspect": inspect_plan(inputs, base, machine, inv)}
    if inputs.merge:
        plans["merge check"] = reference_plan(
            base, machine, inputs.max_len, "merged-checkpoint logits check (fp32, host)", inv
        )
    return plans


def reference_plan(
    model: str, machine: Machine, tokens: int, step: str, inv: Inventory | None = None
) -> Plan:
    """A transformers copy in fp32 on the host (parity reference, merged-logits check)."""
    inv = inv or _inv(model)
    return Plan(
        step,
        reference_devices(inv, machine.host_bytes, tokens),
        {
            "model": f"{_count(inv.parameters)} parameters",
            "dtype": "float32 on the host",
            "machine": machine.describe(),
        },
    )


def serve_plan(
    inputs: ServingInputs, model: str, machine: Machine, inv: Inventory | None = None, fp8_blocks: bool = True
) -> Plan:
    """Notebook 10: vLLM's share per GPU (TP x PP, replicated over DP) and whether one sequence's KV fits.

    ``fp8_blocks=False``: this machine cannot run FP8 block-scaled linears, so an FP8 checkpoint is served as
    a bf16 copy (``dsr1kit.infer.serve_form``) and planned as one.
    """
    inv = inv or _inv(model)
    bf16_copy = not fp8_blocks and checkpoint_is_fp8(inv.config)
    c = replace(inputs, dtype="bfloat16") if bf16_copy else inputs
    n = c.tensor_parallel_size * c.pipeline_parallel_size
    devices, info = serving_devices(
        inv,
        dtype=c.dtype,
        n_gpus=machine.gpus and n,
        gpu_bytes=machine.gpu_bytes,
        utilization=c.gpu_memory_utilization,
        host_bytes=machine.host_bytes,
        tp=c.tensor_parallel_size,
        pp=c.pipeline_parallel_size,
        max_model_len=c.max_model_len,
        max_num_seqs=c.max_num_seqs,
        batched_tokens=c.max_num_batched_tokens,
        enforce_eager=c.enforce_eager,
        cpu_kv_bytes=c.cpu_kv_cache_gib * GIB,
        expert_shards=n * c.data_parallel_size if c.enable_expert_parallel else 0,
    )
    facts = {
        "model": f"{_count(inv.parameters)} parameters",
        "weights": "FP8 blocks as stored"
        if c.dtype == "auto" and checkpoint_is_fp8(inv.config)
        else "bfloat16 copy of the FP8 checkpoint"
        if bf16_copy
        else c.dtype,
        "GPUs": f"TP {c.tensor_parallel_size} x PP {c.pipeline_parallel_size} x DP {c.data_parallel_size}"
        + (
            f", experts over all {n * c.data_parallel_size} (expert parallel)"
            if c.enable_expert_parallel
            else ""
        )
        if machine.gpus
        else "none (vLLM-CPU)",
        "KV": f"{info['kv_bytes_per_token'] / 1024:.1f} KiB/token, room for {info['kv_tokens']:,} tokens",
        "machine": machine.describe(),
    }
    plan = Plan("vLLM serving", devices, facts)
    if info["kv_tokens"] < c.max_model_len:
        plan.extra_problems.append(
            f"the KV cache holds {info['kv_tokens']:,} tokens, fewer than one sequence of max_model_len "
            f"{c.max_model_len:,} (vLLM refuses to start)"
        )
    if not plan.fits:
        plan.advice = serving_advice(c, devices, info)
    return plan
