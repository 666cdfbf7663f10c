"""infer/'s configs: a default is notebook 10's parameter default (one value, not two), and the step builds
them from the notebook's parameters."""

from __future__ import annotations

import dataclasses

from dsr1kit.infer.client import ClientConfig
from dsr1kit.infer.serve_spec import ServeSettings, server_spec, vllm_server
from dsr1kit.infer.server import ServerSpec
from dsr1kit.params import InferenceParams
from dsr1kit.steps.serve_configs import client_config, serve_settings

PARAM_OF = {"env": "server_env"}  # ServerSpec field -> InferenceParams field, where the names differ


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


# ServerSpec fields the step computes, not parameters: the adapters served, and DP's address and port on the job
NO_PARAMETER = ("lora_modules", "data_parallel_address", "data_parallel_rpc_port")


def test_server_spec_defaults_are_the_notebook_parameters_defaults():
    params = InferenceParams.model_fields
    for f in dataclasses.fields(ServerSpec):
        default = _default(f)
        if default is dataclasses.MISSING or f.name in NO_PARAMETER:  # required, or no parameter
            continue
        expected = params[PARAM_OF.get(f.name, f.name)].default
        assert default == (tuple(expected) if isinstance(default, tuple) else expected), f.name


def test_client_config_and_serve_settings_have_no_second_defaults():
    for config in (ClientConfig, ServeSettings):
        assert all(_default(f) is dataclasses.MISSING for f in dataclasses.fields(config)), config


def test_the_step_builds_the_configs_from_the_parameters():
    p = InferenceParams(
        port=8123,
        max_num_seqs=4,
        data_parallel_size=2,
        extra_args=["--x", "1"],
        retries=1,
        server_env={"A": "b"},
        max_new_tokens=7,
        temperature=0.5,
        top_p=0.95,
        samples_per_question=4,
        sample_seed=11,
        request_timeout_s=9,
    )
    settings = serve_settings(p)
    spec = server_spec(settings, "/models/m", {"attn": "/a"}, max_lora_rank=32)
    assert (spec.model, spec.port, spec.max_num_seqs, spec.extra_args, spec.env) == (
        "/models/m",
        8123,
        4,
        ("--x", "1"),
        {"A": "b"},
    )
    assert spec.command()[-9:] == [
        "--enable-lora",
        "--max-lora-rank",
        "32",
        "--max-loras",
        "1",
        "--lora-modules",
        "attn=/a",
        "--x",
        "1",
    ]
    assert server_spec(settings, "/m").max_lora_rank == p.max_lora_rank
    assert server_spec(serve_settings(InferenceParams()), "/m").port > 0  # port 0: a free one
    expected = ClientConfig(
        concurrency=16,
        timeout_s=9,
        retries=1,
        max_tokens=7,
        temperature=0.5,
        key_env="VLLM_API_KEY",
        chat=False,
        top_p=0.95,
        samples=4,
        seed=11,
    )
    assert client_config(p) == expected  # concurrency 0: 2 x max_num_seqs x data_parallel_size
    server = vllm_server(settings, "/runs/r", "/m", name="server-base")
    assert str(server.log_path) == "/runs/r/logs/server-base.log"
    assert server.ready_timeout_s == p.ready_timeout_s
