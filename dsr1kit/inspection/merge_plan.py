"""What merging an adapter into a copy of its base writes: the shards it rewrites (from the base's index and
headers when the base is on this node), the rest linked; for notebook 10's and 30's disk plans."""

from __future__ import annotations

from pathlib import Path

from ..plan.disk import Write
from .adapter import read_adapter
from .merge import merge_write_bytes


def _last_layer_attention(local: Path) -> list[str]:
    from ..model.checkpoint_index import read_weight_map

    weight_map = read_weight_map(local)
    last = max(int(k.split(".")[2]) for k in weight_map if k.startswith("model.layers."))
    return sorted(
        k[: -len(".weight")]
        for k in weight_map
        if k.startswith(f"model.layers.{last}.self_attn.") and k.endswith("proj.weight")
    )


def merged_checkpoint_write(base: str, adapter_path: Path | None, folder: Path, fix: str) -> Write:
    """The bytes a merge of the adapter at ``adapter_path`` (None: not trained yet, the last layer's attention
    counted) into ``base`` writes into ``folder``."""
    from ..embedded.tiny import resolve_model
    from ..model import staging

    local = staging.locate(resolve_model(base))
    what = "merged checkpoint"
    if local is None:
        from ..plan.inventory import inventory, resolve_config

        last = inventory(resolve_config(base)).layer_sizes()[-1] * 2
        return Write(what, str(folder), last, "the base is not on this node: its last layer in bf16", fix)
    if adapter_path is not None and (adapter_path / "adapter_config.json").is_file():
        modules = read_adapter(adapter_path).modules
        why = f"{len(modules)} adapted modules"
    else:
        modules, why = _last_layer_attention(local), "no adapter yet: the last layer's attention"
    size, shards = merge_write_bytes(local, modules)
    return Write(what, str(folder), size, f"{why}: {shards} shard(s) rewritten, the others linked", fix)
