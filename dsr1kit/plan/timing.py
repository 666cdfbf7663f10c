"""Time plan: how long a HARI job's parts take at R1's widths, from the rates the benchmarks measured, against
the time the Slurm job has left.

The rates are the kit's own measurements on one H200 at R1's widths (``docs/results/hari_cached.h200.json``,
``docs/benchmarks.md``): the 60-layer prefix pass per GPU, the cached step per GPU, the whole-model step per
node, and the streaming loader's FP8 → NF4 rate. They hold for models of R1's widths only; for any other
model the plan says it has no rate rather than guess.

What a job cannot resume is what a short ``--time`` wastes: loading the model (every job loads it again) and
the work since the last checkpoint. A job whose remaining time cannot cover its load plus one checkpoint
interval stops at once, with the estimate; the rest (prefix shards, steps) resumes in the next job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "hari_cached.h200.json"
R1_HIDDEN = 7168
LOAD_GIB_PER_S = 4.83 / 5.1  # streaming FP8 -> NF4, 4.83 GiB in 5.1 s (docs/benchmarks.md, loading table)


class TimeRefused(RuntimeError):
    """The job's remaining time cannot cover what it could not resume: stopped before the load."""


@dataclass(frozen=True)
class Rates:
    """Measured per-GPU and per-node rates at R1's widths, and where they come from."""

    source: str
    prefix_tokens_per_s_per_gpu: float  # 60 frozen layers, forward only (NF4 experts)
    cached_tokens_per_s_per_gpu: float  # HARI step from the prefix cache, bf16 last layer
    whole_tokens_per_s_per_node: float  # HARI step through all 61 layers over a node's GPUs
    load_gib_per_s: float = LOAD_GIB_PER_S

    @classmethod
    def measured(cls, path: str | Path = RESULTS) -> "Rates":
        m = json.loads(Path(path).read_text())
        cached = next(r for r in m["cached"] if r["experts"] == "bf16")
        prefix = next(r for r in m["prefix_r1_extrapolation"] if r["shape"] == [4, 4096])
        return cls(
            f"{m['device']}, {Path(path).name}",
            prefix["r1_60_split_tokens_per_s_per_gpu"],
            cached["tokens_per_s"],
            m["earlier_61_layer"]["tokens_per_s"],
        )


@dataclass(frozen=True)
class Part:
    what: str
    seconds: float
    basis: str
    resumable: bool


@dataclass
class TimePlan:
    """A job's parts in order, each with its estimate and whether a later job picks it up where it stopped."""

    step: str
    parts: list[Part] = field(default_factory=list)
    note: str = ""  # why there is no estimate

    @property
    def total(self) -> float:
        return sum(p.seconds for p in self.parts)

    @property
    def not_resumable(self) -> float:
        return sum(p.seconds for p in self.parts if not p.resumable)

    def rows(self) -> list[dict]:
        return [
            {
                "part": p.what,
                "minutes": round(p.seconds / 60, 1),
                "resumes": "yes" if p.resumable else "no",
                "counted as": p.basis,
            }
            for p in self.parts
        ]

    def text(self) -> str:
        if not self.parts:
            return f"time plan, {self.step}: {self.note}"
        lines = [
            f"  {r['part']}: {r['minutes']} min ({r['counted as']}; resumes: {r['resumes']})"
            for r in self.rows()
        ]
        return (
            f"time plan, {self.step}: {self.total / 3600:.2f} h in all, {self.not_resumable / 60:.1f} min that a "
            f"job cannot resume\n" + "\n".join(lines)
        )

    def check(self, remaining_s: float | None) -> "TimePlan":
        """TimeRefused when ``remaining_s`` (the job's time left; None: no limit) is shorter than what cannot
        be resumed."""
        if remaining_s is not None and self.parts and remaining_s < self.not_resumable:
            raise TimeRefused(
                f"the job has {remaining_s / 60:.1f} min left, and {self.step} needs {self.not_resumable / 60:.1f} "
                f"min it cannot resume (loading and one checkpoint interval) before anything it does is kept:\n"
                f"{self.text()}\nWhat to change: submit with a longer --time (the whole run needs about "
                f"{self.total / 3600:.1f} h; with --requeue and USR1 it continues in the next job), or save_every "
                "lower so a checkpoint comes sooner"
            )
        return self

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "total_s": round(self.total),
            "not_resumable_s": round(self.not_resumable),
            "rows": self.rows(),
            "note": self.note,
        }


def unmeasured(hidden_size: int, gpus_per_node: int) -> str:
    """Why no measured rate applies to a run ("" when one does): the rates are GPU rates at R1's widths."""
    if hidden_size == R1_HIDDEN and gpus_per_node > 0:
        return ""
    why = "no GPU here" if gpus_per_node == 0 else f"hidden size {hidden_size:,}, not R1's {R1_HIDDEN:,}"
    return f"no measured rate for this run ({why}): not estimated"


def hari_time(
    step: str,
    hidden_size: int,
    model_gib: float,
    tokens_per_epoch: float,
    epochs: int,
    nodes: int,
    gpus_per_node: int,
    prefix_cache: bool,
    save_every_tokens: float,
    rates: Rates | None = None,
) -> TimePlan:
    """HARI's parts on ``nodes`` × ``gpus_per_node`` from the measured rates: load, (prefix pass,) training."""
    if why := unmeasured(hidden_size, gpus_per_node):
        return TimePlan(step, note=why)
    rates = rates or Rates.measured()
    basis = f"measured on {rates.source}"
    parts = [
        Part(
            "load the model",
            model_gib / rates.load_gib_per_s,
            f"{model_gib:,.0f} GiB at {rates.load_gib_per_s:.2f}"
            f" GiB/s per node (streaming FP8 → NF4), every job again",
            False,
        )
    ]
    if prefix_cache:
        rate = nodes * gpus_per_node * rates.prefix_tokens_per_s_per_gpu
        parts.append(
            Part(
                "prefix pass (once)",
                tokens_per_epoch / rate,
                f"{tokens_per_epoch:,.0f} tokens / ({nodes * gpus_per_node} GPUs × "
                f"{rates.prefix_tokens_per_s_per_gpu:,.0f} tokens/s, wavefront ideal); {basis}",
                True,
            )
        )
        rate = nodes * gpus_per_node * rates.cached_tokens_per_s_per_gpu
        what = (
            f"{nodes * gpus_per_node} GPUs × {rates.cached_tokens_per_s_per_gpu:,.0f} tokens/s (cached step)"
        )
    else:
        rate = nodes * rates.whole_tokens_per_s_per_node
        what = f"{nodes} nodes × {rates.whole_tokens_per_s_per_node:,.0f} tokens/s (whole-model step)"
    save_every_tokens = min(save_every_tokens, epochs * tokens_per_epoch)
    parts.append(
        Part(
            "one checkpoint interval",
            save_every_tokens / rate,
            f"{save_every_tokens:,.0f} tokens / {what}; lost if the job ends before the checkpoint",
            False,
        )
    )
    parts.append(
        Part(
            f"training, {epochs} epoch(s)",
            max(0.0, epochs * tokens_per_epoch - save_every_tokens) / rate,
            f"{epochs} × {tokens_per_epoch:,.0f} tokens / {what}; {basis}",
            True,
        )
    )
    return TimePlan(step, parts)
