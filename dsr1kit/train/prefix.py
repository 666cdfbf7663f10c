"""The prefix cache: the hidden state entering the first adapted layer, computed once per sample.

HARI adapts only the last layers. Everything below them is frozen, has no
dropout and routes in eval mode, so what the first adapted layer receives is a
pure function of the sample. Running those frozen layers on every step of
every epoch is most of a full-depth step's time (60 of R1's 61 layers); this
module runs them once, forward only, and stores the result:

    <cache>/cache.json               fingerprint, hidden size, dtype, the shard plan (samples, lengths)
    <cache>/shard-00000.safetensors  one tensor [length, hidden] per sample, named by its position in the data

Samples are named by position, not by their id: datasets often repeat ids
across splits or files, and the fingerprint pins the order anyway.

Samples are sorted by length and packed into micro-batches of about
``tokens_per_batch`` padded tokens, and batches into shards of about
``shard_mib``. Shard ``i`` belongs to task ``i % tasks`` (one task per node,
the node's GPUs holding the prefix through the device_map). A shard is written
to a temporary name and renamed when whole, so a killed or requeued pass
redoes only the shards that are missing.

Within a node, the frozen layers are cut into stages at the GPU boundaries of
the device_map and micro-batches flow through them as a wavefront: stage k
works on micro-batch t - k while stage k - 1 works on t - k + 1, so every GPU
is busy instead of one at a time. Each stage is a thread; the tensors cross
GPUs through the model's own dispatch hooks.

A cache is only reused by a run that would compute exactly the same tensors:
the fingerprint covers the model files, dtype, quantization, tokenizer, data
plan, max_len, the encoded samples and the first adapted layer; a mismatch is
refused field by field.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.std import tqdm

from ..data.labels import Encoded, collate
from ..model.lora import decoder_layers
from .hari import prefix_forward, run_layers

VERSION = 1
INDEX = "cache.json"
SHARD = "shard-{:05d}.safetensors"
FULL_HASH_BELOW = 256 * 2**20  # model files smaller than this are hashed whole; larger ones by name, size, header
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class PrefixCacheError(RuntimeError):
    """The cache does not belong to this run, is incomplete, or will not fit on its disk."""


# -- what determines the cached tensors ------------------------------------------------------------

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
        if not path.name.startswith("tokenizer") and path.name not in ("special_tokens_map.json",
                                                                       "generation_config.json"):
            _file_digest(path, h)
    return h.hexdigest()[:16]


def tokenizer_digest(tokenizer) -> str:
    """The vocabulary, special tokens and chat template the samples were encoded with."""
    h = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps([str(tokenizer.bos_token), str(tokenizer.eos_token), str(tokenizer.pad_token),
                         tokenizer.chat_template or ""]).encode())
    return h.hexdigest()[:16]


def samples_digest(examples: list[Encoded]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(e.id.encode() + b"\0")
        h.update(torch.tensor(e.input_ids, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]


def fingerprint(p, model_path: str | Path, tokenizer, examples: list[Encoded], first_layer: int) -> dict[str, str]:
    """Every input of the prefix pass, one readable field each (compared field by field on reuse)."""
    return {
        "version": str(VERSION),
        "model": f"{Path(model_path).name} {model_digest(model_path)}",
        "dtype": p.dtype,
        "quantization": f"linears {p.quantization}, experts {'nf4' if p.quantize_experts else 'as stored'}",
        "tokenizer": tokenizer_digest(tokenizer),
        "data_plan": json.dumps({"dataset": p.dataset, "splits": p.splits, "sample_limit": p.sample_limit,
                                 "system_prompt": p.system_prompt}, sort_keys=True),
        "max_len": str(p.max_len),
        "samples": f"{len(examples)} samples {samples_digest(examples)}",
        "first_adapted_layer": str(first_layer),
    }


def fingerprint_id(fp: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def differences(saved: dict[str, str], now: dict[str, str]) -> list[str]:
    return [f"{k}: cached {saved.get(k)!r}, this run {now.get(k)!r}"
            for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]


# -- the plan: batches and shards --------------------------------------------------------------------

def length_batches(lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Indices sorted by length (longest first) and packed so batch × longest ≤ tokens_per_batch.

    Sorting keeps padding small; a sample longer than the budget gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= tokens_per_batch:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@dataclass
class ShardPlan:
    file: str
    samples: list[int]  # positions in the encoded examples
    lengths: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def plan_shards(examples: list[Encoded], tokens_per_batch: int, shard_tokens: int) -> list[ShardPlan]:
    """Whole micro-batches, in length order, grouped into shards of about ``shard_tokens`` tokens."""
    lengths = [len(e.input_ids) for e in examples]
    shards: list[ShardPlan] = []
    current: list[int] = []
    for batch in length_batches(lengths, tokens_per_batch):
        current += batch
        if sum(lengths[i] for i in current) >= shard_tokens:
            shards.append(current)
            current = []
    if current:
        shards.append(current)
    return [ShardPlan(SHARD.format(k), list(idx), [lengths[i] for i in idx])
            for k, idx in enumerate(shards)]


@dataclass
class CacheLayout:
    """What cache.json holds."""

    fingerprint: dict[str, str]
    hidden_size: int
    dtype: str
    tokens_per_batch: int
    shards: list[ShardPlan]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def bytes_per_token(self) -> int:
        return self.hidden_size * ELEMENT_BYTES[self.dtype]

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "tokens": self.tokens}, indent=1)

    @classmethod
    def read(cls, directory: Path) -> CacheLayout:
        raw = json.loads((directory / INDEX).read_text())
        raw.pop("tokens", None)
        raw["shards"] = [ShardPlan(**s) for s in raw["shards"]]
        return cls(**raw)


def missing_shards(directory: Path, layout: CacheLayout) -> list[ShardPlan]:
    return [s for s in layout.shards if not (directory / s.file).is_file()]


def check_disk(directory: Path, layout: CacheLayout, todo: list[ShardPlan]) -> int:
    """Bytes still to write; PrefixCacheError when the disk has less free space than that (plus 5%)."""
    need = sum(s.tokens for s in todo) * layout.bytes_per_token
    free = shutil.disk_usage(directory).free
    if need * 1.05 > free:
        raise PrefixCacheError(
            f"the prefix cache needs {need / 2**30:.2f} GiB more ({sum(s.tokens for s in todo):,} tokens × "
            f"{layout.bytes_per_token:,} B) but {directory} has {free / 2**30:.2f} GiB free. Point prefix_cache at a "
            f"larger disk (node-local or scratch), or lower sample_limit / max_len")
    return need


def _write_layout(directory: Path, layout: CacheLayout) -> None:
    """Whole or absent, and a private temp name: tasks on several nodes may write it at once (same content)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{INDEX}.", dir=directory)
    with os.fdopen(fd, "w") as f:
        f.write(layout.to_json())
    os.replace(tmp, directory / INDEX)


def prepare_layout(directory: str | Path, fp: dict[str, str], examples: list[Encoded], hidden_size: int,
                   dtype: str, tokens_per_batch: int, shard_mib: float) -> CacheLayout:
    """The cache's layout: read when the folder has one (refused if its fingerprint differs), else planned
    and written. Every task plans the same layout from the same inputs, so none waits for another."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / INDEX).is_file():
        layout = CacheLayout.read(directory)
        diff = differences(layout.fingerprint, fp)
        if diff:
            raise PrefixCacheError(
                f"{directory} holds a prefix cache for other inputs: {'; '.join(diff)}. Use another prefix_cache "
                f"folder ('auto' picks one per fingerprint), or delete this one to rebuild it")
        return layout
    shard_tokens = max(1, int(shard_mib * 2**20 / (hidden_size * ELEMENT_BYTES[dtype])))
    layout = CacheLayout(fp, hidden_size, dtype, tokens_per_batch,
                         plan_shards(examples, tokens_per_batch, shard_tokens))
    _write_layout(directory, layout)
    return layout


# -- the pass: sequential or as a wavefront over stages ---------------------------------------------

def stage_bounds(model, first_layer: int, stages: int | None = None) -> list[int]:
    """Layer indices where stages start, plus ``first_layer`` at the end.

    Default: a new stage wherever the device_map moves to another device, so
    each GPU is one stage. ``stages`` cuts the layers into that many even parts
    instead (how the wavefront is tested on one CPU).
    """
    if first_layer == 0:
        return [0, 0]
    if stages:
        stages = min(stages, first_layer)
        return sorted({round(k * first_layer / stages) for k in range(stages)}) + [first_layer]
    layers = decoder_layers(model)

    def device(i):
        return next((t.device for t in layers[i].parameters()), None)

    bounds = [0] + [i for i in range(1, first_layer) if device(i) != device(i - 1)]
    return bounds + [first_layer]


def _inputs(model, examples: list[Encoded], pad_id: int, vocab: int, device):
    batch = {k: v.to(device) for k, v in collate(examples, pad_id, vocab).items()}
    hidden, args, kwargs = prefix_forward(model, batch, 0)  # embeddings, causal mask, rotary: layer 0's inputs
    return hidden, args, kwargs


def sequential_pass(model, batches: list[list[Encoded]], first_layer: int, pad_id: int) -> Iterator[torch.Tensor]:
    """Hidden states entering ``first_layer``, one [B, S, H] tensor per batch, one batch at a time."""
    vocab = model.get_input_embeddings().num_embeddings
    device = model.get_input_embeddings().weight.device
    for examples in batches:
        batch = {k: v.to(device) for k, v in collate(examples, pad_id, vocab).items()}
        with torch.no_grad():
            hidden, _, _ = prefix_forward(model, batch, first_layer)
        yield hidden


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def wavefront_pass(model, batches: list[list[Encoded]], first_layer: int, pad_id: int,
                   bounds: list[int]) -> Iterator[torch.Tensor]:
    """The same tensors as ``sequential_pass``, with stage k on batch t - k while stage k - 1 is on t - k + 1.

    One thread feeds layer 0's inputs, one thread per stage runs its layers,
    and results come out in batch order. An error in any thread is raised here.
    """
    vocab = model.get_input_embeddings().num_embeddings
    device = model.get_input_embeddings().weight.device
    n = len(bounds) - 1
    links = [queue.Queue(maxsize=2) for _ in range(n + 1)]
    stop = threading.Event()

    def put(q, item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def feed():
        try:
            with torch.no_grad():
                for examples in batches:
                    if not put(links[0], _inputs(model, examples, pad_id, vocab, device)):
                        return
            put(links[0], None)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer
            put(links[0], _Failure(err))

    def stage(k: int):
        with torch.no_grad():
            while True:
                item = links[k].get()
                if item is None or isinstance(item, _Failure):
                    put(links[k + 1], item)
                    return
                try:
                    hidden, args, kwargs = item
                    item = (run_layers(model, bounds[k], hidden, args, kwargs, end=bounds[k + 1]), args, kwargs)
                except BaseException as err:  # noqa: BLE001
                    put(links[k + 1], _Failure(err))
                    return
                if not put(links[k + 1], item):
                    return

    threads = [threading.Thread(target=feed, daemon=True, name="prefix-feed")]
    threads += [threading.Thread(target=stage, args=(k,), daemon=True, name=f"prefix-stage-{k}") for k in range(n)]
    for t in threads:
        t.start()
    try:
        while True:
            item = links[n].get()
            if item is None:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item[0]
    finally:
        stop.set()
        for link in links:  # wake a stage blocked on an empty queue
            try:
                link.put_nowait(None)
            except queue.Full:
                pass
        for t in threads:
            t.join(timeout=5)


@dataclass
class BuildStats:
    directory: str
    shards: int
    shards_built: int = 0
    shards_reused: int = 0
    shards_other_tasks: int = 0
    tokens_built: int = 0
    padded_tokens: int = 0
    seconds: float = 0.0
    bytes_total: int = 0
    stages: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_built / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 1)}


def build(model, examples: list[Encoded], directory: str | Path, layout: CacheLayout, first_layer: int, pad_id: int,
          *, task: int = 0, tasks: int = 1, pipeline: bool = True, stages: int | None = None,
          progress: bool = True) -> BuildStats:
    """Write this task's missing shards (shard i belongs to task i % tasks); the others are left alone."""
    directory = Path(directory)
    mine = [s for k, s in enumerate(layout.shards) if k % tasks == task]
    todo = [s for s in mine if not (directory / s.file).is_file()]
    stats = BuildStats(str(directory), len(layout.shards), shards_reused=len(mine) - len(todo),
                       shards_other_tasks=len(layout.shards) - len(mine),
                       bytes_total=layout.tokens * layout.bytes_per_token)
    if not todo:
        return stats
    for shard in todo:  # a shard half-written by a killed pass of this task
        for stale in directory.glob(f".{shard.file}.*.tmp"):
            stale.unlink(missing_ok=True)
    check_disk(directory, layout, todo)
    bounds = stage_bounds(model, first_layer, stages)
    stats.stages = bounds
    dtype = getattr(torch, layout.dtype)
    # every micro-batch of every missing shard, in shard order, through one wavefront (no refill per shard)
    plan = [(k, [shard.samples[i] for i in b]) for k, shard in enumerate(todo)
            for b in length_batches(shard.lengths, layout.tokens_per_batch)]
    left = Counter(k for k, _ in plan)
    batches = [[examples[i] for i in positions] for _, positions in plan]
    run = (wavefront_pass(model, batches, first_layer, pad_id, bounds) if pipeline and len(bounds) > 2
           else sequential_pass(model, batches, first_layer, pad_id))
    bar = tqdm(total=sum(s.tokens for s in todo), desc=f"prefix pass (task {task})", unit="tok", unit_scale=True,
               disable=not progress, mininterval=2)
    started = time.monotonic()
    model.eval()
    tensors: dict[str, torch.Tensor] = {}
    for (k, positions), hidden in zip(plan, run):
        stats.padded_tokens += hidden.shape[0] * hidden.shape[1]
        for row, i in enumerate(positions):
            tensors[str(i)] = hidden[row, :len(examples[i].input_ids)].to(device="cpu", dtype=dtype).contiguous()
        bar.update(sum(len(examples[i].input_ids) for i in positions))
        left[k] -= 1
        if left[k]:
            continue
        shard = todo[k]
        tmp = directory / f".{shard.file}.{os.getpid()}.tmp"
        save_file(tensors, str(tmp), metadata={"first_adapted_layer": str(first_layer)})
        tmp.replace(directory / shard.file)  # whole or absent: a kill before this line redoes the shard
        tensors = {}
        stats.shards_built += 1
        stats.tokens_built += shard.tokens
        stats.seconds = time.monotonic() - started
        bar.set_postfix(tok_s=f"{stats.tokens_per_s:,.0f}")
    bar.close()
    return stats


# -- reading it back ----------------------------------------------------------------------------------

class PrefixCache:
    """A complete cache, read lazily: shards are memory-mapped, a batch is assembled and zero-padded on demand."""

    def __init__(self, directory: str | Path, expected: dict[str, str] | None = None):
        self.directory = Path(directory)
        if not (self.directory / INDEX).is_file():
            raise PrefixCacheError(f"{self.directory} holds no prefix cache ({INDEX} missing): run the prefix pass "
                                   f"first (python -m dsr1kit.train --prefix-only, slurm/hari_prefix.sbatch, or "
                                   f"notebook 20 on one machine)")
        self.layout = CacheLayout.read(self.directory)
        if expected is not None:
            diff = differences(self.layout.fingerprint, expected)
            if diff:
                raise PrefixCacheError(f"{self.directory} was built for other inputs: {'; '.join(diff)}. Rebuild "
                                       f"it (prefix_cache: auto, or another folder)")
        missing = missing_shards(self.directory, self.layout)
        if missing:
            raise PrefixCacheError(
                f"{self.directory} is incomplete: {len(missing)} of {len(self.layout.shards)} shards missing (e.g. "
                f"{missing[0].file}). Rerun the prefix pass on the same folder (python -m dsr1kit.train --prefix-only, "
                f"or slurm/hari_prefix.sbatch); it writes only the missing shards")
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
        out = torch.zeros(len(positions), width, self.layout.hidden_size, dtype=getattr(torch, self.layout.dtype))
        for row, position in enumerate(positions):
            h = self.hidden(position)
            out[row, :h.shape[0]] = h
        return out

    def describe(self) -> dict[str, Any]:
        size = sum((self.directory / s.file).stat().st_size for s in self.layout.shards)
        return {"folder": str(self.directory), "samples": len(self.where), "tokens": self.layout.tokens,
                "shards": len(self.layout.shards), "size_gib": round(size / 2**30, 4),
                "bytes_per_token": self.layout.bytes_per_token, "dtype": self.layout.dtype,
                "first_adapted_layer": self.layout.fingerprint.get("first_adapted_layer")}
