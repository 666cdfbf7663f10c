"""Turn one dataset row into chat messages, the same way for training and evaluation.

The assistant turn is ``<think>\\n{rationale}\\n</think>\\n<answer>\\n{answer}\\n</answer>``,
or the answer block alone when the row has no rationale. Multiple-choice
options are lettered A., B., … under an "Options:" header.
"""

from __future__ import annotations

from typing import Any

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
QUESTION_KEYS = ("question", "prompt", "input")
ANSWER_KEYS = ("answer", "output", "target")
RATIONALE_KEYS = ("cot", "rationale", "explanation")
OPTION_KEYS = ("choices", "options")
DEFAULT_SYSTEM = "You are DeepSeek-R1."


def first_of(row: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for k in keys:
        v = row.get(k)
        if v is not None and (not isinstance(v, str) or v.strip()):
            return v
    return None


def options_of(row: dict[str, Any]) -> list[str]:
    opts = first_of(row, OPTION_KEYS)
    if isinstance(opts, dict):  # {"label": [...], "text": [...]} as some hub sets store them
        opts = opts.get("text") or list(opts.values())
    return [str(o) for o in opts] if opts else []


def user_text(row: dict[str, Any]) -> str | None:
    """The question with lettered options; None when the row has no question."""
    question = first_of(row, QUESTION_KEYS)
    if question is None:
        return None
    text = str(question).strip()
    opts = options_of(row)
    if opts:
        text += "\n\nOptions:\n" + "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(opts))
    return text


def rationale_of(row: dict[str, Any]) -> str | None:
    """The row's reasoning text (``cot``, ``rationale`` or ``explanation``), None when it has none."""
    rationale = first_of(row, RATIONALE_KEYS)
    return None if rationale is None else str(rationale)


def assistant_text(row: dict[str, Any]) -> str | None:
    answer = first_of(row, ANSWER_KEYS)
    if answer is None:
        return None
    block = f"<answer>\n{str(answer).strip()}\n</answer>"
    rationale = rationale_of(row)
    if rationale is None:
        return block
    return f"<think>\n{str(rationale).strip()}\n</think>\n{block}"


def to_messages(
    row: dict[str, Any], system_prompt: str = DEFAULT_SYSTEM, with_answer: bool = True
) -> list[dict] | None:
    """Chat messages for a row, or None if the row lacks a question (or an answer when needed)."""
    user = user_text(row)
    if user is None:
        return None
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": user})
    if with_answer:
        assistant = assistant_text(row)
        if assistant is None:
            return None
        messages.append({"role": "assistant", "content": assistant})
    return messages
