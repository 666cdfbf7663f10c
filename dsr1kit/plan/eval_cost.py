"""What an evaluation asks of the server, before it runs: answers, generated tokens, and hours at a measured
rate, so that k samples per question (and max_new_tokens) are chosen knowing their price.

The upper bound is every answer at max_new_tokens. An earlier run of the same model and benchmark (its
``summary.json``: the tokens each answer took and the server's tokens/s, which the report measures) turns
that into an expected count and a time; without one the plan says what it could not price.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MeasuredRate:
    """From an earlier run: mean generated tokens per answer and the server's generated tokens per second."""

    tokens_per_answer: float
    tokens_per_s: float
    source: str  # the summary.json it was read from


@dataclass(frozen=True)
class EvalCost:
    models: int  # the base, and the adapter when there is one
    questions: int  # rows asked of each model (0 when not counted)
    samples: int  # answers per question
    max_new_tokens: int
    measured: MeasuredRate | None = None
    not_counted: str = ""  # why the questions could not be counted

    @property
    def answers(self) -> int:
        return self.models * self.questions * self.samples

    @property
    def tokens_at_most(self) -> int:
        return self.answers * self.max_new_tokens

    @property
    def tokens_expected(self) -> float | None:
        return self.answers * self.measured.tokens_per_answer if self.measured else None

    @property
    def hours_expected(self) -> float | None:
        if not self.measured or not self.measured.tokens_per_s:
            return None
        return self.tokens_expected / self.measured.tokens_per_s / 3600

    def text(self) -> str:
        if self.not_counted:
            return f"evaluation cost: not counted ({self.not_counted})"
        lines = [
            f"evaluation cost: {self.models} model(s) × {self.questions:,} questions × {self.samples} "
            f"sample(s) = {self.answers:,} answers; at most {self.tokens_at_most:,} generated tokens "
            f"(max_new_tokens {self.max_new_tokens:,} each)"
        ]
        if self.measured is None:
            lines.append("  expected tokens and time: no earlier run to price it (--rate-from RUN_DIR)")
        else:
            m = self.measured
            lines.append(
                f"  expected: {self.tokens_expected:,.0f} tokens ({m.tokens_per_answer:,.0f} per answer) at "
                f"{m.tokens_per_s:,.1f} tokens/s ≈ {self.hours_expected:.2f} h, measured in {m.source}"
            )
        return "\n".join(lines)


def measured_rate(run_dir: str | Path) -> MeasuredRate:
    """The base's throughput as an earlier run of notebook 10 recorded it (``summary.json``'s throughput:
    generated tokens over answers, and tokens per second); a clear error when the run has none."""
    path = Path(run_dir) / "summary.json"
    try:
        throughput = json.loads(path.read_text())["throughput"]
    except (OSError, KeyError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: no measured throughput to price the evaluation with ({err!r})") from err
    label = "base" if "base" in throughput else next(iter(throughput))
    stats = throughput[label]
    if not stats.get("answered") or not stats.get("tokens_per_s"):
        raise ValueError(f"{path}: the {label} model answered nothing in that run: no rate to price with")
    return MeasuredRate(stats["completion_tokens"] / stats["answered"], stats["tokens_per_s"], str(path))
