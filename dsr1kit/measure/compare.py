"""How far the adapted model moved from its base, on probe sets, and what it now says.

Per probe set: mean per-token KL(base ‖ adapted) with its distribution, top-1
token agreement, and CE for both models on the set's targets (assistant
tokens for chats, every token for plain text). The base is the same model
with the adapter disabled, loaded with the training code's loader, so the
same comparison runs on the tiny model on a CPU and on R1 on GPUs. Chats are
encoded by training's encoder and KL is ``measure.kl``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..data.chat import to_messages
from ..data.labels import IGNORE, encode_row
from .kl import kl_per_token, log_probs


@dataclass
class ProbeResult:
    name: str
    examples: int
    tokens: int
    kl_mean: float
    top1_agreement: float
    ce_base: float
    ce_adapted: float
    kl_per_token: list[float] = field(default_factory=list, repr=False)

    def row(self) -> dict[str, Any]:
        return {
            "probe set": self.name,
            "examples": self.examples,
            "tokens": self.tokens,
            "KL(base‖adapted) mean": self.kl_mean,
            "top-1 agreement": self.top1_agreement,
            "CE base": self.ce_base,
            "CE adapted": self.ce_adapted,
            "CE change": self.ce_adapted - self.ce_base,
        }


def encode_probe(
    tokenizer, rows: list[dict], max_len: int, system_prompt: str
) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) per row: chats train on assistant tokens, plain ``text`` rows on all tokens."""
    out = []
    for row in rows:
        if "text" in row and "question" not in row:
            ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"][: max_len - 2]
            if tokenizer.bos_token_id is not None:
                ids = [tokenizer.bos_token_id, *ids, tokenizer.eos_token_id]
            out.append((ids, list(ids)))
            continue
        encoded = encode_row(tokenizer, row, max_len, system_prompt)
        if encoded is not None:
            out.append((encoded[1].input_ids, encoded[1].labels))
    return out


@torch.no_grad()
def compare_on(model, examples: list[tuple[list[int], list[int]]], name: str) -> ProbeResult:
    """Run every example through the adapted model and its base (adapter disabled)."""
    device = model.get_input_embeddings().weight.device
    kl_all: list[torch.Tensor] = []
    agree = tokens = 0
    ce = {"base": 0.0, "adapted": 0.0}
    n_targets = 0
    model.eval()
    for ids, labels in examples:
        x = torch.tensor([ids], device=device)
        adapted = model(input_ids=x).logits[0].float()
        with model.disable_adapter():
            base = model(input_ids=x).logits[0].float()
        log_a, log_b = log_probs(adapted), log_probs(base)
        kl_all.append(kl_per_token(log_b, log_a).cpu())
        agree += int((adapted.argmax(-1) == base.argmax(-1)).sum())
        tokens += len(ids)
        targets = torch.tensor(labels[1:] + [IGNORE], device=device)
        valid = targets != IGNORE
        n_targets += int(valid.sum())
        for key, logp in (("base", log_b), ("adapted", log_a)):
            ce[key] += float(-logp[valid].gather(1, targets[valid].unsqueeze(1)).sum())
    kl = torch.cat(kl_all) if kl_all else torch.zeros(0)
    return ProbeResult(
        name,
        len(examples),
        tokens,
        float(kl.mean()) if tokens else 0.0,
        agree / max(tokens, 1),
        ce["base"] / max(n_targets, 1),
        ce["adapted"] / max(n_targets, 1),
        kl.tolist(),
    )


@torch.no_grad()
def generations(
    model, tokenizer, rows: list[dict], max_new_tokens: int, system_prompt: str
) -> list[dict[str, str]]:
    """Greedy answers of the base and the adapted model, side by side."""
    device = model.get_input_embeddings().weight.device
    out = []
    for row in rows:
        messages = to_messages(row, system_prompt, with_answer=False)
        if messages is None:
            continue
        enc = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        ).to(device)
        n = enc["input_ids"].shape[1]
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        adapted = model.generate(**enc, **kwargs)[0, n:]
        with model.disable_adapter():
            base = model.generate(**enc, **kwargs)[0, n:]
        out.append(
            {
                "id": str(row.get("id")),
                "question": messages[-1]["content"],
                "gold": str(row.get("answer")),
                "base": tokenizer.decode(base, skip_special_tokens=True),
                "adapted": tokenizer.decode(adapted, skip_special_tokens=True),
            }
        )
    return out
