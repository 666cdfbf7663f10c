"""The evaluation's prompts, every row asked for accounted for: served prompts that fit, rows left out with why.

A schema no benchmark adapter reads stops here, before any server starts; a prompt that leaves no room
for the answer is excluded and counted, so scored + excluded is every row asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import evaluate


@dataclass(frozen=True)
class PromptConfig:
    """What the prompts are made of: the evaluation sets, how many rows of each, and the context they fit."""

    eval_dataset: str  # local jsonl or hub name; several, comma-separated
    eval_limit: int  # rows of each set at most; 0: all
    system_prompt: str  # as in training
    max_model_len: int  # the served context
    max_new_tokens: int  # room left for each answer


@dataclass
class Prompts:
    """Every evaluation row asked for: the served prompts that fit, and each row left out with its reason."""

    accounting: Any  # evaluate.Accounting: kept prompts + excluded rows = every row asked for
    adapters: dict[str, str]  # evaluation set → the benchmark adapter that read it
    budget: int  # prompt tokens that leave room for max_new_tokens
    served_example: str

    @property
    def kept(self):
        return self.accounting.kept

    @property
    def totals(self) -> dict[str, int]:
        return self.accounting.totals()

    def describe(self) -> str:
        lines = [self.accounting.describe()]
        lines += [f"{name}: read as {adapter}" for name, adapter in self.adapters.items()]
        lines.append(f"prompt budget: {self.budget} tokens (max_model_len - max_new_tokens)")
        lines.append(f"first prompt as served: {self.served_example!r}")
        return "\n".join(lines)

    def excluded_frame(self):
        """One row per excluded row: its id, set, category, reason and detail (empty when none)."""
        import pandas as pd

        cols = ["id", "source", "category", "reason", "detail"]
        return pd.DataFrame(
            [{c: getattr(e, c) for c in cols} for e in self.accounting.excluded], columns=cols
        )

    def summary(self) -> dict[str, Any]:
        return {
            "n_total": self.accounting.asked,
            "n_scored": len(self.kept),
            "excluded_by_reason": self.accounting.reason_counts(),
            "excluded": [
                {"id": e.id, "source": e.source, "reason": e.reason, "detail": e.detail}
                for e in self.accounting.excluded
            ],
            "benchmark_adapters": self.adapters,
            "served_prompt_example": self.served_example,
        }


def prepare_prompts(config: PromptConfig, tokenizer) -> Prompts:
    """Rows → benchmark items (a schema no adapter reads stops here, before any server) → chat prompts
    formatted as in training → the context filter (max_model_len - max_new_tokens)."""
    adapted = evaluate.load_items(config.eval_dataset, config.eval_limit)
    prompts = evaluate.build_prompts(adapted.items, tokenizer, config.system_prompt)
    ctx = evaluate.filter_by_context(prompts, config.max_model_len, config.max_new_tokens)
    served = tokenizer.decode(ctx.kept[0].token_ids) if ctx.kept else ""
    return Prompts(evaluate.account(adapted, ctx), adapted.adapters, ctx.budget, served)


def count_rows(eval_dataset: str, eval_limit: int) -> tuple[int, str]:
    """(rows asked of each model, "") or (0, why they could not be counted): the data may not be readable
    where the run is planned (a login node)."""
    from ..data.plan import load_rows

    try:
        rows = len(load_rows(eval_dataset).rows)
    except (OSError, ValueError) as err:
        return 0, f"the evaluation data is not readable here ({err})"
    if eval_limit:
        rows = min(rows, eval_limit * len(eval_dataset.split(",")))
    return rows, ""
