"""Work-arounds for known traps, each applied only where its trap exists.

- DeepSeek remote code (``trust_remote_code``): the MoE gate asserts
  ``not self.training`` → gates are kept in eval mode and frozen, re-applied
  after every ``model.train()``; the MoE MLP can raise
  ``UnboundLocalError: ... 'y' ...`` on its shared-experts path → that layer's
  MLP falls back to identity, *only* for that exact error, and it is counted.
  Native transformers modeling has neither trap (its router has no training-mode assert).
- bitsandbytes on CPU: an eval-mode ``no_grad`` forward repacks NF4 weights
  for AVX512-BF16 and afterwards training silently gets ``None`` grads
  → the repack is switched off on every ``Linear4bit``.
"""

from __future__ import annotations

import types

from torch import nn

REMOTE_GATE_CLASSES = ("MoEGate",)
REMOTE_MOE_CLASSES = ("DeepseekV3MoE", "DeepseekV2MoE", "DeepseekMoE")


def _is_remote(module: nn.Module) -> bool:
    return type(module).__module__.startswith("transformers_modules")


def freeze_remote_gates(model: nn.Module) -> int:
    n = 0
    for module in model.modules():
        if type(module).__name__ in REMOTE_GATE_CLASSES:
            module.eval()
            for p in module.parameters():
                p.requires_grad_(False)
            n += 1
    return n


def keep_gates_frozen_on_train(model: nn.Module) -> None:
    """Make every later ``model.train()`` re-freeze the gates (the assert fires otherwise)."""
    if getattr(model, "_dsr1kit_gate_hook", False):
        return
    original = model.train

    def train(self, mode: bool = True):
        out = original(mode)
        freeze_remote_gates(self)
        return out

    model.train = types.MethodType(train, model)
    model._dsr1kit_gate_hook = True


class UnboundYFallback:
    """Wraps a remote MoE forward: identity on the exact ``'y'`` UnboundLocalError, counted."""

    def __init__(self, module: nn.Module):
        self.forward = module.forward
        self.fallbacks = 0

    def __call__(self, hidden_states, *args, **kwargs):
        try:
            return self.forward(hidden_states, *args, **kwargs)
        except UnboundLocalError as err:
            if "'y'" not in str(err):
                raise
            self.fallbacks += 1
            return hidden_states


def guard_remote_moe(model: nn.Module) -> list[UnboundYFallback]:
    guards = []
    for module in model.modules():
        if type(module).__name__ in REMOTE_MOE_CLASSES and _is_remote(module):
            guard = UnboundYFallback(module)
            module.forward = guard
            for p in module.parameters():
                p.requires_grad_(False)
            guards.append(guard)
    return guards


def disable_cpu_nf4_repack(model: nn.Module) -> int:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    n = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            n += 1
    return n


def apply_quirks(model: nn.Module) -> dict[str, int]:
    """Apply every applicable work-around; return what was done, for the report."""
    gates = freeze_remote_gates(model)
    if gates:
        keep_gates_frozen_on_train(model)
    guards = guard_remote_moe(model)
    return {
        "remote_gates_frozen": gates,
        "remote_moe_guarded": len(guards),
        "nf4_cpu_repack_disabled": disable_cpu_nf4_repack(model),
    }
