"""Block-scaled FP8 GEMMs on a GPU (DeepSeek's e4m3 weights, 128×128 scales): torch's for the dense linears,
the kit's Triton kernels for the routed experts.

The dense linears (``linear``) take torch's own ``scaled_mm`` with 1×128 activation and 128×128 weight
blocks (cuBLAS, 1.6–1.9× the kit's former Triton GEMM at R1's dense shapes on Hopper, measured in
``docs/benchmarks.md``). Where this torch or cuBLAS refuses a shape (a reduction that is not whole
128-blocks, a torch without block-scaled ``scaled_mm``), the linear dequantizes the quantized input and the
weight to bf16 and multiplies them there: the same activation rounding, a bf16 GEMM.

cuBLAS refuses the per-expert shapes, so the routed experts run the kit's Triton kernels. Why our own: the
maintained block-scaled grouped kernels (vLLM's, DeepGEMM, sgl-kernel) come inside packages built against
one torch and CUDA, that a training environment would have to match; Triton ships with torch. Three
kernels, all forward only:

- ``_quant`` quantizes activations per row and 128-column group (absmax/448);
- ``_gemm`` multiplies e4m3 activations [M, K] by e4m3 weights [E, N, K] with
  float32 accumulation, applying the activation scale per row and the weight
  scale per 128-column block at each 128-wide step of K (one scalar per step
  when the column tile is the 128-wide block). It runs all experts in one
  launch: rows are sorted by expert and each expert's segment is padded to the
  row tile, so a tile belongs to one expert (``block_expert``); the first GEMM
  gathers its rows from the tokens, the second scatters each row, times its
  routing weight, to its (token, k) slot;
- ``_silu_mul_quant`` fuses SiLU(gate)·up with the quantization of the result.

Every index and routing step is built on the GPU, without a host sync. Under
``TRITON_INTERPRET=1`` the same kernels run on CPU tensors with one fixed
tile configuration (the CPU tests of their indexing).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .expert_tiles import expert_tiles
from .fp8 import DEFAULT_BLOCK, FP8_DTYPE, FP8_MAX, dequantize_fp8_blocks

GROUP = 128
EPS = 1e-10
# row tile of the grouped GEMMs: each expert's rows are padded to a multiple of it (128 ran no faster at R1's
# widths with 512 rows per expert, docs/benchmarks.md)
BLOCK_M_GROUPED = 64
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> bool:
    """FP8 tensor cores: compute capability 8.9 (Ada) or 9.0+ (Hopper)."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def _quant(X, Q, S, M, K, stride_xm, stride_qm, stride_sm, BLOCK_M: tl.constexpr, GROUP_K: tl.constexpr):
    pid_m, pid_g = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_g * GROUP_K + tl.arange(0, GROUP_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / 448.0
    q = tl.clamp(x / scale[:, None], -448.0, 448.0)
    tl.store(Q + rows[:, None] * stride_qm + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + rows * stride_sm + pid_g, scale, mask=rows < M)


@triton.jit
def _silu_mul_quant(
    X, Q, S, M, INTER, P, stride_xm, stride_qm, stride_sm, BLOCK_M: tl.constexpr, GROUP_K: tl.constexpr
):
    """X [M, 2P] holds gate in columns [0, INTER) and up in [P, P + INTER); Q [M, INTER] = quant(silu(gate) * up)."""
    pid_m, pid_g = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_g * GROUP_K + tl.arange(0, GROUP_K)
    mask = (rows[:, None] < M) & (cols[None, :] < INTER)
    base = X + rows[:, None] * stride_xm + cols[None, :]
    gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + P, mask=mask, other=0.0).to(tl.float32)
    h = gate / (1.0 + tl.exp(-gate)) * up
    scale = tl.maximum(tl.max(tl.abs(h), axis=1), 1e-10) / 448.0
    q = tl.clamp(h / scale[:, None], -448.0, 448.0)
    tl.store(Q + rows[:, None] * stride_qm + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + rows * stride_sm + pid_g, scale, mask=rows < M)


def _configs(block_m: tuple[int, ...]):
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8}, num_warps=w, num_stages=st)
        for bm in block_m
        for bn, w, st in (
            (128, 4, 3),
            (128, 8, 3),
            (128, 4, 4),
            (128, 8, 4),
            (256, 8, 3),
            (256, 8, 4),
            (64, 4, 4),
        )
    ]


@triton.jit
def _gemm(
    A,
    AS,
    B,
    BS,
    C,
    ROWS,
    BLOCK_EXPERT,
    ROUTE_W,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_cm,
    GROUPED: tl.constexpr,  # 1: rows gathered from tokens; 2: rows scattered to their (token, k) slots
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n  # row tiles visited together, so their weight tiles stay in L2
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    expert = tl.load(BLOCK_EXPERT + pid_m)
    if expert < 0:
        return
    b_base = B + expert.to(tl.int64) * stride_be
    bs_base = BS + expert.to(tl.int64) * stride_bse
    slot = tl.load(ROWS + offs_m, mask=offs_m < M, other=-1)
    row_ok = slot >= 0
    if GROUPED == 1:
        a_row = tl.where(row_ok, slot // TOP_K, 0)
    else:
        a_row = offs_m
    a_ptrs = A + a_row[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_base + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    as_ptrs = AS + a_row.to(tl.int64) * stride_asm
    bs_ptrs = bs_base + (offs_n // BLOCK_K) * stride_bsn
    bs_tile = bs_base + pid_n * stride_bsn  # a 128-wide column tile is one weight block: one scale per step

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + k, mask=row_ok, other=0.0)
        if BLOCK_N == BLOCK_K:
            acc += tl.dot(a, b) * (a_s * tl.load(bs_tile + k))[:, None]
        else:
            b_s = tl.load(bs_ptrs + k, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if GROUPED == 2:
        weight = tl.load(ROUTE_W + slot, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
        c_row = tl.where(row_ok, slot, 0)
    else:
        c_row = offs_m
    c_ptrs = C + c_row[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# the rows come padded per expert to BLOCK_M_GROUPED
if INTERPRETING:  # no autotuner without a GPU driver
    _INTERPRETED = {"BLOCK_N": 128, "GROUP_M": 8}
    _gemm_grouped = _gemm
else:
    _gemm_grouped = triton.autotune(configs=_configs((BLOCK_M_GROUPED,)), key=["N", "K", "GROUPED"])(_gemm)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], float32 scales [M, ceil(K/128)]) of a row-major [M, K] tensor."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, triton.cdiv(k, GROUP), dtype=torch.float32, device=x.device)
    block_m = 16
    _quant[(triton.cdiv(m, block_m), triton.cdiv(k, GROUP))](
        x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), BLOCK_M=block_m, GROUP_K=GROUP
    )
    return q, s


def _check_weight(weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
    if weight.dtype != FP8_DTYPE or not weight.is_contiguous() or not scale_inv.is_contiguous():
        raise ValueError("the FP8 GEMM needs contiguous e4m3 weights and float32 scales")


# (device, N, K, M aligned) -> the scaled_mm layout that ran there, or None where none did
_torch_variant: dict[tuple, object] = {}


def _torch_blockwise(q, s, weight, scale_inv, out_dtype):
    """torch's block-scaled FP8 GEMM (cuBLAS) on quantized rows, or None where this torch or shape refuses it.

    The scale layouts cuBLAS takes have moved between releases; the first that runs is kept per shape."""
    import torch.nn.functional as F

    kinds = getattr(F, "ScalingType", None)
    if kinds is None or not hasattr(F, "scaled_mm"):
        return None
    a_kind = getattr(kinds, "BlockWise1x128", None) or getattr(kinds, "Blockwise_1x128", None)
    b_kind = getattr(kinds, "BlockWise128x128", None) or getattr(kinds, "Blockwise_128x128", None)
    if a_kind is None or b_kind is None:
        return None
    key = (q.device, weight.shape[0], weight.shape[1], q.shape[0] % 16 == 0)
    known = _torch_variant.get(key, ...)
    if known is None:
        return None
    layouts = [known] if known is not ... else [(True, True), (True, False), (False, True), (False, False)]
    for a_outer, b_view in layouts:
        a_scale = s.t().contiguous().t() if a_outer else s  # outer-dim-major: (M, K/128) with strides (1, M)
        b_scale = scale_inv.t() if b_view else scale_inv.t().contiguous()
        try:
            out = F.scaled_mm(q, weight.t(), a_scale, a_kind, b_scale, b_kind, output_dtype=out_dtype)
        except (RuntimeError, ValueError, TypeError, NotImplementedError):
            continue
        _torch_variant[key] = (a_outer, b_view)
        return out
    _torch_variant[key] = None
    return None


def _dequantized_linear(q, s, weight, scale_inv, out_dtype):
    """The quantized rows times the weight, both dequantized to bf16 (shapes cuBLAS's block-scaled GEMM
    refuses): the activations rounded to e4m3 as in the FP8 GEMM, the products summed by a bf16 GEMM."""
    rows = (q.to(torch.float32) * s.repeat_interleave(GROUP, dim=1)[:, : q.shape[1]]).to(torch.bfloat16)
    w = dequantize_fp8_blocks(weight, scale_inv, DEFAULT_BLOCK, torch.bfloat16)
    return (rows @ w.T).to(out_dtype)


@torch.compiler.disable  # under torch.compile: a graph break, not a trace into Triton's autotuner
def linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for e4m3 ``weight`` [N, K] with ``scale_inv`` [ceil(N/128), ceil(K/128)]; x's dtype out.

    torch's block-scaled ``scaled_mm`` where it takes the shape, else the bf16 GEMM of the dequantized operands
    (``_dequantized_linear``)."""
    _check_weight(weight, scale_inv)
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    q, s = quantize(rows)
    n = weight.shape[0]
    out = _torch_blockwise(q, s, weight, scale_inv, x.dtype) if k % GROUP == 0 else None  # whole 128-blocks
    if out is None:
        out = _dequantized_linear(q, s, weight, scale_inv, x.dtype)
    return out.view(*x.shape[:-1], n)


def launch(
    a, a_s, b, b_s, c, m, n, k, grouped, rows=None, block_expert=None, route_w=None, top_k=1, config=None
):
    """One launch of the grouped block-scaled GEMM (the arguments as ``experts`` passes them; ``grouped``: 1
    gathers rows from the tokens, 2 scatters them to their slots), autotuned; ``config`` (BLOCK_M, BLOCK_N,
    GROUP_M, num_warps, num_stages) runs that tile instead (tile sweeps)."""
    dummy = a_s  # the routing weights' pointer, unused by the first GEMM
    kernel = _gemm_grouped
    fixed = {**_INTERPRETED, "BLOCK_M": BLOCK_M_GROUPED} if INTERPRETING else {}
    if config is not None:
        kernel, fixed = _gemm, dict(config)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    kernel[grid](
        a,
        a_s,
        b,
        b_s,
        c,
        rows if rows is not None else dummy,
        block_expert if block_expert is not None else dummy,
        route_w if route_w is not None else dummy,
        m,
        n,
        k,
        a.stride(0),
        a_s.stride(0),
        b.stride(0),
        b.stride(1),
        b_s.stride(0),
        b_s.stride(1),
        c.stride(0),
        GROUPED=grouped,
        TOP_K=top_k,
        BLOCK_K=GROUP,
        **fixed,
    )


@torch.compiler.disable
def experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale_inv: torch.Tensor,
    down: torch.Tensor,
    down_scale_inv: torch.Tensor,
    intermediate: int,
) -> torch.Tensor:
    """The routed experts of a DeepSeek MoE layer on [T, H] tokens: two grouped GEMMs and one fused activation.

    ``gate_up`` [E, 2·P, H] (gate rows, then up rows, each padded to P), ``down`` [E, H, I]."""
    for w, s in ((gate_up, gate_up_scale_inv), (down, down_scale_inv)):
        _check_weight(w, s)
    tokens, top_k = top_k_index.shape
    num_experts, two_p, h = gate_up.shape
    block_m = BLOCK_M_GROUPED
    rows, block_expert = expert_tiles(top_k_index, num_experts, block_m)
    bound = rows.numel()
    x = hidden if hidden.is_contiguous() else hidden.contiguous()
    q, s = quantize(x)
    gate_up_out = torch.empty(bound, two_p, dtype=hidden.dtype, device=hidden.device)
    launch(
        q,
        s,
        gate_up,
        gate_up_scale_inv,
        gate_up_out,
        bound,
        two_p,
        h,
        1,
        rows,
        block_expert,
        top_k=top_k,
    )
    act = torch.empty(bound, intermediate, dtype=FP8_DTYPE, device=hidden.device)
    act_s = torch.empty(bound, triton.cdiv(intermediate, GROUP), dtype=torch.float32, device=hidden.device)
    _silu_mul_quant[(triton.cdiv(bound, 16), triton.cdiv(intermediate, GROUP))](
        gate_up_out,
        act,
        act_s,
        bound,
        intermediate,
        two_p // 2,
        gate_up_out.stride(0),
        act.stride(0),
        act_s.stride(0),
        BLOCK_M=16,
        GROUP_K=GROUP,
    )
    del gate_up_out
    slots = torch.empty(tokens * top_k, h, dtype=hidden.dtype, device=hidden.device)
    weights = top_k_weights.reshape(-1).to(torch.float32).contiguous()
    launch(
        act,
        act_s,
        down,
        down_scale_inv,
        slots,
        bound,
        h,
        intermediate,
        2,
        rows,
        block_expert,
        weights,
    )
    return slots.view(tokens, top_k, h).sum(1)


__all__ = ["EPS", "FP8_MAX", "available", "experts", "launch", "linear", "quantize"]
