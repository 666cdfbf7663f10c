"""Humanity's Last Exam (``cais/hle``): ``answer_type`` exactMatch or multipleChoice (the choices inside
the question), an ``image`` on the multimodal rows. Its owners ask for an explanation, an answer and a
confidence in the system turn, and a judge model decides whether the answer matches the gold; text-only
models are scored on the text-only rows, the others are excluded as needing an image."""

from __future__ import annotations

import re
from typing import Any

from .adapter import Adapter
from .item import JUDGED, NEEDS_IMAGE, UNREADABLE, Exclude, Item, text_of

# The answer formats of HLE's own prediction script, one per answer type.
EXACT_FORMAT = (
    "Your response should be in the following format:\n"
    "Explanation: {your explanation for your final answer}\n"
    "Exact Answer: {your succinct, final answer}\n"
    "Confidence: {your confidence score between 0% and 100% for your answer}"
)
CHOICE_FORMAT = (
    "Your response should be in the following format:\n"
    "Explanation: {your explanation for your answer choice}\n"
    "Answer: {your chosen answer}\n"
    "Confidence: {your confidence score between 0% and 100% for your answer}"
)
ANSWER_TYPES = {"exactMatch": EXACT_FORMAT, "multipleChoice": CHOICE_FORMAT}
_CHOICE_LINE = re.compile(r"^\s*([A-Z])[.)]\s", re.M)


def read(row: dict[str, Any], row_id: str) -> Item:
    if str(row.get("image") or "").strip():
        raise Exclude(NEEDS_IMAGE, str(row.get("category") or ""))
    answer_type = row.get("answer_type")
    if answer_type not in ANSWER_TYPES:
        raise Exclude(UNREADABLE, f"answer_type {answer_type!r} is not one of {', '.join(ANSWER_TYPES)}")
    question = text_of(row, "question")
    meta = {"answer_type": answer_type}
    if answer_type == "multipleChoice":
        meta["n_choices"] = len(set(_CHOICE_LINE.findall(question.split("Answer Choices:")[-1])))
    return Item(
        row_id,
        question,
        text_of(row, "answer"),
        JUDGED,
        rationale=(row.get("rationale") or "").strip() or None,
        instructions=ANSWER_TYPES[answer_type],
        meta=meta,
    )


ADAPTER = Adapter(
    "HLE",
    ("cais/hle",),
    frozenset({"question", "answer", "answer_type", "image"}),
    read,
    "a judge model compares the extracted answer with the gold; accuracy and RMS calibration error",
)
