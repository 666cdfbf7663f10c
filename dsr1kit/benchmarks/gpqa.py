"""GPQA (``Idavidrein/gpqa``): the correct answer and three incorrect ones in columns of their own. The
four are shuffled with a seed taken from the row's id, so every run asks each question in the same order;
the order is kept in the item (and the answers file) so a reader can check a letter against the text."""

from __future__ import annotations

import hashlib
import random
from typing import Any

from ..data.chat import LETTERS
from .adapter import Adapter
from .item import CHOICE, Item, text_of

COLUMNS = ("Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")


def order_for(row_id: str) -> list[int]:
    """The permutation of ``COLUMNS`` asked as A–D for this row: fixed by the id alone."""
    seed = int.from_bytes(hashlib.sha256(f"gpqa:{row_id}".encode()).digest()[:8], "big")
    order = list(range(len(COLUMNS)))
    random.Random(seed).shuffle(order)
    return order


def read(row: dict[str, Any], row_id: str) -> Item:
    answers = [text_of(row, key) for key in COLUMNS]
    order = order_for(row_id)
    return Item(
        row_id,
        text_of(row, "Question"),
        LETTERS[order.index(0)],
        CHOICE,
        options=[answers[i] for i in order],
        rationale=(row.get("Explanation") or "").strip() or None,
        meta={"option_order": [COLUMNS[i] for i in order]},
    )


ADAPTER = Adapter(
    "GPQA",
    ("Idavidrein/gpqa",),
    frozenset({"Question", *COLUMNS}),
    read,
    "accuracy on the option letter, the four answers shuffled (here with a fixed seed per row id)",
    id_key="Record ID",
    category_key="High-level domain",
    default_split="train",
)
