"""What a run concluded, and the three calls every notebook makes around its work.

A notebook starts with :func:`begin` (typed parameters from its globals, the run folder), ends in a
:class:`Verdict` that :func:`record` writes into the run's ``summary.json``, then calls :func:`finish`,
which fails the run when the verdict is ``fail`` (the report is still written, with the error at its end).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OK, WARN, FAIL = "ok", "warn", "fail"


class StepFailed(RuntimeError):
    """A notebook's verdict is fail: raised by finish() so the run's status is failed."""


@dataclass
class Verdict:
    """What a run concluded: status (ok, warn, fail), the one-line headline, and the lines behind it."""

    status: str
    headline: str
    lines: list[str] = field(default_factory=list)
    error: type[StepFailed] = (
        StepFailed  # the exception finish() raises on fail (its name shows in `dsr1kit runs`)
    )

    def html(self) -> str:
        from .viz import verdict_html

        return verdict_html(self.status, [self.headline, *self.lines])

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "headline": self.headline, "lines": self.lines}


def begin(model, namespace: dict[str, Any]):
    """Typed parameters of ``model`` (a notebook's parameter class) from the notebook's globals, validated
    with secrets refused, and the run folder."""
    from .report import ensure_run_dir

    p = model.from_namespace(namespace)
    run_dir = ensure_run_dir(p.run_dir, p.notebook)
    p.run_dir = str(run_dir)
    return p, run_dir


def record(run_dir: str | Path, verdict: Verdict, **metrics: Any) -> None:
    """The verdict (and any last metrics) into the run's summary.json, where `dsr1kit runs` reads it."""
    from .report import record_summary

    record_summary(
        run_dir, headline=verdict.headline, verdict=verdict.status, verdict_lines=verdict.lines, **metrics
    )


def finish(verdict: Verdict) -> None:
    """Fail the run on a failing verdict (the report is still written, with this error at the end)."""
    if verdict.status == FAIL:
        raise verdict.error("; ".join([verdict.headline, *verdict.lines]))
