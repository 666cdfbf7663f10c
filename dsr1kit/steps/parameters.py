"""A notebook's parameters for the command line: read from YAML files and -p overrides, validated.

The command line reaches the notebooks' parameter models only through here, as every other reader does
through ``steps/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import params
from ..params import ParamsError

__all__ = ["ParamsError", "load", "model_for_stem", "parse_overrides"]


def parse_overrides(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """-p KEY VALUE pairs as values (each VALUE parsed as YAML)."""
    return {k: params.parse_override(v) for k, v in pairs}


def load(notebook: str | Path, files: list[str | Path], overrides: dict[str, Any] | None = None):
    """The validated parameters of ``notebook`` (ParamsError naming each bad key and the valid ones)."""
    return params.load(notebook, files, overrides)


def model_for_stem(stem: str):
    """The parameter model of the notebook named ``stem``, or None when it has none."""
    return params.MODELS.get(stem)
