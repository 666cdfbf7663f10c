"""The tiny R1-style model stored exactly as DeepSeek-R1 ships, in a local Hugging Face cache under a repo id.

DeepSeek-R1's release is FP8 ``float8_e4m3fn`` linear weights, each with a
``weight_scale_inv`` of one float32 per 128×128 block; embeddings, norms,
the router gate and ``lm_head`` in bf16; one key per routed expert
(``mlp.experts.7.gate_proj.weight``); R1's ``quantization_config`` in
config.json; sharded safetensors with an index. This module writes the
``tiny-r1`` model (R1's tokenizer setup) that way into
``<HF_HOME>/hub/models--<org>--<name>/snapshots/<rev>/`` with ``refs/main``,
so that with ``HF_HUB_OFFLINE=1`` the repo id resolves as it does on a
cluster whose cache already holds R1. Nothing is downloaded.

    python -m dsr1kit.embedded.r1_format          # builds it (cached), prints where it is
    eval "$(python -m dsr1kit.embedded.r1_format --env)"   # and sets the offline hub environment in this shell
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..model.fp8 import quantize_fp8_blocks
from .tiny import TINY_R1_NAME, cache_root, resolve_model

REPO_ID = "dsr1kit-rehearsal/DeepSeek-R1-tiny"
FORMAT_VERSION = 1
R1_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
INDEX_FILE = "model.safetensors.index.json"  # as dsr1kit.model.checkpoint_index reads it; kept import-light:
# tests import this module to set the offline hub environment before anything imports huggingface_hub
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
)


def is_fp8_weight(key: str, tensor: torch.Tensor) -> bool:
    """R1 keeps embeddings, norms, the router gate and lm_head in bf16; every other linear weight is FP8."""
    return (
        tensor.dim() == 2
        and key.endswith(".weight")
        and not key.endswith("mlp.gate.weight")
        and key not in ("model.embed_tokens.weight", "lm_head.weight")
    )


def to_fp8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every weight R1 stores in FP8 replaced by (fp8 weight, weight_scale_inv); the rest unchanged."""
    out = {}
    for key, t in tensors.items():
        if is_fp8_weight(key, t):
            out[key], out[key + "_scale_inv"] = quantize_fp8_blocks(t)
        else:
            out[key] = t
    return out


def shard_name(key: str) -> str:
    """One shard per decoder layer, one for the rest: a real index with several files."""
    parts = key.split(".")
    return (
        f"layer-{int(parts[2]):03d}.safetensors" if key.startswith("model.layers.") else "other.safetensors"
    )


def write_checkpoint(out: Path, tensors: dict[str, torch.Tensor], config: dict, fp8: bool = False) -> Path:
    """Sharded safetensors + index + config.json (with R1's FP8 quantization_config when fp8)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = to_fp8(tensors) if fp8 else tensors
    shards: dict[str, dict] = {}
    for key, t in tensors.items():
        shards.setdefault(shard_name(key), {})[key] = t.contiguous()
    for name, part in shards.items():
        save_file(part, out / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: shard_name(k) for k in sorted(tensors)}}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    config = dict(config, quantization_config=R1_QUANTIZATION_CONFIG) if fp8 else dict(config)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def hf_home() -> Path:
    """The rehearsal's own HF_HOME (beside the tiny models' cache), never the user's."""
    return cache_root() / "hf-rehearsal"


def _revision(source: Path) -> str:
    h = hashlib.sha1(f"r1-format-v{FORMAT_VERSION}-{source.name}".encode())
    return h.hexdigest()


def snapshot_dir(home: Path, repo_id: str = REPO_ID, revision: str = "") -> Path:
    return home / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / revision


def _write_snapshot(source: Path, target: Path) -> None:
    """The FP8 checkpoint and tokenizer files into target, atomically (temp dir, then rename)."""
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        config = json.loads((source / "config.json").read_text())
        write_checkpoint(tmp, read_tensors(source), config, fp8=True)
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, tmp / name)
        tmp.chmod(0o755)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build(home: Path | None = None, repo_id: str = REPO_ID) -> Path:
    """Write tiny-r1 in R1's format into the hub cache under ``home`` (atomically); return the snapshot dir."""
    home = home or hf_home()
    source = Path(resolve_model(TINY_R1_NAME))
    revision = _revision(source)
    target = snapshot_dir(home, repo_id, revision)
    if (target / INDEX_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(f"{target}.lock"):  # two jobs on a fresh cache write it once
        if not (target / INDEX_FILE).is_file():
            _write_snapshot(source, target)
    refs = target.parent.parent / "refs"
    refs.mkdir(exist_ok=True)
    (refs / "main").write_text(revision)
    return target


def offline_env(home: Path | None = None) -> dict[str, str]:
    """Environment under which the repo id resolves from the rehearsal cache, as on a cluster with R1 cached."""
    home = home or hf_home()
    return {
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


if __name__ == "__main__":
    import shlex
    import sys

    snap = build()
    if "--env" in sys.argv[1:]:
        print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in offline_env().items()))
    else:
        print(f"HF_HOME={hf_home()}\nrepo id: {REPO_ID}\nsnapshot: {snap}")
