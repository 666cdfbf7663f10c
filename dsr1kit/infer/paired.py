"""Base vs adapter as a paired comparison: both models answer the same questions, so the question is the unit.

Two accuracies with their own intervals hide a difference that a paired test sees: the questions that both
models get right (or both wrong) add nothing to the difference but widen each interval. Here each question
gives one number per model, its pass@1 (the fraction of its samples scored correct: 0 or 1 with one sample),
and the verdict reads the per-question differences: their mean, a paired bootstrap 95% interval over
questions (fixed seed, so a rerun gives the same interval), and the smallest difference this many questions
could detect at 80% power given the differences' observed spread. The verdict names a side only where the
interval excludes 0 *and* an exact sign test on the questions whose pass@1 differs agrees (p < 0.05): a
bootstrap over a handful of questions is degenerate (three questions all +1 give the interval [1, 1]), the
sign test is not. A verdict of "no difference detected"
with a detectable difference larger than the one a user cares about says: ask more questions or more samples
before concluding.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist

BETTER, WORSE, NO_DIFFERENCE = "the adapter is better", "the adapter is worse", "no difference detected"
RESAMPLES = 10_000
SEED = 0
POWER = 0.8
ALPHA = 0.05
_CHUNK = 1_000  # resamples drawn at a time: memory stays at _CHUNK × questions indices


@dataclass(frozen=True)
class PairedDifference:
    """One scope's paired comparison (scope "all" or a category); rates and differences in [0, 1]."""

    scope: str
    questions: int  # questions both models answered (the pairs)
    base: float  # mean pass@1 of the base on those questions
    adapter: float
    difference: float  # adapter - base, the mean of the per-question differences
    ci95_low: float  # paired bootstrap percentile interval of the difference
    ci95_high: float
    detectable: float  # smallest |difference| detectable at 80% power, two-sided 5%, from the observed spread
    sign_test_p: float  # exact two-sided sign test over the questions whose pass@1 differs
    verdict: str

    def line(self) -> str:
        if not self.questions:
            return f"{self.scope}: no question answered by both models"
        return (
            f"{self.scope}: {self.verdict} (adapter - base {100 * self.difference:+.1f} points, paired 95% CI "
            f"[{100 * self.ci95_low:+.1f}, {100 * self.ci95_high:+.1f}] on {self.questions} questions; "
            f"sign test p = {self.sign_test_p:.3g}; detectable at 80% power: ±{100 * self.detectable:.1f} points)"
        )

    def to_dict(self) -> dict:
        return asdict(self)


def detectable_difference(differences: list[float], power: float = POWER, alpha: float = ALPHA) -> float:
    """The smallest mean difference a two-sided paired test at ``alpha`` finds with probability ``power``:
    (z_{1-α/2} + z_power) · sd / √n, sd the per-question differences' sample standard deviation. NaN below two
    questions; 0 when every difference is the same (nothing varies, so any shift shows)."""
    n = len(differences)
    if n < 2:
        return float("nan")
    mean = sum(differences) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    return z * sd / math.sqrt(n)


def sign_test(differences: list[float]) -> float:
    """Exact two-sided sign test: the probability, with no difference, of a split of the non-zero differences
    at least as uneven as the one observed (McNemar's exact test when each question has one sample)."""
    up = sum(1 for d in differences if d > 0)
    n = up + sum(1 for d in differences if d < 0)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(up, n - up) + 1)) / 2**n
    return min(1.0, 2 * tail)


def bootstrap_interval(differences: list[float], resamples: int = RESAMPLES, seed: int = SEED):
    """Percentile 95% interval of the mean difference over ``resamples`` resamplings of the questions with
    replacement (numpy's PCG64 with ``seed``: the same answers give the same interval)."""
    import numpy as np

    d = np.asarray(differences, dtype=float)
    if d.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = []
    for start in range(0, resamples, _CHUNK):
        idx = rng.integers(0, d.size, size=(min(_CHUNK, resamples - start), d.size))
        means.append(d[idx].mean(axis=1))
    low, high = np.percentile(np.concatenate(means), [2.5, 97.5])
    return float(low), float(high)


def compare(
    scope: str, base: dict[str, float], adapter: dict[str, float], seed: int = SEED
) -> PairedDifference:
    """Paired comparison on the questions in both ``base`` and ``adapter`` (question id → its pass@1)."""
    ids = sorted(set(base) & set(adapter))
    differences = [adapter[i] - base[i] for i in ids]
    if not ids:
        nan = float("nan")
        return PairedDifference(scope, 0, nan, nan, nan, nan, nan, nan, 1.0, NO_DIFFERENCE)
    low, high = bootstrap_interval(differences, seed=seed)
    p = sign_test(differences)
    verdict = NO_DIFFERENCE if p >= ALPHA else BETTER if low > 0 else WORSE if high < 0 else NO_DIFFERENCE
    return PairedDifference(
        scope,
        len(ids),
        sum(base[i] for i in ids) / len(ids),
        sum(adapter[i] for i in ids) / len(ids),
        sum(differences) / len(ids),
        low,
        high,
        detectable_difference(differences),
        p,
        verdict,
    )


def pass_at_1(per_example) -> dict[str, float]:
    """Question id → the fraction of its scored samples that are correct, over the answered rows (a row the
    model never answered is no pair: it is in the accuracy's N, not in the paired test)."""
    answered = per_example[per_example["answered"]]
    return {str(i): float(v) for i, v in answered.groupby("id")["correct"].mean().items()}


def compare_models(base_examples, adapter_examples, seed: int = SEED) -> list[PairedDifference]:
    """The paired comparison over all questions, then per category (in the base's category order)."""
    base, adapter = pass_at_1(base_examples), pass_at_1(adapter_examples)
    category = dict(zip(base_examples["id"].astype(str), base_examples["category"]))
    rows = [compare("all", base, adapter, seed)]
    for cat in sorted(set(category.values())):
        ids = {i for i, c in category.items() if c == cat}
        if len(ids) < len(category):
            pick = {i: v for i, v in base.items() if i in ids}
            rows.append(compare(cat, pick, {i: v for i, v in adapter.items() if i in ids}, seed))
    return rows
