"""Which form of a checkpoint vLLM serves here: R1's FP8 as shipped, or a bf16 copy where FP8 cannot run.

On GPUs (H100/H200) vLLM serves DeepSeek-R1's FP8 block-scaled weights as
they are. vLLM's CPU backend runs FP8 block-scaled linears only with AMX
tiles (Sapphire Rapids or newer); elsewhere it refuses to load ("Failed to
find a kernel that can implement the ScaledMM linear layer"). There the kit
serves a bf16 copy, dequantized shard by shard with the same block formula
the loaders use, and the report says so. Modules already stored in bf16 (a
merged adapter's) are copied as they are.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..model.checkpoint_index import INDEX_FILE, read_index
from ..model.fp8 import FP8_DTYPE, SCALE_SUFFIX, dequantize_fp8_blocks


def is_fp8_block_checkpoint(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    quant = json.loads(cfg.read_text()).get("quantization_config") or {}
    return quant.get("quant_method") == "fp8" and bool(quant.get("weight_block_size"))


def cpu_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def fp8_blocks_servable(config: dict | None = None) -> bool:
    """Can vLLM on this machine run FP8 block-scaled linears (GPUs yes; a CPU only with AMX), and load this
    checkpoint's (``config``, config.json as a dict) into its fused layers?"""
    return (torch.cuda.is_available() or cpu_has_amx()) and not unaligned_fused_shards(config or {})


def unaligned_fused_shards(config: dict) -> list[str]:
    """The fused layers vLLM cannot fill from FP8 block scales: it places each part of a fused linear
    (q_a + kv_a, gate + up) at a whole number of 128-row scale blocks, so every part but the last must be a
    multiple of the block (R1's 1536, 18432 and 2048 are; a small test model's 64 is not)."""
    block = ((config.get("quantization_config") or {}).get("weight_block_size") or [128])[0]
    firsts = {
        "q_lora_rank (fused with kv_a_proj_with_mqa)": config.get("q_lora_rank"),
        "intermediate_size (gate of gate_up_proj)": config.get("intermediate_size"),
        "moe_intermediate_size (gate of the experts' gate_up)": config.get("moe_intermediate_size"),
    }
    return [f"{name} = {size}" for name, size in firsts.items() if size and size % block]


def checkpoint_config(model: str) -> dict | None:
    """config.json of ``model`` when it is on this node (a folder, an embedded model or the hub cache)."""
    from ..embedded.tiny import resolve_model
    from ..model import staging

    folder = staging.locate(resolve_model(model))
    path = folder / "config.json" if folder is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def dequantized_copy(src: str | Path, dst: str | Path) -> Path:
    """A bf16 copy of an FP8 block checkpoint (atomically; reused when complete). Host memory: one shard."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    if (dst / INDEX_FILE).is_file():
        return dst
    config = json.loads((src / "config.json").read_text())
    block = tuple(config["quantization_config"]["weight_block_size"])
    index = read_index(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=dst.parent))
    try:
        for shard in sorted(set(index["weight_map"].values())):
            out = {}
            with safe_open(src / shard, "pt") as f:
                for key in f.keys():
                    if key.endswith(SCALE_SUFFIX):
                        continue
                    t = f.get_tensor(key)
                    if t.dtype == FP8_DTYPE:
                        t = dequantize_fp8_blocks(
                            t, f.get_tensor(key + SCALE_SUFFIX), block, torch.bfloat16, key
                        )
                    out[key] = t.contiguous()
            save_file(out, tmp / shard, metadata={"format": "pt"})
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.endswith(SCALE_SUFFIX)}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        config.pop("quantization_config")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for item in src.iterdir():
            if item.is_file() and not (tmp / item.name).exists() and not item.name.endswith(".safetensors"):
                shutil.copy2(item, tmp / item.name)
        tmp.chmod(0o755)
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def servable(model: str, work_dir: str | Path) -> tuple[str, str]:
    """(what to pass to ``vllm --model``, a line for the report) for ``model`` (local dir or repo id)."""
    from ..model.load import local_checkpoint

    if torch.cuda.is_available() and not Path(model).is_dir():
        return model, "served as stored"  # a repo id on a GPU node: vLLM resolves (or downloads) it itself
    local = Path(local_checkpoint(model))
    if not is_fp8_block_checkpoint(local):
        return model, "served as stored"
    config = json.loads((local / "config.json").read_text())
    if fp8_blocks_servable(config):
        return model, "served as stored"
    unaligned = unaligned_fused_shards(config)
    why = (
        f"vLLM cannot load these FP8 block scales into its fused layers ({'; '.join(unaligned)}: not a "
        "multiple of the 128-row block)"
        if unaligned
        else "FP8 block-scaled weights cannot run on this CPU (vLLM needs AMX tiles)"
    )
    copy = dequantized_copy(local, Path(work_dir) / f"{local.name}-bf16")
    return str(copy), f"{why}; serving a bf16 copy dequantized from the checkpoint: {copy}"
