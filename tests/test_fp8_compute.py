"""The FP8 prefix path: R1's e4m3 weights kept as stored and run as block-scaled GEMMs.

CPU tests run the float32 emulation of the kernels' arithmetic (the path a CPU takes); the CUDA tests
(marker gpu, skipped without CUDA) check the Triton kernels against that emulation. Tolerances against the
bf16-dequantized reference come from e4m3 itself: rounding an activation to 3 mantissa bits moves it by
2.6% RMS (measured below), so one GEMM's output moves by about as much, and a sublayer that chains two or
three of them by ~4–5% (docs/benchmarks.md, "The prefix pass in FP8").
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsr1kit.model import fp8_compute
from dsr1kit.model.checkpoint_index import CheckpointError
from dsr1kit.model.expert_tiles import expert_tiles
from dsr1kit.model.fp8 import FP8_MAX, dequantize_fp8_blocks, quantize_fp8_blocks
from dsr1kit.model.fp8_compute import (
    FP8Experts,
    FP8Linear,
    quantize_activations,
    reference_linear,
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_activations_round_to_e4m3_per_row_and_128_column_group():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 200, generator=g) * torch.logspace(-3, 3, 37)[:, None]  # rows of any magnitude
    x[5, 128:] = 0.0  # an all-zero group quantizes to zeros, not 0/0
    q, scale = quantize_activations(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (
        37,
        2,
    )  # 200 columns: a full and a partial group
    back = fp8_compute.dequantize_activations(q, scale)
    assert torch.isfinite(back).all() and (back[5, 128:] == 0).all()
    # each group's largest magnitude maps to 448, and e4m3 keeps 3 mantissa bits: ≤ 2^-4 relative per element
    assert torch.allclose(q.float().abs()[:, :128].amax(1), torch.full((37,), FP8_MAX))
    big = x.abs() > scale.repeat_interleave(128, 1)[:, :200] * 2**-6  # normal e4m3 range
    assert ((back - x).abs()[big] <= x.abs()[big] * 2**-4 + 1e-12).all()
    assert 0.02 < _rel(back, x) < 0.03  # the 2.6% RMS the tolerances below rest on


def test_fp8_linear_is_the_quantized_input_times_the_dequantized_weight():
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(200, 576, bias=False)  # MLA's kv_a shape: partial blocks both ways
    nn.init.normal_(linear.weight, std=0.02, generator=g)
    fp8 = FP8Linear.from_linear(linear)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.weight_scale_inv.shape == (5, 2)
    x = torch.randn(3, 7, 200, generator=g)
    q, s = quantize_activations(x)
    w = dequantize_fp8_blocks(fp8.weight, fp8.weight_scale_inv, dtype=torch.float32)
    with torch.no_grad():
        y = fp8(x)
        assert y.shape == (3, 7, 576)
        assert torch.allclose(y.reshape(-1, 576), fp8_compute.dequantize_activations(q, s) @ w.T, atol=1e-6)
        assert 0.015 < _rel(y, x @ w.T) < 0.04  # activation rounding only: the weights are the same


def test_fp8_modules_are_forward_only():
    fp8 = FP8Linear.from_linear(nn.Linear(128, 128, bias=False))
    x = torch.randn(2, 128, requires_grad=True)
    with pytest.raises(RuntimeError, match="forward-only"):
        fp8(x)
    with torch.no_grad():
        fp8(x)


def test_expert_tiles_give_each_slot_one_row_and_each_tile_one_expert():
    g = torch.Generator().manual_seed(2)
    experts, top_k, tokens, block = 16, 4, 45, 8
    index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    index[index == 3] = 4  # expert 3 gets no rows
    index[:, 0] = torch.where(index[:, 0] == 4, 5, index[:, 0])  # keep rows distinct per token
    rows, block_expert = expert_tiles(index, experts, block)
    flat = index.reshape(-1)
    used = rows[rows >= 0].long()
    assert sorted(used.tolist()) == list(range(tokens * top_k))  # every (token, k) slot exactly once
    assert rows.numel() % block == 0 and block_expert.numel() == rows.numel() // block
    for tile, expert in enumerate(block_expert.tolist()):
        tile_rows = rows[tile * block : (tile + 1) * block]
        live = tile_rows[tile_rows >= 0].long()
        if expert < 0:
            assert live.numel() == 0
        else:
            assert (flat[live] == expert).all()
    assert 3 not in block_expert.tolist()


def test_fp8_experts_match_transformers_experts_on_the_dequantized_weights():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    config = DeepseekV3Config(
        hidden_size=256, moe_intermediate_size=96, n_routed_experts=8
    )  # I' = 128: padded
    experts = DeepseekV3Experts(config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for t in (experts.gate_up_proj, experts.down_proj):
            t.normal_(std=0.02, generator=g)
    fp8 = FP8Experts.from_experts(experts)
    assert fp8.act_is_silu  # so a GPU runs the kernels' fused SiLU(gate)·up
    with torch.no_grad():  # the bf16 reference: the same FP8 weights, dequantized
        for e in range(8):
            gu = dequantize_fp8_blocks(fp8.gate_up[e], fp8.gate_up_scale_inv[e], dtype=torch.float32)
            experts.gate_up_proj[e] = torch.cat([gu[:96], gu[128:224]])
            experts.down_proj[e] = dequantize_fp8_blocks(
                fp8.down[e], fp8.down_scale_inv[e], dtype=torch.float32
            )
        x = torch.randn(50, 256, generator=g)
        index = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(50)])
        weights = torch.rand(50, 2, generator=g)
        assert _rel(fp8(x, index, weights), experts(x, index, weights)) < 0.06


@pytest.fixture(scope="module")
def r1_tiny_both():
    """The R1-format tiny checkpoint loaded as stored (FP8 compute) and dequantized (the reference), fp32."""
    from dsr1kit.embedded import r1_format
    from dsr1kit.model.stream_load import load_streaming

    path = r1_format.build()
    kwargs = dict(nf4_linears=False, nf4_experts=False, dtype=torch.float32, progress=False)
    return path, load_streaming(path, fp8_compute=True, **kwargs), load_streaming(path, **kwargs)


def test_r1s_fp8_shards_load_as_stored(r1_tiny_both):
    from safetensors import safe_open

    from dsr1kit.model.checkpoint_index import read_weight_map

    path, fp8, _ = r1_tiny_both
    weight_map = read_weight_map(path)
    stored = {k for k in weight_map if k.endswith("weight_scale_inv")}
    linears = [n for n, m in fp8.model.layers.named_modules() if isinstance(m, FP8Linear)]
    expert_modules = [n for n, m in fp8.model.layers.named_modules() if isinstance(m, FP8Experts)]
    left = [n for n, m in fp8.model.layers.named_modules() if isinstance(m, nn.Linear)]
    assert linears and expert_modules and not left  # no decoder-layer linear kept a bf16/fp32 copy
    assert len(linears) + 3 * 8 * len(expert_modules) == len(stored)  # 8 experts × gate, up, down each
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    with safe_open(path / weight_map[name], "pt") as f:
        assert torch.equal(
            fp8.get_submodule(name.removesuffix(".weight")).weight.view(torch.uint8),
            f.get_tensor(name).view(torch.uint8),
        )
    assert fp8.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router as transformers keeps it


def test_the_loaded_fp8_models_layers_run_the_lean_forward(r1_tiny_both, monkeypatch):
    """The loader keeps the router fp32 (an autocast-free forward) and then swaps in the lean classes: each
    router must still run the lean router's forward, and each layer the lean layer's."""
    from dsr1kit.model import prefix_layer

    _, fp8, _ = r1_tiny_both
    calls = []
    original = prefix_layer.router_logits
    monkeypatch.setattr(prefix_layer, "router_logits", lambda h, w, k: calls.append(k) or original(h, w, k))
    moe = [layer for layer in fp8.model.layers if hasattr(layer.mlp, "experts")]
    assert moe and all(type(layer.mlp.gate) is prefix_layer.PrefixRouter for layer in moe)
    with torch.no_grad():
        fp8(input_ids=torch.arange(12)[None] % fp8.config.vocab_size)
    assert calls == [True] * len(moe)  # the kernels where a GPU runs them, by default


def test_fp8_layers_match_the_dequantized_reference_layer_by_layer(r1_tiny_both):
    """Each decoder layer, fed the reference's own input to it: the hidden state it passes on, and each sublayer
    (attention, then the MLP on the reference's own post-attention input) within 6% of the dequantized
    reference's: e4m3 activation rounding moves each GEMM's output by ~2.6%, and a sublayer chains two or three
    GEMMs (√3 × 2.6% ≈ 4.5%). Above 0.5%, so the path did quantize. Each sublayer gets the reference's input so
    that a token whose top-k routing flips on a rounded input (the tiny model's router margins are small and
    depend on its build) does not count as the FP8 GEMMs' error; the layer's output still includes it."""
    _, fp8, ref = r1_tiny_both
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, fp8.config.vocab_size, (2, 48), generator=g)
    with torch.no_grad():
        states = ref(input_ids=ids, output_hidden_states=True).hidden_states
        pos = torch.arange(ids.shape[1])[None]
        rotary = ref.model.rotary_emb(states[0], pos)
        mask = torch.full((48, 48), float("-inf")).triu(1)[None, None]
        attn_kwargs = dict(attention_mask=mask, position_embeddings=rotary, position_ids=pos)
        errors = []
        for i, (layer_ref, layer_fp8) in enumerate(zip(ref.model.layers, fp8.model.layers)):
            out_ref = layer_ref(states[i], **attn_kwargs)
            out_fp8 = layer_fp8(states[i], **attn_kwargs)
            out_ref = out_ref[0] if isinstance(out_ref, tuple) else out_ref
            out_fp8 = out_fp8[0] if isinstance(out_fp8, tuple) else out_fp8
            attn_in = layer_ref.input_layernorm(states[i])
            attn_ref = layer_ref.self_attn(attn_in, **attn_kwargs)[0]
            attn_fp8 = layer_fp8.self_attn(attn_in, **attn_kwargs)[0]
            mlp_in = layer_ref.post_attention_layernorm(states[i] + attn_ref)
            sub = max(_rel(attn_fp8, attn_ref), _rel(layer_fp8.mlp(mlp_in), layer_ref.mlp(mlp_in)))
            errors.append((i, round(_rel(out_fp8, out_ref), 4), round(sub, 4)))
    print("layer, hidden-state error, largest sublayer error:", errors)
    assert all(hidden < 0.06 and 0.005 < sub < 0.06 for _, hidden, sub in errors), errors


def test_fp8_compute_refuses_a_checkpoint_not_stored_in_fp8():
    from dsr1kit.embedded import tiny
    from dsr1kit.model.stream_load import load_streaming

    with pytest.raises(CheckpointError, match="not stored in FP8.*prefix_precision"):
        load_streaming(tiny.resolve_model(tiny.TINY_R1_NAME), fp8_compute=True, progress=False)


# -- the Triton kernels against their emulation (CUDA) ---------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m, k, n", [(1, 128, 128), (37, 200, 576), (64, 256, 576), (300, 7168, 1536), (4096, 2048, 7168)]
)
def test_fp8_linear_kernel_equals_its_emulation(m, k, n):
    """torch's block-scaled GEMM, or where it refuses the shape (k = 200: not whole 128-blocks) the bf16 GEMM of
    the dequantized operands: both within bf16 rounding of the float32 emulation."""
    from dsr1kit.model import fp8_kernels

    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    weight, scale = quantize_fp8_blocks(torch.randn(n, k, generator=g, device="cuda") * 0.02)
    x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
    got = fp8_kernels.linear(x, weight, scale)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert _rel(got, reference_linear(x, weight, scale, torch.float32)) < 5e-3  # bf16 output rounding
    layer = FP8Linear(k, n, device="cuda")
    layer.weight, layer.weight_scale_inv = weight, scale
    with torch.no_grad():
        assert torch.equal(layer(x), got)  # the module takes the kernel on this GPU


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter",
    [(37, 8, 2, 256, 96), (1000, 64, 6, 2048, 1408)],
)
def test_fp8_experts_kernel_equals_its_emulation(tokens, experts, top_k, hidden, inter, monkeypatch):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    from dsr1kit.model import fp8_kernels

    config = DeepseekV3Config(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts)
    with torch.device("cuda"):
        module = DeepseekV3Experts(config).to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    with torch.no_grad():
        for t in (module.gate_up_proj, module.down_proj):
            t.normal_(std=0.02, generator=g)
        fp8 = FP8Experts.from_experts(module)
        x = torch.randn(tokens, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
        index = torch.stack(
            [torch.randperm(experts - 1, generator=g, device="cuda")[:top_k] for _ in range(tokens)]
        )
        weights = torch.rand(tokens, top_k, generator=g, device="cuda")
        assert fp8.act_is_silu  # DeepSeek's experts take the kernels' fused SiLU
        calls = []
        real = fp8_kernels.experts
        monkeypatch.setattr(fp8_kernels, "experts", lambda *a, **k: calls.append(1) or real(*a, **k))
        got = fp8(x, index, weights)  # the last expert gets no rows
        assert calls and torch.isfinite(got).all()
        # 1e-2, not the linear's 5e-3: gate/up outputs are rounded to bf16 and summed in another order than the
        # emulation's, and the few activations that then land on the other side of an e4m3 rounding boundary
        # move by a whole e4m3 step (6-12%)
        assert _rel(got, fp8.reference(x, index, weights)) < 1e-2
