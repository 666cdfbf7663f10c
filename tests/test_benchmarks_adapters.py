"""Benchmark adapters on rows in each hub schema, resolved by repo id from an offline hub cache: each row
is an item scored as the benchmark's owners score it, or an excluded row with its reason, and the counts
add up to every row asked for."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from benchmark_rows import GPQA, HLE, MEDMCQA, MMLU, OLYMPIADBENCH, write_all

from dsr1kit import benchmarks as B
from dsr1kit.benchmarks.gpqa import order_for
from dsr1kit.benchmarks.registry import training_rows
from dsr1kit.data.chat import to_messages
from dsr1kit.infer import evaluate as ev

EXPECTED = {  # dataset spec → (adapter, items, excluded reasons)
    "cais/mmlu/all": ("MMLU", 4, {B.UNREADABLE: 1}),
    "openlifescienceai/medmcqa": ("MedMCQA", 2, {}),  # validation: the split MedMCQA is scored on
    "openlifescienceai/medmcqa@test": ("MedMCQA", 0, {B.NO_GOLD: 1}),
    "Idavidrein/gpqa/gpqa_diamond": ("GPQA", 6, {}),
    "cais/hle": ("HLE", 2, {B.NEEDS_IMAGE: 1}),
    "TIGER-Lab/MMLU-Pro": ("MMLU-Pro", 1, {}),
    "HuggingFaceH4/MATH-500": ("MATH-500", 2, {}),
    "HuggingFaceH4/aime_2024": ("AIME", 1, {}),
    "Hothan/OlympiadBench": ("OlympiadBench", 1, {B.NO_GOLD: 1, B.NEEDS_IMAGE: 1}),
}


@pytest.fixture(scope="module")
def hub() -> Path:
    """The sets in the hub cache the tests read offline (conftest's HF_HOME), as a cluster's cache holds them."""
    home = Path(os.environ["HF_HOME"])
    write_all(home)
    return home


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.mark.parametrize("spec", list(EXPECTED))
def test_each_hub_schema_is_read_by_its_adapter_and_every_row_counted(hub, spec):
    name, n_items, reasons = EXPECTED[spec]
    adapted = ev.load_items(spec)
    assert adapted.adapters == {spec: name}
    assert len(adapted.items) == n_items and adapted.reason_counts() == reasons
    assert adapted.asked == n_items + sum(reasons.values())


def test_mmlu_and_medmcqa_golds_are_letters_and_their_answers_score_right(hub, tokenizer):
    """MMLU's int answer and MedMCQA's cop become the option letter: the right letter is scored right."""
    items = ev.load_items("cais/mmlu/all,openlifescienceai/medmcqa").items
    assert [i.gold for i in items] == ["B", "C", "A", "A", "C", "A"]
    assert items[4].options == ["A", "B12", "C", "D"] and items[4].rationale.startswith("Scurvy")
    assert [i.category for i in items[:2]] == ["elementary_mathematics", "anatomy"]
    prompts = ev.build_prompts(items, tokenizer, "")
    answers = {p.id: {"text": f"<answer>\n{p.gold}\n</answer>"} for p in prompts}
    answers[prompts[0].id] = {"text": "The answer is A."}  # one wrong
    per_example, table = ev.score(prompts, answers)
    assert per_example["correct"].tolist() == [False, True, True, True, True, True]
    assert table.iloc[0]["correct"] == 5


def test_gpqa_options_are_shuffled_by_row_id_and_the_order_is_recorded(hub):
    items = ev.load_items("Idavidrein/gpqa/gpqa_diamond").items
    for item, row in zip(items, GPQA["train"]):
        assert item.id == row["Record ID"]
        assert item.options[B.item.LETTERS.index(item.gold)] == row["Correct Answer"]
        assert item.meta["option_order"][B.item.LETTERS.index(item.gold)] == "Correct Answer"
        assert order_for(item.id) == order_for(item.id)  # the same every run
    assert len({i.gold for i in items}) > 1  # the correct answer is not always in one place
    prompt = ev.Prompt(items[0].id, [1], items[0].gold, "x", B.CHOICE, items[0].options, meta=items[0].meta)
    assert prompt.request().record == {"meta": {"option_order": items[0].meta["option_order"]}}


def test_hle_keeps_text_rows_with_its_answer_format_and_excludes_image_rows(hub, tokenizer):
    adapted = ev.load_items("cais/hle")
    exact, choice = adapted.items
    assert (exact.kind, choice.kind) == (B.JUDGED, B.JUDGED)
    assert "Exact Answer:" in exact.instructions and "Answer:" in choice.instructions
    assert choice.meta == {"answer_type": "multipleChoice", "n_choices": 3}
    assert [(e.id, e.reason, e.category) for e in adapted.excluded] == [
        ("h-3", B.NEEDS_IMAGE, "Biology/Medicine")
    ]
    prompts = ev.build_prompts(adapted.items, tokenizer, "")
    assert "Confidence:" in tokenizer.decode(prompts[0].token_ids)  # the format is in the system turn
    answers = {
        "h-1": {"text": "Explanation: 2 is the least.\nExact Answer: 2\nConfidence: 90%"},
        "h-2": {"text": "Explanation: neon is inert.\nAnswer: A\nConfidence: 80%"},
    }
    per_example, _ = ev.score(prompts, answers)
    assert per_example["correct"].tolist() == [True, True]
    assert all(ev.NO_JUDGE in rule for rule in per_example["rule"])  # says it was not judged


def test_math_rows_are_scored_for_equivalence_and_every_final_answer_counts(hub, tokenizer):
    items = ev.load_items("HuggingFaceH4/MATH-500,Hothan/OlympiadBench").items
    assert [i.kind for i in items] == [B.MATH] * 3
    assert items[0].id == "test/prealgebra/1.json" and items[2].gold == ["2", "-2"]
    prompts = ev.build_prompts(items, tokenizer, "")
    answers = {
        prompts[0].id: {"text": r"<think>1/2 + 1/4</think>The answer is $\boxed{0.75}$"},
        prompts[1].id: {"text": r"\boxed{x = 3}"},
        prompts[2].id: {"text": r"\boxed{-2, 2}"},
    }
    per_example, _ = ev.score(prompts, answers)
    assert per_example["correct"].tolist() == [True, True, True]
    answers[prompts[2].id] = {"text": r"\boxed{2}"}  # one of two answers is not the answer
    assert ev.score(prompts, answers)[0]["correct"].tolist() == [True, True, False]


def test_every_row_asked_for_is_scored_or_excluded_with_its_reason(hub, tokenizer):
    """N counts every row: the adapters' exclusions and the context filter's, per category too."""
    adapted = ev.load_items("cais/hle,Hothan/OlympiadBench,openlifescienceai/medmcqa@test")
    prompts = ev.build_prompts(adapted.items, tokenizer, "")
    longest = max(len(p.token_ids) for p in prompts)
    ctx = ev.filter_by_context(prompts, max_model_len=longest - 1 + 8, max_new_tokens=8)
    accounting = ev.account(adapted, ctx)
    assert accounting.asked == len(HLE["test"]) + len(OLYMPIADBENCH["train"]) + len(MEDMCQA["test"]) == 7
    assert accounting.reason_counts() == {B.NEEDS_IMAGE: 2, B.NO_GOLD: 2, B.OVER_CONTEXT: 1}
    assert len(accounting.kept) + len(accounting.excluded) == 7
    _, table = ev.score(accounting.kept, {}, accounting.totals())
    assert table.iloc[0]["scored_on"] == f"{len(accounting.kept)} of 7"
    assert "excluded: 2 needs an image, 2 no gold, 1 over the context" in accounting.describe()
    with pytest.raises(AssertionError, match="asked for"):
        ev.Accounting(accounting.kept, accounting.excluded[1:], 7)


def test_a_schema_no_adapter_reads_is_refused_naming_its_columns_and_the_adapters():
    with pytest.raises(B.UnknownSchema) as err:
        B.adapt([("data/mine.jsonl", [{"prompt_text": "q", "label": 1}])])
    message = str(err.value)
    assert "['label', 'prompt_text']" in message
    assert all(name in message for name in ("MMLU", "MedMCQA", "GPQA", "HLE", "MATH-500", "kit jsonl"))
    with pytest.raises(B.UnknownSchema, match="the MedMCQA adapter needs columns"):
        B.adapt([("openlifescienceai/medmcqa", [{"question": "q", "answer": "x"}])])


def test_rows_in_a_hub_schema_are_read_by_their_columns_when_the_name_says_nothing():
    rows = [dict(MMLU["test"][0], id="local-1")]
    adapted = B.adapt([("data/my_mmlu_copy.jsonl", rows)])
    assert adapted.adapters == {"data/my_mmlu_copy.jsonl": "MMLU"} and adapted.items[0].gold == "B"


def test_a_hub_medmcqa_row_trains_as_options_to_letter_with_its_explanation_as_reasoning():
    rows = [
        dict(r, _source=f"openlifescienceai/medmcqa@{split}")
        for split in ("validation", "test")
        for r in MEDMCQA[split]
    ]
    train = training_rows(rows)
    messages = to_messages(train[0], "sys")
    assert messages[1]["content"].endswith("Options:\nA. A\nB. B12\nC. C\nD. D")
    assert (
        messages[2]["content"] == "<think>\nScurvy is vitamin C deficiency.\n</think>\n<answer>\nC\n</answer>"
    )
    assert to_messages(train[1], "sys")[2]["content"] == "<answer>\nA\n</answer>"  # no exp: the answer alone
    assert to_messages(train[2], "sys") is None and train[2]["_excluded"].startswith(B.NO_GOLD)
    assert [r["_source"] for r in train] == [r["_source"] for r in rows]  # counted per source
