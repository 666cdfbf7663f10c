"""Tokenize chats and build labels that train only on the final assistant turn.

The chat is rendered by `render.render_chat`: the tokens before the first
label are exactly the prompt evaluation serves, and the labelled tokens are
the assistant content as the data wrote it (reasoning included, even under
templates such as DeepSeek-R1's that drop it), then the end of the turn.
Samples longer than ``max_len`` are truncated and counted. Per source, the
trained tokens are split into reasoning and answer, so a report shows what
is actually trained. ``encode_row`` is the kit's one chat encoder: measurement
(``dsr1kit.measure``) scores exactly the tokens training trains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .chat import rationale_of, to_messages
from .render import Rendered, reasoning_mask, render_chat

IGNORE = -100
COUNTS = ("rows", "kept", "skipped", "truncated", "no_reasoning", "reasoning_tokens", "answer_tokens")


@dataclass
class Encoded:
    id: str
    input_ids: list[int]
    labels: list[int]
    truncated: bool


@dataclass
class EncodedSet:
    examples: list[Encoded]
    skipped: int = 0  # rows without question or answer
    truncated: int = 0
    no_target: int = 0  # truncation removed every assistant token
    per_source: dict[str, dict[str, int]] = field(default_factory=dict)
    rendering: dict[str, int] = field(default_factory=dict)  # how the chats were rendered → count
    example: dict[str, Any] = field(default_factory=dict)  # one rendered example, labelled span split out


def encode_rendered(rendered: Rendered, max_len: int) -> tuple[list[int], list[int], bool]:
    ids = rendered.ids
    labels = [IGNORE] * len(rendered.prompt_ids) + list(rendered.target_ids)
    return ids[:max_len], labels[:max_len], len(ids) > max_len


def encode_messages(tokenizer, messages: list[dict], max_len: int) -> tuple[list[int], list[int], bool]:
    """input_ids and labels (IGNORE on the served prompt), truncated to max_len."""
    return encode_rendered(render_chat(tokenizer, messages), max_len)


def encode_row(
    tokenizer, row: dict[str, Any], max_len: int, system_prompt: str
) -> tuple[Rendered, Encoded] | None:
    """One row as training encodes it: its rendered chat, ids and labels; None without question or answer."""
    messages = to_messages(row, system_prompt)
    if messages is None:
        return None
    rendered = render_chat(tokenizer, messages)
    ids, labels, truncated = encode_rendered(rendered, max_len)
    return rendered, Encoded(str(row.get("id")), ids, labels, truncated)


def labelled_example(rendered: Rendered, source: str, row_id: str) -> dict[str, Any]:
    """The rendered text of one example split into prompt / trained reasoning / trained answer."""
    start, end = rendered.reasoning
    text = rendered.target_text
    return {
        "source": source,
        "id": row_id,
        "how": rendered.how,
        "prompt": rendered.prompt_text,
        "before_reasoning": text[:start],
        "reasoning": text[start:end],
        "answer": text[end:],
    }


def encode_rows(tokenizer, rows: list[dict[str, Any]], max_len: int, system_prompt: str) -> EncodedSet:
    """Rows → encoded examples, counting skipped, truncated and target-less rows, trained tokens per source."""
    result = EncodedSet(examples=[])
    for row in rows:
        src = row.get("_source", "?")
        counts = result.per_source.setdefault(src, dict.fromkeys(COUNTS, 0))
        counts["rows"] += 1
        encoded = encode_row(tokenizer, row, max_len, system_prompt)
        if encoded is None:
            result.skipped += 1
            counts["skipped"] += 1
            continue
        rendered, example = encoded
        truncated = example.truncated
        trained = max(0, len(example.labels) - len(rendered.prompt_ids))
        if trained == 0:
            result.no_target += 1
            counts["skipped"] += 1
            continue
        in_reasoning = reasoning_mask(rendered)[:trained]
        counts["reasoning_tokens"] += sum(in_reasoning)
        counts["answer_tokens"] += trained - sum(in_reasoning)
        counts["no_reasoning"] += rationale_of(row) is None
        result.truncated += truncated
        counts["truncated"] += truncated
        counts["kept"] += 1
        result.rendering[rendered.how] = result.rendering.get(rendered.how, 0) + 1
        if not result.example or (not result.example["reasoning"] and rendered.reasoning[1] > 0):
            result.example = labelled_example(rendered, src, str(row.get("id")))  # prefer one with reasoning
        result.examples.append(example)
    return result


def collate(examples: list[Encoded], pad_id: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch. Refuses ids outside the vocab: on a GPU they become a device-side assert."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    top = int(ids.max())
    if top >= vocab_size or pad_id >= vocab_size:
        raise ValueError(
            f"token id {max(top, pad_id)} >= model vocab {vocab_size}: resize the embeddings "
            f"(dsr1kit.model.load.ensure_vocab) before training"
        )
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
