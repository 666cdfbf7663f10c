"""Read the answer out of a completion the way a careful grader would, R1's long reasoning included.

Text up to the last ``</think>`` is reasoning and is never searched (its
"A patient presents…" is not an answer). A completion whose reasoning never
closes (cut off by ``max_new_tokens``, or a prompt that opened ``<think>``
and no ``</think>`` followed) has no answer: it is *unparseable*, never a
guess. In what follows the reasoning the rules are tried in order, the last
occurrence of each winning (a model that corrects itself is read at its
final word):

1. ``<answer>…</answer>`` (an unclosed block counts);
2. ``\\boxed{…}``;
3. "answer is X" / "Answer: X" (bold and parentheses allowed);
4. the last non-empty line, if it is an option by itself (``B``, ``(B)``,
   ``B. text``, or an option's full text); for free-form questions the last line.

What no rule reads is unparseable and scored wrong; the rule that read each
answer is kept, so a report can count them and list the unparseable ones.

An answer row served through vLLM's reasoning parser (``--reasoning-parser
deepseek_r1``; the row then has a ``reasoning`` field) is read from the content
the server split off: its reasoning never closed when the content is empty and
there was reasoning. A completion that stopped at ``max_new_tokens`` before its
reasoning closed *ran out of tokens while thinking*: counted apart from answers
that were read and wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
UNPARSEABLE = "unparseable"
TRUNCATED = "unparseable: reasoning not closed"

ANSWER_BLOCK = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.S)
_MARKUP = re.compile(r"\*\*|__|`|\$")
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}")


@dataclass(frozen=True)
class Parsed:
    value: str | None  # the option letter (multiple choice) or the answer text; None when unparseable
    rule: str  # which rule read it: "answer block", "boxed", "answer is", "last line", or why not


def normalize(text: str) -> str:
    text = re.sub(r"[\s]+", " ", str(text).strip().lower())
    return text.strip(" .,:;!?\"'`()[]")


def _clean(fragment: str) -> str:
    fragment = _TEXT_WRAP.sub(r"\1", fragment)
    return _MARKUP.sub("", fragment).strip()


def read_choice(fragment: str, n_options: int, options: list[str] = ()) -> str | None:
    """The option a short fragment names: ``B``, ``(B)``, ``B.``/``B)``/``B:`` + text, or an option's text."""
    valid = LETTERS[:n_options]
    text = _clean(fragment)
    m = re.fullmatch(rf"\(?([{valid}])\)?(?:\s*[.):]\s*(.*))?[.\s]*", text, re.S)
    if m:
        letter, rest = m.group(1), m.group(2) or ""
        i = valid.index(letter)
        own = options[i] if i < len(options) else None
        others = set(re.findall(rf"\b([{valid}])\b", rest)) - {letter}
        # "B. 42" names B; "A. or rather C" names two options and is no answer
        return letter if not others or (own is not None and normalize(rest) == normalize(own)) else None
    for letter, opt in zip(valid, options):
        if text and normalize(text) == normalize(opt):
            return letter
    return None


def _boxed(text: str) -> list[str]:
    """Contents of every ``\\boxed{…}``, braces balanced."""
    out, i = [], 0
    while (i := text.find("\\boxed{", i)) >= 0:
        depth, j = 1, i + len("\\boxed{")
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth == 0:
            out.append(text[i + len("\\boxed{") : j - 1])
        i = j
    return out


def _answer_is(text: str, n_options: int) -> list[str]:
    if n_options:
        valid = LETTERS[:n_options]
        # the letter is case-sensitive: "the answer is a bit unclear" names no option
        pattern = rf"(?i:answer)\s*(?:(?i:is)|:)\s*[:\s]*\(?([{valid}])\)?(?![A-Za-z0-9])"
    else:
        pattern = r"(?i:answer)\s*(?:(?i:is)|:)\s*[:\s]*([^\n]+?)\s*(?:\.\s|\.?$|\n)"
    return [m.group(1) for m in re.finditer(pattern, _clean(text), re.M)]


def after_reasoning(text: str, reasoning_open: bool = False) -> str | None:
    """What follows the reasoning; None when the reasoning never closed (truncated)."""
    text = text or ""
    if THINK_CLOSE in text:
        return text.rsplit(THINK_CLOSE, 1)[1]
    if reasoning_open or THINK_OPEN in text:
        return None
    return text


def response_of(row: dict, reasoning_open: bool = False) -> str | None:
    """What follows the reasoning of an answer row (the content a reasoning parser split off, else the text
    after the last ``</think>``); None when the reasoning never closed."""
    if "reasoning" in row:
        return _parser_split(row, reasoning_open)[1]
    return after_reasoning(row.get("text") or "", reasoning_open)


def thinking_of(row: dict, reasoning_open: bool = False) -> str:
    """The reasoning of an answer row: the parser's, else the text up to the last ``</think>`` (all of it
    when the reasoning never closed); '' for a model that did not reason."""
    if "reasoning" in row:
        return _parser_split(row, reasoning_open)[0]
    text = row.get("text") or ""
    if THINK_CLOSE in text:
        return text.rsplit(THINK_CLOSE, 1)[0].replace(THINK_OPEN, "", 1)
    return text.replace(THINK_OPEN, "", 1) if reasoning_open or THINK_OPEN in text else ""


def _parser_split(row: dict, reasoning_open: bool) -> tuple[str, str | None]:
    """(reasoning, response) of a row a reasoning parser split, read by the token route's rule.

    The parser takes a completion that never wrote ``</think>`` for all reasoning (R1's prompt opens it).
    Where the row records the tags the model wrote (``closed_reasoning``, ``opened_reasoning``: the served
    vocabulary has them as single tokens), a completion that neither closed nor opened a reasoning, after a
    prompt that opened none, is the answer. Without that record the parser's split stands.
    """
    reasoning, content = row.get("reasoning") or "", row.get("text") or ""
    closed = row.get("closed_reasoning")
    if closed is None:
        return reasoning, (content if content or not reasoning else None)
    if closed:
        return reasoning, content
    if reasoning_open or row.get("opened_reasoning"):
        return reasoning, None
    return "", reasoning + content


def ran_out_thinking(row: dict, reasoning_open: bool = False) -> bool:
    """The completion hit max_new_tokens before its reasoning closed: no answer, for want of tokens."""
    return row.get("finish_reason") == "length" and response_of(row, reasoning_open) is None


def parse_answer(
    text: str, n_options: int = 0, options: list[str] = (), reasoning_open: bool = False
) -> Parsed:
    """The answer of one completion and the rule that read it (see the module docstring)."""
    return read_response(after_reasoning(text, reasoning_open), n_options, options)


def parse_row(row: dict, n_options: int = 0, options: list[str] = (), reasoning_open: bool = False) -> Parsed:
    """The answer of one answer row (either route: token ids, or chat through a reasoning parser)."""
    return read_response(response_of(row, reasoning_open), n_options, options)


def read_response(tail: str | None, n_options: int = 0, options: list[str] = ()) -> Parsed:
    """The answer in what follows the reasoning (None: the reasoning never closed)."""
    if tail is None:
        return Parsed(None, TRUNCATED)

    def read(fragment: str) -> str | None:
        if n_options:
            return read_choice(fragment, n_options, options)
        value = _clean(fragment)
        return value or None

    blocks = ANSWER_BLOCK.findall(tail)
    if blocks:
        inner = blocks[-1]
        for rule, found in (
            ("answer block", [inner]),
            ("answer block", _boxed(inner)),
            ("answer block", _answer_is(inner, n_options)),
        ):
            if found and (value := read(found[-1])) is not None:
                return Parsed(value, rule)
    for rule, found in (("boxed", _boxed(tail)), ("answer is", _answer_is(tail, n_options))):
        if found and (value := read(found[-1])) is not None:
            return Parsed(value, rule)
    lines = [ln for ln in ANSWER_BLOCK.sub("", tail).splitlines() if ln.strip()]
    if lines and (value := read(lines[-1])) is not None:
        return Parsed(value, "last line")
    return Parsed(None, UNPARSEABLE)


def sample_id(question_id: str, sample: int, samples: int) -> str:
    """The answers file's key of a question's sample: the question's id with one sample (so a file written
    before sampling existed resumes as it was), ``id#j`` with several."""
    return question_id if samples == 1 else f"{question_id}#{sample}"
