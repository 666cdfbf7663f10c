"""Notebook 10, serving and evaluation: model → prompts → plan → servers → parity → answers → scores → verdict."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data.plan import load_rows
from ..infer import evaluate, harness, judge
from ..infer.client import ClientConfig, read_answers
from ..infer.server import ServerSpec, VLLMServer
from ..plan import DiskPlan, Machine, Plan, ServingInputs, reference_plan, serve_plan
from . import FAIL, OK, WARN, StepFailed, Verdict


def plan_inputs(p) -> ServingInputs:
    """What the serving planner reads of notebook 10's parameters."""
    return ServingInputs(
        dtype=p.dtype,
        tensor_parallel_size=p.tensor_parallel_size,
        pipeline_parallel_size=p.pipeline_parallel_size,
        data_parallel_size=p.data_parallel_size,
        gpu_memory_utilization=p.gpu_memory_utilization,
        max_model_len=p.max_model_len,
        max_num_seqs=p.max_num_seqs,
        max_num_batched_tokens=p.max_num_batched_tokens,
        enforce_eager=p.enforce_eager,
        cpu_kv_cache_gib=float(p.server_env.get("VLLM_CPU_KVCACHE_SPACE", 4)),
        enable_expert_parallel=p.enable_expert_parallel,
    )


def server_spec(
    p,
    model_path: str,
    lora_modules: dict[str, str] | None = None,
    max_lora_rank: int | None = None,
    nodes: int | None = None,
) -> ServerSpec:
    """The server command notebook 10's parameters give for ``model_path`` (port 0: a free one), serving
    ``lora_modules`` (name -> adapter folder) up to rank ``max_lora_rank`` (default: the parameter), on a
    job of ``nodes`` nodes (default: the Slurm job's)."""
    from ..cluster.rendezvous import free_port

    nodes = nodes or job_nodes()
    across = p.data_parallel_size > 1 and p.data_parallel_backend == "ray" and nodes > 1
    return ServerSpec(
        model=model_path,
        port=p.port or free_port(),
        served_model_name=p.served_model_name,
        host=p.host,
        tensor_parallel_size=p.tensor_parallel_size,
        pipeline_parallel_size=p.pipeline_parallel_size,
        data_parallel_size=p.data_parallel_size,
        data_parallel_backend=p.data_parallel_backend,
        data_parallel_size_local=p.data_parallel_size_local
        or (p.data_parallel_size // nodes if across else 0),
        data_parallel_address=p.host if across else "",  # the head's address, which every node reaches
        data_parallel_rpc_port=free_port() if across else 0,
        enable_expert_parallel=p.enable_expert_parallel,
        distributed_executor_backend=p.distributed_executor_backend,
        gpu_memory_utilization=p.gpu_memory_utilization,
        max_num_seqs=p.max_num_seqs,
        max_num_batched_tokens=p.max_num_batched_tokens,
        max_model_len=p.max_model_len,
        dtype=p.dtype,
        enforce_eager=p.enforce_eager,
        seed=p.seed,
        lora_modules=dict(lora_modules or {}),
        max_lora_rank=p.max_lora_rank if max_lora_rank is None else max_lora_rank,
        reasoning_parser=p.reasoning_parser,
        extra_args=tuple(p.extra_args) + (judge.SERVED_JUDGE_ARGS if p.judge_url == "served" else ()),
        env=dict(p.server_env),
        server_key_env=p.server_key_env,
    )


def job_nodes() -> int:
    """Nodes of the Slurm job this runs in (1 outside one)."""
    from ..cluster.slurm import job_nodes as nodes

    return nodes()


def vllm_parse(command: list[str]):
    """vLLM's own parse of a server command line (after ``python -m MODULE``), with the serve checks it runs;
    argparse exits (SystemExit) on a flag it does not know, the checks raise on a value they refuse."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(command[3:])
    validate_parsed_serve_args(args)
    return args


def vllm_refuses(command: list[str]) -> str:
    """What vLLM's own argument parser and serve checks say against a server command line ("" when they
    accept it): a flag it does not know or a value it refuses, found before any allocation."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # argparse prints its reason, then exits
            vllm_parse(command)
    except SystemExit:
        lines = [line for line in said.getvalue().splitlines() if line.strip()]
        return lines[-1] if lines else "its argument parser exited"
    except (ValueError, TypeError) as err:
        return str(err)
    return ""


def planned_command(p, nodes: int) -> tuple[str, bool]:
    """(text, accepted): the base server's command as notebook 10 starts it on a ``nodes``-node job, its
    replicas, and vLLM's verdict on it where vLLM is installed (a login node may not have it)."""
    import shlex

    from .preflight import BadInput

    try:
        check_data_parallel(p, nodes)
    except BadInput as err:
        return f"vLLM server on {nodes} node(s): {err}", False
    spec = server_spec(p, p.model, nodes=nodes)
    command = spec.command(python="python")
    layout = f"{spec.data_parallel_size} replica(s) × TP {spec.tensor_parallel_size}"
    if spec.data_parallel_address:
        layout += (
            f", {spec.data_parallel_size_local} per node, replicas reach {spec.data_parallel_address}"
            f":{spec.data_parallel_rpc_port} ({spec.data_parallel_backend})"
        )
    try:
        import vllm

        refused = vllm_refuses(command)
        verdict = (
            f"vLLM {vllm.__version__} refuses it: {refused}"
            if refused
            else f"vLLM {vllm.__version__} accepts it"
        )
    except ImportError:
        refused, verdict = "", "vLLM is not installed here: not checked by its parser"
    text = f"vLLM server on {nodes} node(s), {layout}:\n  {shlex.join(command)}\n  {verdict}"
    return text, not refused


def check_data_parallel(p, nodes: int) -> None:
    """Replicas that cannot land as asked on a job of ``nodes`` nodes: BadInput with the fix."""
    from .preflight import BadInput

    dp = p.data_parallel_size
    if dp == 1 or nodes == 1:
        return
    if p.data_parallel_backend == "mp":
        raise BadInput(
            f"data_parallel_size {dp} on a {nodes}-node job with data_parallel_backend mp starts every replica "
            "on the first node, and the other nodes idle: set data_parallel_backend: ray (the job's Ray cluster "
            "places the replicas on every node), or submit with -N 1"
        )
    if not p.data_parallel_size_local and dp % nodes:
        raise BadInput(
            f"data_parallel_size {dp} does not split over the job's {nodes} nodes: make it a multiple of "
            f"{nodes}, or set data_parallel_size_local (the replicas on the first node)"
        )


def server(
    p,
    run_dir: str | Path,
    model_path: str,
    lora_modules: dict[str, str] | None = None,
    name: str = "server",
    max_lora_rank: int | None = None,
) -> VLLMServer:
    """A server of ``server_spec`` with its log (and pid file) at ``run_dir/logs/<name>.log``; not started."""
    spec = server_spec(p, model_path, lora_modules, max_lora_rank)
    return VLLMServer(spec, Path(run_dir) / "logs" / f"{name}.log", p.ready_timeout_s)


def client_config(p) -> ClientConfig:
    """How the evaluation asks the server (``concurrency`` 0: enough requests to keep the engine's batch full)."""
    return ClientConfig(
        concurrency=p.client_concurrency,
        timeout_s=p.request_timeout_s,
        retries=p.retries,
        max_tokens=p.max_new_tokens,
        temperature=p.temperature,
        key_env=p.server_key_env,
        chat=bool(p.reasoning_parser),
    )


def judge_config(p, served_url: str, served_name: str) -> judge.JudgeConfig | None:
    """Where HLE-style rows are judged: None without a judge; 'served': the model being evaluated, on its own
    server (a rehearsal of the protocol, not HLE's judge); else the endpoint and model the parameters name."""
    if not p.judge_url:
        return None
    served = p.judge_url == "served"
    return judge.JudgeConfig(
        base_url=served_url if served else p.judge_url,
        model=p.judge_model or served_name if served else p.judge_model,
        api_key_env=p.server_key_env if served else p.judge_key_env,
        key_param="server_key_env" if served else "judge_key_env",
        concurrency=p.client_concurrency,
        timeout_s=p.request_timeout_s,
        retries=p.retries,
        max_tokens=p.judge_max_tokens,
        max_chars=judge.SERVED_JUDGE_MAX_CHARS if served else 0,
    )


def harness_config(p, tokenizer_path: str) -> harness.HarnessConfig:
    """How lm-eval asks the served model: as many requests in flight as the evaluation, R1's </think> cut."""
    return harness.HarnessConfig(
        tasks=tuple(p.lm_eval_tasks),
        model_type=p.lm_eval_model,
        num_concurrent=p.client_concurrency,
        max_retries=p.retries,
        timeout_s=p.request_timeout_s,
        system_prompt=p.system_prompt,
        think_end_token="</think>",
        tokenizer=tokenizer_path,
        key_env=p.server_key_env,
        extra_args=tuple(p.lm_eval_args),
    )


def memory_plan(p, machine: Machine | None = None, model_path: str | None = None) -> list[Plan]:
    """vLLM serving the model on ``machine`` (this node by default), and with a LoRA adapter served for parity,
    the PEFT reference in fp32 on the host (512 tokens: the plan of the look-ahead; the step plans its prompts)."""
    from ..infer.serve_form import checkpoint_config, fp8_blocks_servable

    machine = machine or Machine.detect()
    model = model_path or p.model
    fp8_blocks = fp8_blocks_servable(checkpoint_config(model))
    plans = [serve_plan(plan_inputs(p), model, machine, fp8_blocks=fp8_blocks)]
    if p.lora_adapter and p.adapter_mode == "lora" and model_path is None:
        plans.append(reference_plan(model, machine, 512, "parity reference (PEFT, fp32, host)"))
    return plans


def disk_plan(p, run_dir: Path, free: float | None = None) -> DiskPlan:
    """What the evaluation writes into its run folder: the answers of each model (at most every row with
    max_new_tokens of text and reasoning), and with an adapter that is merged (adapter_mode merge, or a
    parity that falls back to a merge) the merged checkpoint's rewritten shards."""
    from ..plan.disk import DiskPlan, Write
    from .plans import merged_checkpoint_write

    models = 2 if p.lora_adapter else 1
    try:
        rows = len(load_rows(p.eval_dataset).rows)
        if p.eval_limit:
            rows = min(rows, p.eval_limit * len(p.eval_dataset.split(",")))
        basis = f"{models} model(s) × {rows:,} rows × (max_new_tokens {p.max_new_tokens:,} × 8 B + 1 KiB)"
    except (OSError, ValueError) as err:  # the data is not readable here (e.g. planning on a login node)
        rows, basis = 0, f"not counted: the evaluation data is not readable here ({err})"
    writes = [
        Write(
            "answers",
            str(run_dir),
            models * rows * (p.max_new_tokens * 8 + 1024),
            basis,
            "run_dir on a filesystem with room (DSR1KIT_RUN_DIR / --run-dir)",
        )
    ]
    if p.lora_adapter and (p.adapter_mode == "merge" or p.merge_if_ignored):
        try:
            adapter = resolve_adapter(p, run_dir)
        except FileNotFoundError:
            adapter = None
        write = merged_checkpoint_write(
            p.model,
            adapter,
            run_dir / "merged",
            "adapter_mode: lora with merge_if_ignored: false (no merged copy), or a run_dir with room",
        )
        if p.adapter_mode != "merge":
            write = Write(
                write.what + " (if parity falls back to it)",
                write.folder,
                write.bytes,
                write.basis,
                write.fix,
            )
        writes.append(write)
    return DiskPlan("vLLM evaluation", writes, free)


def load_model_and_tokenizer(model: str):
    """(local model path or hub name, tokenizer); 'tiny' builds the embedded model once."""
    from ..embedded.tiny import resolve_model
    from ..model.load import load_tokenizer

    path = resolve_model(model)
    return path, load_tokenizer(path)


def resolve_adapter(p, run_dir: str | Path):
    """lora_adapter as a folder: '' → None (base only), 'latest' → newest HARI adapter beside this run."""
    from ..infer.adapters import resolve_adapter as resolve

    return resolve(p.lora_adapter, run_dir)


@dataclass
class Prompts:
    """Every evaluation row asked for: the served prompts that fit, and each row left out with its reason."""

    accounting: Any  # evaluate.Accounting: kept prompts + excluded rows = every row asked for
    adapters: dict[str, str]  # evaluation set → the benchmark adapter that read it
    budget: int  # prompt tokens that leave room for max_new_tokens
    served_example: str

    @property
    def kept(self):
        return self.accounting.kept

    @property
    def totals(self) -> dict[str, int]:
        return self.accounting.totals()

    def describe(self) -> str:
        lines = [self.accounting.describe()]
        lines += [f"{name}: read as {adapter}" for name, adapter in self.adapters.items()]
        lines.append(f"prompt budget: {self.budget} tokens (max_model_len - max_new_tokens)")
        lines.append(f"first prompt as served: {self.served_example!r}")
        return "\n".join(lines)

    def excluded_frame(self):
        """One row per excluded row: its id, set, category, reason and detail (empty when none)."""
        import pandas as pd

        cols = ["id", "source", "category", "reason", "detail"]
        return pd.DataFrame(
            [{c: getattr(e, c) for c in cols} for e in self.accounting.excluded], columns=cols
        )

    def summary(self) -> dict[str, Any]:
        return {
            "n_total": self.accounting.asked,
            "n_scored": len(self.kept),
            "excluded_by_reason": self.accounting.reason_counts(),
            "excluded": [
                {"id": e.id, "source": e.source, "reason": e.reason, "detail": e.detail}
                for e in self.accounting.excluded
            ],
            "benchmark_adapters": self.adapters,
            "served_prompt_example": self.served_example,
        }


def preflight(p) -> None:
    """The server's key is there when required, every evaluation set loads and a benchmark adapter reads it,
    and a judge endpoint answers with the key and model named, before any run folder or server."""
    from ..benchmarks import UnknownSchema
    from ..infer import auth
    from .preflight import BadInput

    check_data_parallel(p, job_nodes())
    if p.require_server_key and not auth.key(p.server_key_env):
        raise BadInput(
            f"require_server_key: ${p.server_key_env} is not set, so the server would answer anyone on the "
            f"network; export the key it should demand (e.g. `export {p.server_key_env}=$(openssl rand -hex 32)`"
            f" in the job's environment), or set require_server_key: false to serve without one"
        )
    try:
        evaluate.load_items(p.eval_dataset, p.eval_limit)
    except UnknownSchema as err:
        raise BadInput(f"eval_dataset {err}") from None
    except (ValueError, FileNotFoundError, ConnectionError) as err:
        raise BadInput(
            f"eval_dataset {p.eval_dataset!r} cannot be read: {type(err).__name__}: {err}"
        ) from None
    if p.judge_url not in ("", "served"):
        try:
            judge.check_endpoint(p.judge_url, p.judge_model, p.judge_key_env)
        except judge.JudgeUnreachable as err:
            raise BadInput(f"judge_url: {err}") from None
    if p.lm_eval_tasks:
        try:
            harness.check_tasks(tuple(p.lm_eval_tasks))
        except harness.HarnessError as err:
            raise BadInput(str(err)) from None


def prepare_prompts(p, tokenizer) -> Prompts:
    """Rows → benchmark items (a schema no adapter reads stops here, before any server) → chat prompts
    formatted as in training → the context filter (max_model_len - max_new_tokens)."""
    adapted = evaluate.load_items(p.eval_dataset, p.eval_limit)
    prompts = evaluate.build_prompts(adapted.items, tokenizer, p.system_prompt)
    ctx = evaluate.filter_by_context(prompts, p.max_model_len, p.max_new_tokens)
    served = tokenizer.decode(ctx.kept[0].token_ids) if ctx.kept else ""
    return Prompts(evaluate.account(adapted, ctx), adapted.adapters, ctx.budget, served)


@contextlib.contextmanager
def stop_on_error(server):
    """Stop the server when the block raises (then re-raise): a failing cell leaves no server behind."""
    try:
        yield server
    except BaseException:
        server.stop()
        raise


class ServedEval:
    """Notebook 10's servers, one alive at a time, each stopped when a step fails.

    The base is served first (with ``--enable-lora`` when ``adapter_mode`` is ``lora``), once the memory
    plan says it fits. A served adapter is trusted only after the parity check; otherwise (or with
    ``adapter_mode: merge``) the adapter is merged into a copy of the base and that copy is served and
    evaluated instead. When the host cannot hold the PEFT reference (the plan says so, as for R1), the
    reference is the served merge: samples are taken from the LoRA server, the base is evaluated there,
    then the merge is served, completes the parity check and is evaluated as the adapter.
    """

    def __init__(self, p, run_dir: str | Path, model_path: str, adapter: Path | None, machine=None):
        self.p, self.run_dir, self.model_path, self.adapter = p, Path(run_dir), model_path, adapter
        self.serve_lora = bool(adapter) and p.adapter_mode == "lora"
        self.machine = machine or Machine.detect()
        self.server = None
        self.phases: dict[str, dict[str, float]] = {}
        self.parity = None
        self.parity_note = (
            "no adapter" if not adapter else f"adapter_mode={p.adapter_mode} (merged copy is served)"
        )
        self.samples = None  # served-reference parity: the LoRA server's half, finished on the merge's server
        self.stats: dict = {}
        self.judge_stats: dict = {}
        self.harness: dict[str, dict] = {}  # label -> lm-eval's results JSON
        self.served_forms: dict[
            str, str
        ] = {}  # phase -> how the checkpoint is served (as stored, or a bf16 copy)

    def memory_plan(self):
        """vLLM's share per GPU (or host) for this model; the notebook shows it, start() refuses a misfit."""
        return memory_plan(self.p, self.machine, self.model_path)[0]

    def _launch(self, name: str, model_path: str, phase: str, lora: bool = False):
        from ..infer import adapters
        from ..infer.serve_form import servable

        if self.server is not None:
            self.server.stop()
        model_path, self.served_forms[phase] = servable(model_path, self.run_dir / "served")
        modules = {self.p.lora_name: str(self.adapter)} if lora else None
        rank = (
            max(self.p.max_lora_rank, adapters.adapter_rank(self.adapter)) if lora else self.p.max_lora_rank
        )
        self.server = server(self.p, self.run_dir, model_path, modules, name=name, max_lora_rank=rank)
        with stop_on_error(self.server):
            self.server.start()
            self.phases[phase] = self.server.wait_ready()
        return self.server

    def start(self, plan=None):
        """The base server (plus the adapter as a LoRA in lora mode) once the plan fits; returns it once it answers."""
        (plan or self.memory_plan()).check()
        return self._launch("server-base", self.model_path, "base", lora=self.serve_lora)

    def check_parity(self, prompts):
        """PEFT vs vLLM logprobs for a served LoRA; not 'applied' + merge_if_ignored → base restarted without LoRA."""
        from ..infer import adapters

        if not self.serve_lora:
            return None
        prompts = prompts[: self.p.parity_prompts]
        reference = reference_plan(
            self.model_path,
            self.machine,
            max((len(pr.token_ids) for pr in prompts), default=1) + 16,
            "parity reference (PEFT, fp32, host)",
        )
        if not reference.fits:
            with stop_on_error(self.server):
                self.samples = adapters.served_samples(
                    self.server.base_url,
                    self.p.served_model_name,
                    self.p.lora_name,
                    [pr.token_ids for pr in prompts],
                    key_env=self.p.server_key_env,
                )
            self.serve_lora = False  # the adapter is evaluated on the served merge, which finishes the check
            self.parity_note = (
                "the PEFT reference does not fit this host ("
                + "; ".join(reference.problems())
                + "): the served LoRA's samples are taken now and compared with the served "
                "merge after the base is evaluated"
            )
            return None
        with stop_on_error(self.server):
            self.parity = adapters.parity_check(
                self.server.base_url,
                self.p.served_model_name,
                self.p.lora_name,
                self.model_path,
                str(self.adapter),
                [pr.token_ids for pr in prompts],
                tol=self.p.parity_tol,
                key_env=self.p.server_key_env,
            )
        if self.parity.verdict != "applied" and self.p.merge_if_ignored:
            print("parity not applied: restarting the base without LoRA; the adapter will be merged")
            self.serve_lora = False
            self._launch("server-base-nolora", self.model_path, "base")
        return self.parity

    def evaluate(self, prompts) -> dict:
        """label -> client Stats for the base and (served or merged) adapter; answers resume per label. With a
        judge, each label's judged rows are judged right after its answers, while its server is up."""
        from ..infer import adapters

        p, run_dir, client = self.p, self.run_dir, client_config(self.p)
        with stop_on_error(self.server):
            self._answer("base", p.served_model_name, prompts, client)
            if self.adapter and self.serve_lora:
                self._answer("adapter", p.lora_name, prompts, client)
        if self.adapter and not self.serve_lora:  # merge, then serve the merged copy
            self.server.stop()
            merged = adapters.merge_adapter(self.model_path, self.adapter, run_dir / "merged")
            self._launch("server-merged", str(merged), "adapter (merged)")
            with stop_on_error(self.server):
                if self.samples is not None:
                    self.parity = adapters.served_parity(
                        self.samples,
                        self.server.base_url,
                        p.served_model_name,
                        p.parity_tol,
                        p.server_key_env,
                    )
                self._answer("adapter", p.served_model_name, prompts, client)
        return self.stats

    def _answer(self, label: str, served_name: str, prompts, client: ClientConfig) -> None:
        out = evaluate.results_path(self.run_dir, label)
        self.stats[label] = evaluate.run_eval(self.server.base_url, served_name, prompts, out, client)
        config = judge_config(self.p, self.server.base_url, served_name)
        if config is not None and any(pr.kind == "judged" for pr in prompts):
            self.judge_stats[label] = judge.judge(
                prompts, read_answers(out), judge.judgments_path(self.run_dir, label), config
            )
        if self.p.lm_eval_tasks:
            config = harness_config(self.p, str(self.model_path))
            self.harness[label] = harness.run(config, self.server.base_url, served_name, self.run_dir, label)

    @property
    def adapter_how(self) -> str:
        return "served as LoRA (parity: applied)" if self.serve_lora else "merged into a copy of the base"

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


class AdapterHasNoEffect(StepFailed):
    """The served merge answers as the base: the run fails instead of reporting an adapter that is not there."""


def headline(tables) -> str:
    """One line per run: each model's overall accuracy with the n of N it was scored on."""
    overall = {label: t.iloc[0] for label, t in tables.items()}
    return "; ".join(f"{k} {r['accuracy']:.1%} (scored on {r['scored_on']})" for k, r in overall.items())


@dataclass
class EvalResult:
    """What the verdict reads: each model's accuracy table and, with an adapter, its parity check."""

    tables: dict[str, Any]  # label -> evaluate.score's accuracy table
    parity: Any = None  # adapters.ParityResult, or None: no adapter or no check


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
    status = OK
    if parity is not None:
        lines += parity.lines()
        status = FAIL if parity.verdict == "no-effect" else (OK if parity.status == "pass" else WARN)
    return Verdict(status, headline(tables) if tables else "nothing was scored", lines, AdapterHasNoEffect)


def category_changes(tables) -> list[str]:
    """Per category, base → adapter accuracy: with several evaluation sets (the new task and the old one),
    what the adapter gained on one and cost on the other, in one line each."""
    if "base" not in tables or "adapter" not in tables:
        return []
    base, adapted = tables["base"].set_index("category"), tables["adapter"].set_index("category")
    cats = [c for c in base.index if c != "all" and c in adapted.index]
    if len(cats) < 2:
        return []
    return [
        f"{cat}: base {base.loc[cat, 'accuracy']:.1%} → adapter {adapted.loc[cat, 'accuracy']:.1%} "
        f"({100 * (adapted.loc[cat, 'accuracy'] - base.loc[cat, 'accuracy']):+.1f} points, "
        f"scored on {base.loc[cat, 'scored_on']})"
        for cat in cats
    ]


def score_all(run_dir: str | Path, prompts, totals: dict[str, int], labels, judged: bool = False):
    """label -> accuracy table, and label -> per-example frame, from the answers (and, ``judged``, the
    judgments) files of the run."""
    tables, examples = {}, {}
    for label in labels:
        answers = read_answers(evaluate.results_path(run_dir, label))
        judgments = judge.read_judgments(judge.judgments_path(run_dir, label)) if judged else None
        examples[label], tables[label] = evaluate.score(prompts, answers, totals, judgments)
    return tables, examples


def judge_frame(run_dir: str | Path, examples):
    """Per model, HLE's numbers over its judged rows: accuracy ± the Wald 95% half-width, the RMS calibration
    error (with how it was binned); None when no row was judged."""
    import pandas as pd

    rows = []
    for label, df in examples.items():
        if not (df["kind"] == "judged").any():
            continue
        metrics = judge.hle_metrics(df, judge.read_judgments(judge.judgments_path(run_dir, label)))
        rows.append({"model": label, **metrics})
    return pd.DataFrame(rows) if rows else None


def answer_rules_frame(examples):
    """Rule → how many answers it read, per model (unparseable and missing answers included)."""
    import pandas as pd

    counts = {label: evaluate.rule_counts(df) for label, df in examples.items()}
    return pd.DataFrame(counts).fillna(0).astype(int).rename_axis("rule").reset_index()


def unparseable_frame(examples, limit: int = 20):
    """The first `limit` unparseable completions of each model, with their text."""
    import pandas as pd

    frames = [evaluate.unparseable(df).head(limit).assign(model=label) for label, df in examples.items()]
    cols = ["model", "id", "gold", "rule", "text"]
    return pd.concat(frames)[cols] if frames else pd.DataFrame(columns=cols)


def accuracy_frame(tables):
    import pandas as pd

    cols = [
        "model",
        "category",
        "accuracy",
        "ci95_low",
        "ci95_high",
        "correct",
        "ran_out_thinking",
        "scored_on",
    ]
    return pd.concat([t.assign(model=label) for label, t in tables.items()])[cols]


def thinking_frame(examples, tokenizer, max_new_tokens: int):
    """Per model, how long it thought (tokens of reasoning, by the model's tokenizer) and how many answers
    ran out of tokens while thinking (no answer: not a wrong one); None when no model reasoned. Also the
    rows whose prompt the server counted otherwise than the kit (the chat route renders its own)."""
    import pandas as pd

    rows = []
    for label, df in examples.items():
        answered = df[df["answered"]]
        lengths = pd.Series(
            [len(tokenizer.encode(t, add_special_tokens=False)) for t in answered["thinking"]]
        )
        if not (lengths > 0).any():
            continue
        served = answered["served_prompt_tokens"]
        rows.append(
            {
                "model": label,
                "answered": len(answered),
                "thinking_tokens_mean": round(float(lengths.mean()), 1),
                "thinking_tokens_median": float(lengths.median()),
                "thinking_tokens_p90": float(lengths.quantile(0.9)),
                "thinking_tokens_max": int(lengths.max()),
                "ran_out_thinking": int(answered["ran_out_thinking"].sum()),
                "max_new_tokens": max_new_tokens,
                "prompt_tokens_differ": int(((served > 0) & (served != answered["prompt_tokens"])).sum()),
                "lengths": lengths.tolist(),
            }
        )
    return pd.DataFrame(rows) if rows else None


def thinking_figure(frame):
    """Histogram of reasoning length per model, with max_new_tokens marked: where answers ran out."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    for row in frame.itertuples():
        ax.hist(row.lengths, bins=30, alpha=0.6, label=f"{row.model} ({row.ran_out_thinking} ran out)")
    ax.axvline(
        frame["max_new_tokens"].iloc[0], color="k", linestyle="--", linewidth=1, label="max_new_tokens"
    )
    ax.set_xlabel("reasoning length (tokens)")
    ax.set_ylabel("answers")
    ax.legend()
    plt.close(fig)
    return fig


def accuracy_table(frame):
    """accuracy_frame styled for the report: percentages, no index."""
    return frame.style.format({"accuracy": "{:.1%}", "ci95_low": "{:.1%}", "ci95_high": "{:.1%}"}).hide(
        axis="index"
    )


def throughput_table(stats) -> dict[str, str]:
    """Per model: tokens/s, requests/s and latency percentiles, one line each."""
    return {
        k: f"{s.tokens_per_s:.1f} tok/s, {s.summary()['requests_per_s']} req/s, "
        f"p50 {s.percentiles()['p50']:.2f} s, p90 {s.percentiles()['p90']:.2f} s"
        for k, s in stats.items()
    }


def comparison_frame(tables, examples):
    """Per category: base vs adapter accuracy, the difference, and how many answers changed."""
    import pandas as pd

    base, adapted = tables["base"].set_index("category"), tables["adapter"].set_index("category")
    changed = (
        examples["base"].set_index("id")["prediction"] != examples["adapter"].set_index("id")["prediction"]
    )
    by_cat = examples["base"].set_index("id")["category"]
    rows = []
    for cat in base.index:
        ids = by_cat.index if cat == "all" else by_cat.index[by_cat == cat]
        rows.append(
            {
                "category": cat,
                "base": base.loc[cat, "accuracy"],
                "adapter": adapted.loc[cat, "accuracy"],
                "delta": adapted.loc[cat, "accuracy"] - base.loc[cat, "accuracy"],
                "answers_changed": int(changed.loc[ids].sum()),
                "scored_on": base.loc[cat, "scored_on"],
            }
        )
    styled = pd.DataFrame(rows).style.format({"base": "{:.1%}", "adapter": "{:.1%}", "delta": "{:+.1%}"})
    return styled.hide(axis="index")


def latency_figure(stats):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    for label, s in stats.items():
        if s.latencies_s:
            ax.hist(s.latencies_s, bins=20, alpha=0.6, label=f"{label} ({s.tokens_per_s:.0f} tok/s)")
    ax.set_xlabel("request latency (s)")
    ax.set_ylabel("requests")
    ax.legend()
    plt.close(fig)
    return fig


def judge_table(frame):
    """judge_frame styled for the report: percentages, no index."""
    shown = frame.assign(
        accuracy=frame["accuracy"].map(lambda a: f"{a:.1%}"),
        ci95=frame["ci95_half_width"].map(lambda h: f"± {h:.1%}"),
        calibration_error=frame["calibration_error"].map(lambda c: f"{c:.1%}"),
    )
    cols = [
        "model",
        "accuracy",
        "ci95",
        "calibration_error",
        "calibration_note",
        "n",
        "judged",
        "correct",
        "unreadable_judgments",
    ]
    return shown[cols].style.hide(axis="index")


def harness_frame(results: dict[str, dict]):
    """lm-eval's results per model: task, filter, metric, value and stderr (None when nothing was run)."""
    import pandas as pd

    rows = [{"model": label, **row} for label, r in results.items() for row in harness.results_rows(r)]
    return pd.DataFrame(rows) if rows else None
