"""Make the small local datasets shipped in ``data/`` (no downloads, deterministic).

``python -m dsr1kit.data.synthetic data`` rewrites:

- ``sft_tiny.jsonl``: a few hundred SFT rows, multiple-choice and free-form,
  with a rationale in ``cot``, ``rationale`` or ``explanation`` (the three
  names real datasets use) and options in ``choices`` or ``options``; some rows
  have no rationale at all.
- ``eval_tiny.jsonl``: held-out questions of the same kinds, with a category.
- ``retain_tiny.jsonl``: plain sentences unrelated to the SFT tasks, used to
  measure how far an adapter moved the model on text it was not trained on.
- ``task_a_eval.jsonl``, ``task_b_train.jsonl``, ``task_b_eval.jsonl``: the
  forgetting experiment (notebook 40). Task A names the *first* word of a
  list, task B the *last*: the same question shape, vocabulary and answer
  format, so learning B can overwrite A. Lists are drawn at random, so the
  evaluation rows are new lists, not repeats of training rows. The tiny
  model is pre-trained on A and on two other phrasings ("starts the list",
  "ends the list"), never on B: it does A and cannot yet do B, though it can
  find a last word.
- ``task_a_prompts.jsonl``: A-style questions without answers, the prompts whose
  answers the base model itself gives for replay (notebook 40's ``replay``
  method); a question that is also a held-out row is dropped when replayed.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

CAPITALS = {
    "France": "Paris",
    "Japan": "Tokyo",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Norway": "Oslo",
    "Poland": "Warsaw",
    "Greece": "Athens",
    "Canada": "Ottawa",
    "Cuba": "Havana",
    "Iran": "Tehran",
    "Ireland": "Dublin",
    "Austria": "Vienna",
    "Portugal": "Lisbon",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Hungary": "Budapest",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Mexico": "Mexico City",
    "Argentina": "Buenos Aires",
    "Colombia": "Bogota",
    "Turkey": "Ankara",
    "India": "New Delhi",
    "China": "Beijing",
    "Germany": "Berlin",
    "Russia": "Moscow",
}
FRUITS = ["apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "pear", "plum", "melon"]
OBJECTS = ["table", "hammer", "window", "pencil", "bottle", "ladder", "carpet", "wallet", "kettle", "mirror"]
WORDS = ["river", "planet", "garden", "silver", "number", "dragon", "window", "castle", "forest", "rocket"]
RETAIN_SUBJECTS = [
    "The old mill",
    "A small boat",
    "The night train",
    "Our neighbour",
    "The library",
    "A quiet village",
    "The orchestra",
    "The mountain road",
    "An early frost",
    "The market",
]
RETAIN_VERBS = [
    "stood beside",
    "drifted past",
    "waited near",
    "looked over",
    "rested under",
    "echoed through",
    "moved along",
    "faded behind",
    "shone above",
    "opened onto",
]
RETAIN_PLACES = [
    "the harbour",
    "the valley",
    "the bridge",
    "the meadow",
    "the station",
    "the cathedral",
    "the lake",
    "the square",
    "the hills",
    "the coast",
]
RATIONALE_KEYS = ("cot", "rationale", "explanation")


def _addition(rng: random.Random) -> dict:
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    return {
        "question": f"What is {a} + {b}?",
        "answer": str(a + b),
        "cot": f"Add {a} and {b}: {a} + {b} = {a + b}.",
        "category": "arithmetic",
    }


def _subtraction(rng: random.Random) -> dict:
    a, b = sorted((rng.randint(2, 90), rng.randint(2, 90)), reverse=True)
    return {
        "question": f"What is {a} - {b}?",
        "answer": str(a - b),
        "cot": f"Subtract {b} from {a}: {a} - {b} = {a - b}.",
        "category": "arithmetic",
    }


def _reverse(rng: random.Random) -> dict:
    w = rng.choice(WORDS)
    return {
        "question": f"Spell the word '{w}' backwards.",
        "answer": w[::-1],
        "cot": f"The letters of {w} are {' '.join(w)}; reversed they read {' '.join(w[::-1])}.",
        "category": "words",
    }


def _mcq(question: str, right: str, wrong: list[str], rng: random.Random, cot: str, category: str) -> dict:
    options = [right] + wrong
    rng.shuffle(options)
    letter = "ABCDEFGH"[options.index(right)]
    return {
        "question": question,
        "choices": options,
        "answer": letter,
        "cot": f"{cot} So the answer is {letter}.",
        "category": category,
    }


def _capital(rng: random.Random) -> dict:
    country = rng.choice(sorted(CAPITALS))
    wrong = rng.sample([c for k, c in sorted(CAPITALS.items()) if k != country], 3)
    return _mcq(
        f"What is the capital of {country}?",
        CAPITALS[country],
        wrong,
        rng,
        f"The capital of {country} is {CAPITALS[country]}.",
        "geography",
    )


def _fruit(rng: random.Random) -> dict:
    fruit = rng.choice(FRUITS)
    return _mcq(
        "Which of these is a fruit?",
        fruit,
        rng.sample(OBJECTS, 3),
        rng,
        f"A {fruit} is a fruit; the others are objects.",
        "words",
    )


def _larger(rng: random.Random) -> dict:
    nums = rng.sample(range(10, 999), 4)
    best = max(nums)
    return _mcq(
        "Which number is the largest?",
        str(best),
        [str(n) for n in nums if n != best],
        rng,
        f"Comparing {', '.join(map(str, nums))}, the largest is {best}.",
        "arithmetic",
    )


MAKERS = (_addition, _subtraction, _reverse, _capital, _fruit, _larger)
LIST_WORDS = sorted(set(WORDS + FRUITS + OBJECTS))
# Position questions: (question, index of the answer in the list). A and B are the forgetting experiment's
# tasks; S and E ask the same two things in other words, and only the tiny model's pre-training sees them,
# so the base model knows how to find the last word (E) but not that "comes last" (B) asks for it.
# The list is one word per line, so each word is spelled with the same tokens as in the answer block
# (a word after a space is another token): the answer is a copy, and the question says which word to copy.
POSITION_TASKS = {
    "A": ("Which word comes first in this list?\n{}", 0),
    "B": ("Which word comes last in this list?\n{}", -1),
    "S": ("Which word starts this list?\n{}", 0),
    "E": ("Which word ends this list?\n{}", -1),
}


def make_position_rows(task: str, n: int, seed: int) -> list[dict]:
    """n rows of a position task (see POSITION_TASKS): 3 to 5 distinct words, answer block only."""
    rng = random.Random(seed)
    question, index = POSITION_TASKS[task]
    rows = []
    for i in range(n):
        words = rng.sample(LIST_WORDS, rng.randint(3, 5))
        rows.append(
            {
                "id": f"task{task.lower()}-{seed}-{i:04d}",
                "question": question.format("\n".join(words)),
                "answer": words[index],
                "category": f"task {task}",
            }
        )
    return rows


def make_rows(n: int, seed: int, prefix: str) -> list[dict]:
    """n rows cycling through the task kinds, with the field-name variants real data has."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        row = MAKERS[i % len(MAKERS)](rng)
        cot = row.pop("cot")
        if i % 7 == 3:
            pass  # no rationale: the assistant gives the answer block alone
        else:
            row[RATIONALE_KEYS[i % 3]] = cot
        if "choices" in row and i % 2:
            row["options"] = row.pop("choices")
        rows.append({"id": f"{prefix}-{i:04d}", **row})
    return rows


def make_retain(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        s = [
            f"{rng.choice(RETAIN_SUBJECTS)} {rng.choice(RETAIN_VERBS)} {rng.choice(RETAIN_PLACES)}."
            for _ in range(3)
        ]
        rows.append({"id": f"retain-{i:04d}", "text": " ".join(s)})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(out_dir: str = "data") -> None:
    out = Path(out_dir)
    write_jsonl(out / "sft_tiny.jsonl", make_rows(360, seed=1, prefix="sft"))
    write_jsonl(out / "eval_tiny.jsonl", make_rows(96, seed=2, prefix="eval"))
    write_jsonl(out / "retain_tiny.jsonl", make_retain(64, seed=3))
    write_jsonl(out / "task_a_eval.jsonl", make_position_rows("A", 200, seed=21))
    write_jsonl(out / "task_b_train.jsonl", make_position_rows("B", 320, seed=31))
    write_jsonl(out / "task_b_eval.jsonl", make_position_rows("B", 200, seed=22))
    prompts = [{"id": r["id"], "question": r["question"]} for r in make_position_rows("A", 400, seed=41)]
    write_jsonl(out / "task_a_prompts.jsonl", prompts)
    print(
        f"wrote sft_tiny.jsonl, eval_tiny.jsonl, retain_tiny.jsonl, task_a_eval.jsonl, task_b_train.jsonl, "
        f"task_b_eval.jsonl, task_a_prompts.jsonl under {out}"
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
