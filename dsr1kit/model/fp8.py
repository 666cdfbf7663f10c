"""DeepSeek's block-scaled FP8 weights: dequantize on load, quantize for tests and benchmarks.

DeepSeek-V3/R1 checkpoints store each linear weight as ``float8_e4m3fn`` plus a
``weight_scale_inv`` tensor holding one float32 scale per 128×128 block, and
``w = fp8.float() * scale_inv`` blockwise. The last block of a row or column
may be partial (e.g. 576 = 4.5 × 128), so the scale grid is ceil-divided.
Dequantizing here, tensor by tensor, is what lets the streaming loader read
the FP8 shards directly instead of writing a 1.3 TB BF16 copy first.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # "…weight" → "…weight_scale_inv"


def scale_grid(shape: tuple[int, int], block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, int]:
    """Shape of the scale tensor for a weight of `shape`: one scale per (partial) block."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Scale per element: each block's scale repeated over the block, edge blocks cut to size."""
    rows = scale.repeat_interleave(block[0], dim=0)[: shape[0]]
    return rows.repeat_interleave(block[1], dim=1)[:, : shape[1]]


def dequantize_fp8_blocks(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
    name: str = "weight",
) -> torch.Tensor:
    """BF16 (or `dtype`) weight from an FP8 weight and its per-block `weight_scale_inv`.

    Computed in float32 and rounded once, as DeepSeek's own ``weight_dequant`` does.
    `name` only makes the error messages point at the offending tensor.
    """
    if weight.dim() != 2:
        raise ValueError(
            f"{name}: FP8 block dequantization expects a 2-D weight, got shape {tuple(weight.shape)}"
        )
    expected = scale_grid(tuple(weight.shape), block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"{name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}, but a {tuple(weight.shape)} weight with "
            f"{block[0]}x{block[1]} blocks needs {expected}. Check `weight_block_size` in the checkpoint's "
            "config.json quantization_config."
        )
    scale = _expand(scale_inv.to(device=weight.device, dtype=torch.float32), tuple(weight.shape), block)
    return (weight.to(torch.float32) * scale).to(dtype)


def quantize_fp8_blocks(
    weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, weight_scale_inv) in DeepSeek's layout: scale = block absmax / 448.

    Used to make FP8 test and benchmark checkpoints from a BF16 model; all-zero
    blocks get scale 1 so dequantization never divides by zero.
    """
    w = weight.to(torch.float32)
    grid = scale_grid(tuple(w.shape), block)
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1], dtype=torch.float32, device=w.device)
    padded[: w.shape[0], : w.shape[1]] = w.abs()
    amax = padded.view(grid[0], block[0], grid[1], block[1]).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / _expand(scale, tuple(w.shape), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale
