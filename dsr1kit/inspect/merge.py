"""Merge a LoRA adapter into a copy of the base checkpoint, shard by shard.

Only the shards that hold an adapted weight are read and rewritten
(W' = W + scale·B·A, computed in fp32 and stored in the weight's own dtype;
FP8 block-quantized weights are dequantized, merged and re-quantized with
fresh block scales); every other shard is hard-linked or copied unchanged.
Host memory stays at about one shard, so this works for R1's 163 shards as
well as for the tiny model, and the result is a plain checkpoint any server
(vLLM included) loads without LoRA support.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from pathlib import Path

import torch

from .adapter import Adapter, AdapterError

SCALE_SUFFIX = "_scale_inv"


def _weight_map(base: Path) -> dict[str, str]:
    index = base / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = base / "model.safetensors"
    if not single.is_file():
        raise AdapterError(f"{base} has neither model.safetensors nor model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return {k: single.name for k in f.keys()}


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _merged(tensors: dict[str, torch.Tensor], key: str, delta: torch.Tensor) -> None:
    weight = tensors[key]
    if tuple(weight.shape) != tuple(delta.shape):
        raise AdapterError(f"{key}: base weight is {list(weight.shape)} but the adapter's change is "
                           f"{list(delta.shape)}: the adapter was made for another base model")
    scale_key = key + SCALE_SUFFIX
    if scale_key in tensors:  # FP8 with block scales, as DeepSeek-R1 ships
        from ..model.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks

        full = dequantize_fp8_blocks(weight, tensors[scale_key], dtype=torch.float32, name=key)
        tensors[key], tensors[scale_key] = quantize_fp8_blocks(full + delta)
        tensors[scale_key] = tensors[scale_key].to(tensors[scale_key].dtype)
    else:
        tensors[key] = (weight.float() + delta).to(weight.dtype).contiguous()


def merge_into_copy(base_dir: str | Path, adapter: Adapter, out_dir: str | Path) -> Path:
    """Write base + adapter as a new checkpoint folder; return it."""
    from safetensors.torch import load_file, save_file

    base, out = Path(base_dir), Path(out_dir)
    weight_map = _weight_map(base)
    by_shard: dict[str, list[str]] = defaultdict(list)
    for module in adapter.modules:
        key = f"{module}.weight"
        if key not in weight_map:
            raise AdapterError(f"the base checkpoint has no {key}: the adapter was made for another base model")
        by_shard[weight_map[key]].append(module)
    out.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        if item.is_file() and item.name not in by_shard and not (out / item.name).exists():
            _link_or_copy(item, out / item.name)
    for shard, modules in by_shard.items():
        tensors = load_file(base / shard)
        for module in modules:
            _merged(tensors, f"{module}.weight", adapter.delta(module))
        tmp = out / f".{shard}.tmp"
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, out / shard)
    (out / "MERGED_FROM.json").write_text(json.dumps(
        {"base": str(base), "adapter": str(adapter.path), "modules": adapter.modules}, indent=2))
    return out


@torch.no_grad()
def verify_merge(adapted_model, merged_model, input_ids: torch.Tensor) -> dict[str, float]:
    """Logits of base+adapter vs the merged checkpoint on the same tokens."""
    a = adapted_model(input_ids=input_ids).logits.float()
    b = merged_model(input_ids=input_ids.to(merged_model.device)).logits.float().to(a.device)
    return {"max_abs_diff": float((a - b).abs().max()), "logit_std": float(a.std()),
            "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean())}
