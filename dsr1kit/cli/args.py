"""The options every command that takes parameters shares, read once: ``-f FILE`` (YAML, layered in order),
``-p KEY VALUE`` (one override, VALUE parsed as YAML) and ``--run-dir``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..steps import parameters


def add_params_options(
    parser: argparse.ArgumentParser, run_dir: str | None = None, run_dir_help: str = "the run folder"
) -> None:
    """-f/-p on ``parser``; ``run_dir`` 'required' or 'optional' adds --run-dir too."""
    parser.add_argument(
        "-f",
        "--params-file",
        action="append",
        default=[],
        help="YAML parameters, layered in order (repeatable)",
    )
    parser.add_argument(
        "-p",
        "--param",
        nargs=2,
        action="append",
        default=[],
        metavar=("KEY", "VALUE"),
        help="override one parameter; VALUE is parsed as YAML (repeatable)",
    )
    if run_dir:
        parser.add_argument("--run-dir", required=run_dir == "required", default=None, help=run_dir_help)


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The -p overrides as values (YAML-parsed)."""
    return parameters.parse_overrides(args.param)


def load_params(notebook: str, args: argparse.Namespace, files: list[str] | None = None, **extra: Any) -> Any:
    """The validated parameters of ``notebook`` from -f files (or ``files``), -p and ``extra``; None after
    printing the error (an unknown or mistyped key names the valid ones)."""
    try:
        return parameters.load(
            notebook, args.params_file if files is None else files, {**overrides(args), **extra}
        )
    except (parameters.ParamsError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return None
