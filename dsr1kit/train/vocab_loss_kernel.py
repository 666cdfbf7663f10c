"""The fused CE + KL kernel over the vocabulary (Triton): two reads of the logits, one write of their gradient.

Pass 1 keeps, per row and online over blocks of the vocabulary, the running max and sum of exp for z, z/T and
r/T, and Σ exp(r/T − m)·(r − z), so that

    CE = lse(z) − z[target];   KL(q || p_T) = Σ q (log q − log p_T) = Σ q (r − z) / T − lse(r/T) + lse(z/T).

Pass 2 writes w_ce·(softmax(z) − onehot) + w_kl/T·(softmax(z/T) − softmax(r/T)) per row, scaled by the row's
CE and KL selections, in the logits' dtype. Everything is accumulated in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096  # vocabulary columns per step: 32 steps over R1's 129,280


@triton.jit
def _online(m, s, x):
    """Running (max, Σ exp(x − max)) after one more block ``x`` (masked lanes −inf)."""
    new_m = tl.maximum(m, tl.max(x, 0))
    return new_m, s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)


@triton.jit
def _ce_kl_grad(
    Z,
    R,
    G,
    TARGETS,
    KL_SELECT,
    CE_OUT,
    KL_OUT,
    V,
    stride_z,
    stride_r,
    stride_g,
    inv_t,
    w_ce,
    w_kl_over_t,
    HAS_REF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    r_row = R + row * stride_r
    g_row = G + row * stride_g
    cols = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    m_z = neg_inf
    s_z = 0.0
    m_p = neg_inf
    s_p = 0.0
    m_q = neg_inf
    s_q = 0.0
    d_q = 0.0  # Σ exp(r/T − m_q)·(r − z), rescaled with s_q
    for start in range(0, V, BLOCK):
        c = start + cols
        ok = c < V
        z = tl.load(z_row + c, mask=ok, other=neg_inf).to(tl.float32)
        m_z, s_z = _online(m_z, s_z, z)
        m_p, s_p = _online(m_p, s_p, z * inv_t)
        if HAS_REF:
            r = tl.load(r_row + c, mask=ok, other=neg_inf).to(tl.float32)
            rt = r * inv_t
            new_m = tl.maximum(m_q, tl.max(rt, 0))
            scale = tl.exp(m_q - new_m)
            e = tl.exp(rt - new_m)
            s_q = s_q * scale + tl.sum(e, 0)
            d_q = d_q * scale + tl.sum(tl.where(ok, e * (r - z), 0.0), 0)
            m_q = new_m
    lse_z = m_z + tl.log(s_z)
    lse_p = m_p + tl.log(s_p)
    target = tl.load(TARGETS + row)
    has_ce = target >= 0
    z_t = tl.load(z_row + tl.maximum(target, 0)).to(tl.float32)
    tl.store(CE_OUT + row, tl.where(has_ce, lse_z - z_t, 0.0))
    row_ce = tl.where(has_ce, w_ce, 0.0)
    lse_q = 0.0
    row_kl = 0.0
    if HAS_REF:
        select = tl.load(KL_SELECT + row).to(tl.float32)
        lse_q = m_q + tl.log(s_q)
        tl.store(KL_OUT + row, (d_q / s_q * inv_t - lse_q + lse_p) * select)
        row_kl = select * w_kl_over_t
    for start in range(0, V, BLOCK):
        c = start + cols
        ok = c < V
        z = tl.load(z_row + c, mask=ok, other=0.0).to(tl.float32)
        g = row_ce * (tl.exp(z - lse_z) - tl.where(c == target, 1.0, 0.0))
        if HAS_REF:
            r = tl.load(r_row + c, mask=ok, other=0.0).to(tl.float32)
            g += row_kl * (tl.exp(z * inv_t - lse_p) - tl.exp(r * inv_t - lse_q))
        tl.store(g_row + c, g.to(G.dtype.element_ty), mask=ok)


def fused_terms_and_grad(z, r, targets, kl_select, temperature: float, w_ce: float, w_kl: float):
    """``vocab_loss.torch_terms_and_grad``'s (per-row CE, per-row KL, gradient), in one kernel launch."""
    rows, vocab = z.shape
    if z.stride(1) != 1 or (r is not None and (r.shape != z.shape or r.stride(1) != 1)):
        raise ValueError("the fused vocab loss needs row-major logits of one shape")
    grad = torch.empty_like(z)
    ce = torch.empty(rows, dtype=torch.float32, device=z.device)
    kl = torch.zeros(rows, dtype=torch.float32, device=z.device)
    targets = targets.to(torch.int64).contiguous()
    select = kl_select.to(torch.float32).contiguous()
    if rows:
        _ce_kl_grad[(rows,)](
            z,
            r if r is not None else z,
            grad,
            targets,
            select,
            ce,
            kl,
            vocab,
            z.stride(0),
            r.stride(0) if r is not None else 0,
            grad.stride(0),
            1.0 / temperature,
            float(w_ce),
            float(w_kl) / temperature,
            HAS_REF=r is not None,
            BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab)),
            num_warps=8,
        )
    return ce, kl, grad


__all__ = ["BLOCK_V", "fused_terms_and_grad"]
