"""How the prefix pass holds the frozen model: FP8 as the checkpoint stores it, NF4, or unquantized.

The pass is forward only, so it can run R1 as R1 ships: e4m3 weights with their
block scales and block-scaled FP8 GEMMs (``model.fp8_compute``), which keeps
the weights at 1 byte each and computes the states R1 itself computes. ``auto``
takes that path where both the checkpoint (FP8 ``quantization_config``) and the
GPUs (compute capability ≥ 8.9: Ada, Hopper and later) allow it, and otherwise
loads the model as training does (``quantization`` / ``quantize_experts``), so
that a cache built before this setting existed keeps its fingerprint.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ...model.load import LoadConfig

PRECISIONS = ("auto", "fp8", "nf4", "bf16")


def gpu_has_fp8() -> bool:
    """Every visible GPU has FP8 tensor cores (none visible: False)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return n > 0 and all(torch.cuda.get_device_capability(i) >= (8, 9) for i in range(n))


def stored_in_fp8(model: str, trust_remote_code: bool = False) -> bool:
    """Whether the checkpoint's config says its weights are stored in FP8 (R1, V3); nothing else is read."""
    from ...plan.inventory import checkpoint_is_fp8, resolve_config

    return checkpoint_is_fp8(resolve_config(model, trust_remote_code, hub=False))


def resolve(setting: str, model: str, trust_remote_code: bool = False) -> str:
    """``setting`` made concrete for this node: fp8, nf4, bf16, or "as loaded" (auto without FP8)."""
    if setting not in PRECISIONS:
        raise ValueError(f"prefix_precision {setting!r}: use one of {', '.join(PRECISIONS)}")
    if setting == "fp8" and not stored_in_fp8(model, trust_remote_code):
        raise ValueError(
            f"prefix_precision fp8 runs the checkpoint's FP8 weights as stored, but {model} is not stored in FP8 "
            "(no FP8 quantization_config): set prefix_precision to auto, nf4 or bf16"
        )
    if setting != "auto":
        return setting
    return "fp8" if gpu_has_fp8() and stored_in_fp8(model, trust_remote_code) else "as loaded"


def prefix_load(load: LoadConfig, precision: str, model_type: str = "deepseek_v3") -> LoadConfig:
    """The training load adjusted for the prefix pass at ``precision`` (resolve's answer)."""
    if precision == "fp8":
        return replace(load, quantization="none", quantize_experts=False, fp8_compute=True)
    if precision == "nf4":
        return replace(
            load, quantization="nf4", quantize_experts=model_type == "deepseek_v3", fp8_compute=False
        )
    if precision == "bf16":
        return replace(load, quantization="none", quantize_experts=False, fp8_compute=False)
    return load
