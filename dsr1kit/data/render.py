"""Render a chat for training so that the trained tokens follow exactly the prompt that is served.

Evaluation sends ``apply_chat_template(messages[:-1], add_generation_prompt=True)``
(the *served prompt*); the model then writes the assistant turn. Training must
therefore label exactly what comes after those tokens, and the assistant
content as the data wrote it. Many templates do this by themselves (the tiny
model's, Llama 3's). Others rewrite the assistant turn: DeepSeek-R1's keeps
only the text after the last ``</think>`` (so the reasoning of every row
would be dropped), and its served prompt already opens the reasoning with
``<｜Assistant｜><think>\\n``. For those the final turn is rendered as the
served prompt + the content + EOS, the content's own ``<think>`` opener
dropped where the prompt has opened it (no doubled ``<think>``), and a row
without reasoning closing the opened block empty (``\\n</think>\\n``), as R1
writes when it does not think.

A template the kit cannot render faithfully (it fails to render, has no
generation prompt, or there is no EOS token to end the turn) is refused with
a `TemplateError` naming the problem; nothing is trained on silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_OPENED = re.compile(re.escape(THINK_OPEN) + r"(\s*)$")


class TemplateError(ValueError):
    """The tokenizer's chat template cannot be rendered faithfully; the message says why and what to do."""


@dataclass
class Rendered:
    """One chat as training sees it: the served prompt, then the trained text."""

    prompt_ids: list[int]  # exactly the ids evaluation sends
    target_ids: list[int]  # the assistant turn as trained (content + end of turn)
    prompt_text: str
    target_text: str
    reasoning: tuple[int, int]  # [start, end) characters of target_text that are reasoning; (0, 0) when none
    how: str  # "template" (rendered as written) or "served prompt + content"
    target_offsets: list[tuple[int, int]] | None = (
        None  # character span of each target token (fast tokenizers)
    )

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.target_ids


def _template(tokenizer, messages: list[dict], **kwargs):
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as err:  # jinja errors, missing template, roles the template rejects
        raise TemplateError(
            f"the tokenizer's chat template does not render these messages "
            f"({type(err).__name__}: {err}); set a chat template that accepts system, user and "
            "assistant turns (tokenizer.chat_template)"
        ) from err


def served_prompt(tokenizer, messages: list[dict]) -> tuple[str, list[int]]:
    """(text, token ids) of the prompt the server continues: the messages with the generation prompt added.

    Tokenized as ``apply_chat_template(..., tokenize=True)`` does: the rendered text, no special tokens added.
    """
    text = _template(tokenizer, messages, tokenize=False, add_generation_prompt=True)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def opens_reasoning(prompt_text: str) -> bool:
    """True when the served prompt ends inside an opened ``<think>`` block (R1's does)."""
    return bool(_OPENED.search(prompt_text))


def think_token_ids(tokenizer) -> tuple[int, int] | None:
    """The ids of ``<think>`` and ``</think>`` when each is one token of the vocabulary (R1's are), else None:
    with them a served answer says whether the model wrote the tags a reasoning parser removes."""
    ids = []
    for tag in (THINK_OPEN, THINK_CLOSE):
        one = tokenizer(tag, add_special_tokens=False)["input_ids"]
        if len(one) != 1 or one[0] == tokenizer.unk_token_id:
            return None
        ids.append(int(one[0]))
    return ids[0], ids[1]


def _continuation(prompt_text: str, content: str) -> str:
    """The content as it continues this prompt: no second opener, an empty reasoning closed."""
    m = _OPENED.search(prompt_text)
    if not m:
        return content
    if content.startswith(THINK_OPEN):
        rest = content[len(THINK_OPEN) :]
        ws = m.group(1)  # the prompt's whitespace after its opener already stands for the content's
        return rest[len(ws) :] if ws and rest.startswith(ws) else rest
    return "\n" + THINK_CLOSE + "\n" + content


def _reasoning_span(target_text: str, opened: bool) -> tuple[int, int]:
    end = target_text.rfind(THINK_CLOSE)
    if end < 0:
        return (0, 0)
    start = 0 if opened else max(target_text.find(THINK_OPEN), 0)
    return (start, end + len(THINK_CLOSE))


def render_chat(tokenizer, messages: list[dict]) -> Rendered:
    """Served prompt of ``messages[:-1]`` and the final assistant turn as written (see the module docstring)."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("render_chat needs a chat whose last message is the assistant's")
    history, content = messages[:-1], str(messages[-1]["content"])
    prompt_text, prompt_ids = served_prompt(tokenizer, history)
    full = _template(tokenizer, messages, tokenize=False)
    if full.startswith(prompt_text) and full[len(prompt_text) :].startswith(content):
        how, target_text = "template", full[len(prompt_text) :]
    else:
        if prompt_text == _template(tokenizer, history, tokenize=False, add_generation_prompt=False):
            raise TemplateError(
                "the chat template drops or rewrites the assistant content and has no generation "
                "prompt (add_generation_prompt adds nothing), so there is no served prompt to "
                "train after; use a template that renders the assistant turn as written"
            )
        if not tokenizer.eos_token:
            raise TemplateError(
                "the chat template drops or rewrites the assistant content and the tokenizer has "
                "no eos_token to end the turn with; set tokenizer.eos_token"
            )
        how, target_text = (
            "served prompt + content",
            _continuation(prompt_text, content) + tokenizer.eos_token,
        )
    try:
        enc = tokenizer(target_text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = [tuple(o) for o in enc["offset_mapping"]]
    except NotImplementedError:  # slow tokenizers have no offsets
        enc, offsets = tokenizer(target_text, add_special_tokens=False), None
    return Rendered(
        prompt_ids,
        list(enc["input_ids"]),
        prompt_text,
        target_text,
        _reasoning_span(target_text, opens_reasoning(prompt_text)),
        how,
        offsets,
    )


def reasoning_mask(rendered: Rendered) -> list[bool]:
    """Per target token: does it lie in the reasoning? (By character offsets; all False without offsets.)"""
    start, end = rendered.reasoning
    if end <= start or rendered.target_offsets is None:
        return [False] * len(rendered.target_ids)
    return [start <= s < end for s, _ in rendered.target_offsets]
