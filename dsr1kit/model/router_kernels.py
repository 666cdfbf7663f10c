"""The MoE router's float32 logits on the tensor cores (a Triton kernel, forward only).

transformers computes DeepSeek's router logits as ``F.linear(hidden.float(), weight.float())``: a float32
copy of the hidden state, then a float32 GEMM on the CUDA cores (about 1.2 ms per 16k tokens at R1's widths,
on an H100). The hidden state is bf16 already, so only the float32 weight needs more than bf16: split into
three bf16 parts (``hi + mid + lo``, 3 × 8 mantissa bits), it is represented exactly, each bf16 × bf16
product is exact in float32, and the tensor cores accumulate in float32. Each BLOCK_K-wide slice of the
reduction is summed on the tensor cores and added to the running sum outside them, so the logits differ
from the float32 GEMM's by little more than the order of the float32 additions. The split is done in
registers, per tile.
"""

from __future__ import annotations

import torch

from .triton_guard import INTERPRETING, runs_triton, tl, triton


def _logits(
    X,
    W,
    OUT,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    AS_FLOAT32: tl.constexpr = False,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + ks) < K
        x = tl.load(
            X + rows[:, None].to(tl.int64) * stride_xm + (k0 + ks)[None, :],
            mask=(rows[:, None] < M) & kmask[None, :],
            other=0.0,
        )
        w = tl.load(
            W + cols[:, None] * stride_wn + (k0 + ks)[None, :],
            mask=(cols[:, None] < N) & kmask[None, :],
            other=0.0,
        )
        hi = w.to(tl.bfloat16)
        rest = w - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        # each BLOCK_K slice's three products summed smallest part first, then added to the running sum
        # outside the tensor cores: inside them float32 accumulation truncates each sum to the largest
        # exponent in play, which over a 7168-long reduction drifts (measured 2.4e-5 of the logits' norm
        # with the running sum fed back into every product). Triton's interpreter multiplies bf16 operands
        # as raw bits, so there (AS_FLOAT32) the same values go in as float32.
        if AS_FLOAT32:
            xf = x.to(tl.float32)
            part = tl.dot(xf, tl.trans(lo.to(tl.float32)), input_precision="ieee")
            part = tl.dot(xf, tl.trans(mid.to(tl.float32)), part, input_precision="ieee")
            part = tl.dot(xf, tl.trans(hi.to(tl.float32)), part, input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(lo))
            part = tl.dot(x, tl.trans(mid), part)
            part = tl.dot(x, tl.trans(hi), part)
        acc += part
    tl.store(
        OUT + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
        acc,
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


if triton is not None:
    _logits = triton.jit(_logits)
    if not INTERPRETING:
        _logits = triton.autotune(
            configs=[
                triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
                for bm, bn, bk, w, st in (
                    (128, 128, 64, 8, 3),
                    (128, 128, 32, 4, 4),
                    (64, 128, 64, 4, 3),
                    (128, 64, 64, 4, 3),
                    (256, 128, 32, 8, 3),
                )
            ],
            key=["N", "K"],
        )(_logits)


def runs_kernel(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``logits`` can take the kernel: Triton runs here (``runs_triton``), bf16 rows, a float32
    weight."""
    return (
        runs_triton(hidden)
        and hidden.dtype == torch.bfloat16
        and weight.dtype == torch.float32
        and hidden.dim() == 2
    )


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 ``hidden @ weight.T`` for bf16 ``hidden`` [M, K] and float32 ``weight`` [N, K]."""
    m, k = hidden.shape
    n = weight.shape[0]
    x = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(m, n, dtype=torch.float32, device=hidden.device)
    if m == 0:
        return out
    fixed = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "AS_FLOAT32": True} if INTERPRETING else {}
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
    _logits[grid](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), **fixed)
    return out


__all__ = ["logits", "runs_kernel"]
