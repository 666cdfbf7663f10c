"""Triton where it is installed, and whether a tensor can run a Triton kernel here.

The prefix layer's kernels (``norm_kernels``, ``rope_kernels``, ``router_kernels``) share this: without Triton
they are never taken and the torch path runs; under ``TRITON_INTERPRET=1`` (the CPU tests) they run on CPU
tensors.
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of torch; without it, the torch paths run
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without Triton
    triton = tl = None

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def runs_triton(t: torch.Tensor) -> bool:
    """Triton is here, ``t`` is on a GPU (or the interpreter runs kernels on CPU), and no gradient is wanted
    (the kernels are forward only)."""
    return triton is not None and (t.is_cuda or INTERPRETING) and not torch.is_grad_enabled()


__all__ = ["INTERPRETING", "runs_triton", "tl", "triton"]
