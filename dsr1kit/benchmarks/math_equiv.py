"""Math answers compared as their owners compare them: for equivalence (``\\frac{1}{2}`` = ``0.5``,
``x = 3`` = ``3``, ``\\{1,2\\}`` = ``\\{2,1\\}``), with Hugging Face's math-verify, never as strings.

math-verify bounds each parse with a SIGALRM timer, which only the main thread may set: elsewhere (a
scoring thread) it runs without one.
"""

from __future__ import annotations

import threading
from functools import lru_cache

TIMEOUT_S = 5


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _as_latex(text: str) -> str:
    """A bare answer (``\\frac{1}{2}``, ``3``) as math-verify reads LaTeX: inside ``$…$`` unless delimited."""
    text = text.strip()
    delimited = text.startswith(("$", "\\(", "\\[")) or "\\boxed" in text
    return text if delimited else f"${text}$"


@lru_cache(maxsize=4096)
def _parse(text: str):
    from math_verify import parse

    parsed = parse(_as_latex(text), parsing_timeout=_timeout())
    return parsed or parse(text, parsing_timeout=_timeout())


def equivalent(prediction: str, gold: str) -> bool:
    """Whether ``prediction`` is mathematically the same answer as ``gold`` (False when either is unreadable)."""
    from math_verify import verify

    if not prediction or not str(prediction).strip():
        return False
    gold_parsed, pred_parsed = _parse(str(gold)), _parse(str(prediction))
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=_timeout()))


def _split_top_level(text: str) -> list[str]:
    """``a, (b, c), d`` → ``["a", "(b, c)", "d"]``: commas inside brackets or braces stay."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def all_equivalent(prediction: str, golds: list[str]) -> bool:
    """Several final answers (OlympiadBench's lists): every gold given once, in any order, nothing extra."""
    if len(golds) == 1:
        return equivalent(prediction, golds[0])
    predicted = _split_top_level(prediction.strip().strip("$"))
    if len(predicted) != len(golds):
        return False
    left = list(predicted)
    for gold in golds:
        match = next((p for p in left if equivalent(p, gold)), None)
        if match is None:
            return False
        left.remove(match)
    return True
