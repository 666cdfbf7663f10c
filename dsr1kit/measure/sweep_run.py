"""The forgetting sweep as a pipeline behind one typed config: every point is a HARI run (its own
``HariRun``) trained on task B, then measured on A and B at the end and at each snapshot.

A point's folder is ``<run>/points/<point>/``; a point with its ``result.json`` is never redone, so a rerun
or a Slurm job array does only what is missing. The base model's accuracies are measured once
(``points/base.json``) and shared by every point. With ``measure_with: server`` the points are only trained
here and ``measure.sweep_served`` measures them all through one served base.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..data import replay
from ..infer.serve_base import BaseServing
from ..train.hari_run import HariRun
from . import point as measure
from .sweep import PointResult

FAMILY_METHOD = {"lambda": "hari", "replay": "replay", "small_adapter": "small_adapter"}
BASE_FILE = "base.json"


class SweepError(RuntimeError):
    """A point stopped before its adapter was written, or base.json was measured another way."""


@dataclass(frozen=True)
class Point:
    """One training run of the sweep: a (λ, seed) of HARI, or a baseline's run for a seed (at λ = 0)."""

    index: int
    lambda_kl: float
    seed: int
    family: str = "lambda"  # lambda | replay | small_adapter

    @property
    def name(self) -> str:
        if self.family == "lambda":
            return f"lambda{self.lambda_kl:g}-seed{self.seed}"
        return f"{self.family}-seed{self.seed}"


@dataclass(frozen=True)
class ReplayConfig:
    """The replay baseline's mix: B's rows with the base's own answers to A-style prompts."""

    prompts: str  # dataset plan of the A-style prompts
    ratio: float  # replay rows per row of B
    limit: int  # prompts answered at most
    max_new_tokens: int
    b_rows: tuple[dict, ...]  # B's training rows, as a run on B alone reads them


@dataclass(frozen=True)
class SweepConfig:
    """Everything the sweep reads; ``runs[i]`` is point ``points[i]``'s HARI run."""

    run_dir: Path
    model: str
    system_prompt: str
    max_len: int
    task_a_eval: str
    task_b_eval: str
    eval_limit: int
    kl_span: str  # answer | all: the tokens the KL to the base is measured on
    measure_with: str  # model | server
    points: tuple[Point, ...]
    runs: tuple[HariRun, ...]
    replay: ReplayConfig | None  # None: no replay baseline
    serving: BaseServing | None  # how the base is served (measure_with: server, or served replay answers)
    serve_as_lora: bool  # serve the adapters as LoRA modules of one server (else a merged copy each)


def point_dir(run_dir: str | Path, point: Point) -> Path:
    return Path(run_dir) / "points" / point.name


def mix_path(run_dir: str | Path, ratio: float) -> Path:
    return Path(run_dir) / "replay" / f"mix-ratio{ratio:g}.jsonl"


def eval_rows(config: SweepConfig) -> tuple[list[dict], list[dict]]:
    from ..data.plan import load_rows

    return (
        load_rows(config.task_a_eval, sample_limit=config.eval_limit).rows,
        load_rows(config.task_b_eval, sample_limit=config.eval_limit).rows,
    )


def base_fingerprint(model: str) -> str:
    """Name and digest of the base's files (``tiny`` resolves to its cached build; a hub id to its local
    snapshot when one is cached, else the id alone)."""
    from ..embedded.tiny import resolve_model
    from ..train.prefix.digest import model_digest

    path = resolve_model(model)
    if not Path(path).is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = snapshot_download(path, local_files_only=True)
        except Exception:
            return model
    return f"{model} {model_digest(path)}"


def _served_answerer(config: SweepConfig, out: Path):
    def answer(rows: list[dict]) -> list[str]:
        from dataclasses import replace

        from ..infer.serve_base import serve_base
        from .served import served_turns

        with serve_base(config.serving, config.run_dir, name="server-replay") as (server, tok, client, name):
            client = replace(client, max_tokens=config.replay.max_new_tokens, temperature=0.0)
            return served_turns(server.base_url, name, rows, tok, config.system_prompt, out, client)

    return answer


def replay_mix(config: SweepConfig) -> list[dict]:
    """B's training rows mixed with the base's own answers on A-style prompts, written once per sweep."""
    r = config.replay
    path = mix_path(config.run_dir, r.ratio)
    spec = replay.ReplaySpec(
        base=base_fingerprint(config.model),
        prompts=r.prompts,
        held_out=(config.task_a_eval, config.task_b_eval),
        system_prompt=config.system_prompt,
        max_new_tokens=r.max_new_tokens,
        limit=r.limit,
        made_with=config.measure_with,
    )
    if config.measure_with == "server":
        answer = _served_answerer(config, path.parent / "served-answers.jsonl")
    else:

        def load_base():
            from ..model.load import load_model

            loaded = load_model(measure.on_cpu_fp32(config.model))
            return loaded.model, loaded.tokenizer

        answer = replay.hf_answerer(load_base, config.system_prompt, r.max_new_tokens)
    rows = replay.mix(list(r.b_rows), replay.replay_rows(path.parent, spec, answer), r.ratio)
    if not path.is_file():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
        tmp.replace(path)
    return rows


def replay_first(config: SweepConfig) -> bool:
    """Must the served base make the replay answers in a job of its own, before the points train? With
    ``measure_with: server`` and a replay baseline, until the mix is made: a base served across nodes
    (R1 on 2 x 8 GPUs) cannot be served inside a one-node array task."""
    r = config.replay
    return (
        config.measure_with == "server" and r is not None and not mix_path(config.run_dir, r.ratio).is_file()
    )


def plan_table(config: SweepConfig) -> list[dict]:
    return [
        {
            "point": pt.index,
            "method": pt.family,
            "lambda_kl": pt.lambda_kl,
            "seed": pt.seed,
            "state": "done" if (point_dir(config.run_dir, pt) / "result.json").is_file() else "to run",
        }
        for pt in config.points
    ]


def saved_base(config: SweepConfig) -> tuple[float, float] | None:
    """base.json's accuracies when present; one measured the other way (model or server) is refused."""
    path = Path(config.run_dir) / "points" / BASE_FILE
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    how = saved.get("measured_with", "model")
    if how != config.measure_with:
        raise SweepError(
            f"{path} was measured with measure_with: {how}, this sweep measures with {config.measure_with}: "
            "the two score differently; use another run_dir or the same measure_with"
        )
    return saved["acc_a"], saved["acc_b"]


def write_base(config: SweepConfig, acc: tuple[float, float], n_a: int, n_b: int) -> tuple[float, float]:
    path = Path(config.run_dir) / "points" / BASE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{BASE_FILE}.{os.getpid()}")  # array tasks may measure it at once: same numbers
    saved = {"acc_a": acc[0], "acc_b": acc[1], "n_a": n_a, "n_b": n_b, "measured_with": config.measure_with}
    tmp.write_text(json.dumps(saved))
    tmp.replace(path)
    return acc


def base_accuracy(config: SweepConfig) -> tuple[float, float]:
    """The base model's accuracy on A and B, measured once per sweep (base.json)."""
    saved = saved_base(config)
    if saved is not None:
        return saved
    rows_a, rows_b = eval_rows(config)
    acc = measure.base_accuracy(config.model, rows_a, rows_b, config.system_prompt, config.max_len)
    return write_base(config, acc, len(rows_a), len(rows_b))


def write_result(path: Path, result: PointResult) -> PointResult:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.to_dict(), indent=1))
    tmp.replace(path)
    return result


def with_cost(result: PointResult, point: Point, cost: dict) -> PointResult:
    peak = cost.get("peak_memory_gib", 0.0)
    result.method = FAMILY_METHOD[point.family]
    result.step, result.total_steps = int(cost["step"]), int(cost["total_steps"])
    result.tokens, result.train_s = int(cost.get("tokens", 0)), float(cost.get("train_s", 0.0))
    result.peak_memory_gib = max(peak.values(), default=0.0) if isinstance(peak, dict) else float(peak or 0.0)
    return result


def _end_cost(info: dict) -> dict:
    total = info["total_steps"]
    return {
        "step": total,
        "total_steps": total,
        "tokens": info.get("tokens", 0),
        "train_s": info.get("train_s", 0.0),
        "peak_memory_gib": info.get("peak_memory_gib", 0.0),
    }


def adapters(folder: Path) -> list[tuple[Path, dict, Path]]:
    """(adapter folder, its cost, its result file) for each snapshot of a trained run and its end."""
    from ..train.checkpoint import snapshots

    out = [
        (snap, json.loads((snap / "cost.json").read_text()), snap / "result.json")
        for _, snap in snapshots(folder)
    ]
    info_file, end = folder / "run_info.json", folder / "adapter"
    if info_file.is_file() and (end / "adapter_config.json").is_file():
        out.append((end, _end_cost(json.loads(info_file.read_text())), folder / "result.json"))
    return out


def measured(folder: Path) -> list[PointResult]:
    """A run's results: its snapshots' by step, then its end's (``result.json``); what was measured so far."""
    from ..train.checkpoint import snapshots

    files = [snap / "result.json" for _, snap in snapshots(folder)] + [folder / "result.json"]
    return [PointResult.from_dict(json.loads(f.read_text())) for f in files if f.is_file()]


def trained(folder: Path) -> bool:
    info = folder / "run_info.json"
    if not (info.is_file() and (folder / "adapter" / "adapter_config.json").is_file()):
        return False
    saved = json.loads(info.read_text())
    return not saved.get("preempted") and saved.get("steps_done") == saved.get("total_steps")


def train_point(config: SweepConfig, point: Point) -> None:
    """Train (or resume) the point's run; a finished run is not loaded again."""
    from ..train import hari_plans, hari_run

    if trained(point_dir(config.run_dir, point)):
        return
    if point.family == "replay":
        replay_mix(config)  # before the run reads it
    run = config.runs[point.index]
    info = hari_run.run(run, hari_plans.memory_plan(run))
    if info.get("preempted") or not info.get("adapter_dir"):
        raise SweepError(
            f"point {point.name} stopped before its adapter was written (steps "
            f"{info.get('steps_done')} of {info.get('total_steps')}); rerun to resume it"
        )


def _measure_adapters(config: SweepConfig, point: Point, folder: Path) -> None:
    base = base_accuracy(config)
    rows_a, rows_b = eval_rows(config)
    for adapter, cost, out in adapters(folder):
        if not out.is_file():
            result = measure.evaluate_point(
                adapter,
                rows_a,
                rows_b,
                config.system_prompt,
                lambda_kl=point.lambda_kl,
                seed=point.seed,
                max_len=config.max_len,
                kl_span=config.kl_span,
                base_acc=base,
            )
            write_result(out, with_cost(result, point, cost))


def run_point(config: SweepConfig, point: Point) -> list[PointResult]:
    """Train (or resume) the point's run, then measure each snapshot along it and its adapter at the end:
    the results by step, the end's (``result.json``) last. Whatever was measured before is read back. With
    ``measure_with: server`` the run is only trained: ``sweep_served.measure_served`` measures them all."""
    folder = point_dir(config.run_dir, point)
    todo = [a for a in adapters(folder) if not a[2].is_file()]
    if trained(folder) and not todo:
        return measured(folder)
    if config.measure_with == "model":
        base_accuracy(config)  # before training: an array task fails early on a mismatched base.json
    train_point(config, point)
    if config.measure_with == "model":
        _measure_adapters(config, point, folder)
    return measured(folder)


def lambda_points(results: list[PointResult]) -> list[PointResult]:
    """HARI's (λ, seed) points at the end of training: what the λ sweep's tables, figures and verdict read."""
    return [r for r in results if r.method == "hari" and r.final]
