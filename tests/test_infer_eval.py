"""Evaluation pieces without a server: prompts, context filter, answer extraction, intervals, scoring."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from dsr1kit.infer import evaluate as ev
from dsr1kit.infer.answers import parse_answer
from dsr1kit.infer.client import read_answers


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return ev.build_prompts(ev.load_items("data/eval_tiny.jsonl").items, tokenizer, "You are DeepSeek-R1.")


def test_prompts_use_the_training_chat_format(tokenizer, prompts):
    from dsr1kit.data.chat import to_messages

    row = ev.load_items("data/eval_tiny.jsonl").items[0]
    text = tokenizer.decode(prompts[0].token_ids)
    assert text == tokenizer.apply_chat_template(
        to_messages(row.to_row(), "You are DeepSeek-R1.", with_answer=False),
        tokenize=False,
        add_generation_prompt=True,
    )
    assert len(prompts) == 96 and text.endswith("<|assistant|>")


def test_context_filter_counts_and_lists_excluded_ids(prompts):
    lengths = sorted(len(p.token_ids) for p in prompts)
    budget = lengths[len(lengths) // 2]  # half of the prompts (or so) do not fit
    ctx = ev.filter_by_context(prompts, max_model_len=budget + 8, max_new_tokens=8)
    too_long = {p.id for p in prompts if len(p.token_ids) > budget}
    assert 0 < len(too_long) < len(prompts)
    assert {e.id for e in ctx.excluded} == too_long and {e.reason for e in ctx.excluded} == {
        "over the context"
    }
    assert len(ctx.kept) + len(ctx.excluded) == ctx.total == 96
    assert ctx.describe().startswith(f"{96 - len(too_long)} of 96 prompts fit")


def test_scores_report_n_of_big_n_after_filtering(prompts):
    ctx = ev.filter_by_context(prompts, max_model_len=10_000, max_new_tokens=8)
    kept = ctx.kept[:60]
    answers = {p.id: {"text": f"<answer>\n{p.gold}\n</answer>"} for p in kept[:30]}
    _, table = ev.score(kept, answers, dict(Counter(p.category for p in prompts)))
    overall = table.iloc[0]
    assert (overall["category"], overall["n"], overall["N"], overall["correct"]) == ("all", 60, 96, 30)
    assert overall["scored_on"] == "60 of 96"
    assert set(table["category"]) == {"all", "arithmetic", "words", "geography"}


@pytest.mark.parametrize(
    "text,expected",
    [
        ("<think>\nhmm\n</think>\n<answer>\n113\n</answer>", "113"),
        ("<answer>1</answer> then <answer> 2 </answer>", "2"),
        ("<answer>\nParis", "Paris"),  # cut by max_new_tokens: unclosed block counts
        ("no tags at all", "no tags at all"),
    ],
)
def test_free_form_answer(text, expected):
    assert parse_answer(text).value == expected


@pytest.mark.parametrize(
    "answer,letter",
    [("B", "B"), ("(C)", "C"), ("D. Paris", "D"), ("paris", "D"), ("The answer is A", "A"), ("E", None)],
)
def test_multiple_choice_letters(answer, letter):
    assert parse_answer(f"<answer>{answer}</answer>", 4, ["Rome", "Oslo", "Lima", "Paris"]).value == letter


def test_exact_match_ignores_case_space_and_trailing_punctuation():
    p = ev.Prompt("x", [1], "Tenalp", "words")
    assert ev.is_correct(p, "<answer>  tenalp. </answer>")[0]
    assert not ev.is_correct(p, "<answer>tenal</answer>")[0]


@pytest.mark.parametrize(
    "k,n,lo,hi",
    [(0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634), (10, 10, 0.7225, 1.0), (81, 96, 0.7581, 0.9030)],
)
def test_wilson_interval(k, n, lo, hi):
    got = ev.wilson(k, n)
    assert got[0] == pytest.approx(lo, abs=1e-4) and got[1] == pytest.approx(hi, abs=1e-4)


def test_read_answers_ignores_a_torn_last_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"id": "a", "text": "x"}) + "\n" + '{"id": "b", "te')
    assert list(read_answers(path)) == ["a"]
