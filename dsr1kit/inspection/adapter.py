"""What a LoRA adapter holds: per adapted module, how big the change is and where it sits.

Reads a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)
with or without the base model. With the base, each module's change
``ΔW = scale·B·A`` is compared with the base weight (dequantized when it is
NF4), and shapes are checked so an adapter made for another base model is
refused with the module that does not fit.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

PREFIX = "base_model.model."


class AdapterError(ValueError):
    """Not an adapter, a truncated file, or an adapter for another base model."""


@dataclass
class Adapter:
    path: Path
    config: dict[str, Any]
    lora_a: dict[str, torch.Tensor]  # module name → A [r, in]
    lora_b: dict[str, torch.Tensor]  # module name → B [out, r]

    @property
    def modules(self) -> list[str]:
        return sorted(self.lora_a)

    def scale(self, module: str) -> float:
        """alpha / r (alpha / sqrt(r) with rsLoRA), honouring per-module patterns."""
        r = self.lora_a[module].shape[0]
        alpha = self.config.get("lora_alpha", r)
        for pattern, value in (self.config.get("alpha_pattern") or {}).items():
            if module.endswith(pattern):
                alpha = value
        return alpha / math.sqrt(r) if self.config.get("use_rslora") else alpha / r

    def delta(self, module: str) -> torch.Tensor:
        """ΔW = scale · B @ A in fp32, shaped like the base weight [out, in]."""
        return self.scale(module) * (self.lora_b[module].float() @ self.lora_a[module].float())


@dataclass
class ModuleStats:
    module: str
    shape: str  # base weight [out, in]
    rank: int
    alpha: float
    scale: float
    norm_a: float
    norm_b: float
    norm_delta: float
    norm_base: float | None
    ratio: float | None  # ‖ΔW‖ / ‖W‖
    effective_rank: float  # exp(entropy of the normalised singular values of ΔW)
    numeric_rank: int  # singular values above 1e-6 of the largest
    zero_share_b: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_adapter(path: str | Path) -> Adapter:
    """Load config + weights, with a clear error for each way a folder can be wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not path.is_dir():
        raise AdapterError(f"{path} is not a folder; give the adapter folder (it holds adapter_config.json)")
    if not cfg_file.is_file():
        raise AdapterError(
            f"{path} is not a PEFT adapter: adapter_config.json is missing "
            f"(an adapter folder holds adapter_config.json and adapter_model.safetensors)"
        )
    if not weights.is_file():
        raise AdapterError(f"{path}: adapter_model.safetensors is missing")
    config = json.loads(cfg_file.read_text())
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{path} is a {config['peft_type']} adapter; only LoRA is supported")
    try:
        tensors = load_file(weights)
    except (SafetensorError, OSError) as err:
        raise AdapterError(
            f"{weights} is truncated or corrupt ({err}); copy it again from the run folder"
        ) from err
    lora_a, lora_b = {}, {}
    for key, value in tensors.items():
        name = key.removeprefix(PREFIX)
        for tag, store in ((".lora_A.weight", lora_a), (".lora_B.weight", lora_b)):
            if name.endswith(tag):
                store[name.removesuffix(tag)] = value
    if not lora_a or set(lora_a) != set(lora_b):
        raise AdapterError(f"{weights} holds no matching lora_A/lora_B pairs (keys: {sorted(tensors)[:4]}…)")
    return Adapter(path, config, lora_a, lora_b)


def find_adapter(value: str, runs_root: str | Path | None = None) -> Path:
    """'latest' → the newest adapter of a HARI run under ``runs_root`` (runs/); else the given folder."""
    from ..run.paths import PROJECT_ROOT, resolve

    if value != "latest":
        return resolve(value)
    root = Path(runs_root or PROJECT_ROOT / "runs")
    found = latest_adapter(root)
    if found is None:
        raise AdapterError(f"no HARI adapter under {root}: run notebook 20 first or set adapter_dir")
    return found


def latest_adapter(runs_root: str | Path) -> Path | None:
    """The newest adapter written by a HARI run (``<run>/adapter`` beside its run_info.json)."""
    found = [
        c.parent
        for c in Path(runs_root).glob("*/adapter/adapter_config.json")
        if (c.parent.parent / "run_info.json").is_file()
    ]
    return max(found, key=lambda path: path.stat().st_mtime) if found else None


def base_weight(model, module: str) -> torch.Tensor:
    """The base weight [out, in] of ``module`` in fp32, dequantized when it is NF4."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        layer = base.get_submodule(module)
    except AttributeError:
        raise AdapterError(
            f"the base model has no module {module}: the adapter was made for another model"
        ) from None
    layer = getattr(layer, "base_layer", layer)  # inside a PeftModel
    weight = layer.weight
    if getattr(weight, "quant_state", None) is not None:
        import bitsandbytes.functional as bf

        return bf.dequantize_4bit(weight.data, weight.quant_state).float()
    return weight.detach().float()


def module_stats(adapter: Adapter, module: str, base: torch.Tensor | None = None) -> ModuleStats:
    a, b = adapter.lora_a[module], adapter.lora_b[module]
    delta = adapter.delta(module)
    if base is not None and tuple(base.shape) != tuple(delta.shape):
        raise AdapterError(
            f"{module}: the adapter changes a [{delta.shape[0]}, {delta.shape[1]}] weight but the "
            f"base model's is [{base.shape[0]}, {base.shape[1]}]: the adapter was made for another base model"
        )
    s = torch.linalg.svdvals(delta)
    total = float(s.sum())
    if total > 0:
        p = s / total
        p = p[p > 0]
        effective = float(torch.exp(-(p * p.log()).sum()))
        numeric = int((s > 1e-6 * s[0]).sum())
    else:
        effective, numeric = 0.0, 0
    norm_delta = float(delta.norm())
    norm_base = float(base.norm()) if base is not None else None
    return ModuleStats(
        module=module,
        shape=f"[{delta.shape[0]}, {delta.shape[1]}]",
        rank=a.shape[0],
        alpha=float(adapter.config.get("lora_alpha", a.shape[0])),
        scale=adapter.scale(module),
        norm_a=float(a.float().norm()),
        norm_b=float(b.float().norm()),
        norm_delta=norm_delta,
        norm_base=norm_base,
        ratio=norm_delta / norm_base if norm_base else None,
        effective_rank=effective,
        numeric_rank=numeric,
        zero_share_b=float((b == 0).float().mean()),
    )


def inspect_adapter(adapter: Adapter, model=None) -> list[ModuleStats]:
    """Stats for every adapted module; with ``model`` also the ratio to the base weight."""
    return [
        module_stats(adapter, m, base_weight(model, m) if model is not None else None)
        for m in adapter.modules
    ]


def stats_frame(stats: list[ModuleStats]):
    import pandas as pd

    return pd.DataFrame([s.to_dict() for s in stats])
