"""Notebook 10, serving and evaluation: model → prompts → plan → servers → parity → answers → scores → verdict.

The pipeline is the library's (``infer.served_eval``, ``infer.prompts``, ``infer.results``); this module
turns the notebook's parameters into its configs (``steps.serve_configs``), refuses input no run could
use, plans memory and disk, and reads the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..infer import adapters
from ..infer.prompts import Prompts
from ..infer.prompts import prepare_prompts as prompts_of
from ..infer.results import category_changes, headline
from ..infer.served_eval import PARITY_REFERENCE, ServedEval, serving_plan
from ..plan import DiskPlan, Machine, Plan, reference_plan
from . import FAIL, OK, WARN, StepFailed, Verdict
from . import serve_configs as configs


def resolve_adapter(p, run_dir: str | Path) -> Path | None:
    """lora_adapter as a folder: '' → None (base only), 'latest' → newest HARI adapter beside this run."""
    return adapters.resolve_adapter(p.lora_adapter, run_dir)


def prepare_prompts(p, tokenizer) -> Prompts:
    """Every row asked for: the served prompts that fit, and each row left out with its reason."""
    return prompts_of(configs.prompt_config(p), tokenizer)


def served_eval(p, run_dir: str | Path, model_path: str, adapter: Path | None, machine=None):
    """The evaluation's servers for the model at ``model_path`` and ``adapter`` (None: the base only)."""
    return ServedEval(configs.eval_config(p, model_path), run_dir, model_path, adapter, machine)


def preflight(p) -> None:
    """The replicas land on the job's nodes, the server's key is there when required, every evaluation set
    loads and a benchmark adapter reads it, a judge endpoint answers with the key and model named, and
    lm-eval knows the tasks, before any run folder or server."""
    from ..infer import auth, harness, judge
    from ..infer.serve_spec import LayoutRefused, check_data_parallel
    from .preflight import BadInput

    try:
        check_data_parallel(configs.serve_settings(p))
    except LayoutRefused as err:
        raise BadInput(str(err)) from None
    if p.require_server_key and not auth.key(p.server_key_env):
        raise BadInput(
            f"require_server_key: ${p.server_key_env} is not set, so the server would answer anyone on the "
            f"network; export the key it should demand (e.g. `export {p.server_key_env}=$(openssl rand -hex 32)`"
            f" in the job's environment), or set require_server_key: false to serve without one"
        )
    check_eval_dataset(p)
    if p.judge_url not in ("", judge.SERVED):
        try:
            judge.check_endpoint(p.judge_url, p.judge_model, p.judge_key_env)
        except judge.JudgeUnreachable as err:
            raise BadInput(f"judge_url: {err}") from None
    if p.lm_eval_tasks:
        try:
            harness.check_tasks(tuple(p.lm_eval_tasks))
        except harness.HarnessError as err:
            raise BadInput(str(err)) from None


def check_eval_dataset(p) -> None:
    """Every evaluation set loads and a benchmark adapter reads it: BadInput naming what stops it."""
    from ..benchmarks import UnknownSchema
    from ..infer import evaluate
    from .preflight import BadInput

    try:
        evaluate.load_items(p.eval_dataset, p.eval_limit)
    except UnknownSchema as err:
        raise BadInput(f"eval_dataset {err}") from None
    except (ValueError, FileNotFoundError, ConnectionError) as err:
        raise BadInput(
            f"eval_dataset {p.eval_dataset!r} cannot be read: {type(err).__name__}: {err}"
        ) from None


def memory_plan(p, machine: Machine | None = None, model_path: str | None = None) -> list[Plan]:
    """vLLM serving the model on ``machine`` (this node by default), and with a LoRA adapter served for parity,
    the PEFT reference in fp32 on the host (512 tokens: the plan of the look-ahead; the step plans its prompts)."""
    machine = machine or Machine.detect()
    plans = [serving_plan(configs.plan_inputs(p), model_path or p.model, machine)]
    if p.lora_adapter and p.adapter_mode == "lora" and model_path is None:
        plans.append(reference_plan(p.model, machine, 512, PARITY_REFERENCE))
    return plans


def disk_plan(p, run_dir: Path, free: float | None = None) -> DiskPlan:
    """What the evaluation writes into its run folder: the answers of each model (at most every row with
    max_new_tokens of text and reasoning), and with an adapter that is merged (adapter_mode merge, or a
    parity that falls back to a merge) the merged checkpoint's rewritten shards."""
    from ..inspection.merge_plan import merged_checkpoint_write
    from ..plan.serving_disk import serving_disk_plan

    merged = None
    if p.lora_adapter and (p.adapter_mode == "merge" or p.merge_if_ignored):
        try:
            adapter = resolve_adapter(p, run_dir)
        except FileNotFoundError:
            adapter = None
        fix = "adapter_mode: lora with merge_if_ignored: false (no merged copy), or a run_dir with room"
        merged = merged_checkpoint_write(p.model, adapter, run_dir / "merged", fix)
    return serving_disk_plan(configs.disk_writes(p), run_dir, merged, p.adapter_mode != "merge", free)


def eval_cost(p, rate_from: str | Path | None = None):
    """Answers and generated tokens the evaluation asks for (every row, each model, k samples), priced in
    hours by the throughput an earlier run (``rate_from``, its run folder) measured."""
    from ..plan.eval_cost import EvalCost, measured_rate

    w = configs.disk_writes(p)
    measured = measured_rate(rate_from) if rate_from else None
    return EvalCost(w.models, w.rows, w.samples, w.max_new_tokens, measured, w.not_counted)


class AdapterHasNoEffect(StepFailed):
    """The served merge answers as the base: the run fails instead of reporting an adapter that is not there."""


@dataclass
class EvalResult:
    """What the verdict reads: each model's accuracy table and, with an adapter, its parity check."""

    tables: dict[str, Any]  # label -> evaluate.score's accuracy table
    parity: Any = None  # adapters.ParityResult, or None: no adapter or no check
    paired: list | None = None  # paired.PairedDifference per scope ("all" first), or None: no adapter


def verdict(result: EvalResult) -> Verdict:
    """Accuracy of each model as the headline; fail when the adapter changes nothing (a merge that answers
    as the base), warn when parity could not confirm that vLLM serves the trained adapter."""
    tables, parity = result.tables, result.parity
    lines = [
        f"{label}: {r['accuracy']:.1%}, 95% CI [{r['ci95_low']:.1%}, {r['ci95_high']:.1%}], "
        f"{r['correct']} correct, scored on {r['scored_on']}"
        + (f"; {r['ran_out_thinking']} ran out of tokens while thinking" if r.get("ran_out_thinking") else "")
        for label, r in ((label, t.iloc[0]) for label, t in tables.items())
    ]
    lines += category_changes(tables)
    lines += [c.line() for c in result.paired or []]
    status = OK
    if parity is not None:
        lines += parity.lines()
        status = FAIL if parity.verdict == "no-effect" else (OK if parity.status == "pass" else WARN)
    head = headline(tables) if tables else "nothing was scored"
    if result.paired and result.paired[0].questions:
        overall = result.paired[0]
        head += f"; paired: {overall.verdict} ({100 * overall.difference:+.1f} points)"
    return Verdict(status, head, lines, AdapterHasNoEffect)
