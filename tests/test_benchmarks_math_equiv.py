"""Math answers checked for equivalence with math-verify, as the math sets' owners check them: a table of
pairs that must and must not match, with the answer read out of a completion first."""

from __future__ import annotations

import pytest

from dsr1kit.benchmarks.math_equiv import all_equivalent, equivalent
from dsr1kit.infer.answers import parse_answer

SAME = [
    ("0.5", r"\frac{1}{2}"),  # fraction vs decimal
    (r"\dfrac{1}{2}", r"\frac12"),
    ("x = 3", "3"),  # an equation names its value
    (r"\{2,1\}", r"\{1,2\}"),  # sets ignore order
    ("(0,1]", "(0,1]"),  # intervals
    (r"\boxed{\frac{3}{4}}", "0.75"),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),  # nested braces inside \boxed{}
    ("10 cm", "10"),  # units dropped
    (r"50\%", "0.5"),
    (r"2\sqrt{2}", r"\sqrt{8}"),
    ("x^2+2x+1", "(x+1)^2"),
    ("(1,2)", "(1,2)"),
    ("3", "3"),
]
DIFFERENT = [
    ("6", "5"),
    ("[0,1]", "(0,1]"),  # a closed end is another interval
    ("(2,1)", "(1,2)"),  # tuples keep order
    ("1/3", "0.333"),
    ("", "1"),
    ("abc", "1"),
    (r"\frac{1}{3}", "0.5"),
]


@pytest.mark.parametrize(("prediction", "gold"), SAME)
def test_equivalent_answers_match(prediction, gold):
    assert equivalent(prediction, gold)


@pytest.mark.parametrize(("prediction", "gold"), DIFFERENT)
def test_different_answers_do_not(prediction, gold):
    assert not equivalent(prediction, gold)


def test_several_final_answers_all_in_any_order_nothing_extra():
    assert all_equivalent("2, 3", ["3", "2"])
    assert all_equivalent(r"\frac{1}{2}, 4", ["0.5", "4"])
    assert not all_equivalent("2", ["3", "2"])
    assert not all_equivalent("2, 3, 4", ["3", "2"])
    assert all_equivalent("(1, 2), 3", ["3", "(1,2)"])  # commas inside a tuple are not a split


def test_the_answer_is_read_from_the_completion_then_compared():
    text = r"<think>Maybe 1/3? No: the sum is \frac{2}{4}.</think>So the answer is $\boxed{\frac{2}{4}}$."
    parsed = parse_answer(text)
    assert parsed.rule == "boxed" and equivalent(parsed.value, "0.5")
    assert not equivalent(parse_answer("<think>0.5</think>").value or "", "0.5")  # never from the reasoning
