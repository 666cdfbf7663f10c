"""A HARI run's config (``HariRun``, built once at the seam) and the state its phases hand each other
(the encoded data, the opened caches, the prepared model): what ``train.hari_run`` and ``train.outputs``
both read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data.labels import EncodedSet
from ..model.load import LoadConfig, LoadedModel
from ..model.lora import LoraConfig, LoraPlan, lora_summary
from ..plan import TrainingInputs
from . import dist, prefix
from .loop import TrainConfig


@dataclass(frozen=True)
class DataSpec:
    """Which rows train, and how each is rendered and cut."""

    dataset: str  # a dataset plan: repo[:limit][@split+split],… or a jsonl path
    splits: tuple[str, ...]
    sample_limit: int  # 0: every row
    max_len: int
    system_prompt: str


@dataclass(frozen=True)
class PrefixSetup:
    """The prefix cache: where it goes, what its fingerprint reads, how the pass loads the model (its
    precision resolved once, on this node) and what the pass's planner reads."""

    fill: prefix.FillConfig
    key: prefix.PrefixConfig
    load: LoadConfig  # the full model as the prefix pass loads it
    plan_inputs: TrainingInputs  # the prefix pass's memory plan
    reference: bool  # the KL's reference states cached beside it (reference_cache, and a KL term)
    adapted_load: str  # how the adapted layers load: what the reference's states depend on besides the cache


@dataclass(frozen=True)
class HariRun:
    """Everything one HARI run reads."""

    run_dir: Path
    model: str
    trust_remote_code: bool
    seed: int  # the LoRA init, identical on every rank
    data: DataSpec
    load: LoadConfig
    lora: LoraConfig
    train: TrainConfig
    plan_inputs: TrainingInputs  # the training memory plan
    prefix: PrefixSetup | None  # None: every step runs the frozen layers too


@dataclass
class TrainingData:
    """The encoded examples and, per source of the dataset plan, what was read and kept."""

    encoded: EncodedSet
    sources: list[dict[str, Any]]

    def describe(self) -> str:
        e = self.encoded
        return f"{len(e.examples)} training examples; {e.skipped} rows skipped, {e.truncated} truncated"


@dataclass
class PrefixCacheReady:
    """A complete prefix cache for this run, and what filling it cost (every recorded pass over the folder)."""

    cache: prefix.PrefixCache
    built_here: dict[str, Any] | None  # this rank's share, built now; None when every shard was there
    passes: list[dict[str, Any]]

    def table(self) -> dict[str, Any]:
        d, built = self.cache.describe(), self.built_here
        out = {
            "folder": d["folder"],
            "samples": d["samples"],
            "tokens": f"{d['tokens']:,}",
            "shards": d["shards"],
            "size": f"{d['size_gib']:.3f} GiB ({d['bytes_per_token']:,} B per token, {d['dtype']})",
            "first adapted layer": d["first_adapted_layer"],
            "this run": (
                f"built {built['shards_built']} shard(s), reused {built['shards_reused']}"
                if built and built["shards_built"]
                else "cache hit: every shard reused"
            ),
        }
        for row in self.passes:
            out[f"pass, task {row['task']} ({row['host']})"] = (
                f"{row['shards_built']} shard(s), {row['tokens_built']:,} tokens in {row['seconds']:.1f} s: "
                f"{row['tokens_per_s']:,.0f} tokens/s"
            )
        return out


@dataclass
class ReferenceReady:
    """The reference's last hidden states for every sample, and what computing this rank's share cost."""

    cache: prefix.PrefixCache
    built_here: dict[str, Any] | None  # None when every shard was there

    def describe(self) -> str:
        if not self.built_here:
            return f"read from {self.cache.directory} (every shard reused)"
        b = self.built_here
        return f"{b['tokens']:,} tokens computed at {b['tokens_per_s']:,.0f} tokens/s into {self.cache.directory}"


@dataclass
class Prepared:
    loaded: LoadedModel
    model: Any  # the PeftModel
    plan: LoraPlan
    data: TrainingData
    info: dist.DistInfo
    prefix: PrefixCacheReady | None = None
    reference: ReferenceReady | None = None

    def model_table(self) -> dict[str, Any]:
        """Quantization, placement, memory and exactly which modules carry adapters."""
        lora = lora_summary(self.model, self.plan)
        table = {
            **{k: v for k, v in self.loaded.info.items() if k != "path"},
            "adapted modules": ", ".join(lora["modules"]),
            "trainable parameters": f"{lora['trainable_params']:,} ({lora['trainable_share']:.4%})",
        }
        if self.prefix is not None:
            table["KL reference"] = (
                self.reference.describe()
                if self.reference
                else "computed by every step (adapted layers twice)"
            )
        return table
