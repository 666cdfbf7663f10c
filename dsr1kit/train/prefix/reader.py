"""Reading a complete cache back: shards memory-mapped, a batch assembled and zero-padded on demand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .digest import differences
from .layout import INDEX, CacheLayout, PrefixCacheError, missing_shards


class PrefixCache:
    """A complete cache, read lazily: shards are memory-mapped, a batch is assembled and zero-padded on demand."""

    def __init__(self, directory: str | Path, expected: dict[str, str] | None = None):
        self.directory = Path(directory)
        if not (self.directory / INDEX).is_file():
            raise PrefixCacheError(
                f"{self.directory} holds no prefix cache ({INDEX} missing): run the prefix pass "
                f"first (python -m dsr1kit train --prefix-only, slurm/hari_prefix.sbatch, or "
                f"notebook 20 on one machine)"
            )
        self.layout = CacheLayout.read(self.directory)
        if expected is not None:
            diff = differences(self.layout.fingerprint, expected)
            if diff:
                raise PrefixCacheError(
                    f"{self.directory} was built for other inputs: {'; '.join(diff)}. Rebuild "
                    f"it (prefix_cache: auto, or another folder)"
                )
        missing = missing_shards(self.directory, self.layout)
        if missing:
            raise PrefixCacheError(
                f"{self.directory} is incomplete: {len(missing)} of {len(self.layout.shards)} shards missing (e.g. "
                f"{missing[0].file}). Rerun the prefix pass on the same folder (python -m dsr1kit train --prefix-only, "
                f"or slurm/hari_prefix.sbatch); it writes only the missing shards"
            )
        self.where = {i: s.file for s in self.layout.shards for i in s.samples}
        self._handles: dict[str, Any] = {}

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.directory / file), framework="pt", device="cpu")
        return self._handles[file]

    def hidden(self, position: int) -> torch.Tensor:
        """The stored states of the sample at ``position`` in the encoded examples."""
        if position not in self.where:
            raise PrefixCacheError(f"sample {position} is not in the prefix cache {self.directory}")
        return self._handle(self.where[position]).get_tensor(str(position))

    def batch(self, positions: list[int], width: int) -> torch.Tensor:
        """[B, width, H], each sample's hidden states then zeros (right padding, as collate pads ids)."""
        out = torch.zeros(
            len(positions), width, self.layout.hidden_size, dtype=getattr(torch, self.layout.dtype)
        )
        for row, position in enumerate(positions):
            h = self.hidden(position)
            out[row, : h.shape[0]] = h
        return out

    def describe(self) -> dict[str, Any]:
        size = sum((self.directory / s.file).stat().st_size for s in self.layout.shards)
        return {
            "folder": str(self.directory),
            "samples": len(self.where),
            "tokens": self.layout.tokens,
            "shards": len(self.layout.shards),
            "size_gib": round(size / 2**30, 4),
            "bytes_per_token": self.layout.bytes_per_token,
            "dtype": self.layout.dtype,
            "first_adapted_layer": self.layout.fingerprint.get("first_adapted_layer"),
        }
