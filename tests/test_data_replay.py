"""Replay of the base's own answers (notebook 40's replay method), with the embedded tiny model as the base:
made once, refused when made from another base, never from a held-out evaluation question."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsr1kit.data import replay
from dsr1kit.data.chat import assistant_text
from dsr1kit.measure.sweep_run import base_fingerprint

ROOT = Path(__file__).resolve().parent.parent
HELD_OUT = (str(ROOT / "data/task_a_eval.jsonl"), str(ROOT / "data/task_b_eval.jsonl"))


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x]


@pytest.fixture(scope="module")
def base():
    from dsr1kit.measure.point import on_cpu_fp32
    from dsr1kit.model.load import load_model

    loaded = load_model(on_cpu_fp32("tiny"))
    return loaded.model, loaded.tokenizer


def _spec(prompts: Path, base_id: str) -> replay.ReplaySpec:
    return replay.ReplaySpec(base_id, str(prompts), HELD_OUT, "You are DeepSeek-R1.", 32, 50)


def test_replay_answers_are_the_base_own_made_once_and_never_a_held_out_question(tmp_path, base):
    held = _jsonl(ROOT / "data/task_a_eval.jsonl")[:3] + _jsonl(ROOT / "data/task_b_eval.jsonl")[:1]
    banned = {r["question"] for f in HELD_OUT for r in _jsonl(Path(f))}
    fresh = [r for r in _jsonl(ROOT / "data/task_a_prompts.jsonl") if r["question"] not in banned][:6]
    prompts = tmp_path / "prompts.jsonl"
    mixed = [held[0], fresh[0], held[1], *fresh[1:], held[2], held[3]]
    prompts.write_text("".join(json.dumps({"question": r["question"]}) + "\n" for r in mixed))
    spec = _spec(prompts, base_fingerprint("tiny"))
    calls = []

    def load_base():
        calls.append(1)
        return base

    answer = replay.hf_answerer(load_base, spec.system_prompt, spec.max_new_tokens)
    rows = replay.replay_rows(tmp_path / "replay", spec, answer)
    meta = json.loads((tmp_path / "replay" / replay.META).read_text())
    assert meta["held_out_dropped"] == 4 and meta["prompts_used"] == 6
    assert rows and not {r["question"] for r in rows} & banned
    assert len(rows) + meta["malformed"] == 6
    # each answer is what greedy decoding of the base produces for that prompt
    model, tokenizer = base
    for row, text in replay.generate_answers(model, tokenizer, rows[:2], spec.system_prompt, 32):
        assert assistant_text(row) == text.strip()
    # the base's own answers, right or wrong: on A it is mostly right (first word)
    firsts = sum(r["answer"] == r["question"].splitlines()[1] for r in rows)
    assert firsts >= len(rows) - 1
    # made once: a second call reads them back without loading the base
    again = replay.replay_rows(tmp_path / "replay", spec, lambda rows: pytest.fail("the base answered again"))
    assert again == rows and calls == [1]


def test_replay_answers_of_another_base_are_refused_with_what_differs(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"question": "Which word comes first in this list?\nplum\nriver\nkettle"}) + "\n"
    )
    folder = tmp_path / "replay"
    folder.mkdir()
    spec = _spec(prompts, "tiny 0000000000000000")
    (folder / replay.ANSWERS).write_text("")
    want = {k: list(v) if isinstance(v, tuple) else v for k, v in spec.__dict__.items()}
    (folder / replay.META).write_text(json.dumps({"spec": {**want, "base": "tiny 1111111111111111"}}))
    with pytest.raises(replay.ReplayMismatch, match=r"base: 'tiny 1111111111111111' there, 'tiny 0{16}' now"):
        replay.replay_rows(folder, spec, lambda rows: pytest.fail("must not ask the base"))


def test_the_base_fingerprint_follows_the_base_files(tmp_path):
    from dsr1kit.embedded.tiny import resolve_model

    fp = base_fingerprint("tiny")
    assert fp.startswith("tiny ") and fp == base_fingerprint("tiny")
    copy = tmp_path / "other"
    copy.mkdir()
    (copy / "config.json").write_text((Path(resolve_model("tiny")) / "config.json").read_text() + " ")
    assert base_fingerprint(str(copy)).split()[1] != fp.split()[1]


def test_mix_interleaves_the_stated_ratio_and_refuses_too_few_answers():
    b = [{"id": f"b{i}"} for i in range(8)]
    r = [{"id": f"r{i}"} for i in range(10)]
    out = replay.mix(b, r, 0.5)
    assert [x["id"] for x in out] == ["b0", "b1", "r0", "b2", "b3", "r1", "b4", "b5", "r2", "b6", "b7", "r3"]
    with pytest.raises(ValueError, match="needs 16 replay rows for 8 training rows, only 10"):
        replay.mix(b, r, 2.0)


def test_parse_turn_reads_the_kit_format_only():
    assert replay.parse_turn("<answer>\nplum\n</answer>") == {"answer": "plum"}
    assert replay.parse_turn("<think>\nfirst\n</think>\n<answer>\nplum\n</answer>") == {
        "answer": "plum",
        "cot": "first",
    }
    assert replay.parse_turn("plum") is None
    # a served model's spacing around the tags (R1 after its reasoning was put back) reads the same
    assert replay.parse_turn("<think>\nfirst \n</think>\n\n<answer>plum</answer>\n") == {
        "answer": "plum",
        "cot": "first",
    }
    assert replay.parse_turn("<answer>plum</answer> and more") is None  # nothing outside the tags
    assert replay.parse_turn("Sure. <answer>plum</answer>") is None


def test_a_served_turn_keeps_the_reasoning_its_parser_split_off():
    from dsr1kit.measure.served import whole_turn

    row = {"id": "replay-00000", "text": "\n\n<answer>\nplum\n</answer>", "reasoning": "first\n"}
    assert replay.parse_turn(whole_turn(row)) == {"answer": "plum", "cot": "first"}
    assert whole_turn({"id": "x", "text": "<answer>\nplum\n</answer>"}) == "<answer>\nplum\n</answer>"
