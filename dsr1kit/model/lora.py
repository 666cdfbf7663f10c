"""Limited-layer LoRA: adapters on the attention of the last K decoder layers only.

Targets are auto-detected in the adapted layers with the recipe's preference
list (the first group whose modules all exist wins), or given explicitly.
Everything else stays frozen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

PREFERENCE = (
    ("q_a_proj", "q_b_proj"),  # DeepSeek MLA with q_lora_rank
    ("kv_b_proj",),
    ("q_proj", "v_proj"),  # Llama, Qwen, DeepSeek without q_lora_rank
    ("wq", "wv"),
    ("qkv_proj",),
    ("query_key_value",),
    ("o_proj",),  # the recipe's last resort [o_proj, wo]: whichever exists
    ("wo",),
)


class LoraTargetError(ValueError):
    """No usable attention linear in the chosen layers, or an explicit target that does not exist."""


@dataclass(frozen=True)
class LoraConfig:
    """The adapter's shape and where it goes (notebook 20's lora_* parameters)."""

    r: int  # LoRA rank
    alpha: float  # scale numerator: the update is scaled by alpha / r
    dropout: float  # dropout on the LoRA input; 0 keeps the fast path exact
    last_k_layers: int  # adapt the last K decoder layers
    targets: tuple[str, ...]  # short module names; (): auto-detect the attention projections


@dataclass
class LoraPlan:
    layers: list[int]
    targets: list[str]  # short names, e.g. ["q_a_proj", "q_b_proj"]
    modules: list[str]  # full module names that get adapters


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    if hasattr(model, "get_base_model"):  # a PeftModel
        model = model.get_base_model()
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    raise LoraTargetError("cannot find the decoder layers (looked for model.layers, transformer.h, …)")


def _is_linear(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    try:
        import bitsandbytes as bnb

        return isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))
    except ImportError:
        return False


def _layer_prefix(model: nn.Module, index: int) -> str:
    layers = decoder_layers(model)
    target = layers[index]
    for name, module in model.named_modules():
        if module is target:
            return name
    raise LoraTargetError(f"layer {index} not found by name")


def plan_lora(model: nn.Module, last_k: int = 1, targets: list[str] | None = None) -> LoraPlan:
    """Which modules of the last ``last_k`` layers get adapters."""
    n = len(decoder_layers(model))
    if last_k > n:
        raise LoraTargetError(f"lora_last_k_layers={last_k} but the model has {n} layers")
    layers = list(range(n - last_k, n))
    prefixes = [_layer_prefix(model, i) for i in layers]
    linears = {name: m for name, m in model.named_modules() if _is_linear(m)}

    def found(short: str) -> list[str]:
        return [
            f
            for f in linears
            if any(f.startswith(p + ".") for p in prefixes) and f.rsplit(".", 1)[-1] == short
        ]

    if targets:
        missing = [t for t in targets if not found(t)]
        if missing:
            available = sorted(
                {f.rsplit(".", 1)[-1] for f in linears if any(f.startswith(p + ".") for p in prefixes)}
            )
            raise LoraTargetError(
                f"lora_targets {missing} not found in layers {layers}; linears there: {available}"
            )
        chosen = list(targets)
    else:
        chosen = None
        for group in PREFERENCE:
            if all(found(t) for t in group):
                chosen = list(group)
                break
        if chosen is None:
            raise LoraTargetError(
                f"no attention linear from the preference list in layers {layers}; "
                f"set lora_targets explicitly"
            )
    modules = sorted(m for t in chosen for m in found(t))
    return LoraPlan(layers, chosen, modules)


def apply_lora(model: nn.Module, cfg: LoraConfig, plan: LoraPlan | None = None):
    """Wrap ``model`` with PEFT adapters on exactly ``plan.modules``; freeze the rest."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    plan = plan or plan_lora(model, cfg.last_k_layers, list(cfg.targets) or None)
    # Full module names (exact matches). A regex string here got widened to every layer's
    # q_a_proj/q_b_proj by PEFT 0.21 on DeepSeek-V3, so the result is checked below too.
    config = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(plan.modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    adapted = sorted(
        n.removeprefix("base_model.model.").removesuffix(".lora_A")
        for n, _ in peft_model.named_modules()
        if n.endswith(".lora_A")
    )
    if adapted != plan.modules:  # never train what was not asked for
        raise LoraTargetError(f"PEFT adapted {adapted}, expected {plan.modules}")
    for name, param in peft_model.named_parameters():
        param.requires_grad_("lora_" in name)
    return peft_model, plan


def lora_summary(peft_model: nn.Module, plan: LoraPlan) -> dict[str, Any]:
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    return {
        "layers": plan.layers,
        "targets": plan.targets,
        "modules": plan.modules,
        "trainable_params": trainable,
        "total_params": total,
        "trainable_share": trainable / total if total else 0.0,
    }


def first_adapted_layer(plan: LoraPlan) -> int:
    return min(plan.layers)
