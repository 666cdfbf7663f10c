"""Notebook 10's parameters (``params.InferenceParams``) as the library's typed configs, in one place.

Every step that serves a model (notebook 10's evaluation, the forgetting sweep's served measurements)
builds its configs here, so a server is started with the same settings wherever it is started, and the
library reads only these configs.
"""

from __future__ import annotations

from ..infer import judge
from ..infer.client import ClientConfig
from ..infer.harness import HarnessConfig
from ..infer.prompts import PromptConfig, count_rows
from ..infer.serve_base import BaseServing
from ..infer.serve_spec import ServeSettings
from ..infer.served_eval import ServedEvalConfig
from ..plan import ServingInputs
from ..plan.serving_disk import ServingWrites


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


def serve_settings(p, nodes: int | None = None) -> ServeSettings:
    """Every server setting, on a job of ``nodes`` nodes (default: the Slurm job's, 1 outside one); a served
    judge adds its structured-output arguments."""
    from ..cluster.slurm import job_nodes

    served_judge = judge.SERVED_JUDGE_ARGS if p.judge_url == judge.SERVED else ()
    return ServeSettings(
        served_model_name=p.served_model_name,
        host=p.host,
        port=p.port,
        tensor_parallel_size=p.tensor_parallel_size,
        pipeline_parallel_size=p.pipeline_parallel_size,
        data_parallel_size=p.data_parallel_size,
        data_parallel_backend=p.data_parallel_backend,
        data_parallel_size_local=p.data_parallel_size_local,
        enable_expert_parallel=p.enable_expert_parallel,
        distributed_executor_backend=p.distributed_executor_backend,
        gpu_memory_utilization=p.gpu_memory_utilization,
        max_num_seqs=p.max_num_seqs,
        max_num_batched_tokens=p.max_num_batched_tokens,
        max_model_len=p.max_model_len,
        dtype=p.dtype,
        enforce_eager=p.enforce_eager,
        seed=p.seed,
        max_lora_rank=p.max_lora_rank,
        reasoning_parser=p.reasoning_parser,
        extra_args=tuple(p.extra_args) + served_judge,
        env=dict(p.server_env),
        server_key_env=p.server_key_env,
        ready_timeout_s=p.ready_timeout_s,
        nodes=nodes or job_nodes(),
    )


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
        top_p=p.top_p,
        samples=p.samples_per_question,
        seed=p.sample_seed,
    )


def judge_config(p) -> judge.JudgeConfig | None:
    """Where HLE-style rows are judged: None without a judge; 'served': the model being evaluated, on its own
    server (``judge.on_server`` fills in where, a rehearsal of the protocol, not HLE's judge); else the
    endpoint and model the parameters name."""
    if not p.judge_url:
        return None
    served = p.judge_url == judge.SERVED
    return judge.JudgeConfig(
        base_url=p.judge_url,
        model=p.judge_model,
        api_key_env=p.server_key_env if served else p.judge_key_env,
        key_param="server_key_env" if served else "judge_key_env",
        concurrency=p.client_concurrency,
        timeout_s=p.request_timeout_s,
        retries=p.retries,
        max_tokens=p.judge_max_tokens,
        max_chars=judge.SERVED_JUDGE_MAX_CHARS if served else 0,
    )


def harness_config(p, tokenizer_path: str) -> HarnessConfig:
    """How lm-eval asks the served model: as many requests in flight as the evaluation, R1's </think> cut."""
    return HarnessConfig(
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
        gen_kwargs=sampling_kwargs(p),
    )


def sampling_kwargs(p) -> tuple[str, ...]:
    """lm-eval's ``--gen_kwargs`` for the evaluation's own sampling (T, top_p), so that both score the same
    decoding; () when the evaluation is greedy (each task's own generation settings then hold)."""
    if p.temperature == 0:
        return ()
    return (f"temperature={p.temperature}",) + ((f"top_p={p.top_p}",) if p.top_p < 1 else ())


def prompt_config(p) -> PromptConfig:
    return PromptConfig(p.eval_dataset, p.eval_limit, p.system_prompt, p.max_model_len, p.max_new_tokens)


def eval_config(p, model_path: str) -> ServedEvalConfig:
    """The served evaluation of the model at ``model_path`` (lm-eval tokenizes with it)."""
    return ServedEvalConfig(
        serve=serve_settings(p),
        plan=plan_inputs(p),
        client=client_config(p),
        adapter_mode=p.adapter_mode,
        lora_name=p.lora_name,
        parity_prompts=p.parity_prompts,
        parity_tol=p.parity_tol,
        merge_if_ignored=p.merge_if_ignored,
        judge=judge_config(p),
        harness=harness_config(p, str(model_path)) if p.lm_eval_tasks else None,
    )


def base_serving(p) -> BaseServing:
    """The base served as notebook 10 serves it (for ``infer.serve_base.serve_base``)."""
    return BaseServing(model=p.model, serve=serve_settings(p), client=client_config(p))


def disk_writes(p) -> ServingWrites:
    """What sizes the evaluation's answers: the base and the adapter (when there is one), every row asked,
    each ``samples_per_question`` times."""
    rows, not_counted = count_rows(p.eval_dataset, p.eval_limit)
    return ServingWrites(
        2 if p.lora_adapter else 1, rows, p.max_new_tokens, not_counted, p.samples_per_question
    )
