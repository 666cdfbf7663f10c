"""The prefix cache: the hidden state entering the first adapted layer, computed once per sample.

HARI adapts only the last layers. Everything below them is frozen, has no
dropout and routes in eval mode, so what the first adapted layer receives is a
pure function of the sample. Running those frozen layers on every step of
every epoch is most of a full-depth step's time (60 of R1's 61 layers); this
package runs them once, forward only, and stores the result:

    <cache>/cache.json               fingerprint, hidden size, dtype, the shard plan (samples, lengths)
    <cache>/shard-00000.safetensors  one tensor [length, hidden] per sample, named by its position in the data

``digest``: what determines the tensors (the fingerprint); ``layout``: shards
and ``cache.json``; ``writer``: the pass, sequential or as a wavefront over
the node's GPUs; ``reader``: ``PrefixCache``; ``fill``: a run's tasks filling
their shares and waiting for the others'.
"""

from .digest import (
    FULL_HASH_BELOW,
    VERSION,
    PrefixConfig,
    differences,
    fingerprint,
    fingerprint_id,
    model_digest,
    samples_digest,
    tokenizer_digest,
)
from .fill import FillConfig, fill_prefix_cache, locate, prefix_cache_folder, prefix_passes, wait_for_shards
from .layout import (
    ELEMENT_BYTES,
    INDEX,
    SHARD,
    CacheLayout,
    PrefixCacheError,
    ShardPlan,
    check_disk,
    length_batches,
    missing_shards,
    plan_shards,
    prepare_layout,
)
from .reader import PrefixCache
from .writer import BuildStats, build, sequential_pass, stage_bounds, wavefront_pass

__all__ = [
    "ELEMENT_BYTES",
    "FULL_HASH_BELOW",
    "INDEX",
    "SHARD",
    "VERSION",
    "BuildStats",
    "CacheLayout",
    "FillConfig",
    "PrefixCache",
    "PrefixCacheError",
    "PrefixConfig",
    "ShardPlan",
    "build",
    "check_disk",
    "differences",
    "fill_prefix_cache",
    "fingerprint",
    "fingerprint_id",
    "length_batches",
    "locate",
    "missing_shards",
    "model_digest",
    "plan_shards",
    "prefix_cache_folder",
    "prefix_passes",
    "prepare_layout",
    "samples_digest",
    "sequential_pass",
    "stage_bounds",
    "tokenizer_digest",
    "wait_for_shards",
    "wavefront_pass",
]
