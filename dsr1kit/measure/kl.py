"""KL(base ‖ adapted) per token, fp32, temperature 1: the one KL of the kit's measurements.

The function is the training loss's (``train.vocab_loss.forward_kl``, which ``train.hari.token_terms``
and the loss's torch ops call, here at temperature 1), so a measured KL and the KL term HARI minimised
are the same quantity. The base is the same PeftModel under ``disable_adapter()``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from ..train import vocab_loss
from ..train.hari import kl_mask
from .batches import batches, encode_scored, eval_mode

KlSpan = Literal["answer", "all"]
_MASK_OF_SPAN = {"answer": "assistant", "all": "all"}


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the vocabulary in fp32."""
    return vocab_loss.log_probs(logits)


def kl_per_token(log_base: torch.Tensor, log_adapted: torch.Tensor) -> torch.Tensor:
    """KL(p_base ‖ p_adapted) at each position, from fp32 log-probabilities [..., vocab] → [...]."""
    return vocab_loss.forward_kl(log_base, log_adapted)


@torch.no_grad()
def kl_to_base(
    peft_model,
    tokenizer,
    rows: list[dict[str, Any]],
    system_prompt: str,
    max_len: int = 256,
    batch_size: int = 16,
    span: KlSpan = "answer",
) -> float:
    """Mean per-token KL(p_base ‖ p_adapted) over every selected token of the rows.

    ``span="answer"``: the positions that predict the assistant turn (training's ``kl_tokens: assistant``);
    ``"all"``: every attended position (``kl_tokens: all``). Same masks as the training loss.
    """
    if span not in _MASK_OF_SPAN:
        raise ValueError(f"span must be 'answer' or 'all', got {span!r}")
    if not hasattr(peft_model, "disable_adapter"):
        raise TypeError("kl_to_base needs a PeftModel (its base is the same model with the adapter disabled)")
    examples = encode_scored(tokenizer, rows, system_prompt, max_len, whole=False)
    total, count = 0.0, 0
    with eval_mode(peft_model):
        for batch in batches(peft_model, examples, tokenizer, batch_size):
            ids, attn = batch["input_ids"], batch["attention_mask"]
            adapted = peft_model(input_ids=ids, attention_mask=attn, use_cache=False).logits
            with peft_model.disable_adapter():
                base = peft_model(input_ids=ids, attention_mask=attn, use_cache=False).logits
            select = kl_mask(batch, _MASK_OF_SPAN[span]).to(adapted.device)
            kl = kl_per_token(log_probs(base[select].to(adapted.device)), log_probs(adapted[select]))
            total += float(kl.sum())
            count += int(select.sum())
    return total / count if count else float("nan")
