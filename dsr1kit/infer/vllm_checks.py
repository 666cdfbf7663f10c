"""vLLM's own verdict on a server command, before any allocation: a flag it does not know or a value it
refuses ends a multi-node job in its first minutes otherwise, after the wait for the nodes."""

from __future__ import annotations

import contextlib
import io

from .serve_spec import LayoutRefused, ServeSettings, check_data_parallel, server_spec


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


def planned_command(settings: ServeSettings, model: str) -> tuple[str, bool]:
    """(text, accepted): the base server's command for ``model`` on the settings' nodes, its replicas, and
    vLLM's verdict on it where vLLM is installed (a login node may not have it)."""
    import shlex

    nodes = settings.nodes
    try:
        check_data_parallel(settings)
    except LayoutRefused as err:
        return f"vLLM server on {nodes} node(s): {err}", False
    spec = server_spec(settings, model)
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
