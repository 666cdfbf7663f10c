"""A step's memory plan: bytes per device, the facts behind them, and what to change when it does not fit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .devices import GIB, Device


class PlanError(RuntimeError):
    """A step's memory plan does not fit: raised before loading, with the table and what to change."""

    def __init__(self, plan: "Refusable"):
        self.plan = plan
        super().__init__(plan.refusal())


class Refusable:
    """What every kind of plan (memory here, disk in ``dsr1kit.plan.disk``) says the same way: the refusal
    (problems, table, what to change), the check that raises it, and the dict a report or summary keeps.
    A plan provides step, kind, fits, advice, rows(), text(), problems() and, as class attributes, the
    error it raises and the line said when no advice applies."""

    error: ClassVar[type[RuntimeError]] = PlanError
    no_advice: ClassVar[str] = "(no setting tried here fits: more nodes?)"

    def facts_dict(self) -> dict:
        return {}

    def refusal(self) -> str:
        advice = "\n".join(f"  - {a}" for a in self.advice) or f"  - {self.no_advice}"
        return (
            f"the {self.kind} plan for {self.step} does not fit: "
            + "; ".join(self.problems())
            + f"\n{self.text()}\nWhat to change:\n{advice}"
        )

    def check(self):
        """Raise the plan's error (table + what to change) when it does not fit; else return the plan."""
        if not self.fits:
            raise self.error(self)
        return self

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "kind": self.kind,
            "fits": self.fits,
            **self.facts_dict(),
            "rows": self.rows(),
            "problems": self.problems(),
            "advice": self.advice,
        }


@dataclass
class Plan(Refusable):
    """One step's bytes per device, the facts it was computed from, and (when it fails) what to change."""

    step: str
    devices: list[Device]
    facts: dict[str, str] = field(default_factory=dict)
    extra_problems: list[str] = field(default_factory=list)  # beyond bytes (e.g. KV cache below one sequence)
    advice: list[str] = field(default_factory=list)
    kind: str = field(default="memory", init=False)  # beside the disk plan (dsr1kit.plan.disk)

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices) and not self.extra_problems

    @property
    def peak_gpu_bytes(self) -> float:
        """Busiest GPU's total without the runtime row (what torch.cuda.max_memory_allocated can see)."""
        gpus = [d for d in self.devices if d.name != "host"]
        return max((d.total - d.parts.get("runtime", 0.0) for d in gpus), default=0.0)

    def rows(self) -> list[dict]:
        columns = sorted({k for d in self.devices for k in d.parts}, key=_column_order)
        out = []
        for d in self.devices:
            row = {
                "device": d.name,
                **({"peak at": d.phase or "-"} if any(x.phase for x in self.devices) else {}),
                **{k: _gib(d.parts.get(k, 0.0)) for k in columns},
            }
            row.update(total=_gib(d.total), available=_gib(d.budget), fits="yes" if d.fits else "NO")
            out.append(row)
        return out

    def text(self) -> str:
        rows = self.rows()
        cols = list(rows[0])
        width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
        lines = ["  ".join(c.rjust(width[c]) for c in cols)]
        lines += ["  ".join(str(r[c]).rjust(width[c]) for c in cols) for r in rows]
        facts = "; ".join(f"{k} {v}" for k, v in self.facts.items())
        return f"memory plan, {self.step} (GiB): {facts}\n" + "\n".join(lines)

    def busiest(self) -> str:
        """The device closest to (or furthest over) its memory, as 'gpu 7 52.9 of 79.6 GiB'."""
        d = max(self.devices, key=lambda d: d.total / max(d.budget, 1))
        return f"{d.name} {d.total / GIB:.1f} of {d.budget / GIB:.1f} GiB"

    def problems(self) -> list[str]:
        out = [
            f"{d.name} needs {d.total / GIB:.1f} GiB, {d.budget / GIB:.1f} GiB available"
            for d in self.devices
            if not d.fits
        ]
        return out + self.extra_problems

    def facts_dict(self) -> dict:
        return {"facts": self.facts}


def _gib(n: float) -> float:
    return round(n / GIB, 2 if n >= GIB else 3)


def _column_order(name: str) -> int:
    order = [
        "weights",
        "dequant (transient)",
        "activations",
        "loss / logits",
        "LoRA + optimizer",
        "weights in transit",
        "CUDA graphs",
        "KV cache",
        "cuBLAS workspaces",
        "runtime",
    ]
    return order.index(name) if name in order else len(order)
