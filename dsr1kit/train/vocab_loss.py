"""CE and KL over the vocabulary for one chunk of positions, and the logits' gradient in closed form.

    d CE/dz = softmax(z) - onehot(target);   d KL(q || p_T)/dz = (softmax(z/T) - q) / T,  q = softmax(r/T)

At R1's vocabulary (129,280) a chunk of 1,024 positions is 132 M logits. Written
with torch ops, the terms take about fifteen passes over float32 copies of that
(upcast, softmax, two log-softmaxes, their exps, products, the gradient's
adds and its cast), which is most of the cached step's non-GEMM time on a GPU.
On CUDA one Triton kernel does it instead: a program per row reads the student's
and the reference's logits once to get the three log-sum-exps, the KL and the
target's logit (online, in float32), then once more to write the gradient in the
logits' dtype. Elsewhere (CPU tests) the torch ops below compute the same; the
two agree to float32 summation order (tests through Triton's interpreter, and
on a GPU). ``route`` picks one (``HariLoss.vocab_route``): ``auto`` takes the kernel where it runs.

The forward KL itself, KL(softmax(r/T) ‖ softmax(z/T)) from fp32 log-probabilities (``log_probs``,
``forward_kl``), is the one the kit writes in torch: the naive loss (``hari.token_terms``) and the
measurements (``measure.kl``) call it too.
"""

from __future__ import annotations

import importlib.util
import os

import torch

ROUTES = ("auto", "torch", "fused")  # auto: the fused kernel on CUDA tensors, torch ops elsewhere
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) over the last dimension, in fp32 (no scaled copy at T = 1)."""
    x = logits.float()
    return torch.log_softmax(x / temperature if temperature != 1.0 else x, -1)


def forward_kl(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """KL(q ‖ p) = Σ q (log q − log p) per position, from fp32 log-probabilities [..., vocab] → [...]: q the
    reference's (the base's), p the adapted model's."""
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def torch_terms_and_grad(z, r, targets, kl_select, temperature: float, w_ce: float, w_kl: float):
    """(per-row CE, per-row KL, d loss / d z in z's dtype) with torch ops; ``r`` None: no KL term.

    ``targets`` < 0 are positions without CE; ``kl_select`` (float, 0/1) the positions the KL covers."""
    zf = z.float()
    valid = targets >= 0
    tgt = targets.clamp_min(0).unsqueeze(1)
    ce = (torch.logsumexp(zf, -1) - zf.gather(1, tgt).squeeze(1)) * valid
    grad = torch.softmax(zf, -1)
    grad.scatter_add_(1, tgt, -torch.ones_like(tgt, dtype=grad.dtype))
    grad.mul_((valid.float() * w_ce).unsqueeze(1))
    kl = torch.zeros_like(ce)
    if r is not None:
        log_q = log_probs(r, temperature)
        log_p = log_probs(zf, temperature)
        del zf
        kl = forward_kl(log_q, log_p) * kl_select
        q = log_q.exp_()
        del log_q
        p_t = log_p.exp_()
        grad.add_((p_t - q).mul_((kl_select * (w_kl / temperature)).unsqueeze(1)))
    return ce, kl, grad.to(z.dtype)


def _fused_available(z: torch.Tensor) -> bool:
    """CUDA tensors with Triton installed, or any tensor under Triton's interpreter (the CPU tests)."""
    return _INTERPRETING or (z.is_cuda and _HAS_TRITON)


def terms_and_grad(
    z, r, targets, kl_select, temperature: float, w_ce: float, w_kl: float, route: str = "auto"
):
    """``torch_terms_and_grad``'s result, by the fused kernel where it runs (``route``: one of ``ROUTES``)."""
    if route not in ROUTES:
        raise ValueError(f"vocab loss route {route!r}: valid are {', '.join(ROUTES)}")
    fused = route == "fused" or (route == "auto" and _fused_available(z))
    if not fused:
        return torch_terms_and_grad(z, r, targets, kl_select, temperature, w_ce, w_kl)
    from .vocab_loss_kernel import fused_terms_and_grad

    return fused_terms_and_grad(z, r, targets, kl_select, temperature, w_ce, w_kl)


__all__ = ["ROUTES", "forward_kl", "log_probs", "terms_and_grad", "torch_terms_and_grad"]
