"""Evaluation: dataset → benchmark items → prompts (training's chat format) → context filter → scores.

Every row asked for is accounted for: a benchmark adapter (``dsr1kit.benchmarks``) reads each row of the
set's own schema into an item or excludes it with a reason (no gold, needs an image, unreadable), and
questions whose prompt plus ``max_new_tokens`` do not fit the served context are excluded "over the
context" — so every score is "scored on n of N" with N every row asked for, as the recipe learned with
HLE (a subset score is not the benchmark's score). Prompts are the served prompts training labels after
(`data.render`), and answers are read by `answers.parse_row`: never from the reasoning, by rules whose
use is counted, "unparseable" (scored wrong) when none reads one. Each item is scored as its benchmark's
owners score it: choice on the option letter, math for equivalence (math-verify), others by normalised
exact match.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..benchmarks import CHOICE, JUDGED, MATH, OVER_CONTEXT, Adapted, ExcludedRow, Item, adapt
from ..benchmarks.item import count_reasons
from ..benchmarks.math_equiv import all_equivalent, equivalent
from ..benchmarks.registry import adapter_by_repo
from ..data.chat import to_messages
from ..data.render import opens_reasoning, served_prompt, think_token_ids
from ..run.paths import resolve
from .answers import TRUNCATED as UNPARSEABLE_TRUNCATED
from .answers import UNPARSEABLE, normalize, parse_row, ran_out_thinking, sample_id, thinking_of
from .client import ClientConfig, CompletionClient, Request, read_answers

Z95 = 1.959964
NO_JUDGE = "no judge: exact match"


@dataclass
class Prompt:
    id: str
    token_ids: list[int]
    gold: str | list[str]
    category: str
    kind: str = "exact"  # how it is scored: choice, exact, math or judged (dsr1kit.benchmarks)
    options: list[str] = field(default_factory=list)
    reasoning_open: bool = (
        False  # the served prompt opened <think>: a completion without </think> is truncated
    )
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    question: str = ""  # the question as asked (a judge reads it beside the answer)
    messages: list[dict] = field(
        default_factory=list
    )  # the chat the token ids render (the chat route's prompt)
    think_ids: tuple[int, int] | None = None  # <think>, </think> as single tokens of the served vocabulary

    @property
    def n_options(self) -> int:
        """Options the answer is read among: the lettered ones, or those inside an HLE question."""
        return len(self.options) if self.kind == CHOICE else int(self.meta.get("n_choices", 0))

    def request(self, chat: bool = False) -> Request:
        """As token ids (``/v1/completions``), or ``chat``: as messages the server renders with the model's
        template (``/v1/chat/completions``, where a reasoning parser splits the reasoning off)."""
        prompt = self.messages if chat else self.token_ids
        return Request(self.id, prompt, {"meta": self.meta} if self.meta else {})


@dataclass
class ContextFilter:
    kept: list[Prompt]
    excluded: list[ExcludedRow]  # reason "over the context", the prompt's length in the detail
    budget: int  # max prompt tokens allowed

    @property
    def total(self) -> int:
        return len(self.kept) + len(self.excluded)

    def describe(self) -> str:
        return (
            f"{len(self.kept)} of {self.total} prompts fit: {len(self.excluded)} excluded because prompt + "
            f"max_new_tokens exceeds max_model_len (prompt budget {self.budget} tokens)"
        )


def dataset_names(dataset: str) -> list[str]:
    names = [part.strip() for part in dataset.split(",") if part.strip()]
    if not names:
        raise ValueError(
            "eval_dataset is empty: give a JSONL file or hub dataset, or several comma-separated"
        )
    return names


def load_sets(dataset: str, limit: int = 0) -> list[tuple[str, list[dict[str, Any]]]]:
    """Rows of one or more evaluation sets, comma-separated: each a local JSONL file or a hub dataset
    ``org/name[/config][@split]`` (the split its benchmark scores when none is named, else ``test``), at
    most `limit` rows from each (0: all).

    Several sets make one evaluation whose per-category table keeps them apart (e.g. the new task and
    the old one); ids must be unique across them, since answers are saved and resumed by id.
    """
    return [(name, _load_one(name, limit)) for name in dataset_names(dataset)]


def load_items(dataset: str, limit: int = 0) -> Adapted:
    """Every row asked for, read by its benchmark's adapter: the items to ask and the rows excluded."""
    return adapt(load_sets(dataset, limit))


def items_of(rows: list[dict[str, Any]], name: str = "") -> list[Item]:
    """Rows already in memory (the kit's schema or a hub one) as items; excluded rows are dropped."""
    return adapt([(name, rows)]).items


def _load_one(dataset: str, limit: int) -> list[dict[str, Any]]:
    path = resolve(dataset)
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        from datasets import load_dataset

        spec, _, split = dataset.partition("@")
        parts = spec.split("/")
        repo, config = "/".join(parts[:2]), "/".join(parts[2:]) or None
        known = adapter_by_repo(repo)
        split = split or (known.default_split if known else "test")
        rows = [dict(r) for r in load_dataset(repo, config, split=split)]
    return rows[:limit] if limit else rows


def system_for(item: Item, system_prompt: str) -> str:
    """The system turn: the run's system prompt, then the answer format the benchmark asks for (HLE's)."""
    return "\n\n".join(part for part in (system_prompt, item.instructions) if part)


def build_prompts(items: list[Item], tokenizer, system_prompt: str) -> list[Prompt]:
    """Token ids of each item's served chat prompt (system + user, generation prompt added) and its gold."""
    prompts = []
    think_ids = think_token_ids(tokenizer)
    for item in items:
        messages = to_messages(item.to_row(), system_for(item, system_prompt), with_answer=False)
        text, ids = served_prompt(tokenizer, messages)
        prompts.append(
            Prompt(
                item.id,
                ids,
                item.gold,
                item.category,
                item.kind,
                list(item.options),
                opens_reasoning(text),
                item.source,
                dict(item.meta),
                item.question,
                messages,
                think_ids,
            )
        )
    return prompts


def filter_by_context(prompts: list[Prompt], max_model_len: int, max_new_tokens: int) -> ContextFilter:
    budget = max_model_len - max_new_tokens
    kept = [p for p in prompts if len(p.token_ids) <= budget]
    excluded = [
        ExcludedRow(p.id, OVER_CONTEXT, f"{len(p.token_ids)} prompt tokens > {budget}", p.source, p.category)
        for p in prompts
        if len(p.token_ids) > budget
    ]
    return ContextFilter(kept, excluded, budget)


@dataclass
class Accounting:
    """N rows asked for = scored + excluded (each with its reason); the per-category N of the tables."""

    kept: list[Prompt]
    excluded: list[ExcludedRow]
    asked: int

    def __post_init__(self):
        if len(self.kept) + len(self.excluded) != self.asked:
            raise AssertionError(
                f"{self.asked} rows asked for but {len(self.kept)} scored + {len(self.excluded)} excluded"
            )

    def totals(self) -> dict[str, int]:
        """N per category: every row asked for, excluded ones included."""
        return dict(Counter([p.category for p in self.kept] + [e.category for e in self.excluded]))

    def reason_counts(self) -> dict[str, int]:
        return count_reasons(self.excluded)

    def describe(self) -> str:
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(self.reason_counts().items()))
        return f"scored on {len(self.kept)} of {self.asked}" + (f"; excluded: {reasons}" if reasons else "")


def account(adapted: Adapted, context: ContextFilter) -> Accounting:
    return Accounting(context.kept, adapted.excluded + context.excluded, adapted.asked)


# -- answers


def is_correct(prompt: Prompt, answer: str | dict) -> tuple[bool, str, str]:
    """(correct, extracted prediction, rule that read it) for one generation (its text, or its answer row),
    scored by the item's kind."""
    n_options = prompt.n_options
    row = {"text": answer} if isinstance(answer, str) else answer
    parsed = parse_row(row, n_options, prompt.options, prompt.reasoning_open)
    if parsed.value is None:
        return False, "", parsed.rule
    gold = prompt.gold
    if n_options:
        ok = parsed.value == str(gold).strip().upper()[:1]
    elif prompt.kind == MATH:
        ok = all_equivalent(parsed.value, gold if isinstance(gold, list) else [gold])
    elif prompt.kind == JUDGED:
        ok = normalize(parsed.value) == normalize(gold) or equivalent(parsed.value, str(gold))
    else:
        ok = normalize(parsed.value) == normalize(gold)
    rule = f"{parsed.rule} ({NO_JUDGE})" if prompt.kind == JUDGED else parsed.rule
    return ok, parsed.value, rule


def sample_requests(prompts: list[Prompt], client: ClientConfig) -> list[Request]:
    """k requests per question (k = ``client.samples``), sample j with its own seed ``client.seed + j``
    (recorded beside its answer) whenever the client samples; each is keyed by ``sample_id``."""
    sampling = client.temperature > 0
    requests = []
    for p in prompts:
        for j in range(client.samples):
            req = p.request(client.chat)
            req.id = sample_id(p.id, j, client.samples)
            if client.samples > 1:
                req.record = {**req.record, "question": p.id, "sample": j}
            if sampling:
                req.params = {
                    "seed": client.seed + j,
                    **({"top_p": client.top_p} if client.top_p < 1 else {}),
                }
                req.record = {**req.record, "seed": client.seed + j}
            requests.append(req)
    return requests


def _judged(judgments: dict[str, Any], prompt_id: str) -> tuple[bool, str, str]:
    if prompt_id not in judgments:
        return False, "", "not judged"
    judgment = judgments[prompt_id]
    if judgment is None:
        return False, "", "judge output unreadable"
    return judgment.correct, judgment.extracted, "judge"


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


def score(
    prompts: list[Prompt],
    answers: dict[str, dict],
    total_by_category: dict[str, int] | None = None,
    judgments: dict[str, Any] | None = None,
    samples: int = 1,
):
    """Per-sample DataFrame (one row per question and sample) and a per-category accuracy table (with 'all')
    carrying n of N and the 95% CI.

    ``total_by_category`` is N, every row asked for; samples with no answer count as wrong. ``judgments``
    (sample id → ``judge.Judgment``, None where the judge's output did not parse) decide the judged rows.
    With k = ``samples`` > 1 the accuracy is pass@1: the mean over questions of the fraction of a question's
    k samples that are correct, with the normal 95% interval of those per-question means (the question is
    the unit: k samples of one question are not k questions), and cons@k (the majority answer's
    correctness) where answers are choices or math.
    """
    import pandas as pd

    rows = []
    for p in prompts:
        for j in range(samples):
            key = sample_id(p.id, j, samples)
            ans = answers.get(key) or {}
            ok, pred, rule = is_correct(p, ans) if ans else (False, "", "no answer")
            judged = p.kind == JUDGED and judgments is not None
            if ans and judged and not rule.startswith(UNPARSEABLE_TRUNCATED):
                ok, pred, rule = _judged(judgments, key)
            rows.append(
                {
                    "id": p.id,
                    "sample": j,
                    "kind": p.kind,
                    "category": p.category,
                    "gold": ", ".join(p.gold) if isinstance(p.gold, list) else p.gold,
                    "prediction": pred,
                    "correct": ok,
                    "rule": rule,
                    "answered": bool(ans) and not ans.get("error"),
                    "ran_out_thinking": bool(ans) and ran_out_thinking(ans, p.reasoning_open),
                    "text": ans.get("text", ""),
                    "thinking": thinking_of(ans, p.reasoning_open) if ans else "",
                    "prompt_tokens": len(p.token_ids),
                    "served_prompt_tokens": ans.get("prompt_tokens", 0),
                }
            )
    columns = ["id", "sample", "kind", "category", "gold", "prediction", "correct", "rule", "answered"]
    columns += ["ran_out_thinking", "text", "thinking", "prompt_tokens", "served_prompt_tokens"]
    per_example = pd.DataFrame(rows, columns=columns)
    questions = per_example[per_example["sample"] == 0]
    totals = dict(total_by_category or questions.groupby("category").size().to_dict())
    table = []
    groups = [("all", per_example)] + sorted(per_example.groupby("category"), key=lambda g: g[0])
    for name, df in groups:
        n, k = df["id"].nunique(), int(df["correct"].sum())
        big_n = sum(totals.values()) if name == "all" else totals.get(name, n)
        accuracy, (lo, hi) = pass_at_1(df, samples)
        row = {
            "category": name,
            "accuracy": accuracy,
            "ci95_low": lo,
            "ci95_high": hi,
            "correct": k,
            "ran_out_thinking": int(df["ran_out_thinking"].sum()),
            "n": n,
            "N": big_n,
            "scored_on": f"{n} of {big_n}" + (f" × {samples} samples" if samples > 1 else ""),
        }
        if samples > 1:
            row.update(samples=samples, cons_at_k=consensus(df))
        table.append(row)
    return per_example, pd.DataFrame(table)


def pass_at_1(per_sample, samples: int) -> tuple[float, tuple[float, float]]:
    """(pass@1, its 95% interval) over the questions of ``per_sample``: with one sample, the accuracy and its
    Wilson interval; with k, the mean of the per-question fractions correct and the normal interval of that
    mean (clipped to [0, 1]; a single question has none)."""
    n = per_sample["id"].nunique()
    if n == 0:
        return float("nan"), (float("nan"), float("nan"))
    if samples == 1:
        k = int(per_sample["correct"].sum())
        return k / n, wilson(k, n)
    per_question = per_sample.groupby("id", sort=False)["correct"].mean()
    mean = float(per_question.mean())
    if n < 2:
        return mean, (float("nan"), float("nan"))
    half = Z95 * float(per_question.std(ddof=1)) / math.sqrt(n)
    return mean, (max(0.0, mean - half), min(1.0, mean + half))


def consensus(per_sample) -> float:
    """cons@k: the fraction of questions whose most common answer among their k samples is correct (ties to
    the answer seen first; unread answers do not vote); NaN where no question is a choice or math one."""
    votable = per_sample[per_sample["kind"].isin([CHOICE, MATH])]
    if votable.empty:
        return float("nan")
    right = 0
    for _, df in votable.groupby("id", sort=False):
        read = df[df["prediction"] != ""]
        if read.empty:
            continue
        top = Counter(read["prediction"]).most_common(1)[0][0]
        right += bool(read[read["prediction"] == top]["correct"].iloc[0])
    return right / votable["id"].nunique()


def rule_counts(per_example) -> dict[str, int]:
    """How many answers each rule read (and how many were unparseable or missing)."""
    return {str(k): int(v) for k, v in per_example["rule"].value_counts().sort_index().items()}


def unparseable(per_example):
    """The rows no rule could read, with their text: what a reader checks before trusting the score."""
    return per_example[per_example["rule"].str.startswith(UNPARSEABLE)][["id", "gold", "rule", "text"]]


def results_path(run_dir: str | Path, label: str) -> Path:
    return Path(run_dir) / "answers" / f"{label}.jsonl"


def run_eval(
    base_url: str,
    model_name: str,
    prompts: list[Prompt],
    out_path: str | Path,
    client: ClientConfig,
    progress: bool = True,
    on_result=None,
):
    """Ask the server for every (question, sample) not yet answered in out_path (tqdm progress; ``on_result``
    also sees each answer row as it is written); return the client Stats."""
    from tqdm import tqdm

    requests = sample_requests(prompts, client)
    ids = {r.id for r in requests}
    already = len(ids & set(read_answers(out_path)))
    http = CompletionClient(
        base_url,
        model_name,
        concurrency=client.concurrency,
        timeout_s=client.timeout_s,
        retries=client.retries,
        key_env=client.key_env,
        chat=client.chat,
        think_ids=prompts[0].think_ids if prompts else None,
    )
    with tqdm(
        total=len(requests), initial=already, desc=model_name, mininterval=1.0, disable=not progress
    ) as bar:

        def each(row):
            bar.update(1)
            if on_result:
                on_result(row)

        return http.complete(
            requests, out_path, max_tokens=client.max_tokens, temperature=client.temperature, on_result=each
        )
