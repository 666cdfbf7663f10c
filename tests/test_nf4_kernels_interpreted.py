"""The NF4 grouped GEMM (the kit's Triton kernel that reads NF4 expert weights as stored) on CPU, through Triton's
interpreter (and compiled, in bf16 up to R1's widths, where a GPU is present): each row tile multiplied by its own
expert's weights, both directions (forward and the input gradient), and NF4 experts giving the same outputs and
gradients by either route.

The interpreter must be switched on before Triton compiles anything, hence a fresh interpreter per check. Its dot
misreads a bf16 tile cast in registers, so the kernel multiplies in float32 there (the products of bf16 values are
exact in float32, as on a GPU's tensor cores); its bf16 stores truncate, which the bf16 tolerance allows for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from bitsandbytes import functional as bnbf

    from dsr1kit.model import experts_nf4, nf4_kernels as K

    assert K.INTERPRETING
    case = json.loads(sys.argv[1])
    g = torch.Generator().manual_seed(3)
    out = {}

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    if case["what"] == "gemm":
        dtype = getattr(torch, case["dtype"])
        rows, cols = case["shape"]
        counts = case["counts"]
        weights = [torch.randn(rows, cols, generator=g).to(dtype) for _ in counts]
        packed, absmax, dense = [], [], []
        for w in weights:
            q, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
            packed.append(q.view(-1))
            absmax.append(state.absmax.float())
            dense.append(bnbf.dequantize_4bit(q, state).float())
        packed, absmax = torch.stack(packed), torch.stack(absmax)
        x = torch.randn(sum(counts), cols, generator=g).to(dtype).requires_grad_()
        row_tiles = K.tiles(counts, x.device)
        out["block_m"] = row_tiles.block_m
        y = K.grouped_mm(x, packed, absmax, row_tiles, (rows, cols))
        grad = torch.randn(y.shape, generator=g).to(dtype)
        (gx,) = torch.autograd.grad(y, x, grad)

        def reference(shift):
            xr = x.detach().float().requires_grad_()
            parts, start = [], 0
            for e, count in enumerate(counts):
                parts.append(xr[start : start + count] @ dense[(e + shift) % len(counts)].T)
                start += count
            want = torch.cat(parts)
            return want, torch.autograd.grad(want, xr, grad.float())[0]

        want, want_gx = reference(0)
        out["forward"], out["backward"] = rel(y, want), rel(gx, want_gx)
        wrong, wrong_gx = reference(1)  # every tile against its neighbour's expert
        out["neighbour"] = min(rel(y, wrong), rel(gx, wrong_gx))
        out["shape"] = list(y.shape)
    else:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

        tokens, experts, top_k, hidden, inter = case["shape"]
        config = DeepseekV3Config(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts)
        bf16 = DeepseekV3Experts(config)
        with torch.no_grad():
            for t in (bf16.gate_up_proj, bf16.down_proj):
                t.copy_(torch.randn(t.shape, generator=g) * 0.05)
        module = experts_nf4.NF4Experts.from_experts(bf16, chunk_experts=3)  # three chunks of experts
        x = torch.randn(tokens, hidden, generator=g).requires_grad_()
        index = torch.stack([torch.randperm(experts - 1, generator=g)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k, generator=g).requires_grad_()
        grad = torch.randn(tokens, hidden, generator=g)
        results = {}
        for route in ("dequant", "fused"):
            experts_nf4.set_route(route)
            y = module(x, index, weights)
            results[route] = (y, *torch.autograd.grad(y, (x, weights), grad))
        for name, got, want in zip(("output", "hidden_grad", "weights_grad"), results["fused"], results["dequant"]):
            out[name] = rel(got, want)
    print("RESULT", json.dumps(out))
    """
)


def _interpreted(case: dict) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(case)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.parametrize(
    ("counts", "block_m"),
    # an expert with no rows, one with fewer rows than a tile, ones that span two and three tiles
    [([0, 70, 5, 130], 64), ([0, 150, 100, 300], 128)],
    ids=["64-row-tiles", "128-row-tiles"],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(256, 128), (128, 320)], ids=["gate-up-like", "down-like-partial-tiles"])
def test_nf4_grouped_gemm_interpreted_multiplies_each_tile_by_its_own_experts_weights(
    shape, dtype, counts, block_m
):
    got = _interpreted({"what": "gemm", "shape": shape, "dtype": dtype, "counts": counts})
    assert got["shape"] == [sum(counts), shape[0]] and got["block_m"] == block_m
    # float32: the same products summed in another order; bf16: the output rounded (truncated here) once
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    assert got["forward"] < tolerance and got["backward"] < tolerance, got
    assert got["neighbour"] > 0.5, got  # a tile multiplied by the wrong expert's weights is far off


def test_nf4_experts_give_the_same_outputs_and_gradients_by_either_route():
    """float32 NF4 experts in three chunks: the fused kernel against bitsandbytes' dequantization + grouped_mm."""
    got = _interpreted({"what": "module", "shape": [150, 8, 3, 256, 128]})
    assert max(got.values()) < 1e-5, got


# -- on a GPU: the compiled kernel, bf16, wider shapes (skipped without CUDA) ----------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter",
    [(37, 8, 2, 256, 128), (2048, 64, 8, 2048, 512), (4096, 256, 8, 7168, 2048)],
    ids=["tiny", "mid", "r1-widths"],
)
def test_nf4_experts_fused_route_matches_the_dequant_route_on_cuda(tokens, experts, top_k, hidden, inter):
    """bf16 NF4 experts: output and input/routing-weight gradients by the fused kernel against bitsandbytes'
    dequantization + grouped_mm. Both multiply the same bf16 weights; they differ by summation order and bf16
    rounding of the outputs (one bf16 step, 2^-8, relative)."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    from dsr1kit.model import experts_nf4

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(tokens)
    config = DeepseekV3Config(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts)
    with torch.device("meta"):  # allocated in bf16 on the GPU only (R1's widths: 22.5 GB, 45 GB in float32)
        bf16 = DeepseekV3Experts(config).to(torch.bfloat16)
    bf16 = bf16.to_empty(device="cuda")
    with torch.no_grad():
        for t in (bf16.gate_up_proj, bf16.down_proj):
            t.copy_(torch.randn(t.shape, generator=g, device="cuda") * 0.02)
    module = experts_nf4.NF4Experts.from_experts(bf16)
    del bf16
    x = torch.randn(tokens, hidden, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
    scores = torch.rand(tokens, experts, generator=g, device="cuda")
    index = scores.topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, generator=g, device="cuda").requires_grad_()
    grad = torch.randn(tokens, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
    results = {}
    try:
        for route in ("dequant", "fused"):
            experts_nf4.set_route(route)
            y = module(x, index, weights)
            results[route] = (y, *torch.autograd.grad(y, (x, weights), grad))
    finally:
        experts_nf4.set_route("auto")
    for name, got, want in zip(
        ("output", "hidden_grad", "weights_grad"), results["fused"], results["dequant"]
    ):
        rel = float((got.float() - want.float()).norm() / want.float().norm())
        assert rel < 1e-2, (name, rel)
