"""The sweep's two figures: the learning–forgetting frontier per λ, and forgetting against KL to the base."""

from __future__ import annotations

import math

from .sweep import PointResult, by_lambda, fit_line, mean_std


def frontier_figure(results: list[PointResult]):
    """B gain against A drop, one point per λ with seed-std error bars: up and left is better."""
    import matplotlib.pyplot as plt

    groups = by_lambda(results)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    cmap = plt.get_cmap("viridis", max(len(groups), 2))  # the same colour per λ as kl_figure
    for i, g in enumerate(groups):  # a legend, not labels beside the points: nearby λs would overprint
        ax.errorbar(
            g.a_drop_mean,
            g.b_gain_mean,
            xerr=g.a_drop_std,
            yerr=g.b_gain_std,
            fmt="s" if g.lambda_kl == 0 else "o",
            capsize=4,
            color=cmap(i),
            label=f"λ={g.lambda_kl:g} (n={g.n})",
        )
    ax.legend(fontsize=8, loc="best")
    ax.axhline(0, color="black", lw=0.6, ls="--")
    ax.axvline(0, color="black", lw=0.6, ls="--")
    ax.set_xlabel("forgetting on A: base acc − adapted acc")
    ax.set_ylabel("learning on B: adapted acc − base acc")
    ax.set_title("λ sweep: learn B, forget less of A (mean ± seed std; up-left is better)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def kl_figure(results: list[PointResult]):
    """Forgetting on A against KL(base ‖ adapted) on A prompts, one dot per run, with the fitted line."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    lams = sorted({r.lambda_kl for r in results})
    cmap = plt.get_cmap("viridis", max(len(lams), 2))
    for i, lam in enumerate(lams):
        pts = [r for r in results if r.lambda_kl == lam]
        ax.scatter(
            [r.kl_a for r in pts], [r.a_drop for r in pts], color=cmap(i), label=f"λ={lam:g}", zorder=3
        )
    xs, ys = [r.kl_a for r in results], [r.a_drop for r in results]
    fit = fit_line(xs, ys)
    if math.isnan(fit.slope):
        ax.plot([], [], " ", label=f"no line: {fit.note}")
    else:
        lo, hi = min(xs), max(xs)
        r2 = f"R² = {fit.r2:.3f}" if not math.isnan(fit.r2) else "R² undefined (all drops equal)"
        ax.plot(
            [lo, hi],
            [fit.slope * lo + fit.intercept, fit.slope * hi + fit.intercept],
            color="tab:red",
            label=f"fit: slope {fit.slope:.3g}, {r2}",
        )
    ax.axhline(0, color="black", lw=0.6, ls="--")
    ax.set_xlabel("KL(base ‖ adapted) on A prompts, nats per token")
    ax.set_ylabel("forgetting on A: base acc − adapted acc")
    ax.set_title("forgetting against drift from the base, one dot per run", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def comparison_figure(results: list[PointResult], levels=()):
    """Each method's frontier: A accuracy kept against B gain, mean over seeds with the seed spread shaded
    (where every seed reaches the gain), its points faint, the matched gains as dotted lines."""
    import matplotlib.pyplot as plt

    from .frontier import a_kept_at, label, method_of, seed_frontiers

    frontiers = seed_frontiers(results)
    top = max((f[-1][0] for by_seed in frontiers.values() for f in by_seed.values()), default=0.0)
    grid = [top * i / 100 for i in range(101)]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    colours = {"hari": "tab:blue", "sft": "tab:red", "replay": "tab:green", "small_adapter": "tab:purple"}
    for method, by_seed in frontiers.items():
        colour = colours.get(method, "tab:gray")
        xs, mean, lo, hi = [], [], [], []
        for g in grid:
            vals = [a_kept_at(f, g) for f in by_seed.values()]
            if any(v is None for v in vals):
                break
            m, s = mean_std(vals)
            xs.append(g), mean.append(m), lo.append(m - s), hi.append(m + s)
        ax.plot(xs, mean, color=colour, label=f"{label(method)} (n={len(by_seed)})")
        ax.fill_between(xs, lo, hi, color=colour, alpha=0.15, lw=0)
        pts = [r for r in results if method_of(r) == method]
        ax.scatter([r.b_gain for r in pts], [r.acc_a for r in pts], color=colour, s=10, alpha=0.35)
    for lv in levels:
        ax.axvline(lv.gain, color="black", lw=0.6, ls=":")
    ax.set_xlabel("learning on B: adapted acc − base acc")
    ax.set_ylabel("A accuracy kept")
    ax.set_title("at the same gain on B, who keeps more of A? (mean ± seed std; up is better)", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
