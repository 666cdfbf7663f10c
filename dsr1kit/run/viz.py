"""Tables and plots for reports: what a teammate looks at instead of reading logs."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

STATUS_COLOURS = {
    "pass": "#d4edda",
    "warn": "#fff3cd",
    "fail": "#f8d7da",
    "ok": "#d4edda",
    "failed": "#f8d7da",
}


def colour_status(df, column: str = "status"):
    """A pandas Styler with each row tinted by its status (pass green, warn amber, fail red)."""

    def tint(row):
        colour = STATUS_COLOURS.get(str(row[column]).lower(), "")
        return [f"background-color: {colour}" if colour else ""] * len(row)

    return df.style.apply(tint, axis=1).hide(axis="index")


def params_table(values: dict[str, Any]) -> Any:
    """A run's parameters, one row each, sorted by name."""
    import pandas as pd

    return pd.DataFrame(sorted(values.items()), columns=["parameter", "value"]).style.hide(axis="index")


def verdict_html(status: str, lines: list[str]) -> str:
    colour = STATUS_COLOURS.get(status, "#eeeeee")
    items = "".join(f"<li>{line}</li>" for line in lines)
    return (
        f"<div style='background:{colour};padding:8px;border-radius:4px'>"
        f"<b>Verdict: {status.upper()}</b><ul>{items}</ul></div>"
    )


def save_figure(fig, run_dir: str | Path, name: str) -> Path:
    path = Path(run_dir) / "figures" / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def kv_table(values: dict[str, Any], key: str = "item", value: str = "value"):
    """One row per item; numbers written with thousands separators and right-aligned, so they line up."""
    import pandas as pd

    def shown(v: Any) -> str:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return str(v)
        return f"{v:,}" if isinstance(v, int) else f"{v:,.4g}"

    frame = pd.DataFrame([(k, shown(v)) for k, v in values.items()], columns=[key, value])
    numeric = [isinstance(v, (int, float)) and not isinstance(v, bool) for v in values.values()]
    return (
        frame.style.hide(axis="index")
        .apply(
            lambda col: ["text-align: right" if n else "text-align: left" for n in numeric], subset=[value]
        )
        .set_properties(subset=[key], **{"text-align": "left"})
    )


class PlansView:
    """Plans (memory, disk, time) as tables in the report, numbers right-aligned and what does not fit in
    red with what to change; in the job log and a terminal, the same plans as their text tables."""

    def __init__(self, plans: list[Any], empty: str = "nothing planned"):
        self.plans = [plan for plan in plans if plan is not None]
        self.empty = empty

    def __repr__(self) -> str:
        texts = [plan.text() if getattr(plan, "fits", True) else plan.refusal() for plan in self.plans]
        return "\n\n".join(texts) or self.empty

    def _repr_html_(self) -> str:
        return "".join(_plan_html(plan) for plan in self.plans) or f"<p>{html.escape(self.empty)}</p>"


def plans_view(*plans: Any, empty: str = "nothing planned") -> PlansView:
    return PlansView(list(plans), empty)


def _plan_html(plan: Any) -> str:
    import pandas as pd

    title, _, facts = plan.text().splitlines()[0].partition(": ")
    out = [f"<p><b>{html.escape(title)}</b>" + (f": {html.escape(facts)}" if facts else "") + "</p>"]
    rows = plan.rows()
    if rows:
        frame = pd.DataFrame(rows)
        numbers = [c for c in frame.columns if pd.api.types.is_numeric_dtype(frame[c])]
        styler = (
            frame.style.hide(axis="index")
            .format({c: "{:,.4g}" for c in numbers})
            .set_properties(subset=numbers, **{"text-align": "right"})
            .set_properties(subset=[c for c in frame.columns if c not in numbers], **{"text-align": "left"})
        )
        if "fits" in frame.columns:
            styler = styler.map(
                lambda v: "color: #b00020; font-weight: bold" if v == "NO" else "", subset=["fits"]
            )
        out.append(styler.to_html())
    if not getattr(plan, "fits", True):
        problems = "".join(f"<li>{html.escape(p)}</li>" for p in plan.problems())
        advice = "".join(f"<li>{html.escape(a)}</li>" for a in plan.advice)
        out.append(
            f"<div style='color:#b00020'><b>Does not fit:</b><ul>{problems}</ul>"
            + (f"<b>What to change:</b><ul>{advice}</ul>" if advice else "")
            + "</div>"
        )
    return "".join(out)


def training_curves(history: list[dict[str, Any]]):
    """Loss, CE, KL and learning rate against the optimizer step."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.2))
    steps = [h["step"] for h in history]
    for ax, key, title in zip(
        axes, ("loss", "ce", "kl", "lr"), ("loss", "CE (assistant tokens)", "KL to base", "learning rate")
    ):
        ax.plot(steps, [h[key] for h in history], marker="o", ms=3)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def data_table(sources: list[dict[str, Any]], per_source: dict[str, dict[str, int]]):
    """Per source and split: read status, rows, kept, skipped, truncated, and what is trained."""
    import pandas as pd

    rows = []
    for s in sources:
        key = f"{s['source']}@{s['split']}"
        c = per_source.get(key, {})
        rows.append(
            {
                "source": s["source"],
                "split": s["split"],
                "status": "pass" if s["status"] == "ok" else "warn",
                "rows read": s["rows"],
                "kept": c.get("kept", 0),
                "skipped": c.get("skipped", 0),
                "truncated": c.get("truncated", 0),
                "rows without reasoning": c.get("no_reasoning", 0),
                "trained tokens: reasoning": c.get("reasoning_tokens", 0),
                "trained tokens: answer": c.get("answer_tokens", 0),
                "reason": s["reason"],
            }
        )
    return colour_status(pd.DataFrame(rows))


def labelled_example_html(example: dict[str, Any]) -> str:
    """One rendered training example: the served prompt plain, trained reasoning blue, trained answer green."""
    from html import escape

    if not example:
        return "<p>(no example)</p>"
    span = "<span style='background:{};'>{}</span>"
    body = (
        escape(example["prompt"])
        + span.format("#d6e9ff", escape(example["before_reasoning"] + example["reasoning"]))
        + span.format("#d4edda", escape(example["answer"]))
    )
    return (
        f"<p><b>{escape(example['source'])}</b>, row {escape(example['id'])}, rendered as "
        f"<i>{escape(example['how'])}</i>: <span style='background:#d6e9ff'>trained reasoning</span>, "
        f"<span style='background:#d4edda'>trained answer</span>, the rest is the served prompt (not trained)."
        f"</p><pre style='white-space:pre-wrap'>{body}</pre>"
    )


def bandwidth_figure(result: dict, expected_gbps: float = 0.0):
    """All-reduce bus bandwidth per message size, with the expected figure as a dashed line."""
    import matplotlib.pyplot as plt

    rows = result.get("results") or []
    fig, ax = plt.subplots(figsize=(6, 3.2))
    if rows:
        sizes = [r["size_mib"] for r in rows]
        ax.plot(sizes, [r["busbw_gbps"] for r in rows], "o-", label="measured bus bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [f"{s:g}" for s in sizes])
    else:
        ax.text(
            0.5,
            0.5,
            result.get("error", "no measurement"),
            ha="center",
            va="center",
            wrap=True,
            transform=ax.transAxes,
            fontsize=8,
        )
    if expected_gbps > 0:
        ax.axhline(expected_gbps, color="tab:red", linestyle="--", label=f"expected {expected_gbps:g} GB/s")
    ax.set_xlabel("message size (MiB)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"all-reduce, {result.get('backend', '?')}, {result.get('world_size', '?')} ranks")
    if rows or expected_gbps > 0:
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def ray_table(state: dict, names: dict[str, str] | None = None):
    """Ray's alive nodes (head first) with the Slurm node each IP belongs to."""
    import pandas as pd

    names = names or {}
    rows = [
        {
            "node": names.get(n["ip"], n["hostname"]),
            "ip": n["ip"],
            "role": "head" if n["head"] else "worker",
            "CPUs": n["cpus"],
            "GPUs": n["gpus"],
        }
        for n in state.get("nodes", [])
    ]
    rows.append(
        {
            "node": "total",
            "ip": state.get("address", ""),
            "role": f"{len(rows)} nodes",
            "CPUs": state.get("cpus", 0),
            "GPUs": state.get("gpus", 0),
        }
    )
    return pd.DataFrame(rows).style.hide(axis="index")


def adapter_bars(stats: list[Any]):
    """Per adapted module: ‖A‖, ‖B‖, ‖ΔW‖ and ‖ΔW‖/‖W‖ as bars."""
    import matplotlib.pyplot as plt

    names = [s.module.replace("model.layers.", "L").replace(".self_attn.", ".") for s in stats]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 3.4))
    x = range(len(stats))
    w = 0.27
    for i, (key, label) in enumerate((("norm_a", "‖A‖"), ("norm_b", "‖B‖"), ("norm_delta", "‖scale·BA‖"))):
        ax1.bar([j + (i - 1) * w for j in x], [getattr(s, key) for s in stats], w, label=label)
    ax1.set_xticks(list(x), names, rotation=20)
    ax1.set_title("adapter norms")
    ax1.legend()
    ax2.bar(list(x), [s.ratio or 0 for s in stats], color="tab:purple")
    ax2.set_xticks(list(x), names, rotation=20)
    ax2.set_title("‖ΔW‖ / ‖W_base‖")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def kl_histogram(results: list[Any]):
    """Distribution of per-token KL(base ‖ adapted) for each probe set (log x)."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 3.4))
    values = [np.clip(np.asarray(r.kl_per_token), 1e-8, None) for r in results]
    bins = np.logspace(-8, np.log10(max(float(v.max()) for v in values if v.size) + 1e-8), 40)
    for r, v in zip(results, values):
        ax.hist(v, bins=bins, alpha=0.55, label=f"{r.name} (mean {r.kl_mean:.2e})")
    ax.set_xscale("log")
    ax.set_xlabel("per-token KL(base ‖ adapted), nats")
    ax.set_ylabel("tokens")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def rows_table(rows: list[dict[str, Any]]):
    """A list of same-keyed dicts as a table (one row each)."""
    import pandas as pd

    return pd.DataFrame(rows).style.hide(axis="index")
