"""Merge a LoRA adapter into a copy of the base checkpoint, shard by shard.

Only the shards that hold an adapted weight are read and rewritten
(W' = W + scale·B·A, computed in fp32); every other shard is hard-linked or
copied unchanged. Host memory stays at about one shard, so this works for
R1's 163 shards as well as for the tiny model, and the result is a plain
checkpoint any server (vLLM included) loads without LoRA support.

FP8 block-quantized weights (DeepSeek-R1's release) are the trap: a LoRA
change of 1e-3–1e-2 of ‖W‖ is below float8 e4m3's step (2^-3 relative), so
re-quantizing W + ΔW would round most of the adapter away and the merged
model would serve nearly the base, silently. A merged FP8 weight is therefore
stored in bf16 without ``weight_scale_inv``, and its module is listed as
not-to-convert in config.json's ``quantization_config``
(``modules_to_not_convert`` for transformers, ``ignored_layers`` for vLLM),
so both load it unquantized. vLLM fuses ``q_a_proj`` with
``kv_a_proj_with_mqa`` and needs both parts in one format: the partner of a
merged one is dequantized to bf16 too.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import torch

from ..model.checkpoint_index import INDEX_FILE, CheckpointError, read_index, read_weight_map
from ..model.fp8 import SCALE_SUFFIX, dequantize_fp8_blocks
from .adapter import Adapter, AdapterError

FUSED_PARTNERS = {"q_a_proj": "kv_a_proj_with_mqa", "kv_a_proj_with_mqa": "q_a_proj"}


def _weight_map(folder: Path) -> dict[str, str]:
    """The folder's tensor → shard map; a checkpoint that cannot be read is an AdapterError here."""
    try:
        return read_weight_map(folder)
    except CheckpointError as err:
        raise AdapterError(str(err)) from err


def _link(src: Path, dst: Path) -> None:
    """An unchanged file of the base in the merged checkpoint: a hard link (same filesystem), else a
    relative symbolic link to the base's file -- never a copy (R1's unchanged shards are ~690 GB)."""
    target = src.resolve()  # a hub cache's snapshot file is itself a link to its blob
    try:
        os.link(target, dst)
    except OSError:
        os.symlink(os.path.relpath(target, dst.parent.resolve()), dst)


def _to_bf16(tensors: dict[str, torch.Tensor], key: str, delta: torch.Tensor | None = None) -> None:
    """Dequantize an FP8 weight (plus delta) into bf16 and drop its scale."""
    full = dequantize_fp8_blocks(tensors[key], tensors.pop(key + SCALE_SUFFIX), dtype=torch.float32, name=key)
    tensors[key] = (full if delta is None else full + delta).to(torch.bfloat16).contiguous()


def _merged(tensors: dict[str, torch.Tensor], key: str, delta: torch.Tensor) -> None:
    weight = tensors[key]
    if tuple(weight.shape) != tuple(delta.shape):
        raise AdapterError(
            f"{key}: base weight is {list(weight.shape)} but the adapter's change is "
            f"{list(delta.shape)}: the adapter was made for another base model"
        )
    if key + SCALE_SUFFIX in tensors:  # FP8 with block scales, as DeepSeek-R1 ships: keep the merge in bf16
        _to_bf16(tensors, key, delta)
    else:
        tensors[key] = (weight.float() + delta).to(weight.dtype).contiguous()


def _partner(module: str) -> str | None:
    prefix, _, leaf = module.rpartition(".")
    return f"{prefix}.{FUSED_PARTNERS[leaf]}" if leaf in FUSED_PARTNERS else None


def _not_converted_config(config: dict, modules: list[str]) -> dict:
    """config.json with `modules` listed as unquantized for transformers and vLLM alike."""
    quant = dict(config["quantization_config"])
    listed = sorted(
        set(quant.get("modules_to_not_convert") or []) | set(quant.get("ignored_layers") or []) | set(modules)
    )
    quant["modules_to_not_convert"] = quant["ignored_layers"] = listed
    return dict(config, quantization_config=quant)


def _shards_to_rewrite(
    weight_map: dict[str, str], modules: list[str]
) -> tuple[dict[str, list[str]], set[str]]:
    """({shard: modules whose weight it holds and the merge rewrites}, FP8 fused partners kept in bf16)."""
    by_shard: dict[str, list[str]] = defaultdict(list)
    for module in modules:
        key = f"{module}.weight"
        if key not in weight_map:
            raise AdapterError(
                f"the base checkpoint has no {key}: the adapter was made for another base model"
            )
        by_shard[weight_map[key]].append(module)
    partners = {
        m
        for m in map(_partner, modules)
        if m and m not in modules and f"{m}.weight{SCALE_SUFFIX}" in weight_map
    }
    for module in partners:
        by_shard[weight_map[f"{module}.weight"]].append(module)
    return by_shard, partners


def merge_write_bytes(base_dir: str | Path, modules: list[str]) -> tuple[int, int]:
    """(bytes the merge writes, shards it rewrites) for ``modules`` of the base at ``base_dir`` (a folder):
    the rewritten shards, each FP8 weight among them growing to bf16 (+1 byte per element), the index and
    config; every other shard is linked. Only safetensors headers are read."""
    from safetensors import safe_open

    base = Path(base_dir)
    weight_map = _weight_map(base)
    by_shard, _ = _shards_to_rewrite(weight_map, modules)
    total = sum((base / f).stat().st_size for f in (INDEX_FILE, "config.json") if (base / f).is_file())
    for shard, shard_modules in by_shard.items():
        total += (base / shard).stat().st_size
        with safe_open(base / shard, "pt") as f:
            for module in shard_modules:
                key = f"{module}.weight"
                if key + SCALE_SUFFIX in weight_map:
                    rows, cols = f.get_slice(key).get_shape()
                    total += rows * cols
    return total, len(by_shard)


def merge_into_copy(base_dir: str | Path, adapter: Adapter, out_dir: str | Path) -> Path:
    """Write base + adapter as a new checkpoint folder; return it. ``base_dir`` may be a hub repo id."""
    from safetensors.torch import load_file, save_file

    from ..model.load import local_checkpoint

    base, out = Path(local_checkpoint(str(base_dir))), Path(out_dir)
    weight_map = _weight_map(base)
    fp8 = any(k.endswith(SCALE_SUFFIX) for k in weight_map)
    by_shard, partners = _shards_to_rewrite(weight_map, adapter.modules)
    rewritten = {INDEX_FILE, "config.json"} if fp8 else set()
    out.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        if (
            item.is_file()
            and item.name not in by_shard
            and item.name not in rewritten
            and not os.path.lexists(out / item.name)
        ):
            _link(item, out / item.name)
    kept_bf16: list[str] = []
    for shard, modules in by_shard.items():
        tensors = load_file(base / shard)
        for module in modules:
            key = f"{module}.weight"
            if key + SCALE_SUFFIX in tensors:
                kept_bf16.append(module)
            if module in partners:
                _to_bf16(tensors, key)
            else:
                _merged(tensors, key, adapter.delta(module))
        tmp = out / f".{shard}.tmp"
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, out / shard)
    if fp8:
        kept = {f"{m}.weight{SCALE_SUFFIX}" for m in kept_bf16}
        index = read_index(base)
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in kept}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
        config = json.loads((base / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(_not_converted_config(config, kept_bf16), indent=2))
    (out / "MERGED_FROM.json").write_text(
        json.dumps(
            {
                "base": str(base_dir),
                "adapter": str(adapter.path),
                "modules": adapter.modules,
                "kept_bf16": sorted(kept_bf16),
            },
            indent=2,
        )
    )
    return out


@torch.no_grad()
def verify_merge(adapted_model, merged_model, input_ids: torch.Tensor) -> dict[str, float]:
    """Logits of base+adapter vs the merged checkpoint on the same tokens."""
    a = adapted_model(input_ids=input_ids).logits.float()
    b = merged_model(input_ids=input_ids.to(merged_model.device)).logits.float().to(a.device)
    return {
        "max_abs_diff": float((a - b).abs().max()),
        "logit_std": float(a.std()),
        "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
    }


def _read_weight(folder: Path, weight_map: dict[str, str], key: str) -> torch.Tensor:
    """One weight in fp32, dequantized when it is stored as FP8 blocks."""
    from safetensors import safe_open

    with safe_open(folder / weight_map[key], "pt") as f:
        weight = f.get_tensor(key)
        if key + SCALE_SUFFIX in weight_map:
            with safe_open(folder / weight_map[key + SCALE_SUFFIX], "pt") as g:
                return dequantize_fp8_blocks(
                    weight, g.get_tensor(key + SCALE_SUFFIX), dtype=torch.float32, name=key
                )
    return weight.float()


def verify_merged_weights(base_dir: str | Path, merged_dir: str | Path, adapter: Adapter) -> dict[str, float]:
    """Each merged weight against base + ΔW, read tensor by tensor (for models no host holds twice in fp32).

    ``rel_err`` = ‖merged − (W + ΔW)‖ / ‖ΔW‖ (bf16 rounding of W + ΔW is ~1e-2 of ‖ΔW‖ at most for
    typical adapters); ``moved`` = ‖merged − W‖ / ‖ΔW‖, about 1 when the change is there, 0 when the
    merged checkpoint is the base.
    """
    from ..model.load import local_checkpoint

    base, merged = Path(local_checkpoint(str(base_dir))), Path(merged_dir)
    base_map, merged_map = _weight_map(base), _weight_map(merged)
    errs, moved = [], []
    for module in adapter.modules:
        key = f"{module}.weight"
        w, m, delta = (
            _read_weight(base, base_map, key),
            _read_weight(merged, merged_map, key),
            adapter.delta(module),
        )
        scale = float(delta.norm()) or 1.0
        errs.append(float((m - (w + delta)).norm()) / scale)
        moved.append(float((m - w).norm()) / scale)
    return {
        "modules": len(adapter.modules),
        "rel_err_max": max(errs, default=0.0),
        "moved_min": min(moved, default=0.0),
    }
