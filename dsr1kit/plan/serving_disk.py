"""What a served evaluation writes into its run folder: each model's answers, and a merged checkpoint when
the adapter is served merged (on R1 hundreds of GB), counted before any server starts."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from .disk import DiskPlan, Write

ANSWER_BYTES_PER_TOKEN = 8  # text and reasoning of one generated token, as JSON
ANSWER_OVERHEAD = 1024  # id, prompt counts and the rest of an answer's record


@dataclass(frozen=True)
class ServingWrites:
    """What sizes the answers: models answering, rows asked of each, and tokens per answer at most."""

    models: int  # the base, and the adapter when there is one
    rows: int  # rows asked of each model (0 when not counted)
    max_new_tokens: int
    not_counted: str = ""  # why the rows could not be counted ('' when they were)
    samples: int = 1  # answers per row (samples_per_question)


def answers_write(writes: ServingWrites, run_dir: Path) -> Write:
    """At most every sample of every row with max_new_tokens of text and reasoning, for each model."""
    if writes.not_counted:
        basis = f"not counted: {writes.not_counted}"
    else:
        samples = f" × {writes.samples} samples" if writes.samples > 1 else ""
        basis = (
            f"{writes.models} model(s) × {writes.rows:,} rows{samples} × (max_new_tokens "
            f"{writes.max_new_tokens:,} × {ANSWER_BYTES_PER_TOKEN} B + 1 KiB)"
        )
    answers = writes.models * writes.rows * writes.samples
    return Write(
        "answers",
        str(run_dir),
        answers * (writes.max_new_tokens * ANSWER_BYTES_PER_TOKEN + ANSWER_OVERHEAD),
        basis,
        "run_dir on a filesystem with room (DSR1KIT_RUN_DIR / --run-dir)",
    )


def serving_disk_plan(
    writes: ServingWrites,
    run_dir: Path,
    merged: Write | None = None,
    merged_on_fallback: bool = False,
    free: float | None = None,
) -> DiskPlan:
    """The evaluation's writes: the answers, and ``merged`` (the merged checkpoint's rewritten shards) when
    the adapter is merged; ``merged_on_fallback``: only if parity falls back to a merge, as its line says."""
    out = [answers_write(writes, run_dir)]
    if merged is not None and merged_on_fallback:
        merged = replace(merged, what=merged.what + " (if parity falls back to it)")
    out += [merged] if merged is not None else []
    return DiskPlan("vLLM evaluation", out, free)
