"""Tables and plots for reports: what a teammate looks at instead of reading logs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

STATUS_COLOURS = {"pass": "#d4edda", "warn": "#fff3cd", "fail": "#f8d7da", "ok": "#d4edda", "failed": "#f8d7da"}


def colour_status(df, column: str = "status"):
    """A pandas Styler with each row tinted by its status (pass green, warn amber, fail red)."""
    def tint(row):
        colour = STATUS_COLOURS.get(str(row[column]).lower(), "")
        return [f"background-color: {colour}" if colour else ""] * len(row)

    return df.style.apply(tint, axis=1).hide(axis="index")


def params_table(p) -> Any:
    import pandas as pd

    return pd.DataFrame(sorted(p.to_dict().items()), columns=["parameter", "value"]).style.hide(axis="index")


def verdict_html(status: str, lines: list[str]) -> str:
    colour = STATUS_COLOURS.get(status, "#eeeeee")
    items = "".join(f"<li>{line}</li>" for line in lines)
    return (f"<div style='background:{colour};padding:8px;border-radius:4px'>"
            f"<b>Verdict: {status.upper()}</b><ul>{items}</ul></div>")


def save_figure(fig, run_dir: str | Path, name: str) -> Path:
    path = Path(run_dir) / "figures" / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def kv_table(values: dict[str, Any], key: str = "item", value: str = "value"):
    import pandas as pd

    return pd.DataFrame([(k, str(v)) for k, v in values.items()], columns=[key, value]).style.hide(axis="index")
