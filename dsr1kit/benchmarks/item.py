"""One benchmark row in the kit's terms: the question as asked, its gold and how it is scored.

Every benchmark family reads its hub schema into these; evaluation and training see nothing else, so a
row of MedMCQA, MMLU or the kit's own jsonl is prompted, trained on and scored the same way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..data.chat import LETTERS

CHOICE, EXACT, MATH, JUDGED = "choice", "exact", "math", "judged"
KINDS = (CHOICE, EXACT, MATH, JUDGED)

# Why a row asked for is not scored; each excluded row carries one, so scored + excluded = asked.
NO_GOLD = "no gold"
NEEDS_IMAGE = "needs an image"
OVER_CONTEXT = "over the context"
UNREADABLE = "unreadable"
REASONS = (NO_GOLD, NEEDS_IMAGE, OVER_CONTEXT, UNREADABLE)


class Exclude(Exception):
    """Raised by an adapter for a row that cannot be scored, with one of ``REASONS`` and the detail."""

    def __init__(self, reason: str, detail: str = ""):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass
class Item:
    """A question as the kit asks it.

    ``gold``: the option letter (choice), the answer text (exact, judged) or the final answers (math; a
    list when the benchmark wants several, all of which must be given). ``instructions``: the answer
    format the benchmark's owners ask for in the system turn (HLE's), "" when none.
    """

    id: str
    question: str
    gold: str | list[str]
    kind: str
    category: str = "all"
    options: list[str] = field(default_factory=list)
    rationale: str | None = None
    instructions: str = ""
    meta: dict[str, Any] = field(
        default_factory=dict
    )  # what a reader needs to check a score, e.g. GPQA's order
    source: str = ""  # the evaluation set it came from

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"item {self.id}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.kind == CHOICE and self.gold not in LETTERS[: len(self.options)]:
            raise Exclude(
                UNREADABLE, f"gold {self.gold!r} is not one of the {len(self.options)} option letters"
            )

    @property
    def gold_text(self) -> str:
        return ", ".join(self.gold) if isinstance(self.gold, list) else self.gold

    def to_row(self) -> dict[str, Any]:
        """The row in the kit's own schema (``data.chat`` turns it into messages, for training too)."""
        row = {"id": self.id, "question": self.question, "answer": self.gold_text, "category": self.category}
        if self.options:
            row["options"] = list(self.options)
        if self.rationale:
            row["cot"] = self.rationale
        return row


@dataclass
class ExcludedRow:
    id: str
    reason: str
    detail: str = ""
    source: str = ""
    category: str = "all"


@dataclass
class Adapted:
    """What one evaluation set became: the items to ask and the rows left out, each with its reason."""

    items: list[Item]
    excluded: list[ExcludedRow]
    adapters: dict[str, str]  # source → the adapter that read it

    @property
    def asked(self) -> int:
        return len(self.items) + len(self.excluded)

    def reason_counts(self) -> dict[str, int]:
        return count_reasons(self.excluded)


def count_reasons(excluded: list[ExcludedRow]) -> dict[str, int]:
    """Excluded rows per reason."""
    return dict(Counter(row.reason for row in excluded))


def letter(index: Any, n_options: int, what: str) -> str:
    """The option letter of a 0-based index as hub sets store it (int or digit string, or already a letter);
    Exclude otherwise."""
    if isinstance(index, str) and len(index.strip()) == 1 and index.strip().upper() in LETTERS[:n_options]:
        return index.strip().upper()
    if index is None or (isinstance(index, str) and not index.strip().lstrip("-").isdigit()):
        raise Exclude(NO_GOLD, f"{what} is {index!r}")
    i = int(index)
    if i < 0:
        raise Exclude(NO_GOLD, f"{what} is {i} (the split has no gold)")
    if i >= n_options:
        raise Exclude(UNREADABLE, f"{what} {i} but only {n_options} options")
    return LETTERS[i]


def text_of(row: dict[str, Any], key: str) -> str:
    """A required text column; a missing or empty one makes the row unreadable."""
    value = row.get(key)
    if value is None or not str(value).strip():
        raise Exclude(UNREADABLE, f"column {key!r} is empty")
    return str(value).strip()
