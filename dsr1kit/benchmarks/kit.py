"""The kit's own jsonl: ``question`` (or prompt/input), ``answer`` (or output/target), optional ``options``
(or choices) with the answer as a letter, ``cot``/``rationale``/``explanation``, ``category``, ``kind``."""

from __future__ import annotations

from typing import Any

from ..data.chat import ANSWER_KEYS, LETTERS, QUESTION_KEYS, first_of, options_of, rationale_of
from .adapter import Adapter
from .item import CHOICE, EXACT, KINDS, NO_GOLD, UNREADABLE, Exclude, Item


def read(row: dict[str, Any], row_id: str) -> Item:
    question = first_of(row, QUESTION_KEYS)
    if question is None:
        raise Exclude(UNREADABLE, "no question, prompt or input")
    gold = first_of(row, ANSWER_KEYS)
    if gold is None:
        raise Exclude(NO_GOLD, "no answer, output or target")
    options = options_of(row)
    kind = row.get("kind") or (CHOICE if options else EXACT)
    if kind not in KINDS:
        raise Exclude(UNREADABLE, f"kind {kind!r} is not one of {', '.join(KINDS)}")
    gold = str(gold).strip()
    if kind == CHOICE:
        by_text = [LETTERS[i] for i, o in enumerate(options) if o.strip().lower() == gold.lower()]
        gold = gold.upper() if len(gold) == 1 else (by_text[0] if len(by_text) == 1 else gold)
    return Item(
        row_id,
        str(question).strip(),
        gold,
        kind,
        options=options,
        rationale=rationale_of(row),
    )


ADAPTER = Adapter(
    "kit jsonl",
    (),
    tuple(frozenset({q, a}) for q in QUESTION_KEYS for a in ANSWER_KEYS),
    read,
    "the kit's own rows: choice rows by the option letter, others by normalised exact match",
)
