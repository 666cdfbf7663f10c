"""How grouped expert GEMMs tile routed rows: each row tile belongs to one expert, built without a host sync."""

from __future__ import annotations

import torch


def expert_tiles(
    top_k_index: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """How the grouped GEMMs tile the routed rows: (rows [P], block_expert [P / block_m]).

    ``rows``: the (token, k) slots sorted by expert, each expert's run padded to ``block_m`` with -1;
    ``block_expert``: the expert of each row tile (-1 past the last). P is the bound T·k + E·(block_m − 1),
    so nothing waits for the GPU to count."""
    flat = top_k_index.reshape(-1)
    slots = flat.numel()
    # not torch.bincount: on CUDA it reads the input's min and max back to the host (two syncs per layer)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    start = torch.cumsum(counts, 0) - counts
    position = (padded_end - padded)[by_expert] + torch.arange(slots, device=flat.device) - start[by_expert]
    bound = -(-(slots + num_experts * (block_m - 1)) // block_m) * block_m
    rows = torch.full((bound,), -1, dtype=torch.int32, device=flat.device)
    rows[position] = order.to(torch.int32)
    tile_start = torch.arange(0, bound, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, tile_start, right=True).to(torch.int32)
    block_expert.masked_fill_(block_expert >= num_experts, -1)  # not a boolean index: that syncs for nonzero
    return rows, block_expert
