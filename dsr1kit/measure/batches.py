"""Rows → the padded batches a measurement runs, encoded by training's own encoder (``data.labels``)."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterable, Iterator

import torch

from ..data.labels import IGNORE, Encoded, collate, encode_row


def encode_scored(
    tokenizer, rows: list[dict[str, Any]], system_prompt: str, max_len: int, whole: bool
) -> list[Encoded]:
    """Rows → (served prompt + assistant turn) ids and labels; rows without question or answer skipped.

    ``whole``: a row longer than ``max_len`` is an error (a truncated turn would be judged on a prefix).
    """
    out, too_long = [], []
    for i, row in enumerate(rows):
        encoded = encode_row(tokenizer, row, max_len, system_prompt)
        if encoded is None:
            continue
        _, example = encoded
        row_id = str(row.get("id", f"#{i}"))
        if example.truncated and whole:
            too_long.append(row_id)
            continue
        if any(label != IGNORE for label in example.labels[1:]):
            out.append(replace(example, id=row_id))
    if too_long:
        raise ValueError(
            f"{len(too_long)} row(s) do not fit max_len={max_len} with their whole assistant turn "
            f"({', '.join(too_long[:5])}{', …' if len(too_long) > 5 else ''}); raise max_len"
        )
    if not out:
        raise ValueError(
            f"none of the {len(rows)} rows has both a question and an answer (keys "
            f"question/prompt/input and answer/output/target) within max_len={max_len}: "
            f"nothing to measure"
        )
    if len(out) < len(rows):
        warnings.warn(
            f"{len(rows) - len(out)} of {len(rows)} rows have no question or answer "
            f"(or no target within max_len) and are skipped",
            stacklevel=3,
        )
    return out


def batches(model, examples: list[Encoded], tokenizer, batch_size: int) -> Iterable[dict[str, torch.Tensor]]:
    """Right-padded batches with attention mask, on the model's input device."""
    embeddings = model.get_input_embeddings()
    device = embeddings.weight.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start : start + batch_size], pad, embeddings.num_embeddings)
        yield {k: v.to(device) for k, v in batch.items()}


@contextmanager
def eval_mode(model) -> Iterator[None]:
    """eval() for the measurement (no dropout), the previous mode restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
