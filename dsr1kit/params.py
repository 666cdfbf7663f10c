"""Typed parameters for each notebook, loaded from ``params/<set>/<notebook>.yaml``.

Every notebook has one parameter model here. A YAML file holds flat keys that
are exactly the notebook's parameter names, so the same file works with
``dsr1kit run -f`` and with papermill's ``-f``. Validation happens before any
GPU work and reports every problem at once: unknown keys (with the valid
ones), wrong types (key, value, expected type) and anything that looks like a
secret. Secrets come from the environment only, because papermill writes
parameters into the executed notebook, i.e. into the report.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# A name part such as hf_token, HF_TOKEN, --api-key, secret_key (not max_new_tokens, not --tokenizer).
SECRET_NAME = re.compile(
    r"(?:^|[_\-.])(token|secret|password|passwd|api[_-]?key|credentials?)(?:$|[_\-.])", re.I
)
SECRET_VALUE = re.compile(r"^(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|ghp_[A-Za-z0-9]{20,})$")
# Keys that contain a secret-ish word but hold no secret.
NOT_SECRET = {"max_new_tokens", "max_num_batched_tokens", "kl_tokens"}
SECRET_ENV_HINT = {"hf": "HF_TOKEN", "openai": "OPENAI_API_KEY", "wandb": "WANDB_API_KEY"}


class ParamsError(ValueError):
    """Raised with every problem of a parameter set, one per line."""

    def __init__(self, notebook: str, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid parameters for {notebook}:\n{lines}")


class NotebookParams(BaseModel):
    """Base: forbids unknown keys; subclasses set ``notebook``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    notebook: str = Field("", exclude=True, repr=False)

    run_dir: str = Field("", description="Run folder; set by `dsr1kit run`; '': a fresh one under runs/")
    seed: int = Field(0, description="Seed for every random choice in the run")

    @classmethod
    def keys(cls) -> list[str]:
        return [k for k in cls.model_fields if k != "notebook"]

    @classmethod
    def validate_dict(cls, values: dict[str, Any]) -> "NotebookParams":
        """Validate a flat dict; raise ParamsError listing all problems."""
        name = cls.model_fields["notebook"].default
        problems = [
            f"key {k!r} ({type(k).__name__}) is not a parameter name: keys are words such as 'lr'; "
            f"quote it in YAML if it is one"
            for k in values
            if not isinstance(k, str)
        ]
        values = {k: v for k, v in values.items() if isinstance(k, str)}
        problems += _secret_problems(values)
        clean = {k: v for k, v in values.items() if not _looks_secret(k, v)}
        try:
            model = cls(**clean)
        except ValidationError as err:
            problems += [_describe(e, cls) for e in err.errors()]
        if problems:
            raise ParamsError(name, problems)
        return model

    @classmethod
    def from_namespace(cls, namespace: dict[str, Any]) -> "NotebookParams":
        """Collect this model's keys from a notebook's globals() and validate them."""
        return cls.validate_dict({k: namespace[k] for k in cls.keys() if k in namespace})

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _looks_secret(key: str, value: Any) -> bool:
    """A top-level key or value that is (or holds) a secret."""
    return bool(_secret_paths(key, value))


def _secret_name(name: str) -> bool:
    name = name.lstrip("-")
    return bool(SECRET_NAME.search(name)) and name.replace("-", "_") not in NOT_SECRET


def _secret_paths(path: str, value: Any) -> list[str]:
    """Where in `value` (named `path`) a secret sits: a secret-like name, a token-shaped string, a dict
    entry named like one (``server_env: {HF_TOKEN: …}``), or the value after a secret-named flag in a list
    (``extra_args: [--api-key, sk-…]`` or ``--api-key=…``)."""
    if _secret_name(path.rsplit(".", 1)[-1].split("[", 1)[0].lstrip("-")) and value not in ("", None, [], {}):
        return [path]
    if isinstance(value, str):
        return [path] if SECRET_VALUE.match(value.strip()) else []
    found: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            found += _secret_paths(f"{path}.{k}", v)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            flag = isinstance(item, str) and item.startswith("-") and _secret_name(item.split("=", 1)[0])
            if flag and "=" in item and item.split("=", 1)[1]:
                found.append(f"{path}[{i}]")
            elif flag and i + 1 < len(value):
                found.append(f"{path}[{i + 1}]")
            elif not (i > 0 and f"{path}[{i}]" in found):
                found += _secret_paths(f"{path}[{i}]", item)
    return found


def _secret_problems(values: dict[str, Any]) -> list[str]:
    out = []
    for key, value in values.items():
        for where in _secret_paths(str(key), value):
            env = next((v for k, v in SECRET_ENV_HINT.items() if k in where.lower()), "HF_TOKEN")
            leaf = where.rsplit(".", 1)[-1]
            if "." in where and _secret_name(leaf):
                env = leaf  # server_env: {VLLM_API_KEY: …} → export VLLM_API_KEY
            what = (
                f"'{where}'" if SECRET_NAME.search(where) and "[" not in where else f"the value of '{where}'"
            )
            out.append(
                f"{what} looks like a secret: secrets are never parameters (they would be written into the "
                f"report and params.yaml); remove it and export it in the environment instead, e.g. "
                f"`export {env}=...` (servers and ranks inherit the environment)"
            )
    return out


def _describe(error: dict[str, Any], model: type[BaseModel]) -> str:
    key = ".".join(str(p) for p in error["loc"]) or "<root>"
    if error["type"] == "extra_forbidden":
        valid = [k for k in model.model_fields if k != "notebook"]
        return f"unknown key '{key}'; valid keys: {', '.join(valid)}"
    if not error["loc"]:  # a rule across keys
        return error["msg"].removeprefix("Value error, ")
    value = error.get("input")
    field = model.model_fields.get(str(error["loc"][0])) if error["loc"] else None
    expected = _type_name(field.annotation) if field else "?"
    return f"'{key}': value {value!r} ({type(value).__name__}) is not a valid {expected}: {error['msg']}"


def _type_name(annotation: Any) -> str:
    name = getattr(annotation, "__name__", None)
    return (
        name if name and not getattr(annotation, "__args__", None) else str(annotation).replace("typing.", "")
    )


# ---------------------------------------------------------------------------
# One model per notebook. Defaults are the tiny CPU set (the demo and tests); a
# parameter file holds only what differs, and each notebook's parameters cell
# is rendered from these fields (dsr1kit.run.parameters_cell), so a default and its
# help live here alone.


def section(title: str) -> dict[str, Any]:
    """Field extra that starts a titled group in the rendered parameters cell."""
    return {"section": title}


class ClusterCheckParams(NotebookParams):
    notebook: str = Field("00_cluster_check", exclude=True, repr=False)
    expected_nodes: int = Field(1, ge=1, description="Nodes the job should span")
    expected_gpus_per_node: int = Field(0, ge=0, description="GPUs each node must see; 0: CPU run")
    shm_min_free_gib: float = Field(0.25, ge=0, description="/dev/shm free space below this fails, GiB")
    scratch_dir: str = Field("", description="Node-local scratch (NVMe); '': $NVME_DIR, $TMPDIR or /tmp")
    scratch_min_free_gib: float = Field(1.0, ge=0, description="Scratch free space below this warns, GiB")
    allreduce_sizes_mib: list[float] = Field([1.0, 4.0], description="All-reduce message sizes, MiB")
    allreduce_timeout_s: float = Field(
        120.0, gt=0, description="Ranks that have not joined by then are reported missing"
    )
    local_ranks: int = Field(2, ge=1, description="Processes for the all-reduce when run outside Slurm")
    expected_busbw_gbps: float = Field(
        0.0, ge=0, description="Expected all-reduce bus bandwidth, GB/s; 0: no target"
    )
    staged_model: str = Field(
        "", description="Model every node must hold complete (repo id or folder); '': not checked"
    )
    staged_model_dir: str = Field(
        "", description="Hub cache the repo id is staged in; '': $HF_HUB_CACHE; {node}: each node's own"
    )
    ray_address: str = Field("", description="Ray head to inspect (host:port); '': no Ray check")
    ray_expected_gpus: int = Field(0, ge=0, description="GPUs Ray must report; 0: not checked")
    rank_results_dir: str = Field(
        "", description="Folder of the per-rank rows written by srun; '': run `local_ranks` processes here"
    )
    plan_files: list[str] = Field(
        [
            "params/tiny/10_vllm_inference.yaml",
            "params/tiny/20_hari_training.yaml",
            "params/tiny/30_adapter_inspection.yaml",
        ],
        description="Params files of the steps to come ('A.yaml' or layered 'A.yaml+B.yaml'), "
        "each memory-planned against this node",
    )


class InferenceParams(NotebookParams):
    notebook: str = Field("10_vllm_inference", exclude=True, repr=False)
    model: str = Field(
        "tiny",
        description="HF repo, local dir, or 'tiny' for the embedded model",
        json_schema_extra=section("model and server"),
    )
    served_model_name: str = Field("model", description="Name the server answers to")
    host: str = Field("127.0.0.1", description="Address the server binds to and the client calls")
    port: int = Field(0, ge=0, le=65535, description="Server port; 0: a free one")
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs per model replica (all GPUs of all nodes on R1)"
    )
    pipeline_parallel_size: int = Field(1, ge=1, description="Pipeline stages (usually 1: TP across nodes)")
    data_parallel_size: int = Field(1, ge=1, description="Model replicas")
    data_parallel_backend: Literal["mp", "ray"] = Field(
        "mp",
        description="Where replicas run: mp on this node; ray on every node of the job (its Ray cluster)",
    )
    data_parallel_size_local: int = Field(
        0, ge=0, description="Replicas on this node; 0: data_parallel_size / the job's nodes (ray), all (mp)"
    )
    enable_expert_parallel: bool = Field(
        False, description="Spread MoE experts over the GPUs instead of slicing them"
    )
    distributed_executor_backend: Literal["mp", "ray", "uni"] = Field(
        "mp", description="ray across nodes (the sbatch brings Ray up); mp on one node and on CPU"
    )
    gpu_memory_utilization: float = Field(
        0.90,
        gt=0,
        le=1,
        description="Start at 0.90, raise once stable; on CPU the share of host memory claimed at start",
    )
    max_num_seqs: int = Field(
        16, ge=1, description="Sequences per engine step; raise step by step once stable"
    )
    max_num_batched_tokens: int = Field(2048, ge=1, description="Tokens per engine step; raise once stable")
    max_model_len: int = Field(
        512,
        ge=16,
        description="Context; prompts longer than this minus max_new_tokens are excluded and counted",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Weights dtype; auto: the checkpoint's (R1: FP8)"
    )
    enforce_eager: bool = Field(True, description="Skip graph capture/compile: faster start, slower decode")
    extra_args: list[str] = Field([], description="Extra `vllm serve` arguments, verbatim")
    reasoning_parser: str = Field(
        "",
        description="vLLM --reasoning-parser (R1: deepseek_r1): answers asked through chat, read from the "
        "content the server splits off; '': token-id prompts, reasoning cut at the last </think> by the kit",
    )
    server_env: dict[str, str] = Field(
        {"VLLM_CPU_KVCACHE_SPACE": "1"},
        description="Extra environment for the server (here: GiB of KV cache on CPU)",
    )
    ready_timeout_s: float = Field(
        300.0, gt=0, description="Wait this long for /health and a first completion, s"
    )
    server_key_env: str = Field(
        "VLLM_API_KEY",
        description="Environment variable holding the key the server demands and the kit's clients send "
        "(never the key); unset: no key; '': no key even if VLLM_API_KEY is exported",
    )
    require_server_key: bool = Field(
        False,
        description="Refuse to start when server_key_env is not set (a shared cluster: others can query)",
    )
    lora_adapter: str = Field(
        "latest",
        description="Adapter folder to compare with the base; 'latest': newest "
        "HARI run's adapter beside this run; '': base only",
        json_schema_extra=section("adapter"),
    )
    lora_name: str = Field("adapter", description="Name the adapter is served under")
    max_lora_rank: int = Field(16, ge=1, description="vLLM --max-lora-rank; must be at least the adapter's r")
    adapter_mode: Literal["lora", "merge"] = Field(
        "merge",
        description="lora: --enable-lora + parity check; merge: serve a merged copy of the base "
        "(MoE on CPU, or an adapter vLLM ignores)",
    )
    merge_if_ignored: bool = Field(True, description="Parity not 'applied' -> evaluate a merged copy instead")
    parity_prompts: int = Field(3, ge=1, description="Prompts compared token by token, PEFT vs vLLM")
    parity_tol: float = Field(
        0.1, gt=0, description="Mean |logprob difference| accepted as equal (bf16 noise)"
    )
    eval_dataset: str = Field(
        "data/eval_tiny.jsonl",
        description="Evaluation set (local jsonl or hub name); several, "
        "comma-separated, are scored together and kept apart by category",
        json_schema_extra=section("evaluation"),
    )
    eval_limit: int = Field(0, ge=0, description="Evaluate at most this many examples of each set; 0: all")
    system_prompt: str = Field("You are DeepSeek-R1.", description="Same system prompt as training")
    max_new_tokens: int = Field(48, ge=1, description="Generated tokens per answer")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature; 0: greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (R1: 0.95); 1: off")
    samples_per_question: int = Field(1, ge=1, description="k answers per question (own request, own seed)")
    sample_seed: int = Field(0, ge=0, description="Sample j is asked with seed sample_seed + j")
    concurrency: int = Field(
        0,
        ge=0,
        description="Requests in flight; 0: 2 x max_num_seqs x data_parallel_size, "
        "so the engine's batch stays full",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="Per-request timeout, s")
    retries: int = Field(
        3, ge=0, description="Retries per request on connection errors and 5xx (with backoff)"
    )
    judge_url: str = Field(
        "",
        description="Judge of HLE-style rows: '' none (scored by exact match, and said so); 'served': "
        "the model this notebook serves; or an OpenAI-compatible endpoint (http://host:port)",
        json_schema_extra=section("judge"),
    )
    judge_model: str = Field("", description="Model name at judge_url; '' with 'served': the served model")
    judge_key_env: str = Field(
        "",
        description="Name of the environment variable holding judge_url's API key (never the key); '': none",
    )
    judge_max_tokens: int = Field(4096, ge=16, description="Tokens per judgment (HLE's judge script: 4096)")
    lm_eval_tasks: list[str] = Field(
        [],
        description="lm-evaluation-harness tasks run on each served model: lm-eval's names, or paths of task "
        "YAML files (e.g. over a local jsonl); []: none",
        json_schema_extra=section("lm-evaluation-harness"),
    )
    lm_eval_model: Literal["local-chat-completions", "local-completions"] = Field(
        "local-chat-completions",
        description="chat: generative tasks, chat template applied by the server, reasoning cut at </think>; "
        "completions: log-likelihood tasks",
    )
    lm_eval_args: list[str] = Field(
        [], description="Extra `lm_eval run` arguments, verbatim (e.g. --limit 50)"
    )

    @field_validator("judge_url")
    @classmethod
    def _judge_url_form(cls, value: str) -> str:
        if value not in ("", "served") and not re.match(r"^https?://[^\s/]+", value):
            raise ValueError("give '', 'served' or an http(s):// URL of an OpenAI-compatible endpoint")
        return value.rstrip("/")

    @field_validator("reasoning_parser")
    @classmethod
    def _parser_is_a_name(cls, value: str) -> str:
        if value and not re.fullmatch(r"[a-z0-9_]+", value):
            raise ValueError("a vLLM reasoning parser's name, e.g. deepseek_r1, or '' for none")
        return value

    @field_validator("judge_key_env", "server_key_env")
    @classmethod
    def _key_is_a_variable_name(cls, value: str) -> str:
        if value and not re.fullmatch(r"[A-Z_][A-Z0-9_]*", value):
            raise ValueError(
                "names the environment variable that holds the key (e.g. VLLM_API_KEY), not the "
                "key itself: export the key under that name"
            )
        return value

    @model_validator(mode="after")
    def _required_key_has_a_variable(self):
        if self.require_server_key and not self.server_key_env:
            raise ValueError("require_server_key needs server_key_env (the variable that holds the key)")
        return self

    @model_validator(mode="after")
    def _judge_endpoint_needs_a_model(self):
        if self.judge_url not in ("", "served") and not self.judge_model:
            raise ValueError(f"judge_url {self.judge_url!r} needs judge_model (the model name it serves)")
        return self

    @model_validator(mode="after")
    def _samples_need_sampling(self):
        if self.samples_per_question > 1 and self.temperature == 0:
            raise ValueError(
                f"samples_per_question {self.samples_per_question} at temperature 0 asks the same greedy answer "
                f"{self.samples_per_question} times: set temperature (R1: 0.6, top_p 0.95) or samples_per_question: 1"
            )
        return self

    @property
    def client_concurrency(self) -> int:
        """Fewer requests in flight than the engine batches leaves its batch part-empty; a queue of as
        many again refills a finished sequence's slot in the next step instead of after an HTTP round trip."""
        return self.concurrency or 2 * self.max_num_seqs * self.data_parallel_size


class HariParams(NotebookParams):
    notebook: str = Field("20_hari_training", exclude=True, repr=False)
    model: str = Field(
        "tiny",
        description="HF repo, local dir, or 'tiny' for the embedded model",
        json_schema_extra=section("model and data"),
    )
    dataset: str = Field(
        "data/sft_tiny.jsonl", description="Dataset plan: repo[:limit][@split+split],… or JSON list"
    )
    sample_limit: int = Field(
        320,
        ge=0,
        description="Global cap on samples; 0: all (tiny: rows 320-359 stay "
        "held out for notebook 30's probes)",
    )
    splits: list[str] = Field(["train", "validation", "test"], description="Default splits per source")
    system_prompt: str = Field(
        "You are DeepSeek-R1.",
        description="System prompt of every training chat (the same one evaluation uses)",
    )
    max_len: int = Field(256, ge=16, description="Tokens per sample; longer ones are truncated and counted")
    quantization: Literal["nf4", "none"] = Field(
        "none", description="nf4: QLoRA (double quant, bf16 compute); none: the plain model"
    )
    quantize_experts: bool = Field(False, description="Also NF4 the fused MoE experts (needed for R1)")
    dtype: Literal["bfloat16", "float32"] = Field(
        "float32", description="Compute dtype; on CPU fp32 is faster than emulated bf16"
    )
    device_map: Literal["contiguous", "round_robin", "cpu"] = Field(
        "cpu",
        description="Layer placement: contiguous blocks per GPU, round_robin (layer i on GPU i % n), or cpu",
    )
    max_memory_gib_per_gpu: float = Field(
        78.0, gt=0, description="GiB per GPU the placement may fill (78 on 80 GB GPUs)"
    )
    cpu_max_memory_gib: float = Field(300.0, gt=0, description="GiB of host memory the placement may fill")
    offload_dir: str = Field("", description="Per-rank offload folder root (node-local NVMe); '': none")
    lora_r: int = Field(4, ge=1, description="LoRA rank", json_schema_extra=section("LoRA"))
    lora_alpha: float = Field(
        8.0, gt=0, description="LoRA scale numerator (the update is scaled by alpha / r)"
    )
    lora_dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the LoRA input; 0 keeps the fast path exact"
    )
    lora_targets: list[str] = Field([], description="Module names; []: auto-detect the attention projections")
    lora_last_k_layers: int = Field(1, ge=1, description="Adapt the last K decoder layers")
    lr: float = Field(
        0.01,
        gt=0,
        description="Peak learning rate (R1: 5e-5; a 3.7M model needs a bigger step)",
        json_schema_extra=section("optimisation"),
    )
    batch_size: int = Field(4, ge=1, description="Samples per micro-batch, per rank")
    grad_accum: int = Field(2, ge=1, description="Micro-batches per optimizer step")
    epochs: int = Field(1, ge=1, description="Passes over the data")
    max_steps: int = Field(0, ge=0, description="Optimizer steps; 0: epochs decide")
    warmup_ratio: float = Field(0.1, ge=0, le=1, description="Share of steps with a linear warm-up")
    clip_norm: float = Field(1.0, gt=0, description="Gradient norm clip")
    log_every: int = Field(3, ge=1, description="Optimizer steps between metric lines")
    save_every: int = Field(15, ge=1, description="Optimizer steps between checkpoints (and on SIGUSR1)")
    snapshot_every: int = Field(
        0,
        ge=0,
        description="Optimizer steps between adapter snapshots kept under snapshots/ (the trajectory that "
        "early stopping picks from); 0: none",
    )
    snapshot_steps: list[int] = Field(
        [],
        description="Also keep an adapter snapshot at these optimizer steps (dense early, where SFT moves fast)",
    )
    lambda_kl: float = Field(
        0.1,
        ge=0,
        description="Weight of the KL term; 0 disables it; 0.05-0.2 is the stable start",
        json_schema_extra=section("HARI"),
    )
    kl_temperature: float = Field(
        1.5, gt=0, description="Softmax temperature T of the KL term (scaled by T²)"
    )
    kl_tokens: Literal["all", "assistant"] = Field("all", description="Tokens the KL term covers")
    hari_impl: Literal["fast", "naive"] = Field(
        "fast",
        description="fast: one base pass with the adapter "
        "disabled from the first adapted layer; naive: two full passes",
    )
    loss_chunk: int = Field(128, ge=1, description="Tokens per chunk of the lm_head/CE/KL pass")
    grad_checkpointing: bool = Field(
        False, description="Recompute activations in backward: less memory, slower"
    )
    trust_remote_code: bool = Field(
        False, description="Run the checkpoint's own modeling code (R1: not needed)"
    )
    resume: bool = Field(True, description="Resume from the run folder's checkpoint when present")
    prefix_cache: str = Field(
        "off",
        description="off; auto; or a folder. The hidden states entering the first "
        "adapted layer, computed once and reused by every step and epoch (auto: reuse or "
        "build one per fingerprint under the kit's cache)",
        json_schema_extra=section("prefix cache"),
    )
    prefix_tokens_per_batch: int = Field(
        2048, ge=1, description="Padded tokens per micro-batch of the prefix pass (samples sorted by length)"
    )
    prefix_shard_mib: float = Field(
        4.0, gt=0, description="MiB per cache shard; a killed pass redoes only unfinished shards (R1: 2048)"
    )
    prefix_pipeline: bool = Field(
        True, description="Prefix pass as a wavefront over the node's GPUs (GPU k on micro-batch t-k)"
    )
    cached_layers_nf4: bool = Field(
        False, description="From the cache, load the adapted layers in NF4 (else in dtype; bf16 on GPUs)"
    )
    reference_cache: bool = Field(
        True,
        description="With a prefix cache and lambda_kl > 0: the KL's reference (the adapted layers with the "
        "adapter off) computed once per sample and stored beside the prefix cache, so a step runs the adapted "
        "layers once instead of twice (off: every step computes it)",
    )
    prefix_precision: Literal["auto", "fp8", "nf4", "bf16"] = Field(
        "auto",
        description="How the prefix pass holds the frozen model: fp8 (an FP8 checkpoint's weights as stored, "
        "block-scaled FP8 GEMMs), nf4, bf16 (unquantized, in dtype); auto: fp8 for an FP8 checkpoint on GPUs "
        "with FP8 units (compute capability 8.9 or newer), else as quantization / quantize_experts load it",
    )

    @field_validator("prefix_cache")
    @classmethod
    def _prefix_cache_given(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("empty: give off, auto, or a folder for the prefix cache")
        return value

    @model_validator(mode="after")
    def _prefix_cache_needs_fast_path(self):
        if self.prefix_cache != "off" and self.hari_impl != "fast":
            raise ValueError(
                f"prefix_cache {self.prefix_cache!r} needs hari_impl 'fast' (the naive path runs the "
                f"whole model on every step); set hari_impl: fast or prefix_cache: off"
            )
        return self


class InspectParams(NotebookParams):
    notebook: str = Field("30_adapter_inspection", exclude=True, repr=False)
    adapter_dir: str = Field(
        "latest", description="PEFT adapter folder; 'latest': newest HARI run's adapter under runs/"
    )
    base_model: str = Field("", description="Base model; '': the adapter's base_model_name_or_path")
    quantization: Literal["nf4", "none"] = Field("none", description="nf4: load the base as notebook 20 does")
    quantize_experts: bool = Field(
        False, description="Also NF4 the fused MoE experts, as notebook 20 loads R1"
    )
    probe_dataset: str = Field(
        "data/sft_tiny.jsonl", description="The training data: its trained and held-out rows are probed"
    )
    retain_dataset: str = Field("data/retain_tiny.jsonl", description="Text unrelated to training")
    n_probe: int = Field(32, ge=1, description="Rows per probe set")
    n_generate: int = Field(3, ge=0, description="Greedy answers shown side by side")
    max_new_tokens: int = Field(48, ge=1, description="Tokens per greedy answer")
    system_prompt: str = Field("You are DeepSeek-R1.", description="Same system prompt as training")
    max_len: int = Field(256, ge=16, description="Tokens per probe row")
    merge_out: str = Field(
        "merged", description="Merged checkpoint folder, relative to the run folder; '': no merge"
    )

    @field_validator("adapter_dir")
    @classmethod
    def _adapter_given(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("empty: give an adapter folder, or 'latest' for the newest HARI run's adapter")
        return value


SET_BY_SWEEP = (
    "run_dir",
    "model",
    "dataset",
    "lambda_kl",
    "seed",
    "system_prompt",
    "max_len",
    "snapshot_every",
    "snapshot_steps",
)


class SweepParams(NotebookParams):
    notebook: str = Field("40_forgetting_sweep", exclude=True, repr=False)
    model: str = Field(
        "tiny",
        description="Base model of every run (HF repo, local dir, or 'tiny')",
        json_schema_extra=section("tasks"),
    )
    task_b_train: str = Field("data/task_b_train.jsonl", description="Training data: the new task B")
    task_b_eval: str = Field("data/task_b_eval.jsonl", description="Held-out rows of task B")
    task_a_eval: str = Field(
        "data/task_a_eval.jsonl", description="Held-out rows of the old task A (what should not be forgotten)"
    )
    eval_limit: int = Field(200, ge=1, description="Rows per evaluation set")
    system_prompt: str = Field("You are DeepSeek-R1.", description="System prompt of training and evaluation")
    max_len: int = Field(256, ge=16, description="Tokens per sample, in training and evaluation")
    lambdas: list[float] = Field(
        [0.0, 0.05, 0.2, 0.9, 2.0],
        description="KL weights swept (0: plain SFT)",
        json_schema_extra=section("sweep"),
    )
    seeds: list[int] = Field([0, 1, 2], description="Seeds per KL weight (data order and LoRA init)")
    hari: dict[str, Any] = Field(
        {"epochs": 3, "lora_last_k_layers": 3, "lr": 0.02},
        description="Notebook 20 parameters for every run (not those the sweep sets: "
        "run_dir model dataset lambda_kl seed system_prompt max_len)",
    )
    kl_span: Literal["answer", "all"] = Field("answer", description="Tokens KL(base||adapted) is measured on")
    baselines: list[Literal["replay", "small_adapter"]] = Field(
        [],
        description="Cheaper methods run beside HARI per seed at lambda 0: replay (the base's own answers mixed "
        "into B) and small_adapter (the LoRA of small_adapter)",
        json_schema_extra=section("methods compared"),
    )
    snapshot_every: int = Field(
        0,
        ge=0,
        description="Optimizer steps between adapter snapshots of every run, each measured as a point (SFT "
        "stopped early, traced); 0: the end of each run only",
    )
    snapshot_steps: list[int] = Field(
        [],
        description="Also snapshot every run at these optimizer steps (dense early: plain SFT learns B fast)",
    )
    small_adapter: dict[str, Any] = Field(
        {"lora_r": 1}, description="Notebook 20 parameters of the smaller adapter (rank, targets, layers)"
    )
    replay_prompts: str = Field(
        "data/task_a_prompts.jsonl",
        description="A-style prompts the base answers for replay (their answers are never read; held-out "
        "evaluation questions are dropped)",
    )
    replay_ratio: float = Field(0.5, gt=0, description="Replay rows per training row of B")
    replay_limit: int = Field(400, ge=1, description="Replay prompts answered at most")
    replay_max_new_tokens: int = Field(64, ge=1, description="Tokens of each greedy base answer at most")
    measure_with: Literal["model", "server"] = Field(
        "model",
        description="model: each point loaded in fp32 on the host (teacher-forced accuracy, KL to the base); "
        "server: the trained runs measured together through one vLLM server of the base with every adapter as "
        "a LoRA (generated answers; no KL), and the replay answers made by that server (R1)",
    )
    serve: dict[str, Any] = Field(
        {}, description="Notebook 10 parameters of that server (parallelism, max_model_len, max_new_tokens…)"
    )
    serve_host: str = Field(
        "127.0.0.1",
        description="Address that server binds to and is called at (the sweep's Slurm jobs pass the first "
        "node's IP)",
    )
    match_fractions: list[float] = Field(
        [0.5, 0.75, 0.9],
        description="B gains at which methods are matched, as fractions of the largest mean B gain any reaches",
    )

    @field_validator("match_fractions")
    @classmethod
    def _fractions(cls, value: list[float]) -> list[float]:
        if not value or any(not 0 < v <= 1 for v in value):
            raise ValueError("give fractions in (0, 1]")
        return value

    @field_validator("serve")
    @classmethod
    def _serve_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        mine = ("model", "system_prompt", "run_dir", "host")  # host: serve_host
        unknown = [k for k in value if k not in InferenceParams.keys() or k in mine]
        if unknown:
            raise ValueError(
                f"{unknown} cannot be set for the sweep's server; valid: "
                f"{', '.join(k for k in InferenceParams.keys() if k not in mine)}"
            )
        InferenceParams(**value)
        return value

    @field_validator("small_adapter")
    @classmethod
    def _small_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = [k for k in value if k not in HariParams.keys() or k in SET_BY_SWEEP]
        if unknown:
            raise ValueError(
                f"{unknown} cannot be set for the smaller adapter; valid: "
                f"{', '.join(k for k in HariParams.keys() if k not in SET_BY_SWEEP)}"
            )
        HariParams(**value)
        return value

    @field_validator("lambdas", "seeds")
    @classmethod
    def _not_empty(cls, value: list) -> list:
        if not value or len(set(value)) != len(value):
            raise ValueError("give at least one value, each once")
        if any(v < 0 for v in value):
            raise ValueError("values must be >= 0")
        return value

    @field_validator("hari")
    @classmethod
    def _hari_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = [k for k in value if k in SET_BY_SWEEP]
        unknown = [k for k in value if k not in HariParams.keys()]
        if bad:
            raise ValueError(f"{bad} are set by the sweep itself; remove them from hari")
        if unknown:
            raise ValueError(
                f"unknown notebook 20 parameter(s) {unknown}; valid: {', '.join(HariParams.keys())}"
            )
        HariParams(**value)  # each value must be valid for notebook 20
        return value


MODELS: dict[str, type[NotebookParams]] = {
    m.model_fields["notebook"].default: m
    for m in (ClusterCheckParams, InferenceParams, HariParams, InspectParams, SweepParams)
}


def model_for(notebook: str | Path) -> type[NotebookParams]:
    name = Path(notebook).stem
    if name not in MODELS:
        raise ParamsError(name, [f"no parameter model for notebook '{name}'; known: {', '.join(MODELS)}"])
    return MODELS[name]


def parse_override(raw: str) -> Any:
    """Parse a `-p KEY VALUE` value as YAML, like papermill does (so 3 is int, [a,b] a list).

    An empty VALUE is the empty string (YAML would make it null, which no parameter accepts).
    """
    if raw == "":
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A params file as a flat dict; a missing file or a YAML error is a ParamsError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        near = sorted(p.name for p in path.parent.glob("*.yaml")) if path.parent.is_dir() else []
        hint = f"; in {path.parent}: {', '.join(near)}" if near else ""
        raise ParamsError(path.name, [f"parameter file not found: {path}{hint}"])
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ParamsError(
            path.name, [f"{path}:{where}: not valid YAML ({problem}); each line is `key: value`"]
        ) from None
    if not isinstance(data, dict):
        raise ParamsError(path.name, [f"{path} must hold a mapping of key: value, got {type(data).__name__}"])
    return data


def load(
    notebook: str | Path, files: list[str | Path] = (), overrides: dict[str, Any] | None = None
) -> NotebookParams:
    """Merge YAML files (later wins) and overrides, then validate for `notebook`."""
    values: dict[str, Any] = {}
    for f in files:
        values.update(read_yaml(f))
    values.update(overrides or {})
    return model_for(notebook).validate_dict(values)
