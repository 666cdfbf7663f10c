"""Which shard holds which tensor: the one reader of a safetensors checkpoint's index.

The streaming loader, the adapter merge and the serving copy all ask this; it
needs only safetensors (no torch model code, no bitsandbytes). A folder holds
either ``model.safetensors.index.json`` plus its shards or one
``model.safetensors``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """The checkpoint directory cannot be loaded as it is; the message says what to fix."""


def read_index(path: str | Path) -> dict[str, Any]:
    """The index json as stored (its ``metadata`` too, for rewriting it); a single ``model.safetensors``
    gives ``{"weight_map": …}``. Every shard the map names must exist."""
    path = Path(path)
    index_file = path / INDEX_FILE
    if index_file.is_file():
        index = json.loads(index_file.read_text())
    elif (path / SINGLE_FILE).is_file():
        with safe_open(path / SINGLE_FILE, framework="pt") as f:
            index = {"weight_map": {key: SINGLE_FILE for key in f.keys()}}
    else:
        raise CheckpointError(
            f"{path} has neither {INDEX_FILE} nor {SINGLE_FILE}: point the loader at the "
            "directory that holds the model's safetensors shards and their index."
        )
    by_shard: dict[str, list[str]] = defaultdict(list)
    for key, shard in index["weight_map"].items():
        by_shard[shard].append(key)
    missing = sorted(shard for shard in by_shard if not (path / shard).is_file())
    if missing:
        listing = "\n".join(
            f"  {s} ({len(by_shard[s])} tensors, e.g. {by_shard[s][0]})" for s in missing[:10]
        )
        more = f"\n  … and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise CheckpointError(
            f"{len(missing)} shard(s) named in {INDEX_FILE} are missing from {path}:\n{listing}{more}\n"
            f"Download them again (e.g. `huggingface-cli download REPO {missing[0]} --local-dir {path}`) "
            "or fix the checkpoint path."
        )
    return index


def read_weight_map(path: str | Path) -> dict[str, str]:
    """Tensor name → shard file name (relative to ``path``)."""
    return read_index(path)["weight_map"]
