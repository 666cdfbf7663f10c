"""The kit's grouped experts forward: transformers' ``grouped_mm`` values and gradients, bit for bit."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from dsr1kit.model.experts_grouped import EXPERTS_IMPLEMENTATION, permute_rows, use_kit_experts_


@pytest.fixture(scope="module")
def bf16_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()
    assert model.config._experts_implementation == "grouped_mm"
    return model


def routed(model, tokens: int = 96):
    """Hidden states routed by layer 1's own router, with the routing weights as leaves of autograd."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, model.config.hidden_size, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        _, weights, index = model.model.layers[1].mlp.gate(hidden)
    return hidden, index, weights


def run(experts, implementation: str, hidden, index, weights):
    experts.config._experts_implementation = implementation
    h = hidden.clone().requires_grad_(True)
    w = weights.clone().requires_grad_(True)
    out = experts(h, index, w)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(g)
    return out.detach(), h.grad, w.grad


def test_forward_and_gradients_are_transformers_grouped_mm_bit_for_bit(bf16_model):
    experts = copy.deepcopy(bf16_model.model.layers[1].mlp.experts)
    experts.config = copy.deepcopy(experts.config)
    hidden, index, weights = routed(bf16_model)
    # the routing weights are float32, so the rows they weight become float32
    assert weights.dtype == torch.float32
    want = run(experts, "grouped_mm", hidden, index, weights)
    got = run(experts, EXPERTS_IMPLEMENTATION, hidden, index, weights)
    for name, a, b in zip(("output", "hidden grad", "routing-weight grad"), want, got):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_a_row_permutation_and_its_gradient():
    x = torch.randn(7, 3, requires_grad=True)
    index = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    inverse = torch.argsort(index)
    y = permute_rows(x, index, inverse)
    assert torch.equal(y, x[index])
    g = torch.randn(7, 3)
    y.backward(g)
    assert torch.equal(x.grad, torch.zeros(7, 3).index_add_(0, index, g))


def test_a_model_switched_to_the_kit_experts_trains_to_the_same_gradients(bf16_model):
    model = copy.deepcopy(bf16_model)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))

    def grads(m):
        m.zero_grad(set_to_none=True)
        for p in m.parameters():
            p.requires_grad_(True)
        m(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    want = grads(model)
    assert use_kit_experts_(model)
    assert model.config._experts_implementation == EXPERTS_IMPLEMENTATION
    assert all(
        m.config._experts_implementation == EXPERTS_IMPLEMENTATION
        for m in model.modules()
        if type(m).__name__.endswith("Experts")
    )
    got = grads(model)
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)
    assert not use_kit_experts_(model)  # already switched: nothing to do


def test_eager_experts_are_left_alone(bf16_model):
    model = copy.deepcopy(bf16_model)
    model.set_experts_implementation("eager")
    assert not use_kit_experts_(model)
    assert model.config._experts_implementation == "eager"


@pytest.mark.parametrize("on", [True, False])
def test_the_loader_switches_models_as_its_config_says(tiny_dir, on):
    """``LoadConfig.kit_experts`` (on by default): the kit's forward, or transformers' ``grouped_mm`` kept."""
    from dsr1kit.model.load import LoadConfig, load_model

    cfg = LoadConfig(
        model=str(tiny_dir), dtype="bfloat16", quantization="none", quantize_experts=False, device_map="cpu"
    )
    assert cfg.kit_experts
    loaded = load_model(replace(cfg, kit_experts=on))
    assert loaded.info["kit_experts"] is on
    assert loaded.model.config._experts_implementation == (EXPERTS_IMPLEMENTATION if on else "grouped_mm")
