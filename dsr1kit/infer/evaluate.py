"""Evaluation: dataset → prompts (training's chat format) → context filter → scores with intervals.

Every score is reported as "scored on n of N": questions whose prompt plus
``max_new_tokens`` do not fit the served context are excluded and listed, as
the recipe learned with HLE (a subset score is not the benchmark's score).
Prompts are the served prompts training labels after (`data.render`), and
answers are read by `answers.parse_answer`: never from the reasoning, by
rules whose use is counted, "unparseable" (scored wrong) when none reads one.
Multiple-choice rows are scored on the option letter, others by normalised
exact match.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data.chat import options_of, to_messages
from ..data.render import opens_reasoning, served_prompt
from ..run.paths import resolve
from .answers import UNPARSEABLE, normalize, parse_answer
from .client import ClientConfig, CompletionClient, Request, read_answers

Z95 = 1.959964


@dataclass
class Prompt:
    id: str
    token_ids: list[int]
    gold: str
    category: str
    n_options: int = 0  # > 0: multiple choice, gold is a letter
    options: list[str] = field(default_factory=list)
    reasoning_open: bool = (
        False  # the served prompt opened <think>: a completion without </think> is truncated
    )

    def request(self) -> Request:
        return Request(self.id, self.token_ids)


@dataclass
class ContextFilter:
    kept: list[Prompt]
    excluded: list[dict[str, Any]]  # {id, prompt_tokens}
    budget: int  # max prompt tokens allowed

    @property
    def total(self) -> int:
        return len(self.kept) + len(self.excluded)

    def describe(self) -> str:
        return (
            f"scored on {len(self.kept)} of {self.total}: {len(self.excluded)} excluded because prompt + "
            f"max_new_tokens exceeds max_model_len (prompt budget {self.budget} tokens)"
        )


def load_rows(dataset: str, limit: int = 0) -> list[dict[str, Any]]:
    """Rows of one or more evaluation sets, comma-separated: each a local JSONL file or a hub dataset's
    test split (``name`` or ``name@split``), at most `limit` rows from each (0: all).

    Several sets make one evaluation whose per-category table keeps them apart (e.g. the new task and
    the old one); ids must be unique across them, since answers are saved and resumed by id.
    """
    names = [part.strip() for part in dataset.split(",") if part.strip()]
    if not names:
        raise ValueError(
            "eval_dataset is empty: give a JSONL file or hub dataset, or several comma-separated"
        )
    rows, origin = [], {}
    for name in names:
        for row in _load_one(name, limit):
            if row["id"] in origin:
                raise ValueError(
                    f"eval_dataset: id {row['id']!r} is in both {origin[row['id']]} and {name}; "
                    "ids must be unique across the sets (answers are saved by id)"
                )
            origin[row["id"]] = name
            rows.append(row)
    return rows


def _load_one(dataset: str, limit: int) -> list[dict[str, Any]]:
    path = resolve(dataset)
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        from datasets import load_dataset

        name, _, split = dataset.partition("@")
        rows = [dict(r) for r in load_dataset(name, split=split or "test")]
    for i, row in enumerate(rows):
        row.setdefault("id", f"row-{i:06d}")
        row["id"] = str(row["id"])
    return rows[:limit] if limit else rows


def build_prompts(rows: list[dict[str, Any]], tokenizer, system_prompt: str) -> list[Prompt]:
    """Token ids of each row's served chat prompt (system + user, generation prompt added) and its gold answer."""
    prompts = []
    for row in rows:
        messages = to_messages(row, system_prompt, with_answer=False)
        if messages is None or row.get("answer") is None:
            continue
        opts = options_of(row)
        text, ids = served_prompt(tokenizer, messages)
        prompts.append(
            Prompt(
                row["id"],
                ids,
                str(row["answer"]).strip(),
                str(row.get("category", "all")),
                len(opts),
                opts,
                opens_reasoning(text),
            )
        )
    return prompts


def filter_by_context(prompts: list[Prompt], max_model_len: int, max_new_tokens: int) -> ContextFilter:
    budget = max_model_len - max_new_tokens
    kept = [p for p in prompts if len(p.token_ids) <= budget]
    excluded = [{"id": p.id, "prompt_tokens": len(p.token_ids)} for p in prompts if len(p.token_ids) > budget]
    return ContextFilter(kept, excluded, budget)


# -- answers


def is_correct(prompt: Prompt, text: str) -> tuple[bool, str, str]:
    """(correct, extracted prediction, rule that read it) for one generation."""
    parsed = parse_answer(text, prompt.n_options, prompt.options, prompt.reasoning_open)
    if parsed.value is None:
        return False, "", parsed.rule
    if prompt.n_options:
        return parsed.value == prompt.gold.strip().upper()[:1], parsed.value, parsed.rule
    return normalize(parsed.value) == normalize(prompt.gold), parsed.value, parsed.rule


# -- scores


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for k successes out of n (95% by default)."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def score(prompts: list[Prompt], answers: dict[str, dict], total_by_category: dict[str, int] | None = None):
    """Per-example DataFrame and a per-category accuracy table (with 'all') carrying n of N and the 95% CI.

    ``total_by_category`` is N before the context filter; rows with no answer count as wrong.
    """
    import pandas as pd

    rows = []
    for p in prompts:
        ans = answers.get(p.id) or {}
        ok, pred, rule = is_correct(p, ans.get("text", "")) if ans else (False, "", "no answer")
        rows.append(
            {
                "id": p.id,
                "category": p.category,
                "gold": p.gold,
                "prediction": pred,
                "correct": ok,
                "rule": rule,
                "answered": bool(ans) and not ans.get("error"),
                "text": ans.get("text", ""),
            }
        )
    per_example = pd.DataFrame(
        rows, columns=["id", "category", "gold", "prediction", "correct", "rule", "answered", "text"]
    )
    totals = dict(total_by_category or per_example.groupby("category").size().to_dict())
    table = []
    groups = [("all", per_example)] + sorted(per_example.groupby("category"), key=lambda g: g[0])
    for name, df in groups:
        n, k = len(df), int(df["correct"].sum())
        big_n = sum(totals.values()) if name == "all" else totals.get(name, n)
        lo, hi = wilson(k, n)
        table.append(
            {
                "category": name,
                "accuracy": k / n if n else float("nan"),
                "ci95_low": lo,
                "ci95_high": hi,
                "correct": k,
                "n": n,
                "N": big_n,
                "scored_on": f"{n} of {big_n}",
            }
        )
    return per_example, pd.DataFrame(table)


def rule_counts(per_example) -> dict[str, int]:
    """How many answers each rule read (and how many were unparseable or missing)."""
    return {str(k): int(v) for k, v in per_example["rule"].value_counts().sort_index().items()}


def unparseable(per_example):
    """The rows no rule could read, with their text: what a reader checks before trusting the score."""
    return per_example[per_example["rule"].str.startswith(UNPARSEABLE)][["id", "gold", "rule", "text"]]


def category_totals(prompts: list[Prompt]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in prompts:
        out[p.category] = out.get(p.category, 0) + 1
    return out


def results_path(run_dir: str | Path, label: str) -> Path:
    return Path(run_dir) / "answers" / f"{label}.jsonl"


def run_eval(
    base_url: str,
    model_name: str,
    prompts: list[Prompt],
    out_path: str | Path,
    client: ClientConfig,
    progress: bool = True,
):
    """Ask the server for every prompt not yet answered in out_path (tqdm progress); return the client Stats."""
    from tqdm import tqdm

    ids = {pr.id for pr in prompts}
    already = len(ids & set(read_answers(out_path)))
    http = CompletionClient(
        base_url,
        model_name,
        concurrency=client.concurrency,
        timeout_s=client.timeout_s,
        retries=client.retries,
    )
    with tqdm(
        total=len(prompts), initial=already, desc=model_name, mininterval=1.0, disable=not progress
    ) as bar:
        return http.complete(
            [pr.request() for pr in prompts],
            out_path,
            max_tokens=client.max_tokens,
            temperature=client.temperature,
            on_result=lambda _row: bar.update(1),
        )
