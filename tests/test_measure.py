"""dsr1kit.measure: exact-match accuracy equals greedy decoding, KL to the base, one point, the λ-sweep analysis."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from dsr1kit.data.chat import to_messages
from dsr1kit.data.plan import load_rows
from dsr1kit.data.render import render_chat
from dsr1kit.measure.accuracy import accuracy, answer_matches
from dsr1kit.measure.figures import frontier_figure, kl_figure
from dsr1kit.measure.kl import kl_to_base
from dsr1kit.measure.point import evaluate_point
from dsr1kit.measure.sweep import PointResult, by_lambda, fit_line, sweep_verdict
from dsr1kit.steps import FAIL, OK, WARN

SYSTEM = "You are DeepSeek-R1."
TURN = re.compile(r"^(?:<think>\n(?P<cot>.*?)\n</think>\n)?<answer>\n(?P<answer>.*?)\n</answer>", re.S)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from dsr1kit.model.load import load_tokenizer

    return load_tokenizer(str(tiny_dir))


def _base(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def base_model(tiny_dir):
    return _base(tiny_dir)


@pytest.fixture
def peft_model(tiny_dir):
    from dsr1kit.model.lora import LoraConfig, apply_lora

    model, _ = apply_lora(_base(tiny_dir), LoraConfig(r=4, alpha=8, dropout=0.0, last_k_layers=1, targets=()))
    return model.eval()


@pytest.fixture(scope="module")
def eval_rows():
    return load_rows("data/eval_tiny.jsonl").rows


def _randomize_lora_b(model, scale: float = 0.5) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, q in model.named_parameters():
            if "lora_B" in name:
                q.copy_(torch.randn(q.shape, generator=gen) * scale)


@torch.no_grad()
def _greedy(model, prompt_ids: list[int], n: int, pad_id: int) -> list[int]:
    x = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=pad_id
    )
    return out[0, x.shape[1] :].tolist()


def _own_answer_rows(model, tokenizer, rows: list[dict]) -> list[dict]:
    """Rows rewritten to say what the model greedily says: their whole turn is reproduced."""
    out = []
    for row in rows:
        rendered = render_chat(tokenizer, to_messages(row, SYSTEM))
        said = tokenizer.decode(_greedy(model, rendered.prompt_ids, 60, tokenizer.pad_token_id))
        m = TURN.match(said)
        if m and m["answer"].strip():
            own = {"id": f"{row['id']}-own", "question": row["question"], "answer": m["answer"]}
            if m["cot"]:
                own["cot"] = m["cot"]
            out.append(own)
    return out


def test_answer_matches_is_greedy_generation(base_model, tokenizer, eval_rows):
    own = _own_answer_rows(base_model, tokenizer, eval_rows[:12])
    assert len(own) >= 3, "the tiny model's greedy answers should parse as <think>/<answer> turns"
    rows = [r for pair in zip(eval_rows[:10], own + [None] * 10) for r in pair if r is not None]
    assert len(rows) >= 13
    matches = answer_matches(base_model, tokenizer, rows, SYSTEM, batch_size=4)  # several padded batches
    expected, partial = [], 0
    for row in rows:
        rendered = render_chat(tokenizer, to_messages(row, SYSTEM))
        target = rendered.target_ids
        generated = _greedy(base_model, rendered.prompt_ids, len(target) + 1, tokenizer.pad_token_id)
        expected.append(generated[: len(target)] == target)
        partial += 0 < next((i for i, (g, t) in enumerate(zip(generated, target)) if g != t), 0)
    assert matches == expected
    assert any(matches) and not all(matches)
    assert (
        partial >= 3
    )  # misses after a correct start: the teacher-forced shortcut is tested where it matters
    assert accuracy(matches) == sum(expected) / len(expected)


def test_wrong_answer_is_false_and_answerless_rows_skipped(base_model, tokenizer, eval_rows):
    own = _own_answer_rows(base_model, tokenizer, eval_rows[:3])
    assert answer_matches(base_model, tokenizer, own[:1], SYSTEM) == [True]
    wrong = {**own[0], "answer": own[0]["answer"] + "9"}
    assert answer_matches(base_model, tokenizer, [wrong], SYSTEM) == [False]
    with pytest.warns(UserWarning, match="1 of 2 rows"):
        assert answer_matches(base_model, tokenizer, [{"question": "no answer"}, own[0]], SYSTEM) == [True]
    with pytest.raises(ValueError, match="none of the 1 rows"):
        answer_matches(base_model, tokenizer, [{"question": "no answer"}], SYSTEM)
    with pytest.raises(ValueError, match="raise max_len"):
        answer_matches(base_model, tokenizer, own[:1], SYSTEM, max_len=8)


def _direct_kl(model, tokenizer, rows, span: str) -> float:
    """One row at a time, no padding, with F.kl_div: the reference for kl_to_base."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            rendered = render_chat(tokenizer, to_messages(row, SYSTEM))
            x = torch.tensor([rendered.ids])
            adapted = F.log_softmax(model(input_ids=x).logits[0].float(), -1)
            with model.disable_adapter():
                base = F.log_softmax(model(input_ids=x).logits[0].float(), -1)
            n_prompt = len(rendered.prompt_ids)
            pos = (
                slice(n_prompt - 1, len(rendered.ids) - 1)
                if span == "answer"
                else slice(0, len(rendered.ids))
            )
            total += float(F.kl_div(adapted[pos], base[pos], log_target=True, reduction="sum"))
            count += len(range(*pos.indices(len(rendered.ids))))
    return total / count


def test_kl_to_base(peft_model, tokenizer, eval_rows):
    rows = eval_rows[:10]
    assert (
        kl_to_base(peft_model, tokenizer, rows, SYSTEM, span="answer") == 0.0
    )  # lora_B = 0: the base itself
    _randomize_lora_b(peft_model)
    for span in ("answer", "all"):
        got = kl_to_base(peft_model, tokenizer, rows, SYSTEM, batch_size=4, span=span)
        assert got > 1e-3
        assert got == pytest.approx(_direct_kl(peft_model, tokenizer, rows, span), rel=1e-4)
    with pytest.raises(ValueError, match="span"):
        kl_to_base(peft_model, tokenizer, rows, SYSTEM, span="prompt")


def test_evaluate_point(peft_model, tokenizer, base_model, eval_rows, tmp_path):
    _randomize_lora_b(peft_model, 0.05)
    adapter = tmp_path / "run" / "adapter"
    peft_model.save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    (tmp_path / "run" / "params.yaml").write_text("seed: 3\nlambda_kl: 0.1\n")
    own = _own_answer_rows(base_model, tokenizer, eval_rows[:3])
    rows_a, rows_b = own + eval_rows[:3], eval_rows[3:8]
    point = evaluate_point(adapter, rows_a, rows_b, SYSTEM)
    assert (point.lambda_kl, point.seed, point.n_a, point.n_b) == (0.1, 3, len(rows_a), len(rows_b))
    assert point.base_acc_a == accuracy(answer_matches(base_model, tokenizer, rows_a, SYSTEM))
    assert point.base_acc_a > 0 and point.kl_a > 0 and point.kl_b > 0
    assert PointResult.from_dict(point.to_dict()) == point
    assert evaluate_point(adapter, rows_a, rows_b, SYSTEM, lambda_kl=0.0, seed=1).lambda_kl == 0.0


# ----------------------------------------------------------------------------- analysis on hand-made points


def _point(lam, seed, drop_a, gain_b, kl_a=0.1, kl_b=0.2, base_a=0.8, base_b=0.1) -> PointResult:
    return PointResult(lam, seed, base_a - drop_a, base_b + gain_b, kl_a, kl_b, base_a, base_b)


def test_by_lambda():
    results = [_point(0.0, 0, 0.30, 0.50), _point(0.0, 1, 0.20, 0.40), _point(0.1, 0, 0.05, 0.45)]
    zero, one = by_lambda(results)
    assert (zero.lambda_kl, zero.n, zero.seeds, one.n) == (0.0, 2, [0, 1], 1)
    assert zero.a_drop_mean == pytest.approx(0.25) and zero.a_drop_std == pytest.approx(math.sqrt(0.005))
    assert zero.b_gain_mean == pytest.approx(0.45) and zero.b_gain_std == pytest.approx(math.sqrt(0.005))
    assert one.a_drop_mean == pytest.approx(0.05) and one.a_drop_std == 0.0 and one.kl_a_std == 0.0
    with pytest.raises(ValueError, match="twice"):
        by_lambda(results + [_point(0.0, 1, 0.1, 0.1)])


def test_fit_line():
    fit = fit_line([0.0, 1.0, 2.0, 3.0], [1.0, 3.0, 5.0, 7.0])
    assert (fit.slope, fit.intercept, fit.r2, fit.note) == (
        pytest.approx(2.0),
        pytest.approx(1.0),
        pytest.approx(1.0),
        "",
    )
    flat = fit_line([0.0, 1.0, 2.0], [0.5, 0.5, 0.5])
    assert flat.slope == 0.0 and math.isnan(flat.r2) and "R²" in flat.note
    assert math.isnan(fit_line([1.0, 1.0], [0.0, 1.0]).slope)
    noisy = fit_line([0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 1.0, 3.0])
    assert 0 < noisy.r2 < 1


def _numbers(text: str) -> set[str]:
    return set(re.findall(r"-?\d+\.\d+", text))


def test_verdict_helps():
    results = [
        _point(0.0, 0, 0.30, 0.50),
        _point(0.0, 1, 0.20, 0.40),
        _point(0.1, 0, 0.06, 0.40),
        _point(0.1, 1, 0.04, 0.30),
        _point(0.5, 0, 0.10, 0.20),
        _point(0.5, 1, 0.10, 0.10),
    ]
    v = sweep_verdict(results)
    assert v.status == OK
    assert v.headline.startswith("HARI helps: λ = 0.1 ")
    # λ=0: drop 0.250 ± 0.071, gain 0.450; λ=0.1: drop 0.050 ± 0.014, gain 0.350 → cost 0.100, spread 0.085
    assert {"0.250", "0.050", "0.200", "0.085", "0.350", "0.450", "0.100"} <= _numbers(v.headline)
    assert "costs 0.100 on B" in v.headline
    assert any("0.250 ± 0.071" in line for line in v.lines)


def test_verdict_single_seed_is_not_confirmed():
    v = sweep_verdict([_point(0.0, 0, 0.30, 0.50), _point(0.1, 0, 0.10, 0.50)])
    assert v.status == WARN and v.headline.startswith("HARI helps")
    assert any("only one seed at λ = 0 and 0.1" in line for line in v.lines)
    assert "no cost on B" in v.headline


def test_verdict_does_not_help():
    results = [
        _point(0.0, 0, 0.30, 0.50),
        _point(0.0, 1, 0.20, 0.40),
        _point(0.1, 0, 0.28, 0.40),
        _point(0.1, 1, 0.16, 0.40),
    ]
    v = sweep_verdict(results)
    assert v.status == WARN
    assert v.headline.startswith("the KL term does NOT help: the best λ = 0.1")
    # 0.250 → 0.220 (-0.030), spread 0.071 + 0.085 = 0.156
    assert {"-0.030", "0.250", "0.220", "0.156"} <= _numbers(v.headline)


def test_verdict_less_forgetting_bought_with_less_learning_is_a_trade_off():
    results = [
        _point(0.0, 0, 0.80, 0.30),
        _point(0.0, 1, 0.84, 0.32),
        _point(2.0, 0, 0.60, 0.10),
        _point(2.0, 1, 0.62, 0.12),
    ]
    v = sweep_verdict(results)
    assert v.status == WARN
    assert v.headline.startswith("a trade-off, not a free gain: λ = 2 cuts the A drop from 0.820 to 0.610")
    # B gain 0.110 vs 0.310: cost 0.200 > spread 0.014 + 0.014
    assert {"0.110", "0.310", "0.200", "0.028"} <= _numbers(v.headline)
    assert any(line.startswith("least forgetting λ > 0 = 2") for line in v.lines)


def test_verdict_no_forgetting_at_lambda_zero():
    results = [_point(0.0, 0, 0.02, 0.50), _point(0.0, 1, -0.02, 0.40), _point(0.1, 0, 0.0, 0.40)]
    v = sweep_verdict(results)
    assert v.status == WARN
    assert v.headline.startswith("no forgetting at λ = 0")
    assert "says nothing" in v.headline
    assert "0.000 ± 0.028" in v.headline


def test_verdict_needs_both_sides():
    assert sweep_verdict([_point(0.1, 0, 0.1, 0.1)]).status == FAIL
    assert "λ = 0" in sweep_verdict([_point(0.1, 0, 0.1, 0.1)]).headline
    assert sweep_verdict([_point(0.0, 0, 0.1, 0.1)]).status == FAIL
    assert sweep_verdict([]).status == FAIL


def test_figures():
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    results = [
        _point(lam, s, 0.3 - lam + 0.01 * s, 0.4, kl_a=0.5 - lam) for lam in (0.0, 0.1, 0.2) for s in (0, 1)
    ]
    fig = frontier_figure(results)
    assert isinstance(fig, Figure)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [
        "λ=0 (n=2)",
        "λ=0.1 (n=2)",
        "λ=0.2 (n=2)",
    ]
    fig2 = kl_figure(results)
    labels = [t.get_text() for t in fig2.axes[0].get_legend().get_texts()]
    fit = fit_line([r.kl_a for r in results], [r.a_drop for r in results])
    assert f"fit: slope {fit.slope:.3g}, R² = {fit.r2:.3f}" in labels
    plt.close(fig)
    plt.close(fig2)
