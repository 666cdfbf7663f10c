"""Sweep points measured through a served model, for a base the host cannot load (R1): each adapter is a LoRA
module of one vLLM server, and its accuracy is the share of held-out rows whose greedily generated answer the
evaluation's own scoring reads as right. The answers are kept per adapter and set, so a measurement that
stops resumes where it stopped. KL to the base needs both models' full distributions and is not measured."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..infer.client import ClientConfig, read_answers
from ..infer.evaluate import Prompt, build_prompts, items_of, run_eval, score


@dataclass(frozen=True)
class ServedSets:
    """The held-out rows of A and B as the server is asked them (served chat prompts with their gold)."""

    a: list[Prompt]
    b: list[Prompt]


def served_sets(rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]], tokenizer, system_prompt: str):
    return ServedSets(
        build_prompts(items_of(rows_a, "task A"), tokenizer, system_prompt),
        build_prompts(items_of(rows_b, "task B"), tokenizer, system_prompt),
    )


def served_accuracy(
    base_url: str, served_name: str, prompts: list[Prompt], out_path: str | Path, client: ClientConfig
) -> float:
    """The share of ``prompts`` the model served as ``served_name`` answers right (unanswered rows are wrong)."""
    run_eval(base_url, served_name, prompts, out_path, client, progress=False)
    per_example, _ = score(prompts, read_answers(out_path))
    return float(per_example["correct"].mean()) if len(per_example) else float("nan")


def served_turns(
    base_url: str,
    served_name: str,
    rows: list[dict[str, Any]],
    tokenizer,
    system_prompt: str,
    out_path: str | Path,
    client: ClientConfig,
) -> list[str]:
    """The served model's greedy turn (text) for each row's question, in order (the replay's answers). A
    reasoning the server's parser split off (R1) is put back in front, as the model wrote it."""
    from ..data.chat import to_messages
    from ..data.render import served_prompt

    prompts = []
    for i, row in enumerate(rows):
        messages = to_messages(row, system_prompt, with_answer=False)
        _, ids = served_prompt(tokenizer, messages)
        prompts.append(Prompt(f"replay-{i:05d}", ids, "", "replay", messages=messages))
    run_eval(base_url, served_name, prompts, out_path, client, progress=False)
    answers = read_answers(out_path)
    return [whole_turn(answers.get(p.id, {})) for p in prompts]


def whole_turn(row: dict[str, Any]) -> str:
    """An answer row's turn with its reasoning: the parser's ``reasoning`` in ``<think>`` before the content."""
    text = row.get("text", "")
    if row.get("reasoning"):
        return f"<think>\n{row['reasoning'].strip()}\n</think>\n{text.strip()}"
    return text
