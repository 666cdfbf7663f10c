"""Competition math: MATH-500 (``HuggingFaceH4/MATH-500``), AIME (the hub's yearly sets) and OlympiadBench
(``Hothan/OlympiadBench``: a list of final answers, images on some rows, proofs without a final answer).
Their owners score the final answer for mathematical equivalence, not as a string (``math_equiv``)."""

from __future__ import annotations

from typing import Any

from .adapter import Adapter
from .item import MATH, NEEDS_IMAGE, NO_GOLD, Exclude, Item, text_of


def read_math500(row: dict[str, Any], row_id: str) -> Item:
    level = row.get("level")
    return Item(
        row_id,
        text_of(row, "problem"),
        text_of(row, "answer"),
        MATH,
        rationale=(row.get("solution") or "").strip() or None,
        meta={"level": level} if level is not None else {},
    )


def read_aime(row: dict[str, Any], row_id: str) -> Item:
    return Item(
        row_id,
        text_of(row, "problem"),
        text_of(row, "answer"),
        MATH,
        rationale=(row.get("solution") or "").strip() or None,
    )


IMAGES = tuple(f"image_{i}" for i in range(1, 6))


def read_olympiad(row: dict[str, Any], row_id: str) -> Item:
    if any(row.get(key) for key in IMAGES) or str(row.get("modality", "")).lower().startswith("multi"):
        raise Exclude(NEEDS_IMAGE, str(row.get("subfield") or ""))
    answers = row.get("final_answer")
    if isinstance(answers, str):
        answers = [answers]
    answers = [str(a).strip() for a in answers or [] if str(a).strip()]
    if not answers:
        raise Exclude(NO_GOLD, f"{row.get('question_type') or 'the row'} has no final answer")
    question = text_of(row, "question")
    if str(row.get("context") or "").strip():
        question = f"{str(row['context']).strip()}\n\n{question}"
    return Item(
        row_id,
        question,
        answers,
        MATH,
        meta={"unit": row.get("unit")} if row.get("unit") else {},
    )


MATH500 = Adapter(
    "MATH-500",
    ("HuggingFaceH4/MATH-500",),
    frozenset({"problem", "answer", "subject", "level"}),
    read_math500,
    "the final answer (\\boxed{}) checked for equivalence with math-verify",
    id_key="unique_id",
    category_key="subject",
)
AIME = Adapter(
    "AIME",
    (
        "AI-MO/aimo-validation-aime",
        "HuggingFaceH4/aime_2024",
        "math-ai/aime24",
        "math-ai/aime25",
        "yentinglin/aime_2025",
    ),
    frozenset({"problem", "answer"}),
    read_aime,
    "the final answer (an integer 0-999) checked for equivalence with math-verify",
    category_key="year",
    default_split="train",
)
OLYMPIADBENCH = Adapter(
    "OlympiadBench",
    ("Hothan/OlympiadBench",),
    frozenset({"question", "final_answer"}),
    read_olympiad,
    "every final answer checked for equivalence (math-verify); text-only rows, proofs excluded",
    category_key="subfield",
    default_split="train",
)
