"""What the training run beside an adapter folder recorded: its parameters and how many rows it trained on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def run_settings(adapter_dir: str | Path) -> dict[str, Any]:
    """The training run's parameters (``params.yaml`` beside the adapter folder), {} when absent."""
    import yaml

    path = Path(adapter_dir).parent / "params.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def training_slices(rows: list[dict], adapter_dir: Path, n: int) -> dict[str, list[dict]]:
    """The adapter's training rows and the held-out rows after them (from its run_info.json)."""
    info_file = adapter_dir.parent / "run_info.json"
    used = json.loads(info_file.read_text())["samples"] if info_file.is_file() else None
    if used is None:
        return {"probe": rows[:n]}
    slices = {"training slice": rows[: min(n, used)]}
    if rows[used:]:
        slices["held-out"] = rows[used : used + n]
    return slices
