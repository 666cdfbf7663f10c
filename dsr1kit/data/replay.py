"""Replay of the base model's own answers: a cheap rival to HARI's KL term.

The base answers A-style prompts greedily, once; those answers, mixed into the new task's training rows
at a stated ratio, pull the adapter towards what the base already did, with no reference forward at
training time. The answers are kept with the base's fingerprint and reused only for the same base,
prompts and settings. A prompt that is also a held-out evaluation question is never used: replaying it
would train on the test.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .chat import to_messages, user_text

ANSWERS = "answers.jsonl"
META = "replay.json"
# The kit's turn; whitespace around the tags may differ (a served model's), nothing else may be outside them.
_TURN = re.compile(r"^(?:<think>\s*(?P<cot>.*?)\s*</think>\s*)?<answer>\s*(?P<answer>.*?)\s*</answer>$", re.S)


class ReplayMismatch(ValueError):
    """Replay answers on disk were made by another base or with other settings."""


@dataclass(frozen=True)
class ReplaySpec:
    """What the replay answers depend on (all recorded beside them)."""

    base: str  # the base's fingerprint: name and file digest (measure.sweep_run.base_fingerprint)
    prompts: str  # dataset plan of the A-style prompts (their answers, if any, are never read)
    held_out: tuple[str, ...]  # evaluation files whose questions are never replayed
    system_prompt: str
    max_new_tokens: int
    limit: int  # prompts at most
    made_with: str = "model"  # model: transformers on the host; server: the base served by vLLM


def held_out_questions(files: tuple[str, ...]) -> set[str]:
    from .plan import load_rows

    return {q.strip() for f in files for q in (user_text(r) for r in load_rows(f).rows) if q}


def parse_turn(text: str) -> dict[str, str] | None:
    """The answer (and reasoning) of a generated turn in the kit's format, None when it is not in it."""
    m = _TURN.match(text.strip())
    if not m:
        return None
    out = {"answer": m.group("answer")}
    if m.group("cot") is not None:
        out["cot"] = m.group("cot")
    return out


def hf_answerer(load_base, system_prompt: str, max_new_tokens: int):
    """Answers by greedy decoding with transformers; ``load_base()`` → (model, tokenizer), called once."""

    def answer(rows: list[dict[str, Any]]) -> list[str]:
        model, tokenizer = load_base()
        return [text for _, text in generate_answers(model, tokenizer, rows, system_prompt, max_new_tokens)]

    return answer


def generate_answers(model, tokenizer, rows: list[dict[str, Any]], system_prompt: str, max_new_tokens: int):
    """Greedy turns of ``model`` for each row's question, as text (the served prompt, as training renders
    it). Yields (row, text)."""
    import torch
    from tqdm.auto import tqdm

    from .render import served_prompt

    model.eval()
    for row in tqdm(rows, desc="replay answers", mininterval=2):
        _, ids = served_prompt(tokenizer, to_messages(row, system_prompt, with_answer=False))
        x = torch.tensor([ids], device=model.device)
        with torch.no_grad():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
        yield row, tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def _read(folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    meta, answers = folder / META, folder / ANSWERS
    if not (meta.is_file() and answers.is_file()):
        return None
    return json.loads(meta.read_text()), [json.loads(x) for x in answers.read_text().splitlines() if x]


def replay_rows(folder: str | Path, spec: ReplaySpec, answer) -> list[dict[str, Any]]:
    """The base's answers for the replay, made once in ``folder`` and read back after.

    ``answer(rows)`` → the base's greedy turn (text) for each row's question (``hf_answerer``, or through a
    server), called only when the answers must be made; tasks of a job array that arrive together make
    them once (a file lock). Answers on disk from another base or other settings are refused with what
    differs (never silently remade: a sweep's points may already have trained on them).
    """
    from filelock import FileLock

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder / ".lock")):
        return _replay_rows(folder, spec, answer)


def _replay_rows(folder: Path, spec: ReplaySpec, answer) -> list[dict[str, Any]]:
    from .plan import load_rows

    saved = _read(folder)
    want = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(spec).items()}
    if saved is not None:
        differ = [k for k in want if saved[0].get("spec", {}).get(k) != want[k]]
        if differ:
            lines = [f"{k}: {saved[0]['spec'].get(k)!r} there, {want[k]!r} now" for k in differ]
            raise ReplayMismatch(
                f"the replay answers in {folder} were made with other settings ({'; '.join(lines)}); "
                "they may already be trained on: give this sweep another run_dir, or delete that folder "
                "to remake them"
            )
        return saved[1]
    banned = held_out_questions(spec.held_out)
    prompts, dropped = [], 0
    for row in load_rows(spec.prompts).rows:
        q = user_text(row)
        if not q:
            continue
        if q.strip() in banned:
            dropped += 1
            continue
        prompts.append({"question": row.get("question", q), **{k: row[k] for k in ("choices",) if k in row}})
        if len(prompts) >= spec.limit:
            break
    rows, malformed = [], 0
    texts = answer(prompts)
    for i, (row, text) in enumerate(zip(prompts, texts, strict=True)):
        turn = parse_turn(text)
        replayed = {**row, **turn} if turn and turn["answer"] else None
        if replayed is None:
            malformed += 1  # not in the kit's answer format: training would render something else
            continue
        rows.append({"id": f"replay-{i:05d}", **replayed, "category": "replay"})
    tmp = folder / f".{ANSWERS}.{os.getpid()}"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(folder / ANSWERS)
    meta = {"spec": want, "prompts_used": len(prompts), "held_out_dropped": dropped, "malformed": malformed}
    tmp = folder / f".{META}.{os.getpid()}"
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(folder / META)
    return rows


def mix(b_rows: list[dict[str, Any]], replay: list[dict[str, Any]], ratio: float) -> list[dict[str, Any]]:
    """B's rows and round(ratio × len(B)) replay rows, interleaved evenly (training shuffles them anyway)."""
    n = round(ratio * len(b_rows))
    if n > len(replay):
        raise ValueError(
            f"replay_ratio {ratio:g} needs {n} replay rows for {len(b_rows)} training rows, only {len(replay)} "
            "were made: lower replay_ratio or give more replay prompts"
        )
    picked = replay[:n]
    out, j = [], 0
    for i, row in enumerate(b_rows):
        out.append(row)
        while j < n and (j + 1) * len(b_rows) <= (i + 1) * n:
            out.append(picked[j])
            j += 1
    return out + picked[j:]
