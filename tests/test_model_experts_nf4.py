"""NF4 routed experts: equal to the bf16 module on the dequantized weights, frozen, and trainable through."""

from __future__ import annotations

import copy

import pytest
import torch
from bitsandbytes import functional as bnbf

from dsr1kit.model.experts_nf4 import NF4Experts, keep_routing_fp32, nf4_bytes, quantize_experts_
from dsr1kit.model.stream_load import load_streaming

IMPLEMENTATIONS = ["eager", "grouped_mm"]  # transformers' two experts forwards we mirror


@pytest.fixture(scope="module")
def bf16_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def routed(bf16_model):
    """A batch of hidden states routed by layer 1's own (fp32) router."""
    hidden = torch.randn(64, bf16_model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(torch.bfloat16)
    _, weights, index = bf16_model.model.layers[1].mlp.gate(hidden)
    return hidden, index, weights.detach()


def quantized_and_reference(bf16_model, implementation: str, chunk_experts: int = 3):
    """NF4 experts of layer 1 and the original bf16 module holding their dequantized weights."""
    experts = bf16_model.model.layers[1].mlp.experts
    nf4 = NF4Experts.from_experts(experts, implementation=implementation, chunk_experts=chunk_experts)
    reference = copy.deepcopy(experts)
    reference.config = copy.deepcopy(experts.config)
    reference.config._experts_implementation = implementation
    every = torch.arange(nf4.num_experts)
    with torch.no_grad():
        reference.gate_up_proj.copy_(nf4.dequantize("gate_up", every))
        reference.down_proj.copy_(nf4.dequantize("down", every))
    return nf4, reference


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_forward_equals_bf16_experts_on_dequantized_weights(bf16_model, routed, implementation):
    """Bit for bit: same kernels on the same rows in the same order, chunked 3 experts at a time."""
    nf4, reference = quantized_and_reference(bf16_model, implementation)
    hidden, index, weights = routed
    with torch.no_grad():
        assert torch.equal(nf4(hidden, index, weights), reference(hidden, index, weights))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gradients_equal_bf16_experts_on_dequantized_weights(bf16_model, routed, implementation):
    """Input and routing-weight grads match; the hidden-state grad is summed over a token's experts
    in fp32 here but in bf16 by autograd, so it may differ by one bf16 rounding (2^-8 relative)."""
    nf4, reference = quantized_and_reference(bf16_model, implementation)
    hidden, index, weights = routed
    grad_out = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1)).to(hidden.dtype)
    grads = []
    for module in (nf4, reference):
        h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        grads.append(torch.autograd.grad(module(h, index, w), [h, w], grad_out))
    (gh, gw), (gh_ref, gw_ref) = grads
    assert torch.allclose(gh.float(), gh_ref.float(), rtol=2**-7, atol=2**-8 * gh_ref.abs().max().item())
    assert torch.allclose(gw, gw_ref, rtol=1e-5, atol=1e-6)


def test_group_dequantize_equals_bitsandbytes_per_expert(bf16_model):
    """Four calls for a group of experts give exactly bnb's own per-expert dequantization."""
    experts = bf16_model.model.layers[2].mlp.experts
    nf4 = NF4Experts.from_experts(experts)
    group = nf4.dequantize("gate_up", torch.tensor([1, 4, 7]))
    for g, e in enumerate([1, 4, 7]):
        packed, state = bnbf.quantize_4bit(
            experts.gate_up_proj[e].detach().contiguous(),
            blocksize=64,
            compress_statistics=True,
            quant_type="nf4",
        )
        assert torch.equal(group[g], bnbf.dequantize_4bit(packed, state))


def test_memory_is_about_a_quarter_of_bf16(bf16_model):
    """4 bits + one 8-bit absmax per 64 + one fp32 per 64·256 = 0.258 of bf16's 16 bits."""
    experts = bf16_model.model.layers[1].mlp.experts
    bf16 = sum(p.numel() * p.element_size() for p in experts.parameters())
    ratio = nf4_bytes(NF4Experts.from_experts(experts)) / bf16
    assert 0.255 < ratio < 0.26, ratio


def test_weights_are_frozen_and_backward_keeps_no_bf16_weights(bf16_model, routed):
    nf4, _ = quantized_and_reference(bf16_model, "grouped_mm")
    assert list(nf4.parameters()) == []  # buffers: no optimizer, no grad, no LoRA target
    hidden, index, weights = routed
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = nf4(hidden.clone().requires_grad_(), index, weights.clone().requires_grad_())
    assert sorted(saved) == sorted([tuple(hidden.shape), tuple(index.shape), tuple(weights.shape)])
    out.float().pow(2).sum().backward()  # re-dequantizes chunk by chunk
    assert all(b.grad is None for b in nf4.buffers())


def test_quantize_in_place_matches_the_streaming_loader(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    assert quantize_experts_(model) == 2  # layers 1 and 2; layer 0 is dense
    streamed = load_streaming(tiny_dir, nf4_linears=False, progress=False)
    for name, buf in model.model.layers[2].mlp.experts.named_buffers():
        assert torch.equal(buf, dict(streamed.model.layers[2].mlp.experts.named_buffers())[name]), name
    assert not any(".mlp.experts." in n for n, _ in model.named_parameters())


def test_routing_stays_fp32_under_autocast(bf16_model, routed):
    """bf16 router logits flip expert choices (6–33% of them, measured), so the router runs outside autocast."""
    router = copy.deepcopy(bf16_model.model.layers[1].mlp.gate)
    hidden = routed[0]
    expected = router(hidden)
    keep_routing_fp32(router)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, weights, index = router(hidden)
    assert logits.dtype == torch.float32 and torch.equal(index, expected[2])


def test_an_fp32_router_keeps_its_own_weights_when_copied_and_its_class_when_swapped(bf16_model, routed):
    """The autocast-free forward is looked up at call time on the module it is bound to: a deepcopy routes with
    its own weights, and a class swapped in afterwards (the prefix pass's lean router) is the one that runs."""
    router = copy.deepcopy(bf16_model.model.layers[1].mlp.gate)
    keep_routing_fp32(router)
    twin = copy.deepcopy(router)
    with torch.no_grad():
        twin.weight.mul_(-1.0)
    hidden = routed[0]
    assert not torch.equal(twin(hidden)[0], router(hidden)[0])

    class Swapped(type(router)):
        def forward(self, hidden_states):
            return "swapped"

    twin.__class__ = Swapped
    assert twin(hidden) == "swapped"


# -- training through NF4 experts -------------------------------------------------------------


def with_lora(model, layer: int, seed: int = 0):
    """PEFT LoRA r=4, alpha=8 on one layer's q_a_proj/q_b_proj (the recipe's targets), B non-zero."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        bias="none",
        target_modules=[
            f"model.layers.{layer}.self_attn.q_a_proj",
            f"model.layers.{layer}.self_attn.q_b_proj",
        ],
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)  # so lora_A gets a gradient too
    return peft_model


def lora_grads(model, ids) -> dict[str, torch.Tensor]:
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_gradients_reach_lora_below_nf4_experts(tiny_dir):
    """LoRA on layer 0 sits below both NF4-experts layers: its grads equal the bf16-experts model's."""
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(2))
    nf4 = load_streaming(tiny_dir, nf4_linears=False, progress=False)
    bf16 = load_streaming(tiny_dir, nf4_linears=False, nf4_experts=False, progress=False)
    every = torch.arange(bf16.config.n_routed_experts)
    with torch.no_grad():
        for layer_nf4, layer_bf16 in zip(nf4.model.layers[1:], bf16.model.layers[1:]):
            layer_bf16.mlp.experts.gate_up_proj.copy_(layer_nf4.mlp.experts.dequantize("gate_up", every))
            layer_bf16.mlp.experts.down_proj.copy_(layer_nf4.mlp.experts.dequantize("down", every))
    for model in (nf4, bf16):
        model.requires_grad_(False)
    got, expected = lora_grads(with_lora(nf4, layer=0), ids), lora_grads(with_lora(bf16, layer=0), ids)
    assert got.keys() == expected.keys() and len(got) == 4
    for name, g in got.items():
        assert g.abs().sum() > 0, name
        cos = torch.nn.functional.cosine_similarity(g.flatten(), expected[name].flatten(), dim=0)
        assert cos > 0.9999, (name, cos)


def test_lora_trains_on_nf4_experts_model_and_only_lora_changes(tiny_dir):
    """The HARI setting: NF4 linears + NF4 experts, LoRA on the last layer's attention, CE loss."""
    model = load_streaming(tiny_dir, progress=False)
    model.requires_grad_(False)
    model = with_lora(model, layer=model.config.num_hidden_layers - 1)
    before = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(trainable, lr=2e-2)
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(3))
    model.train()
    losses = []
    for _ in range(5):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.2, losses
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.equal(t, before[name]) != ("lora_" in name), name
