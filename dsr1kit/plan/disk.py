"""Disk plan: the bytes a step will write, against the free space of each filesystem it writes them to.

On R1 a merged checkpoint, a prefix cache or a folder of checkpoints is tens to hundreds of GB; a job that
fills its disk an hour in loses the hour (and can lose the file it was writing). Each step lists what it
writes and where (``Write``); the plan groups the writes by filesystem and refuses, before anything loads,
when their sum is more than that filesystem has free, naming the parameter that moves or shrinks each write.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from .devices import GIB
from .result import Refusable


@dataclass(frozen=True)
class Write:
    """One thing a step writes: what, into which folder, how many bytes (at most), and how that was counted."""

    what: str
    folder: str
    bytes: float
    basis: str
    fix: str = ""  # the parameter that moves or shrinks it


def existing_ancestor(folder: str | Path) -> Path:
    """The folder itself, or its nearest parent that exists (what a not-yet-made run folder will live on)."""
    path = Path(folder).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


class DiskPlanError(RuntimeError):
    """A step would write more than its filesystem has free: raised before anything is loaded or written."""

    def __init__(self, plan: "DiskPlan"):
        self.plan = plan
        super().__init__(plan.refusal())


@dataclass
class DiskPlan(Refusable):
    """One step's writes, grouped by the filesystem they land on, each filesystem's need against its free."""

    step: str
    writes: list[Write]
    free_override: float | None = None  # bytes free on every filesystem (planning for another machine)
    kind: str = field(default="disk", init=False)
    error: ClassVar[type[RuntimeError]] = DiskPlanError
    no_advice: ClassVar[str] = "free space there"

    def filesystems(self) -> list[dict]:
        """[{folders, need, free, fits}] per filesystem (st_dev), in the order of their first write."""
        groups: dict[int, dict] = {}
        for w in self.writes:
            anchor = existing_ancestor(w.folder)
            entry = groups.setdefault(
                os.stat(anchor).st_dev,
                {"anchor": anchor, "writes": [], "free": self._free(anchor)},
            )
            entry["writes"].append(w)
        for g in groups.values():
            g["need"] = sum(w.bytes for w in g["writes"])
            g["fits"] = g["need"] <= g["free"]
        return list(groups.values())

    def _free(self, anchor: Path) -> float:
        return self.free_override if self.free_override is not None else float(shutil.disk_usage(anchor).free)

    @property
    def fits(self) -> bool:
        return all(g["fits"] for g in self.filesystems())

    @property
    def advice(self) -> list[str]:
        return [
            w.fix for g in self.filesystems() if not g["fits"] for w in g["writes"] if w.fix and w.bytes > 0
        ]

    def rows(self) -> list[dict]:
        out = []
        for g in self.filesystems():
            for w in g["writes"]:
                out.append(
                    {
                        "writes": w.what,
                        "into": w.folder,
                        "GiB": _gib(w.bytes),
                        "filesystem free GiB": _gib(g["free"]),
                        "filesystem need GiB": _gib(g["need"]),
                        "fits": "yes" if g["fits"] else "NO",
                        "counted as": w.basis,
                    }
                )
        return out

    def text(self) -> str:
        rows = self.rows()
        if not rows:
            return f"disk plan, {self.step}: writes nothing large"
        cols = [c for c in rows[0] if c != "counted as"]
        width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
        lines = ["  ".join(str(c).rjust(width[c]) for c in cols)]
        lines += ["  ".join(str(r[c]).rjust(width[c]) for c in cols) for r in rows]
        lines += [f"  {r['writes']}: {r['counted as']}" for r in rows]
        return f"disk plan, {self.step}:\n" + "\n".join(lines)

    def busiest(self) -> str:
        groups = self.filesystems()
        if not groups:
            return "nothing large written"
        g = max(groups, key=lambda g: g["need"] / max(g["free"], 1))
        return f"{g['anchor']}: {g['need'] / GIB:.1f} GiB to write, {g['free'] / GIB:.1f} GiB free"

    def problems(self) -> list[str]:
        return [
            f"the filesystem of {g['anchor']} has {g['free'] / GIB:.1f} GiB free, "
            f"{g['need'] / GIB:.1f} GiB would be written there ("
            + ", ".join(f"{w.what} {w.bytes / GIB:.1f} GiB" for w in g["writes"])
            + ")"
            for g in self.filesystems()
            if not g["fits"]
        ]


def _gib(n: float) -> float:
    return round(n / GIB, 2 if n >= GIB else 4)
