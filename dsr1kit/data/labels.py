"""Tokenize chats and build labels that train only on the assistant's tokens.

The assistant mask comes from the chat template's ``{% generation %}`` markers
when it has them; otherwise everything before the first ``<think>`` (or
``<answer>``) of the rendered text is masked using the tokenizer's offsets,
as the recipe did. Samples longer than ``max_len`` are truncated and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .chat import to_messages

IGNORE = -100
ASSISTANT_START_MARKERS = ("<think>", "<answer>")


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


def _has_generation_markers(tokenizer) -> bool:
    template = tokenizer.chat_template or ""
    return "{% generation %}" in template or "{%- generation %}" in template


def _offset_labels(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = [text.find(m) for m in ASSISTANT_START_MARKERS if text.find(m) >= 0]
    if not starts:
        raise ValueError("cannot find where the assistant turn starts: the chat template has no "
                         "{% generation %} markers and the text has no <think>/<answer>")
    first = min(starts)
    ids = enc["input_ids"]
    labels = [tid if s >= first else IGNORE for tid, (s, _) in zip(ids, enc["offset_mapping"])]
    return ids, labels


def encode_messages(tokenizer, messages: list[dict], max_len: int) -> tuple[list[int], list[int], bool]:
    """input_ids and labels (IGNORE outside the assistant turn), truncated to max_len."""
    if _has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids = list(out["input_ids"])
        labels = [t if m else IGNORE for t, m in zip(ids, out["assistant_masks"])]
    else:
        ids, labels = _offset_labels(tokenizer, messages)
    truncated = len(ids) > max_len
    return ids[:max_len], labels[:max_len], truncated


def encode_rows(tokenizer, rows: list[dict[str, Any]], max_len: int, system_prompt: str) -> EncodedSet:
    """Rows → encoded examples, counting skipped, truncated and target-less rows per source."""
    result = EncodedSet(examples=[])
    for row in rows:
        src = row.get("_source", "?")
        counts = result.per_source.setdefault(src, {"rows": 0, "kept": 0, "skipped": 0, "truncated": 0})
        counts["rows"] += 1
        messages = to_messages(row, system_prompt)
        if messages is None:
            result.skipped += 1
            counts["skipped"] += 1
            continue
        ids, labels, truncated = encode_messages(tokenizer, messages, max_len)
        if all(x == IGNORE for x in labels):
            result.no_target += 1
            counts["skipped"] += 1
            continue
        result.truncated += truncated
        counts["truncated"] += truncated
        counts["kept"] += 1
        result.examples.append(Encoded(str(row.get("id")), ids, labels, truncated))
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
        raise ValueError(f"token id {max(top, pad_id)} >= model vocab {vocab_size}: resize the embeddings "
                         f"(dsr1kit.model.load.ensure_vocab) before training")
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
