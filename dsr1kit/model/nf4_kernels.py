"""A grouped GEMM that reads NF4 expert weights as stored, dequantizing them tile by tile on the way in.

Why: the NF4 experts' default route dequantizes each group of 64 experts to bf16
with bitsandbytes, then multiplies with ``grouped_mm``. At R1's widths that is
1.4 G bf16 elements written and read again per call, 24 calls per cached step
(policy forward, reference forward, the backward's recompute): 39 ms of a
173 ms step on an H100 (``docs/benchmarks.md``). With about 128 rows per
expert the bf16 grouped GEMM is bound by reading its weights; NF4 weights are a
quarter of those bytes.

``_nf4_grouped`` multiplies expert-sorted rows by each row's expert weight
``W [R, C]`` (NF4, blocks of 64 along the flattened rows, first element in the
high nibble, as ``bitsandbytes.quantize_4bit`` stores them) either as
``x @ W.T`` (forward) or ``x @ W`` (the input gradient). Every tile of W is
loaded as bytes, split into nibbles, looked up in the 16 NF4 values and
multiplied by its block's absmax in float32, then cast to the rows' dtype:
the same arithmetic as bitsandbytes' dequantization, so the weights the dot
sees are the bf16 weights the default route multiplies by. The absmax are
dequantized from their double quantization by bitsandbytes first (one small
float32 tensor per call), so they are bit for bit the default route's.

The row tiles are built on the host from the per-expert counts the routing has
already read (``tiles``): each tile belongs to one expert.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK = 64  # NF4 block along the flattened weight rows
# row tiles: each dequantizes its expert's whole weight once, so taller tiles dequantize less per row;
# an expert's rows take ceil(count / block_m) tiles (``block_rows`` picks by the rows per expert)
BLOCK_MS = (64, 128)
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
_CODES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def nf4_code(device: torch.device) -> torch.Tensor:
    """The 16 NF4 values (float32) on a device, as bitsandbytes defines them."""
    key = (torch.device(device), torch.float32)
    if key not in _CODES:
        from bitsandbytes import functional as bnbf

        _CODES[key] = bnbf.get_4bit_type("nf4", device="cpu").to(device=device, dtype=torch.float32)
    return _CODES[key]


def _configs():
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bn, bk, w, st in (
            (128, 64, 4, 3),
            (128, 64, 8, 4),
            (128, 128, 8, 3),
            (256, 64, 8, 3),
            (64, 64, 4, 4),
            (64, 128, 4, 3),
        )
    ]


@triton.jit
def _nf4_grouped(
    X,
    W,
    ABSMAX,
    CODE,
    Y,
    TILE_EXPERT,
    TILE_START,
    TILE_END,
    N_OUT,
    K_RED,
    W_COLS,
    stride_xm,
    stride_we,
    stride_ae,
    stride_ym,
    TRANS: tl.constexpr,  # True: y = x @ W.T (reduce over W's columns); False: y = x @ W (over its rows)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(TILE_EXPERT + pid_m)
    start = tl.load(TILE_START + pid_m)
    end = tl.load(TILE_END + pid_m)
    offs_m = start + tl.arange(0, BLOCK_M)
    row_ok = offs_m < end
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N_OUT
    w_base = W + expert.to(tl.int64) * stride_we
    a_base = ABSMAX + expert.to(tl.int64) * stride_ae
    half_cols = W_COLS // 2
    blocks_per_row = W_COLS // 64

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_RED, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K_RED
        x = tl.load(
            X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if TRANS:  # W rows are the output (n), its contiguous columns the reduction (k)
            rows, row_ok_w = offs_n, n_ok
            half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            half_ok = half < K_RED // 2
            blocks = k0 // 64 + tl.arange(0, BLOCK_K // 64)
            width: tl.constexpr = BLOCK_K
        else:  # W rows are the reduction (k), its contiguous columns the output (n)
            rows, row_ok_w = offs_k, k_ok
            half = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            half_ok = half < N_OUT // 2
            blocks = pid_n * (BLOCK_N // 64) + tl.arange(0, BLOCK_N // 64)
            width: tl.constexpr = BLOCK_N
        packed = tl.load(
            w_base + rows[:, None].to(tl.int64) * half_cols + half[None, :],
            mask=row_ok_w[:, None] & half_ok[None, :],
            other=0,
        )
        nibbles = tl.interleave(packed >> 4, packed & 15).to(tl.int32)  # the first element is the high nibble
        # one absmax per row and 64 columns, loaded once and spread over its block
        absmax = tl.load(
            a_base + rows[:, None].to(tl.int64) * blocks_per_row + blocks[None, :],
            mask=row_ok_w[:, None] & (blocks < blocks_per_row)[None, :],
            other=0.0,
        )
        absmax = tl.reshape(
            tl.broadcast_to(absmax[:, :, None], (rows.shape[0], width // 64, 64)), (rows.shape[0], width)
        )
        w = (tl.load(CODE + nibbles) * absmax).to(X.dtype.element_ty)  # as bitsandbytes dequantizes
        if (
            DOT_F32
        ):  # the interpreter's dot misreads a bf16 tile cast in registers; the products are exact in f32
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        if TRANS:
            acc += tl.dot(x, tl.trans(w))
        else:
            acc += tl.dot(x, w)

    y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


if INTERPRETING:  # no autotuner without a GPU driver
    _INTERPRETED = {"BLOCK_N": 64, "BLOCK_K": 64, "DOT_F32": True}
    _kernel = _nf4_grouped
else:
    _INTERPRETED = {"DOT_F32": False}
    _kernel = triton.autotune(configs=_configs(), key=["N_OUT", "K_RED", "TRANS", "BLOCK_M"])(_nf4_grouped)


def block_rows(counts: list[int]) -> int:
    """The row tile for these per-expert counts: 128 once experts average 96 rows or more (R1 at 4,096 tokens
    averages 128), else 64, so that few rows are padding."""
    used = [c for c in counts if c]
    return BLOCK_MS[1] if used and sum(used) / len(used) >= 96 else BLOCK_MS[0]


@dataclass(frozen=True)
class RowTiles:
    """Row tiles over expert-sorted rows: ``index`` [3, tiles] int32 holds each tile's group, first and end row."""

    index: torch.Tensor
    block_m: int

    @property
    def count(self) -> int:
        return self.index.shape[1]


def tiles(counts: list[int], device: torch.device, block_m: int | None = None) -> RowTiles:
    """The row tiles of expert-sorted rows with these per-group counts, ``block_m`` rows each at most
    (``block_rows(counts)`` when not given); built on the host from counts the routing has already read."""
    block_m = block_m or block_rows(counts)
    if block_m not in BLOCK_MS:
        raise ValueError(f"row tile must be one of {BLOCK_MS}, got {block_m}")
    expert, start, end, row = [], [], [], 0
    for g, count in enumerate(counts):
        for first in range(row, row + count, block_m):
            expert.append(g)
            start.append(first)
            end.append(min(first + block_m, row + count))
        row += count
    index = torch.tensor([expert, start, end], dtype=torch.int32).to(device, non_blocking=True)
    return RowTiles(index, block_m)


def check(packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int]) -> None:
    rows, cols = shape
    if cols % BLOCK or rows % 2:
        raise ValueError(f"NF4 grouped GEMM needs weight columns in whole {BLOCK}-blocks, got {shape}")
    if packed.shape[1] != rows * cols // 2 or absmax.shape[1] != rows * cols // BLOCK:
        raise ValueError(f"packed {tuple(packed.shape)} / absmax {tuple(absmax.shape)} do not hold {shape}")


def _launch(x, packed, absmax, row_tiles, shape, trans: bool) -> torch.Tensor:
    rows, cols = shape
    n_out, k_red = (rows, cols) if trans else (cols, rows)
    if x.shape[1] != k_red:
        raise ValueError(
            f"rows of width {x.shape[1]} against weights {shape} ({'x @ W.T' if trans else 'x @ W'})"
        )
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(x.shape[0], n_out, dtype=x.dtype, device=x.device)
    if row_tiles.count == 0:
        return y
    grid = lambda meta: (row_tiles.count, triton.cdiv(n_out, meta["BLOCK_N"]))  # noqa: E731
    _kernel[grid](
        x,
        packed,
        absmax,
        nf4_code(x.device),
        y,
        row_tiles.index[0],
        row_tiles.index[1],
        row_tiles.index[2],
        n_out,
        k_red,
        cols,
        x.stride(0),
        packed.stride(0),
        absmax.stride(0),
        y.stride(0),
        TRANS=trans,
        BLOCK_M=row_tiles.block_m,
        **_INTERPRETED,
    )
    return y


class _GroupedMM(torch.autograd.Function):
    """``x @ W.T`` per expert; its backward is ``grad @ W`` by the same kernel (frozen weights: no W grad)."""

    @staticmethod
    def forward(ctx, x, packed, absmax, row_tiles, shape):
        ctx.save_for_backward(packed, absmax)
        ctx.row_tiles, ctx.shape = row_tiles, shape
        return _launch(x, packed, absmax, row_tiles, shape, True)

    @staticmethod
    def backward(ctx, grad):
        packed, absmax = ctx.saved_tensors
        return _launch(grad, packed, absmax, ctx.row_tiles, ctx.shape, False), None, None, None, None


def grouped_mm(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    row_tiles: torch.Tensor,
    shape: tuple[int, int],
) -> torch.Tensor:
    """``x @ W_g.T`` for expert-sorted rows ``x`` [M, C], each tile by its group's NF4 weight ``W_g [R, C]``.

    ``packed`` [G, R·C/2] uint8 and ``absmax`` [G, R·C/64] float32 hold the G experts' weights; ``row_tiles``
    comes from ``tiles``. Differentiable in ``x``."""
    check(packed, absmax, shape)
    return _GroupedMM.apply(x, packed, absmax, row_tiles, tuple(shape))


__all__ = ["BLOCK_MS", "RowTiles", "block_rows", "grouped_mm", "nf4_code", "tiles"]
