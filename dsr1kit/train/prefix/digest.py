"""What determines the cached tensors: a cache is reused only by a run that would compute exactly the same ones.

The fingerprint covers the model files, dtype, quantization (FP8 as stored, NF4 or none), tokenizer, data
plan, max_len, the encoded samples and the first adapted layer; a mismatch is
refused field by field. Its strings and their order are the keys of caches
already on disk (and of their ``auto`` folders): change them and every cache
is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ...data.labels import Encoded

VERSION = 1
FP8_PASS = "fp8 as stored: e4m3 weights in 128x128 blocks, activations per 1x128 group"
# model files smaller than this are hashed whole; larger ones by name, size, header
FULL_HASH_BELOW = 256 * 2**20


@dataclass(frozen=True)
class PrefixConfig:
    """What the fingerprint reads besides the model files, tokenizer and samples (notebook 20's parameters)."""

    dataset: str  # the dataset plan, as given
    splits: tuple[str, ...]  # default splits per source
    sample_limit: int  # global cap on samples; 0: all
    system_prompt: str  # system prompt of every training chat
    max_len: int  # tokens per sample
    dtype: str  # bfloat16 | float32: the dtype the prefix runs and is stored in
    quantization: str  # nf4 | none: the linears of the full model that runs the prefix
    quantize_experts: bool  # NF4 fused MoE experts in that model
    fp8: bool = False  # the checkpoint's FP8 weights as stored, block-scaled FP8 GEMMs (prefix_precision fp8)


def _file_digest(path: Path, h) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    if size < FULL_HASH_BELOW:
        h.update(path.read_bytes())
    elif path.suffix == ".safetensors":  # names, dtypes, shapes and offsets of every tensor
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h.update(f.read(n))


def model_digest(model_path: str | Path) -> str:
    """config.json and the weight files (whole when small; name, size and tensor header when large)."""
    root = Path(model_path)
    h = hashlib.sha256()
    for path in sorted(root.glob("*.json")) + sorted(root.glob("*.safetensors")):
        if not path.name.startswith("tokenizer") and path.name not in (
            "special_tokens_map.json",
            "generation_config.json",
        ):
            _file_digest(path, h)
    return h.hexdigest()[:16]


def tokenizer_digest(tokenizer) -> str:
    """The vocabulary, special tokens and chat template the samples were encoded with."""
    h = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(
        json.dumps(
            [
                str(tokenizer.bos_token),
                str(tokenizer.eos_token),
                str(tokenizer.pad_token),
                tokenizer.chat_template or "",
            ]
        ).encode()
    )
    return h.hexdigest()[:16]


def samples_digest(examples: list[Encoded]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(e.id.encode() + b"\0")
        h.update(torch.tensor(e.input_ids, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]


def fingerprint(
    cfg: PrefixConfig, model_path: str | Path, tokenizer, examples: list[Encoded], first_layer: int
) -> dict[str, str]:
    """Every input of the prefix pass, one readable field each (compared field by field on reuse)."""
    return {
        "version": str(VERSION),
        "model": f"{Path(model_path).name} {model_digest(model_path)}",
        "dtype": cfg.dtype,
        "quantization": FP8_PASS
        if cfg.fp8
        else f"linears {cfg.quantization}, experts {'nf4' if cfg.quantize_experts else 'as stored'}",
        "tokenizer": tokenizer_digest(tokenizer),
        "data_plan": json.dumps(
            {
                "dataset": cfg.dataset,
                "splits": list(cfg.splits),
                "sample_limit": cfg.sample_limit,
                "system_prompt": cfg.system_prompt,
            },
            sort_keys=True,
        ),
        "max_len": str(cfg.max_len),
        "samples": f"{len(examples)} samples {samples_digest(examples)}",
        "first_adapted_layer": str(first_layer),
    }


def fingerprint_id(fp: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def differences(saved: dict[str, str], now: dict[str, str]) -> list[str]:
    return [
        f"{k}: cached {saved.get(k)!r}, this run {now.get(k)!r}"
        for k in sorted(set(saved) | set(now))
        if saved.get(k) != now.get(k)
    ]
