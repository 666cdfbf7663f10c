"""The served evaluation: the base and the adapter each served, checked and asked every prompt, with one
server alive at a time and none left behind when a step fails.

A served LoRA is trusted only after parity says vLLM applies it; otherwise the adapter is merged into a
copy of the base and that copy is served and evaluated instead, so a reported adapter score is always
the trained adapter's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..plan import Machine, Plan, ServingInputs, reference_plan, serve_plan
from . import evaluate, harness, judge
from .client import ClientConfig, read_answers
from .harness import HarnessConfig
from .judge import JudgeConfig
from .serve_base import start_server, stop_on_error
from .serve_spec import ServeSettings

PARITY_REFERENCE = "parity reference (PEFT, fp32, host)"


@dataclass(frozen=True)
class ServedEvalConfig:
    """Everything the evaluation reads: the servers' settings and plan, how the client, the judge and lm-eval
    ask, and how the adapter is served and checked."""

    serve: ServeSettings
    plan: ServingInputs  # what the memory plan reads of the servers' settings
    client: ClientConfig
    adapter_mode: str  # lora: served beside the base, trusted after parity; merge: a merged copy is served
    lora_name: str  # name the adapter is served under
    parity_prompts: int  # prompts compared token by token
    parity_tol: float  # mean |logprob difference| accepted as equal
    merge_if_ignored: bool  # parity not 'applied' -> a merged copy is evaluated instead
    judge: JudgeConfig | None  # HLE-style rows' judge (base_url judge.SERVED: the served model); None: none
    harness: HarnessConfig | None  # lm-eval on each served model; None: no task


def serving_plan(inputs: ServingInputs, model: str, machine: Machine) -> Plan:
    """vLLM's share per GPU (or of the host) for ``model``, its FP8 blocks served as stored where they can."""
    from .serve_form import checkpoint_config, fp8_blocks_servable

    return serve_plan(inputs, model, machine, fp8_blocks=fp8_blocks_servable(checkpoint_config(model)))


class ServedEval:
    """Notebook 10's servers, one alive at a time, each stopped when a step fails.

    The base is served first (with ``--enable-lora`` when ``adapter_mode`` is ``lora``), once the memory
    plan says it fits. A served adapter is trusted only after the parity check; otherwise (or with
    ``adapter_mode: merge``) the adapter is merged into a copy of the base and that copy is served and
    evaluated instead. When the host cannot hold the PEFT reference (the plan says so, as for R1), the
    reference is the served merge: samples are taken from the LoRA server, the base is evaluated there,
    then the merge is served, completes the parity check and is evaluated as the adapter.
    """

    def __init__(
        self,
        config: ServedEvalConfig,
        run_dir: str | Path,
        model_path: str,
        adapter: Path | None,
        machine=None,
    ):
        self.config, self.run_dir, self.model_path, self.adapter = config, Path(run_dir), model_path, adapter
        self.serve_lora = bool(adapter) and config.adapter_mode == "lora"
        self.machine = machine or Machine.detect()
        self.server = None
        self.phases: dict[str, dict[str, float]] = {}
        self.parity = None
        self.parity_note = (
            "no adapter" if not adapter else f"adapter_mode={config.adapter_mode} (merged copy is served)"
        )
        self.samples = None  # served-reference parity: the LoRA server's half, finished on the merge's server
        self.stats: dict = {}
        self.judge_stats: dict = {}
        self.harness: dict[str, dict] = {}  # label -> lm-eval's results JSON
        self.served_forms: dict[str, str] = {}  # phase -> how the checkpoint is served (as stored, or bf16)

    def memory_plan(self) -> Plan:
        """vLLM's share per GPU (or host) for this model; the notebook shows it, start() refuses a misfit."""
        return serving_plan(self.config.plan, self.model_path, self.machine)

    def _launch(self, name: str, model_path: str, phase: str, lora: bool = False):
        if self.server is not None:
            self.server.stop()
        modules = {self.config.lora_name: str(self.adapter)} if lora else None
        self.server, self.served_forms[phase], self.phases[phase] = start_server(
            self.config.serve, self.run_dir, model_path, modules, name
        )
        return self.server

    def start(self, plan: Plan | None = None):
        """The base server (plus the adapter as a LoRA in lora mode) once the plan fits; returns it once it answers."""
        (plan or self.memory_plan()).check()
        return self._launch("server-base", self.model_path, "base", lora=self.serve_lora)

    def check_parity(self, prompts):
        """PEFT vs vLLM logprobs for a served LoRA; not 'applied' + merge_if_ignored → base restarted without LoRA."""
        from . import adapters

        if not self.serve_lora:
            return None
        c, prompts = self.config, prompts[: self.config.parity_prompts]
        ids = [pr.token_ids for pr in prompts]
        longest = max((len(t) for t in ids), default=1) + 16
        reference = reference_plan(self.model_path, self.machine, longest, PARITY_REFERENCE)
        if not reference.fits:
            with stop_on_error(self.server):
                self.samples = adapters.served_samples(
                    self.server.base_url,
                    c.serve.served_model_name,
                    c.lora_name,
                    ids,
                    key_env=c.serve.server_key_env,
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
                c.serve.served_model_name,
                c.lora_name,
                self.model_path,
                str(self.adapter),
                ids,
                tol=c.parity_tol,
                key_env=c.serve.server_key_env,
            )
        if self.parity.verdict != "applied" and c.merge_if_ignored:
            print("parity not applied: restarting the base without LoRA; the adapter will be merged")
            self.serve_lora = False
            self._launch("server-base-nolora", self.model_path, "base")
        return self.parity

    def evaluate(self, prompts) -> dict:
        """label -> client Stats for the base and (served or merged) adapter; answers resume per label. With a
        judge, each label's judged rows are judged right after its answers, while its server is up."""
        from . import adapters

        c, served_name = self.config, self.config.serve.served_model_name
        with stop_on_error(self.server):
            self._answer("base", served_name, prompts)
            if self.adapter and self.serve_lora:
                self._answer("adapter", c.lora_name, prompts)
        if self.adapter and not self.serve_lora:  # merge, then serve the merged copy
            self.server.stop()
            merged = adapters.merge_adapter(self.model_path, self.adapter, self.run_dir / "merged")
            self._launch("server-merged", str(merged), "adapter (merged)")
            with stop_on_error(self.server):
                if self.samples is not None:
                    self.parity = adapters.served_parity(
                        self.samples, self.server.base_url, served_name, c.parity_tol, c.serve.server_key_env
                    )
                self._answer("adapter", served_name, prompts)
        return self.stats

    def _answer(self, label: str, served_name: str, prompts) -> None:
        c, out = self.config, evaluate.results_path(self.run_dir, label)
        self.stats[label] = evaluate.run_eval(self.server.base_url, served_name, prompts, out, c.client)
        if c.judge is not None and any(pr.kind == "judged" for pr in prompts):
            config = judge.on_server(c.judge, self.server.base_url, served_name)
            self.judge_stats[label] = judge.judge(
                prompts,
                read_answers(out),
                judge.judgments_path(self.run_dir, label),
                config,
                c.client.samples,
            )
        if c.harness is not None:
            self.harness[label] = harness.run(
                c.harness, self.server.base_url, served_name, self.run_dir, label
            )

    @property
    def adapter_how(self) -> str:
        return "served as LoRA (parity: applied)" if self.serve_lora else "merged into a copy of the base"

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
