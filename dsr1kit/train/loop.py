"""The HARI training loop: one screen, in commented phases.

Data order is a pure function of (seed, epoch, rank), so a resumed run sees
exactly the batches it would have seen; each rank takes a strided slice of
equal length (drop-last), so ranks always do the same number of steps.
"""

from __future__ import annotations

import json
import math
import resource
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.std import tqdm

from ..data.labels import collate
from . import checkpoint, dist
from .hari import HariLoss, hari_loss

STOP_FILE = "STOP"


@dataclass(frozen=True)
class TrainConfig:
    """What the loop reads (notebook 20's optimisation parameters); ``settings`` is what a resume compares."""

    batch_size: int  # samples per micro-batch, per rank
    grad_accum: int  # micro-batches per optimizer step
    epochs: int  # passes over the data
    max_steps: int  # optimizer steps; 0: epochs decide
    lr: float  # peak learning rate
    warmup_ratio: float  # share of steps with a linear warm-up
    clip_norm: float  # gradient norm clip
    log_every: int  # optimizer steps between metric lines
    save_every: int  # optimizer steps between checkpoints (and on a stop request)
    seed: int  # data order: a pure function of (seed, epoch, rank)
    resume: bool  # resume from the run folder's checkpoint when present
    loss: HariLoss  # the loss of every micro-batch
    settings: dict[str, Any]  # the run's parameters: saved with each checkpoint, checked on resume
    snapshot_every: int = 0  # optimizer steps between adapter snapshots kept along training (0: none)
    snapshot_steps: tuple[
        int, ...
    ] = ()  # and snapshots at these steps (dense early, where SFT moves fastest)


class NonFiniteLoss(RuntimeError):
    """Loss became NaN/inf; the last good state was saved first."""


@dataclass
class TrainResult:
    steps_done: int
    total_steps: int
    preempted: bool = False
    resumed_from: int | None = None
    wall_s: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    optimizer: str = ""  # the class that ran: PagedAdamW8bit on CUDA, AdamW on CPU
    tokens: int = 0  # tokens trained on in this process, every rank together (not before a resume)


def epoch_batches(n: int, seed: int, epoch: int, rank: int, world: int, batch_size: int) -> list[list[int]]:
    """This rank's batches of example indices for an epoch (same length on every rank)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    per_rank = (n // world) // batch_size * batch_size
    mine = perm[rank::world][:per_rank]
    return [mine[i : i + batch_size] for i in range(0, per_rank, batch_size)]


def schedule(n: int, cfg: TrainConfig, world: int) -> tuple[int, int]:
    """(optimizer steps per epoch, total optimizer steps)."""
    per_epoch = ((n // world) // cfg.batch_size) // cfg.grad_accum
    if per_epoch == 0:
        raise ValueError(
            f"{n} examples are too few for batch_size {cfg.batch_size} × grad_accum {cfg.grad_accum} "
            f"× {world} ranks: lower them or add data"
        )
    total = per_epoch * cfg.epochs
    return per_epoch, min(total, cfg.max_steps) if cfg.max_steps else total


class StopRequest:
    """SIGUSR1/SIGTERM (Slurm's warning before preemption) or a STOP file in the run folder."""

    def __init__(self, run_dir: Path):
        self.file = run_dir / STOP_FILE
        self.signalled = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread: the STOP file still works
                pass
        return self

    def _handler(self, signum, frame):
        self.signalled = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)

    @property
    def requested(self) -> bool:
        return self.signalled or self.file.exists()


def peak_memory_gib() -> dict[str, float]:
    if torch.cuda.is_available():
        return {
            f"cuda:{i}": round(torch.cuda.max_memory_allocated(i) / 2**30, 3)
            for i in range(torch.cuda.device_count())
        }
    return {"cpu_rss": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}


class OptimizerUnavailable(ImportError):
    """CUDA without bitsandbytes: the run would silently use another optimizer than configured."""


def make_optimizer(params: list[torch.nn.Parameter], lr: float):
    """PagedAdamW8bit on CUDA (the QLoRA optimizer), AdamW on CPU where bitsandbytes has no paged optimizer."""
    if torch.cuda.is_available():
        try:
            import bitsandbytes as bnb
        except ImportError as err:
            raise OptimizerUnavailable(
                f"CUDA is available but bitsandbytes does not import ({err}): HARI's GPU optimizer is "
                f"PagedAdamW8bit. Install it (`pip install bitsandbytes`, or `conda env update -f environment.yml`)"
            ) from None
        return bnb.optim.PagedAdamW8bit(params, lr=lr, weight_decay=0.0)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def _new_window() -> dict[str, float]:
    return {"loss": 0.0, "ce": 0.0, "kl": 0.0, "tokens": 0, "micro": 0, "t0": time.monotonic()}


def _append_metrics(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def read_metric_lines(path: Path) -> list[dict[str, Any]]:
    """Every whole metric line; a line torn by a kill mid-write (not JSON) is left out."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def _truncate_metrics(path: Path, after_step: int) -> None:
    """Drop metric lines written after the checkpoint we resume from (and any torn line)."""
    if path.is_file():
        keep = [row for row in read_metric_lines(path) if row["step"] <= after_step]
        path.write_text("".join(json.dumps(row) + "\n" for row in keep))


def train(
    model,
    tokenizer,
    examples,
    cfg: TrainConfig,
    run_dir: str | Path,
    first_layer: int,
    info: dist.DistInfo,
    prefix=None,
    reference=None,
) -> TrainResult:
    """HARI over ``examples``; with ``prefix`` (a PrefixCache) each batch enters the model as the cached
    hidden states of its samples at ``first_layer`` instead of as token ids, and with ``reference`` (a
    PrefixCache of the reference's last hidden states) the step reads the KL's reference instead of running
    the adapted layers a second time."""
    from transformers import get_scheduler

    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    params = [q for q in model.parameters() if q.requires_grad]
    names = [n for n, q in model.named_parameters() if q.requires_grad]
    per_epoch, total = schedule(len(examples), cfg, info.world_size)
    optimizer = make_optimizer(params, cfg.lr)
    scheduler = get_scheduler(
        "linear", optimizer, num_warmup_steps=math.ceil(cfg.warmup_ratio * total), num_training_steps=total
    )
    device = model.get_input_embeddings().weight.device
    vocab = model.get_input_embeddings().num_embeddings
    result = TrainResult(0, total, optimizer=type(optimizer).__name__)

    # --- resume: weights, optimizer, scheduler, RNG and data position from the latest checkpoint
    start = 0
    ckpt = checkpoint.check_resumable(run_dir, dict(cfg.settings)) if cfg.resume else None
    if ckpt is not None:
        state = checkpoint.load(ckpt)
        with torch.no_grad():
            for n, q in zip(names, params):
                q.copy_(state["trainable"][n])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        checkpoint.set_rng_state(checkpoint.rank_rng_state(state["rng"], info.rank))
        start = result.resumed_from = state["progress"]["step"]
        if info.is_main:
            _truncate_metrics(metrics_path, start)
    dist.barrier()
    if info.is_main:
        (run_dir / STOP_FILE).unlink(missing_ok=True)  # a requeued job must not stop at once
    dist.barrier()

    def save(step: int) -> None:
        rng = dist.gather_objects(checkpoint.rng_state())  # every rank's: their dropout masks differ
        if info.is_main:
            checkpoint.save(
                run_dir,
                step,
                {
                    "trainable": {n: q.detach().cpu().clone() for n, q in zip(names, params)},
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": rng,
                    "params": dict(cfg.settings),
                    "progress": {"step": step, "epoch": step // per_epoch, "total_steps": total},
                },
            )
        dist.barrier()

    seen = {"tokens": 0}

    def snapshot(step: int) -> None:
        """The adapter as it is at ``step``, kept (early stopping, traced afterwards), with what it cost."""
        tokens = int(dist.allreduce_scalar(seen["tokens"]))
        if info.is_main:
            cost = {
                "step": step,
                "total_steps": total,
                "tokens": tokens,
                "train_s": round(time.monotonic() - t_start, 2),
                "peak_memory_gib": peak_memory_gib(),
                "resumed_from": result.resumed_from,
            }
            checkpoint.save_snapshot(model, tokenizer, run_dir, step, cost)
        dist.barrier()

    model.train()
    t_start = time.monotonic()
    bar = tqdm(total=total, initial=start, desc="HARI steps", disable=not info.is_main, mininterval=2)
    batches: dict[int, list[list[int]]] = {}

    def micro_batch(step: int, micro: int) -> list[int]:
        """Example indices of one micro-batch, from the (seed, epoch, rank) order."""
        epoch, in_epoch = divmod(step, per_epoch)
        if epoch not in batches:
            batches[epoch] = epoch_batches(
                len(examples), cfg.seed, epoch, info.rank, info.world_size, cfg.batch_size
            )
            batches.pop(epoch - 2, None)
        return batches[epoch][in_epoch * cfg.grad_accum + micro]

    def cached_states(step: int, micro: int):
        idx = micro_batch(step, micro)
        width = max(len(examples[i].input_ids) for i in idx)
        return prefix.batch(idx, width), (reference.batch(idx, width) if reference is not None else None)

    # with a prefix cache, the next micro-batch's hidden states are read from disk while this one trains
    reader = ThreadPoolExecutor(1, thread_name_prefix="prefix-read") if prefix is not None else None
    ahead = reader.submit(cached_states, start, 0) if reader and start < total else None
    window = _new_window()
    with StopRequest(run_dir) as stop, reader or nullcontext():
        for step in range(start, total):
            epoch = step // per_epoch
            bad = None
            # --- forward/backward over grad_accum micro-batches
            for micro in range(cfg.grad_accum):
                idx = micro_batch(step, micro)
                chosen = [examples[i] for i in idx]
                batch = collate(chosen, tokenizer.pad_token_id, vocab)
                ref_hidden = None
                if ahead is not None:
                    batch["inputs_embeds"], ref_hidden = ahead.result()
                    after = (step, micro + 1) if micro + 1 < cfg.grad_accum else (step + 1, 0)
                    ahead = reader.submit(cached_states, *after) if after[0] < total else None
                batch = {k: v.to(device) for k, v in batch.items()}
                parts = hari_loss(model, batch, cfg.loss, first_layer, ref_hidden=ref_hidden)
                if not torch.isfinite(parts.loss):
                    bad = [examples[i].id for i in idx]
                    break
                (parts.loss / cfg.grad_accum).backward()
                window["tokens"] += int(batch["attention_mask"].sum())
                seen["tokens"] += int(batch["attention_mask"].sum())
                window["ce"] += parts.ce
                window["kl"] += parts.kl
                window["loss"] += float(parts.loss.detach())
                window["micro"] += 1
            # --- a NaN/inf anywhere stops every rank, after saving the last good state
            if dist.any_rank(bad is not None):
                optimizer.zero_grad(set_to_none=True)
                save(step)
                raise NonFiniteLoss(
                    f"non-finite loss at step {step + 1} (epoch {epoch}); batch ids: {bad}; "
                    f"last good state saved at step {step}. Lower lr or lambda_kl, check the data"
                )
            # --- sync LoRA grads across nodes, clip, step
            dist.allreduce_grads(params)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm))
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            done = step + 1
            result.steps_done = done
            bar.update(1)
            # --- log: means over the micro-batches of every rank since the last line
            if done % cfg.log_every == 0 or done == total:
                n = dist.allreduce_scalar(window["micro"])
                means = {k: dist.allreduce_scalar(window[k]) / n for k in ("loss", "ce", "kl")}
                tokens = dist.allreduce_scalar(window["tokens"])
                row = {
                    "step": done,
                    "epoch": epoch,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    **means,
                    "tokens_per_s": tokens / max(time.monotonic() - window["t0"], 1e-9),
                    "peak_memory_gib": peak_memory_gib(),
                }
                window = _new_window()
                result.history.append(row)
                bar.set_postfix(loss=f"{row['loss']:.4f}", kl=f"{row['kl']:.2e}")
                if info.is_main:
                    _append_metrics(metrics_path, row)
            # --- checkpoint on schedule, or now if a stop was requested (preemption)
            stopping = dist.any_rank(stop.requested)
            if done % cfg.save_every == 0 or stopping or done == total:
                save(done)
            every = cfg.snapshot_every and done % cfg.snapshot_every == 0
            if done < total and (every or done in cfg.snapshot_steps):
                snapshot(done)
            if stopping and done < total:
                result.preempted = True
                break
    bar.close()
    result.wall_s = time.monotonic() - t_start
    result.tokens = int(dist.allreduce_scalar(seen["tokens"]))
    return result
