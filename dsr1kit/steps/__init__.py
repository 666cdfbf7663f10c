"""One module per notebook: the few calls the notebook makes, in the order it shows them.

Notebook ``NN_name.ipynb`` is backed by ``dsr1kit.steps.name`` (``00_cluster_check`` →
``steps.cluster_check``, ``10_vllm_inference`` → ``steps.vllm_inference``, ...). Each step
module starts with ``begin`` (typed parameters from the cell, the run folder) and ends in a
``verdict(...)`` returning a :class:`Verdict`; the notebook records and shows it, then calls
:func:`finish`, which fails the run when the verdict is ``fail``. A cell holds no logic a test
cannot reach: tables and figures come from these modules too.
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
    error: type[StepFailed] = StepFailed  # the exception finish() raises on fail (its name shows in `dsr1kit runs`)

    def html(self) -> str:
        from ..viz import verdict_html

        return verdict_html(self.status, [self.headline, *self.lines])

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "headline": self.headline, "lines": self.lines}


def begin(model, namespace: dict[str, Any]):
    """Typed parameters from the notebook's globals (validated, secrets refused) and the run folder."""
    from ..report import ensure_run_dir

    p = model.from_namespace(namespace)
    run_dir = ensure_run_dir(p)
    return p, Path(run_dir)


def record(run_dir: str | Path, verdict: Verdict, **metrics: Any) -> None:
    """The verdict (and any last metrics) into the run's summary.json, where `dsr1kit runs` reads it."""
    from ..report import record_summary

    record_summary(run_dir, headline=verdict.headline, verdict=verdict.status, verdict_lines=verdict.lines,
                   **metrics)


def finish(verdict: Verdict) -> None:
    """Fail the run on a failing verdict (the report is still written, with this error at the end)."""
    if verdict.status == FAIL:
        raise verdict.error("; ".join([verdict.headline, *verdict.lines]))
