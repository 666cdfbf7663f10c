"""The HARI loss: the fast path equals the recipe's naive path, in value and LoRA gradients."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hari_support import adapted_model_and_batch

from dsr1kit import params
from dsr1kit.train import vocab_loss
from dsr1kit.train.hari import HariLoss, fast_loss, hari_loss, naive_loss, reference_states, token_terms


def _setup(last_k: int):
    p = params.HariParams(quantization="none", dtype="float32", device_map="cpu", lora_last_k_layers=last_k)
    model, plan, batch = adapted_model_and_batch(p, n_rows=5, max_len=96)
    assert (batch["attention_mask"] == 0).any(), "the batch must contain padding"
    return model, plan, batch


@pytest.fixture(scope="module", params=[1, 2], ids=["last1", "last2"])
def setup(request):
    return _setup(request.param)


def _grads(model, parts):
    model.zero_grad(set_to_none=True)
    parts.loss.backward()
    return torch.cat([q.grad.reshape(-1) for q in model.parameters() if q.requires_grad])


@pytest.mark.parametrize("lam", [0.0, 0.9])
@pytest.mark.parametrize("kl_tokens", ["all", "assistant"])
def test_fast_equals_naive_in_value_and_gradients(setup, lam, kl_tokens):
    model, plan, batch = setup
    naive = naive_loss(model, batch, lam, 1.5, kl_tokens)
    g_naive = _grads(model, naive)
    fast = fast_loss(model, batch, lam, 1.5, min(plan.layers), kl_tokens, chunk=7)
    g_fast = _grads(model, fast)
    assert fast.ce_tokens == naive.ce_tokens and fast.kl_tokens == naive.kl_tokens
    assert abs(float(fast.loss) - float(naive.loss)) <= 1e-5 * abs(float(naive.loss))
    assert float((g_fast - g_naive).norm() / g_naive.norm()) < 1e-5
    if lam > 0:
        assert naive.kl > 1e-4  # the KL term is really exercised


def test_lambda_zero_is_plain_assistant_ce(setup):
    model, _, batch = setup
    parts = naive_loss(model, batch, 0.0, 1.5)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ref = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
    )
    assert torch.allclose(parts.loss, ref, rtol=1e-6)


def test_kl_is_zero_when_the_adapter_is_zero():
    model, plan, batch = _setup(1)
    with torch.no_grad():
        for name, q in model.named_parameters():
            if "lora_B" in name:
                q.zero_()
    parts = fast_loss(model, batch, 0.9, 1.5, min(plan.layers), chunk=1024)
    assert parts.kl == pytest.approx(0.0, abs=1e-7)


def test_the_loss_its_vocabulary_route_and_the_measurements_share_one_kl():
    """``token_terms`` (the naive loss), the fast loss's torch ops and ``measure.kl`` all compute the forward KL
    with ``vocab_loss.forward_kl``: the same values bit for bit, equal to torch's own ``kl_div``."""
    from dsr1kit.measure.kl import kl_per_token, log_probs

    g = torch.Generator().manual_seed(3)
    z, r = torch.randn(6, 50, generator=g) * 3, torch.randn(6, 50, generator=g) * 3
    targets, select = torch.full((6,), -100), torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    log_q, log_p = vocab_loss.log_probs(r, 1.5), vocab_loss.log_probs(z, 1.5)
    kl = vocab_loss.forward_kl(log_q, log_p)
    want = torch.nn.functional.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    assert torch.allclose(kl, want, rtol=1e-5, atol=1e-7) and (kl > 0).all()
    assert torch.equal(token_terms(z, r, targets, select, 1.5)[1], (kl * select).sum())
    assert torch.equal(vocab_loss.torch_terms_and_grad(z, r, targets, select, 1.5, 0.0, 1.0)[1], kl * select)
    at_one = vocab_loss.forward_kl(vocab_loss.log_probs(r), vocab_loss.log_probs(z))
    assert torch.equal(kl_per_token(log_probs(r), log_probs(z)), at_one)


def test_the_loss_config_picks_the_vocabulary_route(setup, monkeypatch):
    """``HariLoss.vocab_route`` (auto by default) reaches every chunk's ``vocab_loss.terms_and_grad``."""
    model, plan, batch = setup
    seen = []
    real = vocab_loss.terms_and_grad
    monkeypatch.setattr(vocab_loss, "terms_and_grad", lambda *a: seen.append(a[-1]) or real(*a))
    loss = HariLoss(lambda_kl=0.9, kl_temperature=1.5, kl_tokens="all", loss_chunk=7, impl="fast")
    assert loss.vocab_route == "auto"
    default = hari_loss(model, batch, loss, min(plan.layers))
    forced = hari_loss(model, batch, replace(loss, vocab_route="torch"), min(plan.layers))
    chunks = len(seen) // 2
    assert chunks > 1 and seen == ["auto"] * chunks + ["torch"] * chunks
    assert float(forced.loss) == float(default.loss)  # on a CPU auto takes the torch ops


def test_kl_uses_the_temperature_and_lambda(setup):
    model, plan, batch = setup
    a = naive_loss(model, batch, 0.5, 1.0)
    b = naive_loss(model, batch, 0.5, 2.0)
    assert a.kl != pytest.approx(b.kl)
    assert float(a.loss) == pytest.approx(a.ce + 0.5 * 1.0 * a.kl, rel=1e-5)
    assert float(b.loss) == pytest.approx(b.ce + 0.5 * 4.0 * b.kl, rel=1e-5)


def test_reference_states_computed_once_give_the_steps_loss_and_gradients(setup):
    """What a reference cache would hand the step equals what the step computes itself, bit for bit; and the
    states handed in are what the KL reads (the student's own states give a zero KL)."""
    model, plan, batch = setup
    first = min(plan.layers)
    in_step = fast_loss(model, batch, 0.9, 1.5, first, chunk=7)
    g_in_step = _grads(model, in_step)
    states = reference_states(model, batch, first)
    handed = fast_loss(model, batch, 0.9, 1.5, first, chunk=7, ref_hidden=states)
    g_handed = _grads(model, handed)
    assert float(handed.loss) == float(in_step.loss) and handed.kl == in_step.kl
    assert torch.equal(g_handed, g_in_step)
    assert in_step.kl > 1e-4
    student = _student_states(model, batch, first)
    assert fast_loss(model, batch, 0.9, 1.5, first, chunk=7, ref_hidden=student).kl == pytest.approx(
        0.0, abs=1e-7
    )
    with pytest.raises(ValueError, match="do not match"):
        fast_loss(model, batch, 0.9, 1.5, first, chunk=7, ref_hidden=states[:, 1:])


def _student_states(model, batch, first):
    from dsr1kit.train.hari import prefix_forward, run_layers

    hidden, args, kwargs = prefix_forward(model, batch, first)
    with torch.no_grad():
        return run_layers(model, first, hidden, args, kwargs)
