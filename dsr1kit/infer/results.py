"""Notebook 10's results as the report shows them: each model's scores read back from the run's answers and
judgments files (so a resumed run scores every answer, not only this session's), the reasoning, judge and
lm-eval tables, throughput, base vs adapter, and the figures.
"""

from __future__ import annotations

from pathlib import Path

from . import evaluate, harness, judge, paired
from .client import read_answers


def headline(tables) -> str:
    """One line per run: each model's overall accuracy with the n of N it was scored on."""
    overall = {label: t.iloc[0] for label, t in tables.items()}
    return "; ".join(f"{k} {r['accuracy']:.1%} (scored on {r['scored_on']})" for k, r in overall.items())


def category_changes(tables) -> list[str]:
    """Per category, base → adapter accuracy: with several evaluation sets (the new task and the old one),
    what the adapter gained on one and cost on the other, in one line each."""
    if "base" not in tables or "adapter" not in tables:
        return []
    base, adapted = tables["base"].set_index("category"), tables["adapter"].set_index("category")
    cats = [c for c in base.index if c != "all" and c in adapted.index]
    if len(cats) < 2:
        return []
    return [
        f"{cat}: base {base.loc[cat, 'accuracy']:.1%} → adapter {adapted.loc[cat, 'accuracy']:.1%} "
        f"({100 * (adapted.loc[cat, 'accuracy'] - base.loc[cat, 'accuracy']):+.1f} points, "
        f"scored on {base.loc[cat, 'scored_on']})"
        for cat in cats
    ]


def score_all(
    run_dir: str | Path, prompts, totals: dict[str, int], labels, judged: bool = False, samples: int = 1
):
    """label -> accuracy table, and label -> per-sample frame, from the answers (and, ``judged``, the
    judgments) files of the run; ``samples`` answers per question (pass@1 over them)."""
    tables, examples = {}, {}
    for label in labels:
        answers = read_answers(evaluate.results_path(run_dir, label))
        judgments = judge.read_judgments(judge.judgments_path(run_dir, label)) if judged else None
        examples[label], tables[label] = evaluate.score(prompts, answers, totals, judgments, samples)
    return tables, examples


def judge_frame(run_dir: str | Path, examples):
    """Per model, HLE's numbers over its judged rows: accuracy ± the Wald 95% half-width, the RMS calibration
    error (with how it was binned); None when no row was judged."""
    import pandas as pd

    rows = []
    for label, df in examples.items():
        if not (df["kind"] == "judged").any():
            continue
        metrics = judge.hle_metrics(df, judge.read_judgments(judge.judgments_path(run_dir, label)))
        rows.append({"model": label, **metrics})
    return pd.DataFrame(rows) if rows else None


def answer_rules_frame(examples):
    """Rule → how many answers it read, per model (unparseable and missing answers included)."""
    import pandas as pd

    counts = {label: evaluate.rule_counts(df) for label, df in examples.items()}
    return pd.DataFrame(counts).fillna(0).astype(int).rename_axis("rule").reset_index()


def unparseable_frame(examples, limit: int = 20):
    """The first `limit` unparseable completions of each model, with their text."""
    import pandas as pd

    frames = [evaluate.unparseable(df).head(limit).assign(model=label) for label, df in examples.items()]
    cols = ["model", "id", "gold", "rule", "text"]
    return pd.concat(frames)[cols] if frames else pd.DataFrame(columns=cols)


def accuracy_frame(tables):
    import pandas as pd

    cols = [
        "model",
        "category",
        "accuracy",
        "ci95_low",
        "ci95_high",
        "correct",
        "ran_out_thinking",
        "scored_on",
    ]
    frame = pd.concat([t.assign(model=label) for label, t in tables.items()])
    return frame[cols + [c for c in ("samples", "cons_at_k") if c in frame]]  # with k samples: pass@1, cons@k


def thinking_frame(examples, tokenizer, max_new_tokens: int):
    """Per model, how long it thought (tokens of reasoning, by the model's tokenizer) and how many answers
    ran out of tokens while thinking (no answer: not a wrong one); None when no model reasoned. Also the
    rows whose prompt the server counted otherwise than the kit (the chat route renders its own)."""
    import pandas as pd

    rows = []
    for label, df in examples.items():
        answered = df[df["answered"]]
        lengths = pd.Series(
            [len(tokenizer.encode(t, add_special_tokens=False)) for t in answered["thinking"]]
        )
        if not (lengths > 0).any():
            continue
        served = answered["served_prompt_tokens"]
        rows.append(
            {
                "model": label,
                "answered": len(answered),
                "thinking_tokens_mean": round(float(lengths.mean()), 1),
                "thinking_tokens_median": float(lengths.median()),
                "thinking_tokens_p90": float(lengths.quantile(0.9)),
                "thinking_tokens_max": int(lengths.max()),
                "ran_out_thinking": int(answered["ran_out_thinking"].sum()),
                "max_new_tokens": max_new_tokens,
                "prompt_tokens_differ": int(((served > 0) & (served != answered["prompt_tokens"])).sum()),
                "lengths": lengths.tolist(),
            }
        )
    return pd.DataFrame(rows) if rows else None


def thinking_figure(frame):
    """Histogram of reasoning length per model, with max_new_tokens marked: where answers ran out."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    for row in frame.itertuples():
        ax.hist(row.lengths, bins=30, alpha=0.6, label=f"{row.model} ({row.ran_out_thinking} ran out)")
    ax.axvline(
        frame["max_new_tokens"].iloc[0], color="k", linestyle="--", linewidth=1, label="max_new_tokens"
    )
    ax.set_xlabel("reasoning length (tokens)")
    ax.set_ylabel("answers")
    ax.legend()
    plt.close(fig)
    return fig


def accuracy_table(frame):
    """accuracy_frame styled for the report: percentages, no index."""
    formats = {"accuracy": "{:.1%}", "ci95_low": "{:.1%}", "ci95_high": "{:.1%}", "cons_at_k": "{:.1%}"}
    return frame.style.format({k: v for k, v in formats.items() if k in frame}).hide(axis="index")


def throughput_table(stats) -> dict[str, str]:
    """Per model: tokens/s, requests/s and latency percentiles, one line each."""
    return {
        k: f"{s.tokens_per_s:.1f} tok/s, {s.summary()['requests_per_s']} req/s, "
        f"p50 {s.percentiles()['p50']:.2f} s, p90 {s.percentiles()['p90']:.2f} s"
        for k, s in stats.items()
    }


def paired_comparison(examples):
    """Base vs adapter on the questions both answered (``paired.compare_models``), or None without both."""
    if "base" not in examples or "adapter" not in examples:
        return None
    return paired.compare_models(examples["base"], examples["adapter"])


def comparison_frame(tables, examples, comparison):
    """Per category: base vs adapter accuracy, how many answers changed, and the paired verdict (the paired
    difference, its 95% interval, the smallest detectable difference and what it says)."""
    import pandas as pd

    base, adapted = tables["base"].set_index("category"), tables["adapter"].set_index("category")
    first = {label: df[df["sample"] == 0].set_index("id") for label, df in examples.items()}
    changed = first["base"]["prediction"] != first["adapter"]["prediction"]  # the first sample's answers
    by_cat = first["base"]["category"]
    by_scope = {c.scope: c for c in comparison}
    rows = []
    for cat in base.index:
        ids = by_cat.index if cat == "all" else by_cat.index[by_cat == cat]
        pair = by_scope.get(cat)
        rows.append(
            {
                "category": cat,
                "base": base.loc[cat, "accuracy"],
                "adapter": adapted.loc[cat, "accuracy"],
                "answers_changed": int(changed.loc[ids].sum()),
                "paired_difference": pair.difference if pair else float("nan"),
                "paired_ci95": f"[{pair.ci95_low:+.1%}, {pair.ci95_high:+.1%}]" if pair else "",
                "detectable": pair.detectable if pair else float("nan"),
                "verdict": pair.verdict if pair else "",
                "paired_on": pair.questions if pair else 0,
                "scored_on": base.loc[cat, "scored_on"],
            }
        )
    formats = {"base": "{:.1%}", "adapter": "{:.1%}", "paired_difference": "{:+.1%}", "detectable": "±{:.1%}"}
    return pd.DataFrame(rows).style.format(formats).hide(axis="index")


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


def judge_table(frame):
    """judge_frame styled for the report: percentages, no index; HLE's calibration error where its script
    gives one (else the note says why not), the kit's all-bins variant beside it under its own name."""

    def percent(c):
        return "—" if c is None or c != c else f"{c:.1%}"

    shown = frame.assign(
        accuracy=frame["accuracy"].map(lambda a: f"{a:.1%}"),
        ci95=frame["ci95_half_width"].map(lambda h: f"± {h:.1%}"),
        calibration_error=frame["calibration_error"].map(percent),
        kits_all_bins=frame["calibration_error_all_bins"].map(percent),
    )
    cols = [
        "model",
        "accuracy",
        "ci95",
        "calibration_error",
        "calibration_note",
        "kits_all_bins",
        "n",
        "judged",
        "correct",
        "unreadable_judgments",
    ]
    return shown[cols].style.hide(axis="index")


def harness_frame(results: dict[str, dict]):
    """lm-eval's results per model: task, filter, metric, value and stderr (None when nothing was run)."""
    import pandas as pd

    rows = [{"model": label, **row} for label, r in results.items() for row in harness.results_rows(r)]
    return pd.DataFrame(rows) if rows else None
