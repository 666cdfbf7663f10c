"""HLE's judge: a model behind an OpenAI-compatible endpoint reads each answer beside the gold and returns
structured JSON (the extracted final answer, its reasoning, correct yes/no, the answer's confidence), with
the prompt and fields of HLE's own judge script.

The judge's output is constrained to that JSON schema (``response_format`` json_schema; vLLM decodes it
with guided decoding), so every judgment parses. Judgments are appended per id to
``judgments/<label>.jsonl`` as they arrive: a rerun judges only what is missing, and a judge that is down or
refuses stops with its status (and, for 401/403, the key variable it read), losing nothing. An answer whose
reasoning never closed is not sent: it has no final answer and is scored wrong as truncated.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..benchmarks import JUDGED
from . import auth
from .answers import response_of, sample_id
from .client import CompletionClient, Request, Stats, read_answers

# HLE's judge prompt, as its judge script sends it.
JUDGE_PROMPT = """Judge whether the following [response] to [question] is correct or not based on the precise and unambiguous [correct_answer] below.

[question]: {question}

[response]: {response}

Your judgement must be in the format and criteria specified below:

extracted_final_answer: The final exact answer extracted from the [response]. Put the extracted answer as 'None' if there is no exact, final answer to extract from the response.

[correct_answer]: {correct_answer}

reasoning: Explain why the extracted_final_answer is correct or incorrect based on [correct_answer], focusing only on if there are meaningful differences between [correct_answer] and the extracted_final_answer. Do not comment on any background to the problem, do not attempt to solve the problem, do not argue for any answer different than [correct_answer], focus only on whether the answers match.

correct: Answer 'yes' if extracted_final_answer matches the [correct_answer] given above, or is within a small margin of error for numerical problems. Answer 'no' otherwise, i.e. if there if there is any inconsistency, ambiguity, non-equivalency, or if the extracted answer is incorrect.


confidence: The extracted confidence score between 0|\\%| and 100|\\%| from [response]. Put 100 if there is no confidence score available."""  # noqa: E501

SCHEMA = {
    "type": "object",
    "properties": {
        "extracted_final_answer": {"type": "string"},
        "reasoning": {"type": "string"},
        "correct": {"type": "string", "enum": ["yes", "no"]},
        "confidence": {
            "type": "integer"
        },  # 0-100; clamped on reading (strict schemas of some APIs lack bounds)
    },
    "required": ["extracted_final_answer", "reasoning", "correct", "confidence"],
    "additionalProperties": False,
}
CALIBRATION_BIN = 100  # HLE's bin size
# A served model judging its own answers (a rehearsal of the protocol, e.g. the tiny model) is not a judge:
# its JSON is kept short (no free whitespace, strings bounded) so that a judgment always closes.
SERVED_JUDGE_ARGS = ("--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}')
SERVED_JUDGE_MAX_CHARS = 200
SERVED = "served"  # JudgeConfig.base_url of a judge that is the evaluated model, on its own server


def response_format(max_chars: int = 0) -> dict[str, Any]:
    """The judgment's JSON schema as an OpenAI ``response_format``; ``max_chars`` > 0 bounds its strings and
    the confidence to 0-100 (a small judge's digits can run on)."""
    schema = json.loads(json.dumps(SCHEMA))
    if max_chars:
        for name in ("extracted_final_answer", "reasoning"):
            schema["properties"][name]["maxLength"] = max_chars
        schema["properties"]["confidence"].update(minimum=0, maximum=100)
    return {"type": "json_schema", "json_schema": {"name": "hle_judgment", "schema": schema, "strict": True}}


@dataclass(frozen=True)
class JudgeConfig:
    """Where the judge is and how it is asked: built from notebook 10's parameters by
    ``steps.serve_configs.judge_config``."""

    base_url: str
    model: str
    api_key_env: str  # the environment variable holding the endpoint's key ("" for none); never the key
    concurrency: int
    timeout_s: float
    retries: int
    max_tokens: int
    max_chars: int = 0  # > 0: the judgment's strings are bounded (a small served judge)
    key_param: str = "judge_key_env"  # the parameter naming api_key_env (server_key_env for a served judge)


def on_server(config: JudgeConfig, served_url: str, served_name: str) -> JudgeConfig:
    """The judge as asked while ``served_name`` is served at ``served_url``: a served judge (base_url
    ``SERVED``) is that server, under its model's name unless one is named; any other judge as configured."""
    if config.base_url != SERVED:
        return config
    return replace(config, base_url=served_url, model=config.model or served_name)


@dataclass(frozen=True)
class Judgment:
    extracted: str
    correct: bool
    confidence: int  # 0-100, as the judge read it from the answer
    reasoning: str


class JudgeUnreachable(RuntimeError):
    """The judge endpoint does not answer, refuses its key, or does not serve the model named."""


def check_endpoint(base_url: str, model: str, api_key_env: str = "", timeout_s: float = 10.0) -> None:
    """GET /v1/models on the judge: it answers, accepts the key, and serves ``model`` (raises otherwise)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{base_url.rstrip('/')}/v1/models", headers=auth.headers(api_key_env))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            listed = [m.get("id") for m in json.loads(resp.read()).get("data", [])]
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            raise JudgeUnreachable(
                f"the judge at {base_url} answered HTTP {err.code}: it wants another API key; "
                f"{auth.refused_note(api_key_env, 'judge_key_env')}"
            ) from None
        raise JudgeUnreachable(f"the judge at {base_url} answered HTTP {err.code} on /v1/models") from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise JudgeUnreachable(
            f"the judge at {base_url} is not reachable ({reason}); start it or fix judge_url"
        ) from None
    if listed and model not in listed:
        raise JudgeUnreachable(
            f"the judge at {base_url} does not serve model {model!r}; it serves: {', '.join(map(str, listed[:10]))}"
        )


def judgments_path(run_dir: str | Path, label: str) -> Path:
    return Path(run_dir) / "judgments" / f"{label}.jsonl"


def requests_for(prompts, answers: dict[str, dict], samples: int = 1) -> list[Request]:
    """One judge request per sample of a judged prompt that has an answer whose reasoning closed, keyed as
    the answer is (``answers.sample_id``): the judge sees every sample."""
    out = []
    for p in prompts:
        for j in range(samples if p.kind == JUDGED else 0):
            key = sample_id(p.id, j, samples)
            answer = answers.get(key)
            response = response_of(answer, p.reasoning_open) if answer else None
            if response is None:
                continue
            prompt = JUDGE_PROMPT.format(
                question=p.question, response=response.strip(), correct_answer=p.gold
            )
            out.append(Request(key, [{"role": "user", "content": prompt}]))
    return out


def judge(
    prompts,
    answers: dict[str, dict],
    out_path: str | Path,
    config: JudgeConfig,
    samples: int = 1,
    progress=True,
) -> Stats:
    """Ask the judge about every judged answer (each of ``samples`` per question) not yet in ``out_path``;
    return the client's Stats."""
    from tqdm import tqdm

    requests = requests_for(prompts, answers, samples)
    already = len({r.id for r in requests} & set(read_answers(out_path)))
    client = CompletionClient(
        config.base_url,
        config.model,
        concurrency=config.concurrency,
        timeout_s=config.timeout_s,
        retries=config.retries,
        chat=True,
        key_env=config.api_key_env,
        key_param=config.key_param,
    )
    with tqdm(
        total=len(requests), initial=already, desc=f"judge ({config.model})", disable=not progress
    ) as bar:
        return client.complete(
            requests,
            out_path,
            max_tokens=config.max_tokens,
            temperature=0.0,
            extra={"response_format": response_format(config.max_chars)},
            on_result=lambda _row: bar.update(1),
        )


def parse(text: str) -> Judgment | None:
    """A judge's JSON as a Judgment; None when it does not hold the schema's fields."""
    try:
        data = json.loads(text)
        return Judgment(
            str(data["extracted_final_answer"]),
            data["correct"] == "yes",
            max(0, min(100, int(data["confidence"]))),
            str(data.get("reasoning", "")),
        )
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def read_judgments(path: str | Path) -> dict[str, Judgment | None]:
    """id → the judgment in ``path`` (None where the judge's output did not parse)."""
    return {i: parse(row.get("text", "")) for i, row in read_answers(path).items()}


# -- HLE's metrics


def rms_calibration_error(confidence: list[float], correct: list[bool], bin_size: int = CALIBRATION_BIN):
    """The kit's all-bins variant: (RMS calibration error in [0, 1], note). Answers sorted by confidence (0-1)
    into bins of ``bin_size``, the last bin taking the remainder, each bin's |mean confidence - accuracy|²
    weighted by its share; every bin counts, and fewer than ``bin_size`` answers make one bin.

    Not HLE's number (``hle_calibration_error`` is): it is shown beside it, labelled as the kit's, because HLE's
    leaves the most confident answers out and has no value below two bins."""
    n = len(confidence)
    if n == 0:
        return float("nan"), "no judged answer"
    order = sorted(range(n), key=lambda i: confidence[i])
    conf, ok = [confidence[i] for i in order], [float(correct[i]) for i in order]
    edges = [i * bin_size for i in range(max(1, n // bin_size))] + [n]
    total = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        size = hi - lo
        gap = sum(conf[lo:hi]) / size - sum(ok[lo:hi]) / size
        total += size / n * gap * gap
    note = f"{len(edges) - 1} bin(s) of {bin_size}"
    if n < bin_size:
        note = f"one bin: only {n} judged answers (HLE bins by {bin_size})"
    return math.sqrt(total), note


def hle_calibration_error(confidence: list[float], correct: list[bool], beta: int = CALIBRATION_BIN):
    """(HLE's RMS calibration error, or None where its script gives none; note), computed as HLE's judge script
    computes ``calib_err(confidence, correct, p='2', beta=100)``: the judged answers sorted by confidence (0-1)
    with numpy's default argsort (ties in the integer confidences are ordered as the script orders them),
    ``n // beta`` bins of ``beta`` with the last taking the remainder, and the sum over every bin *but the
    last* (the most confident answers) of the bin's share × (mean confidence - accuracy)².

    Below ``beta`` answers the script fails (it has no bin); below ``2 beta`` its only bin is the one it leaves
    out and it prints 0. Neither is a calibration error, so both are None with the note saying which."""
    import numpy as np

    conf = np.asarray(confidence, dtype=float)
    ok = np.asarray(correct, dtype=bool)
    n = len(conf)
    if n < beta:
        return None, f"none: {n} judged answers, under one bin of {beta} (HLE's script fails here)"
    if n < 2 * beta:
        return None, f"none: {n} judged answers make one bin, the one HLE's script leaves out (it prints 0)"
    order = np.argsort(conf)
    conf, ok = conf[order], ok[order]
    bins = [[i * beta, (i + 1) * beta] for i in range(n // beta)]
    bins[-1][1] = n
    total = 0.0
    for lo, hi in bins[:-1]:
        total += (hi - lo) / n * float(np.square(np.abs(np.nanmean(conf[lo:hi]) - np.nanmean(ok[lo:hi]))))
    last = bins[-1][1] - bins[-1][0]
    note = f"HLE's: {len(bins)} bins of {beta}, the last ({last} most confident) left out"
    return float(np.sqrt(total)), note


HLE_Z = 1.96  # HLE's script's Wald interval


def hle_metrics(per_example, judgments: dict[str, Judgment | None]) -> dict[str, Any]:
    """HLE's numbers as its judge script computes them: accuracy over every judged-kind question of the run
    (one without a judgment — its reasoning never closed, the judge's output did not parse, or it was never
    judged — is wrong, as the script divides by the total), its Wald 95% half-width ``1.96·sqrt(p(1-p)/n)``,
    and its calibration error over the readable judgments; beside them the kit's all-bins variant.

    With k samples per question the script's numbers are computed for each sample index (the run as if it
    had asked once, k times over) and averaged; the counts are summed over the samples."""
    rows = per_example[per_example["kind"] == JUDGED]
    samples = int(rows["sample"].max()) + 1 if len(rows) and "sample" in rows else 1
    if samples == 1:
        return _hle_one(rows, judgments, 1)
    each = [_hle_one(rows[rows["sample"] == j], judgments, samples) for j in range(samples)]
    calibrations = [m["calibration_error"] for m in each]
    mean = {key: sum(m[key] for m in each) / samples for key in ("accuracy", "ci95_half_width")}
    return {
        **each[0],
        **mean,
        "judged": sum(m["judged"] for m in each),
        "correct": sum(m["correct"] for m in each),
        "calibration_error": None if None in calibrations else sum(calibrations) / samples,
        "calibration_note": f"mean over {samples} sample indices; sample 0: {each[0]['calibration_note']}",
        "calibration_error_all_bins": sum(m["calibration_error_all_bins"] for m in each) / samples,
        "unreadable_judgments": sum(m["unreadable_judgments"] for m in each),
        "samples": samples,
    }


def _hle_one(rows, judgments: dict[str, Judgment | None], samples: int) -> dict[str, Any]:
    """HLE's numbers over one answer per question (one sample index of ``rows``)."""
    keys = [sample_id(i, int(j), samples) for i, j in zip(rows["id"], rows["sample"])] if len(rows) else []
    n = len(rows)
    judged = [judgments.get(key) for key in keys]
    correct = [bool(c) for c in rows["correct"]]
    k = sum(correct)
    acc = k / n if n else float("nan")
    half = HLE_Z * math.sqrt(acc * (1 - acc) / n) if n else float("nan")
    pairs = [(j.confidence / 100, j.correct) for j in judged if j is not None]
    confidence, judged_correct = [c for c, _ in pairs], [ok for _, ok in pairs]
    calib, note = hle_calibration_error(confidence, judged_correct)
    all_bins, all_bins_note = rms_calibration_error(confidence, judged_correct)
    return {
        "n": n,
        "judged": len(pairs),
        "correct": k,
        "accuracy": acc,
        "ci95_half_width": half,
        "calibration_error": calib,
        "calibration_note": note,
        "calibration_error_all_bins": all_bins,
        "calibration_all_bins_note": all_bins_note,
        "unreadable_judgments": sum(1 for key in keys if key in judgments and judgments[key] is None),
        "samples": samples,
    }
