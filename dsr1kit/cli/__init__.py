"""The kit's command line (``dsr1kit …`` or ``python -m dsr1kit …``).

Modules: ``main`` (the parser and the notebook commands: run, demo, plan, runs, tiny, parameters-cell),
``args`` (the -f/-p/--run-dir options every command shares, read once), ``jobs`` (steps without a notebook
for sbatch scripts: train, rank-check), ``lab`` (JupyterLab). Notebook parameters are loaded through
``steps/parameters.py``.
"""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
