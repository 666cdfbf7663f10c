"""Exact-match accuracy: does greedy decoding reproduce a row's whole assistant turn (teacher-forced)."""

from __future__ import annotations

from typing import Any

import torch

from ..data.labels import IGNORE
from ..train.hari import next_token_targets
from .batches import batches, encode_scored, eval_mode


@torch.no_grad()
def answer_matches(
    model, tokenizer, rows: list[dict[str, Any]], system_prompt: str, max_len: int = 256, batch_size: int = 16
) -> list[bool]:
    """Per row with a question and an answer (in order; others skipped): does greedy decoding from the
    served prompt reproduce the row's whole assistant turn, end of turn included?

    Teacher-forced: one forward over prompt + turn, True iff the argmax at every target position is the
    target token. By induction this is exactly greedy generation starting with that text (each greedy
    step sees the same prefix the teacher-forced pass feeds), so no generation loop is needed; only an
    exact tie in the logits could decide differently. Tokens are compared, not text: the same text
    reached through another tokenization counts as a mismatch. Accuracy is the mean of the list.
    A row whose turn does not fit ``max_len`` is an error, not a judgement on its prefix.
    """
    examples = encode_scored(tokenizer, rows, system_prompt, max_len, whole=True)
    out: list[bool] = []
    with eval_mode(model):
        for batch in batches(model, examples, tokenizer, batch_size):
            logits = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
            ).logits
            targets = next_token_targets(batch["labels"]).to(logits.device)
            hit = (logits.argmax(-1) == targets) | (targets == IGNORE)
            out.extend(bool(x) for x in hit.all(dim=1).cpu())
    return out


def accuracy(matches: list[bool]) -> float:
    """Share of True (the rows answered exactly)."""
    return sum(matches) / len(matches) if matches else float("nan")
