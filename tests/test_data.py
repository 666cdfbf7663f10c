"""Data: the dataset plan (both forms), formatting, assistant-only labels, truncation, vocab safety."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from dsr1kit.data import chat, labels, plan


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"id": f"r{i}", "question": f"q{i}?", "answer": str(i)} for i in range(10)]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("a.jsonl", [("a.jsonl", None, None)]),
        ("a.jsonl:5", [("a.jsonl", 5, None)]),
        ("a.jsonl:ALL", [("a.jsonl", None, None)]),
        ("org/set:", [("org/set", None, None)]),
        ("org/set:100@train+test", [("org/set", 100, ("train", "test"))]),
        ("org/set@validation", [("org/set", None, ("validation",))]),
        ("a.jsonl:3, org/b:7@test", [("a.jsonl", 3, None), ("org/b", 7, ("test",))]),
        (
            '[{"name": "org/set", "max_n": 4, "splits": ["train"]}, {"name": "x.jsonl"}]',
            [("org/set", 4, ("train",)), ("x.jsonl", None, None)],
        ),
        (
            '[{"name": "org/set", "max_n": "ALL", "splits": "train+test"}]',
            [("org/set", None, ("train", "test"))],
        ),
    ],
)
def test_plan_parses_both_forms(text, expected):
    assert [(s.name, s.max_n, s.splits) for s in plan.parse_plan(text)] == expected


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "empty dataset plan"),
        ("a.jsonl:ten", "is not a number"),
        ('[{"max_n": 3}]', "must be an object with a 'name'"),
        ('[{"name": "a", "limit": 3}]', "unknown keys ['limit']"),
        ("[not json", "does not parse"),
    ],
)
def test_bad_plans_say_what_is_wrong(text, message):
    with pytest.raises(plan.DatasetPlanError, match=message.replace("[", r"\[").replace("]", r"\]")):
        plan.parse_plan(text)


def test_limits_per_source_and_global(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", ROWS)
    b = _jsonl(tmp_path / "b.jsonl", ROWS)
    loaded = plan.load_rows(f"{a}:3,{b}:ALL")
    assert len(loaded.rows) == 13
    assert len(plan.load_rows(f"{a}:3,{b}", sample_limit=5).rows) == 5


def test_folder_source_reads_split_files_and_skips_missing_with_reason(tmp_path):
    d = tmp_path / "set"
    d.mkdir()
    _jsonl(d / "train.jsonl", ROWS[:4])
    import pandas as pd

    pd.DataFrame(ROWS[4:6]).to_parquet(d / "test.parquet")
    with pytest.warns(UserWarning, match=r"@validation skipped: MissingSplit"):
        loaded = plan.load_rows(str(d))
    assert len(loaded.rows) == 6
    assert [(r.split, r.status, r.rows) for r in loaded.report] == [
        ("train", "ok", 4),
        ("validation", "skipped", 0),
        ("test", "ok", 2),
    ]


def test_zero_rows_names_every_source_tried(tmp_path):
    empty = _jsonl(tmp_path / "empty.jsonl", [])
    other = _jsonl(tmp_path / "other.jsonl", [])
    with pytest.raises(plan.DatasetPlanError) as err:
        plan.load_rows(f"{empty},{other}")
    assert "yielded no rows" in str(err.value)
    assert "empty.jsonl@train: no rows" in str(err.value) and "other.jsonl@train: no rows" in str(err.value)


def test_one_broken_source_stops_the_plan_instead_of_training_on_the_rest(tmp_path):
    good = _jsonl(tmp_path / "good.jsonl", ROWS[:4])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "b"}\n{oops\n')
    for broken, reason in [
        (f"{tmp_path}/missing.jsonl", "missing.jsonl@train: FileNotFoundError: local file "),
        (str(bad), "bad.jsonl@train: ValueError: line 2 is not JSON"),
        (f"{tmp_path}@validation", "@validation: MissingSplit: no validation"),
    ]:
        with pytest.raises(plan.DatasetPlanError) as err:
            plan.load_rows(f"{good},{broken}")
        assert "cannot be read" in str(err.value) and reason in str(err.value), str(err.value)
        assert "Fix each source or remove it from the plan" in str(err.value)


def test_corrupt_line_is_a_skipped_split_with_the_line_number(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "b"}\n{oops\n')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(plan.DatasetPlanError, match="line 2 is not JSON"):
            plan.load_rows(str(bad))


@pytest.mark.parametrize(
    "row,expected",
    [
        (
            {"question": "Q?", "answer": "A", "cot": "because"},
            "<think>\nbecause\n</think>\n<answer>\nA\n</answer>",
        ),
        ({"question": "Q?", "answer": "A", "rationale": "r"}, "<think>\nr\n</think>\n<answer>\nA\n</answer>"),
        (
            {"question": "Q?", "answer": "A", "explanation": "e"},
            "<think>\ne\n</think>\n<answer>\nA\n</answer>",
        ),
        ({"question": "Q?", "answer": "A"}, "<answer>\nA\n</answer>"),
        ({"question": "Q?", "answer": "A", "cot": "  "}, "<answer>\nA\n</answer>"),
    ],
)
def test_assistant_turn_format(row, expected):
    assert chat.to_messages(row, "S")[-1] == {"role": "assistant", "content": expected}


@pytest.mark.parametrize("key", ["choices", "options"])
def test_multiple_choice_options_are_lettered(key):
    msgs = chat.to_messages({"question": "Pick", key: ["x", "y", "z"], "answer": "B"}, "S")
    assert msgs[0] == {"role": "system", "content": "S"}
    assert msgs[1]["content"] == "Pick\n\nOptions:\nA. x\nB. y\nC. z"


def test_rows_without_question_or_answer_are_skipped_and_counted(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    rows = [
        {"question": "q", "answer": "a", "_source": "s"},
        {"answer": "a", "_source": "s"},
        {"question": "q", "_source": "s"},
        {"question": "", "answer": "a", "_source": "s"},
    ]
    enc = labels.encode_rows(tok, rows, 64, "S")
    assert (len(enc.examples), enc.skipped) == (1, 3)
    counts = enc.per_source["s"]
    assert {k: counts[k] for k in ("rows", "kept", "skipped", "truncated", "no_reasoning")} == {
        "rows": 4,
        "kept": 1,
        "skipped": 3,
        "truncated": 0,
        "no_reasoning": 1,
    }
    assert counts["reasoning_tokens"] == 0 and counts["answer_tokens"] == len(enc.examples[0].labels) - sum(
        t == labels.IGNORE for t in enc.examples[0].labels
    )


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


MSGS = chat.to_messages({"question": "What is 2 + 3?", "answer": "5", "cot": "2 + 3 = 5"}, "S")


def test_labels_cover_exactly_the_assistant_turn(tok):
    ids, labs, truncated = labels.encode_messages(tok, MSGS, 512)
    assert not truncated and len(ids) == len(labs)
    target = tok.decode([t for t in labs if t != labels.IGNORE])
    assert target == MSGS[-1]["content"] + tok.eos_token
    assert "What is" not in target


def test_offset_fallback_masks_everything_before_think(tok):
    """A template without {% generation %} markers: mask up to the first <think>, as the recipe did."""
    import copy

    plain = copy.deepcopy(tok)
    plain.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    ids, labs, _ = labels.encode_messages(plain, MSGS, 512)
    target = plain.decode([t for t in labs if t != labels.IGNORE])
    assert target.startswith("<think>") and target.endswith("</answer>" + tok.eos_token)


def test_truncation_is_counted_and_target_less_rows_dropped(tok):
    long_row = {"question": "x " * 200, "answer": "y", "_source": "s"}
    short_row = {"question": "q", "answer": "a " * 100, "_source": "s"}
    enc = labels.encode_rows(tok, [long_row, short_row], 60, "S")
    assert enc.no_target == 1  # the long question left no assistant token within 60
    assert enc.truncated == 1 and len(enc.examples[0].input_ids) == 60


def test_collate_pads_right_and_refuses_out_of_vocab_ids():
    ex = [labels.Encoded("a", [5, 6, 7], [-100, 6, 7], False), labels.Encoded("b", [5], [5], False)]
    batch = labels.collate(ex, pad_id=0, vocab_size=10)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [5, -100, -100]]
    with pytest.raises(ValueError, match="token id 12 >= model vocab 10"):
        labels.collate([labels.Encoded("c", [12], [12], False)], pad_id=0, vocab_size=10)


def test_vocab_resize_when_tokenizer_outgrows_the_model(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dsr1kit.model.load import ensure_vocab

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    assert not ensure_vocab(model, tok)
    tok.add_tokens([f"<extra_{i}>" for i in range(model.config.vocab_size - len(tok) + 3)])
    with pytest.warns(UserWarning, match="resizing the embeddings"):
        assert ensure_vocab(model, tok)
    assert model.get_input_embeddings().num_embeddings == len(tok)
