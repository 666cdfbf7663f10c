"""MLA's rotary step and key assembly in one pass (a Triton kernel, forward only).

Between its GEMMs and attention, DeepSeek's MLA rotates the last 64 dimensions of every query head and of
the one shared rotary key, then builds each head's key from its 128 "nope" dimensions and that shared part.
In torch that is about a dozen elementwise kernels over strided views (each a full pass over 16k × 128 heads
at R1's widths). This kernel reads each token's query, latent key and "nope" keys once: it rotates the query
in place and writes the whole key.

The arithmetic is transformers' own, rounding included: each product and each sum rounded to the tensors'
dtype, as torch's elementwise kernels round them (``apply_rotary_pos_emb_interleave`` for DeepSeek's
interleaved layout, ``apply_rotary_pos_emb`` otherwise), so on a GPU the result is bit for bit the same. That
needs Triton's floating-point contraction off: with it on, the compiler turns ``round(a·c) − round(b·s)``
into one bf16 FMA, which skips the second product's rounding (seen in the PTX: ``fma.rn.bf16``).
"""

from __future__ import annotations

import torch

from .triton_guard import runs_triton, tl, triton


def _rope_key(
    Q,
    KV,
    KR,
    COS,
    SIN,
    KEY,
    H,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_kvh,
    stride_krt,
    stride_ct,
    stride_st,
    stride_kt,
    stride_kh,
    NOPE: tl.constexpr,
    HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads[:, None] < H
    j = tl.arange(0, HALF)
    dtype = Q.dtype.element_ty
    if INTERLEAVE:  # pairs (x0, x1), (x2, x3), ... each turned by one angle: cos/sin's first half
        ia, ib = 2 * j, 2 * j + 1
        ca = tl.load(COS + t * stride_ct + j).to(tl.float32)
        sa = tl.load(SIN + t * stride_st + j).to(tl.float32)
        cb, sb = ca, sa
    else:  # halves (x[:h], x[h:]): rotate_half
        ia, ib = j, HALF + j
        ca = tl.load(COS + t * stride_ct + j).to(tl.float32)
        cb = tl.load(COS + t * stride_ct + HALF + j).to(tl.float32)
        sa = tl.load(SIN + t * stride_st + j).to(tl.float32)
        sb = tl.load(SIN + t * stride_st + HALF + j).to(tl.float32)

    # the shared rotary key: [a·c − b·s, b·c + a·s], each product and sum rounded as torch rounds them
    ka = tl.load(KR + t * stride_krt + ia).to(tl.float32)
    kb = tl.load(KR + t * stride_krt + ib).to(tl.float32)
    k1 = ((ka * ca).to(dtype).to(tl.float32) - (kb * sa).to(dtype).to(tl.float32)).to(dtype)
    k2 = ((kb * cb).to(dtype).to(tl.float32) + (ka * sb).to(dtype).to(tl.float32)).to(dtype)

    q = Q + t * stride_qt + heads[:, None] * stride_qh + NOPE
    qa = tl.load(q + ia[None, :], mask=hmask, other=0.0).to(tl.float32)
    qb = tl.load(q + ib[None, :], mask=hmask, other=0.0).to(tl.float32)
    q1 = ((qa * ca[None, :]).to(dtype).to(tl.float32) - (qb * sa[None, :]).to(dtype).to(tl.float32)).to(dtype)
    q2 = ((qb * cb[None, :]).to(dtype).to(tl.float32) + (qa * sb[None, :]).to(dtype).to(tl.float32)).to(dtype)
    tl.store(q + j[None, :], q1, mask=hmask)
    tl.store(q + HALF + j[None, :], q2, mask=hmask)

    d = tl.arange(0, NOPE)
    key = KEY + t * stride_kt + heads[:, None] * stride_kh
    nope = tl.load(KV + t * stride_kvt + heads[:, None] * stride_kvh + d[None, :], mask=hmask, other=0.0)
    tl.store(key + d[None, :], nope, mask=hmask)
    tl.store(key + NOPE + j[None, :], tl.broadcast_to(k1[None, :], (BLOCK_H, HALF)), mask=hmask)
    tl.store(key + NOPE + HALF + j[None, :], tl.broadcast_to(k2[None, :], (BLOCK_H, HALF)), mask=hmask)


if triton is not None:
    _rope_key = triton.jit(_rope_key)


# fp fusion off: else each product folds into the sum as one FMA, rounded once instead of twice
COMPILE_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def runs_kernel(q: torch.Tensor, cos: torch.Tensor, nope: int, rope: int) -> bool:
    """Whether ``rope_and_key`` can take the kernel: Triton runs here (``runs_triton``), cos/sin in q's dtype
    (as transformers' rotary embedding returns them), and widths the kernel tiles (powers of two)."""
    if not runs_triton(q) or cos.dtype != q.dtype:
        return False
    return _power_of_two(nope) and _power_of_two(rope // 2) and rope % 2 == 0


def rope_and_key(
    q: torch.Tensor,
    kv: torch.Tensor,
    k_rot: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    nope: int,
    interleave: bool,
) -> torch.Tensor:
    """Rotate ``q``'s last dims in place and return the key, one pass.

    q [B, S, H, nope + rope] (its rotary part rotated in place), kv [B, S, H, nope + v] (the first ``nope``
    of each head are the key's), k_rot [B, S, rope] (the shared rotary key, not yet rotated), cos/sin
    [B or 1, S, rope]. Returns key [B, S, H, nope + rope]."""
    batch, seq, heads, width = q.shape
    rope = width - nope
    tokens = batch * seq
    key = q.new_empty(batch, seq, heads, width)
    key3 = key.view(tokens, heads, width)
    if tokens == 0:
        return key
    cos = cos.expand(batch, seq, rope).reshape(tokens, rope)
    sin = sin.expand(batch, seq, rope).reshape(tokens, rope)
    k_rot = k_rot.reshape(tokens, rope)
    if q.stride(-1) != 1 or kv.stride(-1) != 1 or k_rot.stride(-1) != 1:
        raise ValueError("rope_and_key needs the last dimension of q, kv and k_rot contiguous")
    q3, kv3 = q.view(tokens, heads, width), kv.reshape(tokens, heads, kv.shape[-1])
    block_h = min(16, triton.next_power_of_2(heads))
    _rope_key[(tokens, triton.cdiv(heads, block_h))](
        q3,
        kv3,
        k_rot,
        cos,
        sin,
        key3,
        heads,
        q3.stride(0),
        q3.stride(1),
        kv3.stride(0),
        kv3.stride(1),
        k_rot.stride(0),
        cos.stride(0),
        sin.stride(0),
        key3.stride(0),
        key3.stride(1),
        NOPE=nope,
        HALF=rope // 2,
        INTERLEAVE=interleave,
        BLOCK_H=block_h,
        **COMPILE_OPTIONS,
    )
    return key


__all__ = ["COMPILE_OPTIONS", "rope_and_key", "runs_kernel"]
