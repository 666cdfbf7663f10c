"""Does HARI learn task B and forget less of task A? Measurements, λ-sweep analysis and plots.

One sweep point is one adapter (one λ, one seed), measured on A rows (the
old task) and B rows (the new one):

- accuracy: the share of rows whose whole assistant turn greedy decoding
  reproduces (teacher-forced, so one forward per batch instead of a
  generation loop), for the adapted model and for its base (adapter off);
- KL(base ‖ adapted) per token on A and on B prompts, fp32, temperature 1,
  with the training code's own KL and position masks.

The analysis is pure: per λ, the mean and seed spread of the B gain and the
A drop; a least-squares line of forgetting against KL; and a verdict that
says "helps" only when the best λ > 0 beats λ = 0 by more than the seed
spread, and says so plainly when it does not or when λ = 0 forgets nothing.
"""

from __future__ import annotations

import json
import math
import statistics
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

import torch

from ..data.chat import to_messages
from ..data.labels import IGNORE, Encoded, collate, encode_rendered
from ..data.render import render_chat
from ..run.verdict import FAIL, OK, WARN, Verdict
from ..train.hari import kl_mask, next_token_targets, token_terms

KlSpan = Literal["answer", "all"]
_MASK_OF_SPAN = {"answer": "assistant", "all": "all"}


# --------------------------------------------------------------------------- encoding and batches


def _encode(tokenizer, rows: list[dict[str, Any]], system_prompt: str, max_len: int,
            whole: bool) -> list[Encoded]:
    """Rows → (served prompt + assistant turn) ids and labels; rows without question or answer skipped.

    ``whole``: a row longer than ``max_len`` is an error (a truncated turn would be judged on a prefix).
    """
    out, too_long = [], []
    for i, row in enumerate(rows):
        messages = to_messages(row, system_prompt)
        if messages is None:
            continue
        ids, labels, truncated = encode_rendered(render_chat(tokenizer, messages), max_len)
        row_id = str(row.get("id", f"#{i}"))
        if truncated and whole:
            too_long.append(row_id)
            continue
        if any(label != IGNORE for label in labels[1:]):
            out.append(Encoded(row_id, ids, labels, truncated))
    if too_long:
        raise ValueError(f"{len(too_long)} row(s) do not fit max_len={max_len} with their whole assistant turn "
                         f"({', '.join(too_long[:5])}{', …' if len(too_long) > 5 else ''}); raise max_len")
    if not out:
        raise ValueError(f"none of the {len(rows)} rows has both a question and an answer (keys "
                         f"question/prompt/input and answer/output/target) within max_len={max_len}: "
                         f"nothing to measure")
    if len(out) < len(rows):
        warnings.warn(f"{len(rows) - len(out)} of {len(rows)} rows have no question or answer "
                      f"(or no target within max_len) and are skipped", stacklevel=3)
    return out


def _batches(model, examples: list[Encoded], tokenizer, batch_size: int) -> Iterable[dict[str, torch.Tensor]]:
    """Right-padded batches with attention mask, on the model's input device."""
    embeddings = model.get_input_embeddings()
    device = embeddings.weight.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start:start + batch_size], pad, embeddings.num_embeddings)
        yield {k: v.to(device) for k, v in batch.items()}


@contextmanager
def _eval_mode(model) -> Iterator[None]:
    """eval() for the measurement (no dropout), the previous mode restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


# --------------------------------------------------------------------------- measurements


@torch.no_grad()
def answer_matches(model, tokenizer, rows: list[dict[str, Any]], system_prompt: str, max_len: int = 256,
                   batch_size: int = 16) -> list[bool]:
    """Per row with a question and an answer (in order; others skipped): does greedy decoding from the
    served prompt reproduce the row's whole assistant turn, end of turn included?

    Teacher-forced: one forward over prompt + turn, True iff the argmax at every target position is the
    target token. By induction this is exactly greedy generation starting with that text (each greedy
    step sees the same prefix the teacher-forced pass feeds), so no generation loop is needed; only an
    exact tie in the logits could decide differently. Tokens are compared, not text: the same text
    reached through another tokenization counts as a mismatch. Accuracy is the mean of the list.
    A row whose turn does not fit ``max_len`` is an error, not a judgement on its prefix.
    """
    examples = _encode(tokenizer, rows, system_prompt, max_len, whole=True)
    out: list[bool] = []
    with _eval_mode(model):
        for batch in _batches(model, examples, tokenizer, batch_size):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           use_cache=False).logits
            targets = next_token_targets(batch["labels"]).to(logits.device)
            hit = (logits.argmax(-1) == targets) | (targets == IGNORE)
            out.extend(bool(x) for x in hit.all(dim=1).cpu())
    return out


def accuracy(matches: list[bool]) -> float:
    """Share of True (the rows answered exactly)."""
    return sum(matches) / len(matches) if matches else float("nan")


@torch.no_grad()
def kl_to_base(peft_model, tokenizer, rows: list[dict[str, Any]], system_prompt: str, max_len: int = 256,
               batch_size: int = 16, span: KlSpan = "answer") -> float:
    """Mean per-token KL(p_base ‖ p_adapted) in fp32 at temperature 1, over every selected token of the rows.

    The base is the same PeftModel under ``disable_adapter()``. ``span="answer"``: the positions that
    predict the assistant turn (training's ``kl_tokens: assistant``); ``"all"``: every attended
    position (``kl_tokens: all``). Same formula and masks as the training loss, so the numbers compare.
    """
    if span not in _MASK_OF_SPAN:
        raise ValueError(f"span must be 'answer' or 'all', got {span!r}")
    if not hasattr(peft_model, "disable_adapter"):
        raise TypeError("kl_to_base needs a PeftModel (its base is the same model with the adapter disabled)")
    examples = _encode(tokenizer, rows, system_prompt, max_len, whole=False)
    total, count = 0.0, 0
    with _eval_mode(peft_model):
        for batch in _batches(peft_model, examples, tokenizer, batch_size):
            ids, attn = batch["input_ids"], batch["attention_mask"]
            adapted = peft_model(input_ids=ids, attention_mask=attn, use_cache=False).logits
            with peft_model.disable_adapter():
                base = peft_model(input_ids=ids, attention_mask=attn, use_cache=False).logits
            select = kl_mask(batch, _MASK_OF_SPAN[span]).to(adapted.device)
            targets = next_token_targets(batch["labels"]).to(adapted.device)
            _, kl_sum = token_terms(adapted[select], base[select].to(adapted.device), targets[select],
                                    torch.ones(int(select.sum()), device=adapted.device), 1.0)
            total += float(kl_sum)
            count += int(select.sum())
    return total / count if count else float("nan")


# --------------------------------------------------------------------------- one sweep point


@dataclass
class PointResult:
    """One adapter of the sweep, measured: accuracies on A and B (adapted and base) and KL to the base."""

    lambda_kl: float
    seed: int
    acc_a: float
    acc_b: float
    kl_a: float
    kl_b: float
    base_acc_a: float
    base_acc_b: float
    n_a: int = 0  # rows judged on A / on B
    n_b: int = 0
    adapter_dir: str = ""

    @property
    def a_drop(self) -> float:
        """Forgetting: base accuracy on A minus adapted accuracy on A."""
        return self.base_acc_a - self.acc_a

    @property
    def b_gain(self) -> float:
        """Learning: adapted accuracy on B minus base accuracy on B."""
        return self.acc_b - self.base_acc_b

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PointResult":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def measure_point(peft_model, tokenizer, rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]],
                  system_prompt: str, lambda_kl: float, seed: int, max_len: int = 256, batch_size: int = 16,
                  kl_span: KlSpan = "answer", base_acc: tuple[float, float] | None = None,
                  adapter_dir: str = "") -> PointResult:
    """All of a point's numbers from a model already loaded (any loader: fp32 on CPU, NF4 on GPUs).

    ``base_acc`` = (A, B) base accuracies from an earlier point of the same sweep skips re-measuring
    the base, which is the same for every point.
    """
    def matches(rows):
        return answer_matches(peft_model, tokenizer, rows, system_prompt, max_len, batch_size)

    if base_acc is None:
        with peft_model.disable_adapter():
            base_acc = (accuracy(matches(rows_a)), accuracy(matches(rows_b)))
    on_a, on_b = matches(rows_a), matches(rows_b)
    kl = [kl_to_base(peft_model, tokenizer, rows, system_prompt, max_len, batch_size, kl_span)
          for rows in (rows_a, rows_b)]
    return PointResult(float(lambda_kl), int(seed), accuracy(on_a), accuracy(on_b), kl[0], kl[1],
                       float(base_acc[0]), float(base_acc[1]), len(on_a), len(on_b), str(adapter_dir))


def run_settings(adapter_dir: str | Path) -> dict[str, Any]:
    """The training run's parameters (``params.yaml`` beside the adapter folder), {} when absent."""
    import yaml

    path = Path(adapter_dir).parent / "params.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def evaluate_point(adapter_dir: str | Path, rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]],
                   system_prompt: str, lambda_kl: float | None = None, seed: int | None = None,
                   base_model: str = "", max_len: int = 256, batch_size: int = 16, kl_span: KlSpan = "answer",
                   base_acc: tuple[float, float] | None = None) -> PointResult:
    """Load the base (fp32, on CPU) and the adapter once, and measure the point.

    λ and seed default to the training run's ``params.yaml`` beside the adapter; the base to the
    adapter's ``base_model_name_or_path``; the tokenizer to the one saved with the adapter.
    For a model that does not fit fp32 in host memory, load it yourself and call `measure_point`.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ..model.load import load_tokenizer
    from ..embedded.tiny import resolve_model

    adapter_dir = Path(adapter_dir)
    config_file = adapter_dir / "adapter_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{adapter_dir} has no adapter_config.json: give a PEFT adapter folder")
    settings = run_settings(adapter_dir)
    lambda_kl = settings.get("lambda_kl") if lambda_kl is None else lambda_kl
    seed = settings.get("seed") if seed is None else seed
    if lambda_kl is None or seed is None:
        raise ValueError(f"no lambda_kl/seed given and none in {adapter_dir.parent / 'params.yaml'}: "
                         "pass lambda_kl= and seed=")
    base_path = resolve_model(base_model or json.loads(config_file.read_text())["base_model_name_or_path"])
    tokenizer = load_tokenizer(str(adapter_dir) if (adapter_dir / "tokenizer_config.json").is_file()
                               else base_path)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    return measure_point(model, tokenizer, rows_a, rows_b, system_prompt, lambda_kl, seed, max_len, batch_size,
                         kl_span, base_acc, str(adapter_dir))


# --------------------------------------------------------------------------- analysis


@dataclass
class LambdaSummary:
    """One λ over its seeds: mean and sample std (0 with one seed) of each quantity."""

    lambda_kl: float
    n: int
    seeds: list[int]
    b_gain_mean: float
    b_gain_std: float
    a_drop_mean: float
    a_drop_std: float
    kl_a_mean: float
    kl_a_std: float
    kl_b_mean: float
    kl_b_std: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def by_lambda(results: list[PointResult]) -> list[LambdaSummary]:
    """Group the points by λ (ascending). The same (λ, seed) twice is an error: it would count a run twice."""
    seen: set[tuple[float, int]] = set()
    groups: dict[float, list[PointResult]] = {}
    for r in results:
        key = (float(r.lambda_kl), int(r.seed))
        if key in seen:
            raise ValueError(f"λ={r.lambda_kl:g}, seed {r.seed} appears twice in the results")
        seen.add(key)
        groups.setdefault(key[0], []).append(r)
    out = []
    for lam in sorted(groups):
        g = groups[lam]
        stats = [_mean_std(vals) for vals in ([r.b_gain for r in g], [r.a_drop for r in g],
                                               [r.kl_a for r in g], [r.kl_b for r in g])]
        out.append(LambdaSummary(lam, len(g), sorted(r.seed for r in g), *[x for pair in stats for x in pair]))
    return out


@dataclass
class LineFit:
    slope: float
    intercept: float
    r2: float
    note: str = ""  # why a value is NaN, "" when all are defined


def fit_line(xs: list[float], ys: list[float]) -> LineFit:
    """Least-squares y = slope·x + intercept, R² = 1 − SS_res/SS_tot.

    Never raises on degenerate data: fewer than two points or all x equal give a NaN slope; all y
    equal (SS_tot = 0) gives R² = NaN (nothing to explain). ``note`` says which.
    """
    if len(xs) != len(ys):
        raise ValueError(f"fit_line needs as many x as y ({len(xs)} vs {len(ys)})")
    n = len(xs)
    if n < 2:
        return LineFit(math.nan, math.nan if n == 0 else float(ys[0]), math.nan, f"{n} point(s): no line")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    ss_tot = sum((y - my) ** 2 for y in ys)
    if sxx == 0:
        return LineFit(math.nan, my, math.nan, "all x are equal: the slope is undefined")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    if ss_tot == 0:
        return LineFit(slope, intercept, math.nan, "all y are equal: R² is undefined")
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys))
    return LineFit(slope, intercept, 1.0 - ss_res / ss_tot)


def _pm(mean: float, std: float) -> str:
    return f"{mean:.3f} ± {std:.3f}"


def sweep_verdict(results: list[PointResult]) -> Verdict:
    """Does λ > 0 forget less of A than λ = 0, beyond the seed spread, and what did it cost on B?

    "Helps" when some λ > 0 has a mean A drop below λ = 0's by more than the two seed stds added
    together, while its B gain is not below λ = 0's by more than those two stds (of the gain). Less
    forgetting bought with clearly less learning is reported as a trade-off, not as help: stopping
    plain SFT earlier might buy the same (the sweep does not measure that). A λ = 0 that forgets
    nothing (mean A drop not above its seed std) leaves nothing to prevent: the sweep then says
    nothing about HARI.
    """
    if not results:
        return Verdict(FAIL, "no sweep results to judge")
    groups = by_lambda(results)
    zero = next((g for g in groups if g.lambda_kl == 0), None)
    others = [g for g in groups if g.lambda_kl > 0]
    if zero is None or not others:
        missing = "λ = 0 (plain LoRA, the baseline)" if zero is None else "any λ > 0"
        return Verdict(FAIL, f"the sweep has no run with {missing}: nothing to compare",
                       [f"λ values present: {', '.join(f'{g.lambda_kl:g}' for g in groups)}"])

    def reduction(g):
        return zero.a_drop_mean - g.a_drop_mean

    def cost(g):
        return zero.b_gain_mean - g.b_gain_mean

    def clear_cut(g):
        return reduction(g) > zero.a_drop_std + g.a_drop_std

    def affordable(g):
        return cost(g) <= zero.b_gain_std + g.b_gain_std

    helping = [g for g in others if clear_cut(g) and affordable(g)]
    best = (max(helping, key=reduction) if helping
            else min(others, key=lambda g: (g.a_drop_mean, -g.b_gain_mean)))
    lines = [f"λ = 0: A drop {_pm(zero.a_drop_mean, zero.a_drop_std)}, B gain "
             f"{_pm(zero.b_gain_mean, zero.b_gain_std)}, KL on A {zero.kl_a_mean:.4g} ({zero.n} seed(s))",
             f"{'best' if helping else 'least forgetting'} λ > 0 = {best.lambda_kl:g}: A drop "
             f"{_pm(best.a_drop_mean, best.a_drop_std)}, B gain {_pm(best.b_gain_mean, best.b_gain_std)}, "
             f"KL on A {best.kl_a_mean:.4g} ({best.n} seed(s))"]
    if zero.b_gain_mean <= 0:
        lines.append(f"λ = 0 did not learn B (gain {zero.b_gain_mean:.3f}): the fine-tuning itself is not working")
    if zero.a_drop_mean <= zero.a_drop_std:
        return Verdict(WARN, f"no forgetting at λ = 0 (A drop {_pm(zero.a_drop_mean, zero.a_drop_std)}): "
                             "the sweep says nothing about whether HARI's KL term limits forgetting", lines)
    spread = zero.a_drop_std + best.a_drop_std
    b_spread = zero.b_gain_std + best.b_gain_std
    cost_text = (f"B gain {best.b_gain_mean:.3f} vs {zero.b_gain_mean:.3f} at λ = 0 "
                 + (f"(costs {cost(best):.3f} on B)" if cost(best) > 0 else f"(no cost on B: {-cost(best):.3f} better)"))
    if helping:
        single = [f"{g.lambda_kl:g}" for g in (zero, best) if g.n < 2]
        status = OK
        if single:
            status = WARN
            lines.append(f"only one seed at λ = {' and '.join(single)}: the seed spread is unknown, "
                         "so the difference is not confirmed")
        return Verdict(status, f"HARI helps: λ = {best.lambda_kl:g} cuts the A drop from {zero.a_drop_mean:.3f} "
                               f"to {best.a_drop_mean:.3f} (by {reduction(best):.3f}, more than the seed spread "
                               f"{spread:.3f}); {cost_text}", lines)
    lines.append(cost_text)
    if clear_cut(best):
        return Verdict(WARN, f"a trade-off, not a free gain: λ = {best.lambda_kl:g} cuts the A drop from "
                             f"{zero.a_drop_mean:.3f} to {best.a_drop_mean:.3f} but learns less B "
                             f"({best.b_gain_mean:.3f} vs {zero.b_gain_mean:.3f}, a cost of {cost(best):.3f}, more "
                             f"than the seed spread {b_spread:.3f}); no λ > 0 forgets less at λ = 0's learning",
                       lines)
    return Verdict(WARN, f"the KL term does NOT help: the best λ = {best.lambda_kl:g} changes the A drop by "
                         f"{-reduction(best):+.3f} ({zero.a_drop_mean:.3f} → {best.a_drop_mean:.3f}), not more than "
                         f"the seed spread {spread:.3f}", lines)


# --------------------------------------------------------------------------- plots


def frontier_figure(results: list[PointResult]):
    """B gain against A drop, one point per λ with seed-std error bars: up and left is better."""
    import matplotlib.pyplot as plt

    groups = by_lambda(results)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    cmap = plt.get_cmap("viridis", max(len(groups), 2))  # the same colour per λ as kl_figure
    for i, g in enumerate(groups):  # a legend, not labels beside the points: nearby λs would overprint
        ax.errorbar(g.a_drop_mean, g.b_gain_mean, xerr=g.a_drop_std, yerr=g.b_gain_std, fmt="s" if g.lambda_kl == 0
                    else "o", capsize=4, color=cmap(i), label=f"λ={g.lambda_kl:g} (n={g.n})")
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
        ax.scatter([r.kl_a for r in pts], [r.a_drop for r in pts], color=cmap(i), label=f"λ={lam:g}", zorder=3)
    xs, ys = [r.kl_a for r in results], [r.a_drop for r in results]
    fit = fit_line(xs, ys)
    if math.isnan(fit.slope):
        ax.plot([], [], " ", label=f"no line: {fit.note}")
    else:
        lo, hi = min(xs), max(xs)
        r2 = f"R² = {fit.r2:.3f}" if not math.isnan(fit.r2) else "R² undefined (all drops equal)"
        ax.plot([lo, hi], [fit.slope * lo + fit.intercept, fit.slope * hi + fit.intercept], color="tab:red",
                label=f"fit: slope {fit.slope:.3g}, {r2}")
    ax.axhline(0, color="black", lw=0.6, ls="--")
    ax.set_xlabel("KL(base ‖ adapted) on A prompts, nats per token")
    ax.set_ylabel("forgetting on A: base acc − adapted acc")
    ax.set_title("forgetting against drift from the base, one dot per run", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
