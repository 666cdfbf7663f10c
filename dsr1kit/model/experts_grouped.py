"""transformers' grouped-GEMM experts forward with the routed rows put back in token order while still bf16.

transformers' ``grouped_mm`` experts forward weights each routed row by its routing weight while the rows
are still sorted by expert, and only then gathers them back to token order. The routing weights are float32,
so that gather, and its backward (a sort-based index accumulation into a zeroed buffer), move float32 copies
of all ``tokens × top_k`` rows: at R1's widths and 4,096 tokens, 32,768 × 7,168 floats, 0.94 GB each way.
Here the rows go back to token order first, in bf16, through a permutation whose backward is the inverse
permutation (a gather, no sort, no zeroed buffer); then they are weighted and summed as transformers does.

The forward's values are transformers' bit for bit (the same products, summed over the same ``[T, K]``
layout); so are the gradients, which only move through a permutation in another order. Registered with
transformers as ``EXPERTS_IMPLEMENTATION``; ``use_kit_experts_`` switches a loaded model to it (the loaders
call it where ``LoadConfig.kit_experts`` is on, the default).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface, grouped_mm_experts_forward

try:  # the dispatcher transformers' own grouped forward uses, so both run the same GEMM kernel
    from transformers.integrations.moe import _grouped_linear
except ImportError:  # pragma: no cover - a transformers without it: the kit's forward is not offered
    _grouped_linear = None

EXPERTS_IMPLEMENTATION = "dsr1kit_grouped_mm"


class _RowPermutation(torch.autograd.Function):
    """``x[index]`` for a permutation ``index``; backward gathers with the inverse permutation."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` in the order ``index`` (a permutation whose inverse is ``inverse``), autograd included."""
    return _RowPermutation.apply(x, index, inverse)


def _plain(module: nn.Module) -> bool:
    """The layout this forward handles: gated, no biases, no expert parallelism, no norm after the experts."""
    return (
        getattr(module, "has_gate", False)
        and not getattr(module, "has_bias", True)
        and not getattr(module, "has_post_expert_norm", True)
        and not getattr(module, "_is_expert_parallel", True)
    )


def grouped_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """``grouped_mm_experts_forward`` with the unsort before the routing weights (see the module docstring)."""
    if _grouped_linear is None or not _plain(self):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    tokens, top_k = top_k_index.shape
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    rows = hidden_states[perm // top_k]
    # histc, not bincount: no read back to the host (as transformers counts)
    counts_of = expert_ids.float() if hidden_states.device.type in ("cpu", "mps") else expert_ids.int()
    per_expert = torch.histc(counts_of, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)
    out = _grouped_linear(rows, self.gate_up_proj, offsets, is_transposed=self.is_transposed)
    out = _grouped_linear(self._apply_gate(out), self.down_proj, offsets, is_transposed=self.is_transposed)
    unsort = torch.empty_like(perm)
    unsort[perm] = torch.arange(perm.numel(), device=perm.device)
    out = permute_rows(out, unsort, perm)  # token order, still bf16
    weighted = out * top_k_weights.reshape(-1, 1)
    return weighted.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


if _grouped_linear is not None:
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, grouped_experts_forward)


def use_kit_experts_(model: nn.Module) -> bool:
    """Switch a model whose experts run transformers' ``grouped_mm`` forward to the kit's; True if switched.

    Other choices (``eager``, the kit's NF4 experts, which have their own forward) are left as they are."""
    config = getattr(model, "config", None)
    if (
        EXPERTS_IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS
        or getattr(config, "_experts_implementation", None) != "grouped_mm"
        or not hasattr(model, "set_experts_implementation")
    ):
        return False
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    return config._experts_implementation == EXPERTS_IMPLEMENTATION
