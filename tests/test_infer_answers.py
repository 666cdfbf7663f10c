"""Reading answers out of completions as R1 writes them: never from the reasoning, never a guess."""

from __future__ import annotations

import pytest

from dsr1kit.infer import evaluate as ev
from dsr1kit.infer.answers import TRUNCATED, UNPARSEABLE, parse_answer

OPTIONS = ["Venus", "Mars", "Jupiter", "Saturn"]

# (completion after R1's served prompt "...<｜Assistant｜><think>\n", expected letter or None, rule)
R1_CASES = [
    (
        "A patient presents with A and C... I think it is Mars.\n</think>\n<answer>\nB\n</answer>",
        "B",
        "answer block",
    ),
    ("A. no. C? no.\n</think>\n\nThe answer is \\boxed{B}.", "B", "boxed"),
    ("Let me think. A is wrong.\n</think>\n\\boxed{\\text{B}}", "B", "boxed"),
    ("Option A is Venus.\n</think>\n**Answer: B**", "B", "answer is"),
    ("Hmm, A or C.\n</think>\nThe answer is (B).", "B", "answer is"),
    ("Reasoning about A.\n</think>\nAfter checking every option, Mars is red.\n\nB", "B", "last line"),
    ("Reasoning about A.\n</think>\nSo:\n(C)", "C", "last line"),
    ("I consider A, B, C and D.\n</think>\nMars", "B", "last line"),
    ("I consider A.\n</think>\n<answer>A</answer> wait, no.\n<answer>C</answer>", "C", "answer block"),
    ("Think.\n</think>\n\\boxed{A} hmm, actually \\boxed{D}", "D", "boxed"),
    ("First </think> nested? Then A.\n</think>\n<answer>B. Mars</answer>", "B", "answer block"),
    ("A patient presents with chest pain. A is likely. Let me reconsider option C and", None, TRUNCATED),
    ("Thinking about A and B", None, TRUNCATED),
    ("Done.\n</think>\nI am not sure which one, maybe A or C.", None, UNPARSEABLE),
    ("Done.\n</think>\n<answer>A or C</answer>", None, UNPARSEABLE),
    ("Done.\n</think>\nThe answer is a bit unclear to me.", None, UNPARSEABLE),
    ("Done.\n</think>\n", None, UNPARSEABLE),
    ("Done.\n</think>\nAnswer: $\\mathrm{C}$", "C", "answer is"),
]


@pytest.mark.parametrize("text,letter,rule", R1_CASES, ids=[f"case{i}" for i in range(len(R1_CASES))])
def test_r1_completions(text, letter, rule):
    parsed = parse_answer(text, len(OPTIONS), OPTIONS, reasoning_open=True)
    assert (parsed.value, parsed.rule) == (letter, rule)


@pytest.mark.parametrize(
    "text,letter,rule",
    [
        ("<answer>\nB\n</answer>", "B", "answer block"),  # the tiny model's format, no reasoning
        ("<think>\nA or C\n</think>\n<answer>(D)</answer>", "D", "answer block"),
        ("<think>\nA patient presents", None, TRUNCATED),  # an opener without a close: cut off
        ("<answer>Saturn", "D", "answer block"),  # unclosed block, option text
        ("A patient presents with pain.", None, UNPARSEABLE),  # the stray letter is never an answer
    ],
)
def test_completions_of_prompts_that_do_not_open_reasoning(text, letter, rule):
    parsed = parse_answer(text, len(OPTIONS), OPTIONS, reasoning_open=False)
    assert (parsed.value, parsed.rule) == (letter, rule)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("<answer>  tenalp. </answer>", "tenalp."),
        ("Sum it.\n</think>\nThe answer is 48.", "48"),
        ("Sum it.\n</think>\n\\boxed{48}", "48"),
    ],
)
def test_free_form_answers(text, expected):
    assert parse_answer(text, reasoning_open="</think>" in text).value == expected


def test_scores_count_unparseable_as_wrong_and_report_the_rules():
    prompts = [
        ev.Prompt(f"q{i}", [1], "B", "planets", "choice", OPTIONS, reasoning_open=True)
        for i in range(len(R1_CASES))
    ]
    answers = {p.id: {"text": text} for p, (text, _, _) in zip(prompts, R1_CASES)}
    per_example, table = ev.score(prompts, answers)
    expected_right = sum(letter == "B" for _, letter, _ in R1_CASES)
    assert table.iloc[0]["correct"] == expected_right and table.iloc[0]["n"] == len(R1_CASES)
    counts = ev.rule_counts(per_example)
    assert counts[TRUNCATED] == 2 and counts[UNPARSEABLE] == 4 and counts["boxed"] == 3
    assert sum(counts.values()) == len(R1_CASES)
    assert sorted(ev.unparseable(per_example)["id"]) == sorted(
        p.id for p, (_, letter, _) in zip(prompts, R1_CASES) if letter is None
    )
