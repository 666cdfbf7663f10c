"""What the benches share: device timing and memory, the DeepSeek-V3 configs, builds, batches, the LoRA.

One place, so a change to how a step is timed or a model is built reaches every bench at once.
"""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch
import torch.nn.functional as F

from dsr1kit.model.lora import LoraConfig, apply_lora

GIB = 2**30
T, LAMBDA, CHUNK = 1.5, 0.9, 1024  # HARI temperature, KL weight, the fast path's loss chunk
LORA = LoraConfig(r=4, alpha=8, dropout=0.0, last_k_layers=1, targets=())  # the last layer's attention


# -- devices ---------------------------------------------------------------------------------------


def is_cuda(device: torch.device | str | None) -> bool:
    """None: the current CUDA device when there is one (the benches that never name a device)."""
    return torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"


def sync(device: torch.device | str | None = None) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def empty_cache(device: torch.device | str | None = None) -> None:
    if is_cuda(device):
        torch.cuda.empty_cache()


def reset_peak(device: torch.device | str | None = None) -> None:
    if is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)


def free(device: torch.device | str | None = None) -> None:
    """Drop what the last measurement left (PEFT / hooks hold reference cycles) and reset the peak."""
    gc.collect()
    if is_cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def allocated_gib(device: torch.device | str | None = None, digits: int = 2) -> float | None:
    return round(torch.cuda.memory_allocated(device) / GIB, digits) if is_cuda(device) else None


def peak_gib(device: torch.device | str | None = None, digits: int = 2) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / GIB, digits) if is_cuda(device) else None


def timed(fn, device: torch.device | str | None, warmup: int, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` calls after ``warmup`` calls, synchronized."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fmt(v, spec: str = "") -> str:
    return "—" if v is None else format(v, spec)


# -- configs -----------------------------------------------------------------------------------------


# What every bench model shares with R1: the MLA projections, the grouped router, untied embeddings.
R1_SHAPE = dict(
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    max_position_embeddings=16384,
    tie_word_embeddings=False,
    use_cache=False,
)


def deepseek_v3_config(**fields):
    """A DeepseekV3Config of R1's shape with the widths and changes given."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{**R1_SHAPE, **fields})


def r1_config(layers: int, **changes):
    """R1's real widths; the first 3 layers dense (fewer when ``layers`` is small)."""
    return deepseek_v3_config(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=layers,
        first_k_dense_replace=min(3, layers - 1),
        num_attention_heads=128,
        num_key_value_heads=128,
        n_routed_experts=256,
        num_experts_per_tok=8,
        n_shared_experts=1,
        **changes,
    )


def h2048_config(layers: int, **changes):
    """The one-GPU bench model: hidden 2048, 64 experts top-6, MLA, vocab 129,280 (~4.5B at 8 layers)."""
    return deepseek_v3_config(
        **{
            "vocab_size": 129280,
            "hidden_size": 2048,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "num_hidden_layers": layers,
            "first_k_dense_replace": 1,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "n_routed_experts": 64,
            "num_experts_per_tok": 6,
            "n_shared_experts": 2,
            **changes,
        }
    )


def tiny_config(layers: int, first_k_dense: int, **changes):
    """Tiny widths for CPU smoke tests; every Linear: in % 64 == 0, out % 32 == 0 (bitsandbytes on CPU)."""
    return deepseek_v3_config(
        **{
            "vocab_size": 512,
            "hidden_size": 128,
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "num_hidden_layers": layers,
            "first_k_dense_replace": first_k_dense,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "q_lora_rank": 64,
            "kv_lora_rank": 64,
            "qk_rope_head_dim": 32,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "max_position_embeddings": 4096,
            **changes,
        }
    )


# -- builds ---------------------------------------------------------------------------------------------


def init_weights_(module: torch.nn.Module) -> None:
    """Norms 1, the router's correction bias 0, every other float tensor N(0, 0.02)."""
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                t.fill_(1.0)
            elif "e_score_correction_bias" in name:
                t.zero_()
            elif t.is_floating_point():
                t.normal_(std=0.02)


def quantize_linears_(module: torch.nn.Module, device: torch.device) -> None:
    """Every nn.Linear under ``module`` to bitsandbytes NF4 on ``device`` (bf16 compute)."""
    import bitsandbytes as bnb

    from dsr1kit.model.stream_load import nf4_linear

    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, nf4_linear(child, child.weight.data, device, torch.bfloat16))
        elif not isinstance(child, bnb.nn.Linear4bit):
            quantize_linears_(child, device)


def build(
    config,
    devices: dict[str, torch.device],
    experts: str = "nf4",
    linears: str = "nf4",
    kit_experts: bool = True,
):
    """Meta skeleton, then each unit of ``devices`` materialized, initialized and quantized there; frozen.

    Never a full model on the host. ``experts`` / ``linears``: "nf4" or "bf16". ``kit_experts``: bf16 experts
    run the kit's grouped forward, as ``LoadConfig.kit_experts`` (on by default) has the loaders do. Without
    "model.embed_tokens" in ``devices`` the table is a 1-row placeholder (a model entered at
    ``inputs_embeds`` never reads it).
    """
    from transformers import DeepseekV3ForCausalLM

    from dsr1kit.model.experts_grouped import use_kit_experts_
    from dsr1kit.model.experts_nf4 import keep_routing_fp32, quantize_experts_

    first = next(iter(devices.values()))
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    model.to(
        torch.bfloat16
    )  # still on meta: each unit then materializes in bf16, never in fp32 (2x transient)
    if "model.embed_tokens" not in devices:
        model.model.embed_tokens = torch.nn.Embedding(
            1, config.hidden_size, device=first, dtype=torch.bfloat16
        )
    for unit, device in devices.items():
        module = model.get_submodule(unit)
        module.to_empty(device=device)
        init_weights_(module)
        if unit.startswith("model.layers."):
            if experts == "nf4":
                quantize_experts_(module)
            if linears == "nf4":
                quantize_linears_(module, device)
        empty_cache(device)
    rotary = devices.get("model.rotary_emb", first)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config).to(rotary)
    keep_routing_fp32(model)
    if kit_experts:
        use_kit_experts_(model)
    if linears == "nf4":
        model.is_loaded_in_4bit = True
    for q in model.parameters():
        q.requires_grad_(False)
    moe = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    if moe != list(range(config.first_k_dense_replace, config.num_hidden_layers)):
        raise RuntimeError(f"MoE layers {moe}, expected from {config.first_k_dense_replace} on")
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"still on meta after the build: {left[:5]}")
    return model


def add_lora(model, trained_looking: bool = True):
    """``LORA`` on the model, in training mode; ``trained_looking``: lora_B ~ N(0, 0.02) so the KL is not 0."""
    model, plan = apply_lora(model, LORA)
    if trained_looking:
        with torch.no_grad():
            for name, q in model.named_parameters():
                if "lora_B" in name:
                    q.normal_(std=0.02)  # lora_A gets a gradient too
    model.train()  # from_pretrained returns eval mode; gradient checkpointing acts in training mode only
    return model, plan


def check_lora_grads(model, what: str = "") -> dict[str, float]:
    """The proof a step trained something: every trainable parameter is a LoRA factor with a finite,
    non-zero gradient. Returns each one's gradient norm."""
    norms = {}
    for name, q in model.named_parameters():
        if q.requires_grad:
            assert "lora_" in name, f"{what}: {name} is trainable"
            assert q.grad is not None, f"{what}: {name} has no gradient"
            norms[name] = float(q.grad.float().norm())
            assert math.isfinite(norms[name]) and norms[name] > 0, (
                f"{what}: {name} gradient norm {norms[name]}"
            )
    assert norms, f"{what}: no trainable parameters"
    return norms


# -- batches and the recipe ---------------------------------------------------------------------------------


def labels_for(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[:, : ids.shape[1] // 2] = -100  # the first half is the prompt: CE on the second half
    return labels


def make_batch(seq: int, vocab: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """One sample of ``seq`` random tokens (drawn on the host, seeded by ``seq``)."""
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, vocab, (1, seq), generator=g).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels_for(ids)}


def recipe_loss(model, batch):
    """The field recipe: HF CE on labels + λ·T²·KL in bf16 over full logits, input grads on."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    with torch.no_grad(), model.disable_adapter():
        ref = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    mask = batch["attention_mask"].bool()
    kl = F.kl_div(
        F.log_softmax(out.logits / T, -1)[mask],
        F.log_softmax(ref / T, -1)[mask],
        log_target=True,
        reduction="batchmean",
    )
    del ref
    return out.loss + LAMBDA * T * T * kl


# -- the kit's memory plan of a bench step ----------------------------------------------------------------


def training_inputs(seq: int, quantization: str = "none", quantize_experts: bool = False):
    """``dsr1kit.plan.TrainingInputs`` of a bench step: batch 1 × ``seq``, bf16, ``LORA``, chunk ``CHUNK``."""
    from dsr1kit.plan import TrainingInputs

    return TrainingInputs(
        model="(config)",
        trust_remote_code=False,
        dtype="bfloat16",
        quantization=quantization,
        quantize_experts=quantize_experts,
        device_map="contiguous",
        batch_size=1,
        max_len=seq,
        loss_chunk=CHUNK,
        lora_r=LORA.r,
        lora_last_k_layers=LORA.last_k_layers,
        lora_targets=LORA.targets,
        from_prefix_cache=False,
        cached_layers_nf4=False,
        prefix_tokens_per_batch=16384,
    )


def plan_on_gpu0(config, inputs):
    """The kit's HARI plan of ``config`` on one GPU of this machine (the first)."""
    from dsr1kit.plan import Machine, hari_plan_for_config

    machine = Machine(1, torch.cuda.get_device_properties(0).total_memory, 0.0, "bench GPU")
    return hari_plan_for_config(config, machine, inputs)


def layer_compiler(model, first: int, end: int | None = None):
    """A switch between the decoder layers ``first`` .. ``end`` as they are and ``torch.compile`` of each
    (dynamic shapes, so one compilation serves every sequence length): ``switch("compiled")`` /
    ``switch("eager")``. The compiled wrappers share the layers' parameters; the kit's Triton kernels and host
    syncs (NF4 routing) split the compiled graphs, so what fuses is the elementwise work between GEMMs."""
    from dsr1kit.model.lora import decoder_layers

    container = decoder_layers(model)
    stop = len(container) if end is None else end
    eager = {i: container[i] for i in range(first, stop)}
    compiled = {i: torch.compile(layer, dynamic=True) for i, layer in eager.items()}

    def switch(name: str) -> None:
        for i, layer in (compiled if name == "compiled" else eager).items():
            container[i] = layer

    return switch
