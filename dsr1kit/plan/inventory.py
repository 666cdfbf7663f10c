"""What a model holds, from its config alone: parameters per load unit and kind, and their bytes as loaded.

The plan must run before anything is downloaded or loaded, so it builds the
model on the meta device (no memory, seconds even for R1) and counts each
parameter under the unit the loaders place as one piece (embeddings, each
decoder layer, final norm, lm_head) and under a kind whose bytes depend on
how it is loaded:

- ``experts``: fused routed experts (NF4 only with ``quantize_experts``);
- ``linear``: every other ``nn.Linear`` weight (NF4 with ``quantization: nf4``);
- ``head``: lm_head, ``embed``: the embeddings (kept in the compute dtype);
- ``router``: the MoE gate and its bias (kept in fp32 for routing);
- ``other``: norms and biases.

Configs resolve like the loaders resolve models (a local folder, the hub
cache, the hub), and a few well-known releases ship with the kit so that
their plan needs no download at all.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

KNOWN_CONFIGS = {  # repo id -> config file shipped beside this module (same architecture, same config)
    "deepseek-ai/DeepSeek-R1": "deepseek-r1.json",
    "deepseek-ai/DeepSeek-R1-0528": "deepseek-r1.json",
    "deepseek-ai/DeepSeek-V3": "deepseek-r1.json",
    "deepseek-ai/DeepSeek-V3-0324": "deepseek-r1.json",
}
NF4_BYTES = (
    0.5 + 1 / 64 + 4 / (64 * 256)
)  # 4-bit codes + 8-bit absmax per 64 + fp32 per 256 absmax (double quant)
FP8_BLOCK_BYTES = 1 + 4 / (128 * 128)  # e4m3 + one fp32 scale per 128x128 block
KINDS = ("experts", "linear", "head", "embed", "router", "other")


@dataclass
class Inventory:
    """Parameter counts per load unit and kind, and the config facts the step estimates need."""

    config: object
    units: dict[str, dict[str, int]] = field(default_factory=dict)  # unit -> kind -> parameters
    largest_linear: int = 0  # parameters of the biggest nn.Linear (bitsandbytes dequantizes one at a time)
    adapted_linears: dict[str, tuple[int, int]] = field(
        default_factory=dict
    )  # name in last layer -> (in, out)

    @property
    def parameters(self) -> int:
        return sum(sum(kinds.values()) for kinds in self.units.values())

    def kind_total(self, kind: str) -> int:
        return sum(kinds.get(kind, 0) for kinds in self.units.values())

    def unit_bytes(self, unit: str, per_kind: dict[str, float]) -> float:
        return sum(n * per_kind[k] for k, n in self.units[unit].items())

    @property
    def layers(self) -> list[str]:
        return [u for u in self.units if u.startswith("model.layers.")]

    def layer_sizes(self) -> list[int]:
        return [sum(self.units[u].values()) for u in self.layers]


def resolve_config(model: str, trust_remote_code: bool = False, hub: bool = True):
    """The model's config: local folder or hub cache, then a config shipped with the kit, then the hub
    (unless ``hub`` is False: a compute node without internet would wait on its timeouts)."""
    from transformers import AutoConfig

    from ..embedded.tiny import resolve_model

    path = resolve_model(model)
    kwargs = dict(trust_remote_code=trust_remote_code, token=os.environ.get("HF_TOKEN"))
    try:
        return strip_quantization(AutoConfig.from_pretrained(path, local_files_only=True, **kwargs))
    except (OSError, ValueError):
        pass
    if model in KNOWN_CONFIGS:  # plan R1 before downloading 700 GB (or with the hub offline)
        return config_from_file(Path(__file__).with_name("known_configs") / KNOWN_CONFIGS[model])
    if not hub:
        raise ValueError(f"no config of {model!r} on this node or shipped with the kit")
    try:
        return strip_quantization(AutoConfig.from_pretrained(path, **kwargs))
    except (OSError, ValueError) as err:
        raise ValueError(
            f"cannot read the config of {model!r} to plan memory ({err}); point `model` at a "
            f"folder with config.json or make the hub reachable"
        ) from err


def config_from_file(path: str | Path):
    from transformers import AutoConfig

    raw = json.loads(Path(path).read_text())
    model_type = raw.pop("model_type")
    return strip_quantization(
        AutoConfig.for_model(model_type, **raw), quantization=raw.get("quantization_config")
    )


def strip_quantization(config, quantization: dict | None = None):
    """Keep the checkpoint's quantization as a plain fact (``checkpoint_quantization``); the skeleton is built
    without it."""
    quant = quantization or getattr(config, "quantization_config", None)
    if quant is not None and not isinstance(quant, dict):
        quant = quant.to_dict()
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.checkpoint_quantization = quant or {}
    return config


def checkpoint_is_fp8(config) -> bool:
    return (getattr(config, "checkpoint_quantization", None) or {}).get("quant_method") == "fp8"


def inventory(config) -> Inventory:
    """Count every parameter of the model the config describes (built on the meta device)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from ..model.experts_nf4 import is_fused_experts

    # meta as the default device too: a fused-experts parameter is made with torch.empty before accelerate
    # moves it, which at R1 widths in fp32 (no dtype in a bench config) asks the host for 30 GB per layer
    with init_empty_weights(), torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    inv = Inventory(config)
    kind_of: dict[str, str] = {}
    for name, module in skeleton.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not own:
            continue
        if is_fused_experts(module):
            kind = "experts"
        elif isinstance(module, nn.Embedding):
            kind = "embed"
        elif name.endswith("lm_head"):
            kind = "head"
        elif name.endswith("mlp.gate"):
            kind = "router"
        elif isinstance(module, nn.Linear):
            kind = "linear"
            inv.largest_linear = max(inv.largest_linear, module.weight.numel())
        else:
            kind = "other"
        for pname in own:
            full = f"{name}.{pname}" if name else pname
            kind_of[full] = kind if (kind != "linear" or pname == "weight") else "other"
    last = len(skeleton.model.layers) - 1
    for name, module in skeleton.model.layers[last].named_modules():
        if isinstance(module, nn.Linear):
            inv.adapted_linears[name.rsplit(".", 1)[-1]] = (module.in_features, module.out_features)
    for full, param in skeleton.named_parameters():
        unit = _unit(full)
        inv.units.setdefault(unit, {}).setdefault(kind_of[full], 0)
        inv.units[unit][kind_of[full]] += param.numel()
    if getattr(config, "tie_word_embeddings", False):
        inv.units.pop("lm_head", None)
    return inv


def _unit(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "model" and parts[1] == "layers":
        return ".".join(parts[:3])
    if parts[0] == "model":
        return ".".join(parts[:2])
    return parts[0]


def bytes_per_param(dtype_bytes: int, nf4_linears: bool, nf4_experts: bool) -> dict[str, float]:
    """Bytes of one parameter of each kind, as the kit's loaders store it."""
    return {
        "experts": NF4_BYTES if nf4_experts else dtype_bytes,
        "linear": NF4_BYTES if nf4_linears else dtype_bytes,
        "head": dtype_bytes,
        "embed": dtype_bytes,
        "router": 4,
        "other": dtype_bytes,
    }


def served_bytes_per_param(config, dtype: str) -> dict[str, float]:
    """Bytes as vLLM holds the checkpoint: FP8 blocks as stored (dtype auto), else the dtype asked for."""
    if dtype == "auto" and checkpoint_is_fp8(config):
        return {
            "experts": FP8_BLOCK_BYTES,
            "linear": FP8_BLOCK_BYTES,
            "head": 2,
            "embed": 2,
            "router": 4,
            "other": 2,
        }
    size = (
        4
        if dtype == "float32"
        or (dtype == "auto" and str(getattr(config, "dtype", "")) in ("float32", "torch.float32"))
        else 2
    )
    return {k: size for k in KINDS} | {"router": 4}


def stored_bytes(model: str) -> int:
    """Bytes of the model's weights as its checkpoint stores them (FP8 blocks for R1), from its config alone:
    what staging a copy writes at least (R1's multi-token-prediction layer, which the model built from the
    config lacks, comes on top)."""
    return config_stored_bytes(resolve_config(model, hub=False))


def config_stored_bytes(config) -> int:
    """`stored_bytes` of a config already resolved."""
    inv = inventory(config)
    per_kind = served_bytes_per_param(config, "auto")
    return int(sum(inv.unit_bytes(unit, per_kind) for unit in inv.units))
