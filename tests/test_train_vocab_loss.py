"""The fused CE + KL kernel over the vocabulary against the torch ops it replaces on a GPU.

On CPU the kernel runs through Triton's interpreter (a fresh process, since the interpreter must be on before
Triton compiles anything), in float32, where the two differ only by the order of float32 sums. On a GPU the
logits are bf16 as the cached step makes them, at R1's vocabulary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dsr1kit.train import vocab_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    import torch
    warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's numpy sees -inf - -inf in masked lanes
    from dsr1kit.train import vocab_loss, vocab_loss_kernel

    vocab, block, with_ref, temperature = json.loads(sys.argv[1])
    vocab_loss_kernel.BLOCK_V = block
    g = torch.Generator().manual_seed(vocab + block)
    rows = 37
    z = torch.randn(rows, vocab, generator=g) * 4
    z[3, 5] = 60.0  # a row whose max sits far above the rest
    r = torch.randn(rows, vocab, generator=g) * 4 if with_ref else None
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[::5] = -100  # positions without CE
    targets[1] = vocab - 1  # the last column, in the last (partial) block
    select = (torch.rand(rows, generator=g) > 0.3).float()
    want = vocab_loss.torch_terms_and_grad(z, r, targets, select, temperature, 0.01, 0.02)
    got = vocab_loss.terms_and_grad(z, r, targets, select, temperature, 0.01, 0.02)  # auto: fused, interpreted
    out = {}
    for name, a, b in zip(("ce", "kl", "grad"), want, got):
        out[name] = [float((a - b).abs().max()), float(a.abs().max())]
    out["zero_rows"] = bool((got[0][::5] == 0).all())
    print("RESULT", json.dumps(out))
    """
)


@pytest.mark.parametrize(
    "vocab, block, with_ref, temperature",
    [(1000, 256, True, 1.5), (1000, 4096, True, 1.0), (777, 128, False, 2.0)],
    ids=["blocks-of-256-T1.5", "one-block-T1", "ce-only-partial-block"],
)
def test_fused_vocab_loss_interpreted_equals_the_torch_ops(vocab, block, with_ref, temperature):
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps([vocab, block, with_ref, temperature])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(
        next(x for x in done.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT ")
    )
    assert got["zero_rows"]  # no CE where there is no target
    for name in ("ce", "kl", "grad"):
        diff, scale = got[name]
        assert diff <= 1e-5 * max(scale, 1.0), (name, got)
    if not with_ref:
        assert got["kl"] == [0.0, 0.0]


def test_an_unknown_route_names_the_valid_ones():
    z = torch.randn(2, 10)
    with pytest.raises(ValueError, match="auto, torch, fused"):
        vocab_loss.terms_and_grad(z, None, torch.tensor([1, 2]), torch.ones(2), 1.0, 0.5, 0.0, route="triton")


def test_without_a_gpu_the_torch_ops_run():
    z = torch.randn(4, 50)
    ce, kl, grad = vocab_loss.terms_and_grad(
        z, None, torch.tensor([1, 2, -100, 3]), torch.ones(4), 1.0, 0.5, 0.0
    )
    assert grad.dtype == z.dtype and float(ce[2]) == 0.0 and float(kl.abs().sum()) == 0.0
    # the CE gradient of each row with a target sums to zero (softmax minus one-hot), times w_ce
    assert torch.allclose(grad.sum(1), torch.zeros(4), atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("with_ref", [True, False])
def test_fused_vocab_loss_equals_the_torch_ops_on_a_gpu_at_r1s_vocabulary(with_ref):
    g = torch.Generator(device="cuda").manual_seed(1)
    rows, vocab = 64, 129_280
    z = (torch.randn(rows, vocab, generator=g, device="cuda") * 4).to(torch.bfloat16)
    r = (torch.randn(rows, vocab, generator=g, device="cuda") * 4).to(torch.bfloat16) if with_ref else None
    targets = torch.randint(0, vocab, (rows,), generator=g, device="cuda")
    targets[::7] = -100
    select = (torch.rand(rows, generator=g, device="cuda") > 0.3).float()
    want = vocab_loss.torch_terms_and_grad(z, r, targets, select, 1.5, 1 / 50, 0.9 * 1.5**2 / 40)
    from dsr1kit.train.vocab_loss_kernel import fused_terms_and_grad

    got = fused_terms_and_grad(z, r, targets, select, 1.5, 1 / 50, 0.9 * 1.5**2 / 40)
    assert got[2].dtype == torch.bfloat16
    assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-4)
    assert torch.allclose(got[1], want[1], rtol=1e-4, atol=1e-5)
    # both gradients are rounded to bf16 once from float32 values that agree to float32 summation order
    assert (got[2].float() - want[2].float()).abs().max() <= 2**-8 * want[2].float().abs().max()
