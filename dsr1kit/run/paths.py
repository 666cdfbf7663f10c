"""Where things are: the project root, and relative paths that work from any cwd.

A notebook opened in JupyterLab runs in ``notebooks/``, papermill runs it
there too, and sbatch scripts run from the project root; a parameter like
``data/sft_tiny.jsonl`` must mean the same file in all three.
"""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def resolve(path: str | Path) -> Path:
    """An existing path as given (absolute or from cwd), else relative to the project root."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    candidate = PROJECT_ROOT / p
    return candidate if candidate.exists() else p
