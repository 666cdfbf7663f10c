"""Small pieces notebook 10 calls: model/tokenizer lookup, server guard, tables and the latency figure."""

from __future__ import annotations

import contextlib
from pathlib import Path

from . import evaluate
from .client import read_answers


def load_model_and_tokenizer(model: str):
    """(local model path or hub name, tokenizer); 'tiny' builds the embedded model once."""
    from transformers import AutoTokenizer

    from ..tiny import resolve_model

    path = resolve_model(model)
    return path, AutoTokenizer.from_pretrained(path)


@contextlib.contextmanager
def stop_on_error(server):
    """Stop the server when the block raises (then re-raise): a failing cell leaves no server behind."""
    try:
        yield server
    except BaseException:
        server.stop()
        raise


def score_all(run_dir: str | Path, prompts, totals: dict[str, int], labels):
    """label -> accuracy table, and label -> per-example frame, from the answers files of the run."""
    tables, examples = {}, {}
    for label in labels:
        answers = read_answers(evaluate.results_path(run_dir, label))
        examples[label], tables[label] = evaluate.score(prompts, answers, totals)
    return tables, examples


def accuracy_frame(tables):
    import pandas as pd

    cols = ["model", "category", "accuracy", "ci95_low", "ci95_high", "correct", "scored_on"]
    return pd.concat([t.assign(model=label) for label, t in tables.items()])[cols]


def comparison_frame(tables, examples):
    """Per category: base vs adapter accuracy, the difference, and how many answers changed."""
    import pandas as pd

    base, adapted = tables["base"].set_index("category"), tables["adapter"].set_index("category")
    changed = (examples["base"].set_index("id")["prediction"] != examples["adapter"].set_index("id")["prediction"])
    by_cat = examples["base"].set_index("id")["category"]
    rows = []
    for cat in base.index:
        ids = by_cat.index if cat == "all" else by_cat.index[by_cat == cat]
        rows.append({"category": cat, "base": base.loc[cat, "accuracy"], "adapter": adapted.loc[cat, "accuracy"],
                     "delta": adapted.loc[cat, "accuracy"] - base.loc[cat, "accuracy"],
                     "answers_changed": int(changed.loc[ids].sum()), "scored_on": base.loc[cat, "scored_on"]})
    return pd.DataFrame(rows).style.format({"base": "{:.1%}", "adapter": "{:.1%}", "delta": "{:+.1%}"}).hide(axis="index")


def latency_figure(stats):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    for label, s in stats.items():
        if s.latencies_s:
            ax.hist(s.latencies_s, bins=20, alpha=0.6, label=f"{label} ({s.tokens_per_s:.0f} tok/s)")
    ax.set_xlabel("request latency (s)")
    ax.set_ylabel("requests")
    ax.legend()
    plt.close(fig)
    return fig
