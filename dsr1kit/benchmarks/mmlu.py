"""MMLU (``cais/mmlu``: ``choices``, ``answer`` the 0-based index, ``subject``) and MMLU-Pro
(``TIGER-Lab/MMLU-Pro``: up to ten ``options``, ``answer`` a letter and ``answer_index``, ``cot_content``)."""

from __future__ import annotations

import re
from typing import Any

from .adapter import Adapter
from .item import CHOICE, UNREADABLE, Exclude, Item, letter, text_of


def _options(row: dict[str, Any], key: str) -> list[str]:
    options = row.get(key)
    if not isinstance(options, (list, tuple)) or len(options) < 2:
        raise Exclude(UNREADABLE, f"{key!r} is not a list of options")
    return [str(o) for o in options]


def read_mmlu(row: dict[str, Any], row_id: str) -> Item:
    options = _options(row, "choices")
    return Item(
        row_id,
        text_of(row, "question"),
        letter(row.get("answer"), len(options), "answer"),
        CHOICE,
        options=options,
    )


_COT_PREFIX = re.compile(r"^\s*A:\s*Let's think step by step\.\s*", re.I)


def read_pro(row: dict[str, Any], row_id: str) -> Item:
    options = _options(row, "options")
    rationale = _COT_PREFIX.sub("", str(row.get("cot_content") or "")).strip() or None
    return Item(
        row_id,
        text_of(row, "question"),
        letter(row.get("answer_index"), len(options), "answer_index"),
        CHOICE,
        options=options,
        rationale=rationale,
    )


ADAPTER = Adapter(
    "MMLU",
    ("cais/mmlu", "hendrycks/mmlu", "hendrycks_test"),
    frozenset({"question", "choices", "answer", "subject"}),
    read_mmlu,
    "accuracy on the option letter (4 options; zero-shot here, the original reports 5-shot)",
    category_key="subject",
)
PRO = Adapter(
    "MMLU-Pro",
    ("TIGER-Lab/MMLU-Pro",),
    frozenset({"question", "options", "answer_index"}),
    read_pro,
    "accuracy on the option letter (up to 10 options; zero-shot chain of thought)",
    id_key="question_id",
)
