"""MedMCQA (``openlifescienceai/medmcqa``): four options ``opa``…``opd``, ``cop`` the 0-based correct one,
``exp`` the explanation. Its test split carries no gold (``cop`` = -1): score on validation."""

from __future__ import annotations

from typing import Any

from .adapter import Adapter
from .item import CHOICE, Item, letter, text_of

OPTIONS = ("opa", "opb", "opc", "opd")


def read(row: dict[str, Any], row_id: str) -> Item:
    options = [text_of(row, key) for key in OPTIONS]
    return Item(
        row_id,
        text_of(row, "question"),
        letter(row.get("cop"), len(options), "cop"),
        CHOICE,
        options=options,
        rationale=(row.get("exp") or "").strip() or None,
    )


ADAPTER = Adapter(
    "MedMCQA",
    ("openlifescienceai/medmcqa", "medmcqa"),
    frozenset({"question", *OPTIONS, "cop"}),
    read,
    "accuracy on the option letter (validation split; the test split has no gold)",
    category_key="subject_name",
    default_split="validation",
)
