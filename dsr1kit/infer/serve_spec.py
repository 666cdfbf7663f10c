"""The server's settings as one typed config, and the command each server of an evaluation gets from them.

An evaluation starts several servers (the base, the base without LoRA, a merged copy), each from the
same settings with its own model folder, adapters and free port; a sweep serves its base the same way.
The replicas' layout is checked here against the job's nodes, so a layout that would idle nodes or not
split is refused before any allocation waits on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .server import ServerSpec, VLLMServer


class LayoutRefused(ValueError):
    """Replicas that cannot land as asked on the job's nodes; the message says what to change."""


@dataclass(frozen=True)
class ServeSettings:
    """Everything a server of the evaluation is started with, but its model, adapters and port number
    (``port`` 0: a free one per server). ``extra_args`` already hold what a served judge needs."""

    served_model_name: str  # name the server answers to
    host: str  # address it binds and the client calls
    port: int  # 0: a free one for each server
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int  # model replicas
    data_parallel_backend: str  # mp: replicas on this node; ray: on every node of the job
    data_parallel_size_local: int  # replicas on this node; 0: data_parallel_size / nodes (ray across nodes)
    enable_expert_parallel: bool
    distributed_executor_backend: str
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    dtype: str
    enforce_eager: bool
    seed: int
    max_lora_rank: int  # at least; raised to the served adapters' rank
    reasoning_parser: str
    extra_args: tuple[str, ...]  # verbatim server arguments
    env: dict[str, str]  # server environment
    server_key_env: str  # the variable holding the key it demands; never the key
    ready_timeout_s: float  # wait this long for /health and a first completion
    nodes: int  # nodes of the job the server runs in

    @property
    def across_nodes(self) -> bool:
        """Replicas placed on every node of the job by its Ray cluster."""
        return self.data_parallel_size > 1 and self.data_parallel_backend == "ray" and self.nodes > 1


def server_spec(
    settings: ServeSettings,
    model_path: str,
    lora_modules: dict[str, str] | None = None,
    max_lora_rank: int | None = None,
) -> ServerSpec:
    """The command for ``model_path`` serving ``lora_modules`` (name -> adapter folder) up to rank
    ``max_lora_rank`` (default: the settings'), on a free port when the settings name none."""
    from ..cluster.rendezvous import free_port

    s, across = settings, settings.across_nodes
    return ServerSpec(
        model=model_path,
        port=s.port or free_port(),
        served_model_name=s.served_model_name,
        host=s.host,
        tensor_parallel_size=s.tensor_parallel_size,
        pipeline_parallel_size=s.pipeline_parallel_size,
        data_parallel_size=s.data_parallel_size,
        data_parallel_backend=s.data_parallel_backend,
        data_parallel_size_local=s.data_parallel_size_local
        or (s.data_parallel_size // s.nodes if across else 0),
        data_parallel_address=s.host if across else "",  # the head's address, which every node reaches
        data_parallel_rpc_port=free_port() if across else 0,
        enable_expert_parallel=s.enable_expert_parallel,
        distributed_executor_backend=s.distributed_executor_backend,
        gpu_memory_utilization=s.gpu_memory_utilization,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        max_model_len=s.max_model_len,
        dtype=s.dtype,
        enforce_eager=s.enforce_eager,
        seed=s.seed,
        lora_modules=dict(lora_modules or {}),
        max_lora_rank=s.max_lora_rank if max_lora_rank is None else max_lora_rank,
        reasoning_parser=s.reasoning_parser,
        extra_args=tuple(s.extra_args),
        env=dict(s.env),
        server_key_env=s.server_key_env,
    )


def vllm_server(
    settings: ServeSettings,
    run_dir: str | Path,
    model_path: str,
    lora_modules: dict[str, str] | None = None,
    name: str = "server",
    max_lora_rank: int | None = None,
) -> VLLMServer:
    """A server of ``server_spec`` with its log (and pid file) at ``run_dir/logs/<name>.log``; not started."""
    spec = server_spec(settings, model_path, lora_modules, max_lora_rank)
    return VLLMServer(spec, Path(run_dir) / "logs" / f"{name}.log", settings.ready_timeout_s)


def check_data_parallel(settings: ServeSettings) -> None:
    """Replicas that cannot land as asked on the job's nodes: LayoutRefused with the fix."""
    dp, nodes = settings.data_parallel_size, settings.nodes
    if dp == 1 or nodes == 1:
        return
    if settings.data_parallel_backend == "mp":
        raise LayoutRefused(
            f"data_parallel_size {dp} on a {nodes}-node job with data_parallel_backend mp starts every replica "
            "on the first node, and the other nodes idle: set data_parallel_backend: ray (the job's Ray cluster "
            "places the replicas on every node), or submit with -N 1"
        )
    if not settings.data_parallel_size_local and dp % nodes:
        raise LayoutRefused(
            f"data_parallel_size {dp} does not split over the job's {nodes} nodes: make it a multiple of "
            f"{nodes}, or set data_parallel_size_local (the replicas on the first node)"
        )
