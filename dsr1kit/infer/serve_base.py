"""A model served in the form this machine can run, up and answering, and never left running on an error.

Notebook 10's evaluation and the forgetting sweep's served measurements start their servers here: the
checkpoint in its servable form (``serve_form``), the LoRA rank raised to the served adapters', the
server started and waited for, and stopped when what follows raises.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from .client import ClientConfig
from .serve_spec import ServeSettings, vllm_server
from .server import VLLMServer


def load_model_and_tokenizer(model: str):
    """(local model path or hub name, tokenizer); 'tiny' builds the embedded model once."""
    from ..embedded.tiny import resolve_model
    from ..model.load import load_tokenizer

    path = resolve_model(model)
    return path, load_tokenizer(path)


@contextlib.contextmanager
def stop_on_error(server):
    """Stop the server when the block raises (then re-raise): a failing cell leaves no server behind."""
    try:
        yield server
    except BaseException:
        server.stop()
        raise


def start_server(
    settings: ServeSettings,
    run_dir: str | Path,
    model_path: str,
    lora_modules: dict[str, str] | None = None,
    name: str = "server",
) -> tuple[VLLMServer, str, dict[str, float]]:
    """(server, how the checkpoint is served, its load phases): ``model_path`` in its servable form (a bf16
    copy under ``run_dir/served`` where FP8 blocks cannot run), with ``lora_modules`` at their rank, ready."""
    from .adapters import adapter_rank
    from .serve_form import servable

    path, form = servable(model_path, Path(run_dir) / "served")
    rank = max([settings.max_lora_rank, *(adapter_rank(a) for a in (lora_modules or {}).values())])
    server = vllm_server(settings, run_dir, path, lora_modules, name=name, max_lora_rank=rank)
    with stop_on_error(server):
        server.start()
        phases = server.wait_ready()
    return server, form, phases


@dataclass(frozen=True)
class BaseServing:
    """A base model served as notebook 10 serves it, for measurements through a server."""

    model: str  # 'tiny', a hub id or a local folder
    serve: ServeSettings
    client: ClientConfig


@contextlib.contextmanager
def serve_base(
    config: BaseServing,
    run_dir: str | Path,
    lora_modules: dict[str, str] | None = None,
    name: str = "server",
    model_path: str = "",
):
    """The base (or ``model_path``, e.g. a merged copy) served with ``lora_modules`` as LoRAs, stopped on
    leaving: yields (server, the base's tokenizer, the client config, the served model's name)."""
    base_path, tokenizer = load_model_and_tokenizer(config.model)
    server, _, _ = start_server(config.serve, run_dir, model_path or base_path, lora_modules, name)
    try:
        yield server, tokenizer, config.client, config.serve.served_model_name
    finally:
        server.stop()
