"""Forward passes on DeepSeek's FP8 weights as stored: block-scaled e4m3 GEMMs, no NF4 and no bf16 copy.

R1 ships its linears and routed experts as ``float8_e4m3fn`` with one float32
scale per 128×128 weight block, and was trained with activations quantized the
same way per 1×128 group of each row. The prefix pass (forward only, no
gradient) can therefore run R1 as R1 runs: each linear quantizes its input per
token and 128-column group (scale = group absmax / 448), multiplies e4m3 by
e4m3 with float32 accumulation, and applies both scales per 128-wide slice of
the reduction. That is the more faithful frozen model (the hidden states the
adapter trains from are R1's, not an NF4 copy's) and the faster one on GPUs
with FP8 units.

- ``FP8Linear`` replaces an ``nn.Linear`` whose weight is stored FP8;
- ``FP8Experts`` replaces transformers' fused ``DeepseekV3Experts`` (one
  grouped GEMM for all experts' gate/up, one for down, on CUDA);
- on a GPU with FP8 units (compute capability ≥ 8.9) the GEMMs are the kit's
  Triton kernels (``fp8_kernels``); elsewhere (CPU tests) the same arithmetic
  runs in float32 (``reference_linear``): e4m3 products are exact in float32,
  so the two differ only by the order of float32 additions.

Both modules are forward-only: they hold buffers, not parameters, and refuse a
forward that would need a gradient.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .fp8 import DEFAULT_BLOCK, FP8_DTYPE, FP8_MAX, dequantize_fp8_blocks, quantize_fp8_blocks, scale_grid

GROUP = 128  # activation group along the reduction, and the weight block: R1's quantization_config
EPS = 1e-10  # an all-zero group gets this absmax, so it quantizes to zeros instead of 0/0


def quantize_activations(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values [M, K], float32 scales [M, ceil(K/group)]) of ``x`` [..., K] per row and column group."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).to(torch.float32)
    groups = -(-k // group)
    padded = F.pad(rows, (0, groups * group - k)).view(rows.shape[0], groups, group)
    scale = padded.abs().amax(dim=-1).clamp(min=EPS) / FP8_MAX
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows.shape[0], groups * group)[:, :k], scale


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """float32 values of ``quantize_activations``' output."""
    expanded = scale.repeat_interleave(group, dim=1)[:, : q.shape[1]]
    return q.to(torch.float32) * expanded


def reference_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The FP8 linear's arithmetic in float32: quantized input times the weight dequantized (CPU path)."""
    q, s = quantize_activations(x)
    w = dequantize_fp8_blocks(weight, scale_inv, DEFAULT_BLOCK, torch.float32)
    y = dequantize_activations(q, s) @ w.T
    return y.to(out_dtype or x.dtype).view(*x.shape[:-1], weight.shape[0])


def is_silu(act_fn) -> bool:
    """Whether ``act_fn`` computes SiLU (transformers wraps it in its own class): checked on probe values."""
    probe = torch.tensor([-6.0, -1.0, -0.25, 0.0, 0.5, 3.0])
    try:
        return bool(torch.allclose(act_fn(probe), F.silu(probe), atol=1e-6))
    except Exception:
        return False


def _kernels_for(x: torch.Tensor):
    """The Triton kernels when ``x`` lives on a GPU that runs them, else None (the float32 reference)."""
    if not x.is_cuda:
        return None
    from . import fp8_kernels

    return fp8_kernels if fp8_kernels.available(x.device) else None


def _refuse_grad(x: torch.Tensor, what: str) -> None:
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError(
            f"{what} is forward-only (the prefix pass runs it under no_grad); a gradient through FP8 weights "
            "needs the model loaded in bf16 or NF4"
        )


class FP8Linear(nn.Module):
    """``nn.Linear`` with its weight as stored: e4m3 ``weight`` [out, in] and ``weight_scale_inv`` per block."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, dtype=torch.bfloat16, device=None
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        grid = scale_grid((out_features, in_features))
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale_inv", torch.ones(grid, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FP8Linear:
        """Quantize an ``nn.Linear`` as DeepSeek stores its weights (benchmarks and tests; checkpoints already
        stored in FP8 are loaded as they are by the streaming loader)."""
        w = linear.weight.detach()
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, w.device)
        new.weight, new.weight_scale_inv = quantize_fp8_blocks(w)
        if linear.bias is not None:
            new.bias = linear.bias.detach().clone()
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _refuse_grad(x, "FP8Linear")
        kernels = _kernels_for(x)
        if kernels is None:
            y = reference_linear(x, self.weight, self.weight_scale_inv)
        else:
            y = kernels.linear(x, self.weight, self.weight_scale_inv)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 128x128 blocks"


class FP8Experts(nn.Module):
    """Drop-in for ``DeepseekV3Experts`` (call signature unchanged) with every expert's weights in e4m3.

    ``gate_up`` [E, 2·I', H] holds gate rows then up rows, each padded to I' (I rounded up to the 128-row
    block) so the two never share a scale block; ``down`` [E, H, I].
    """

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, act_fn, device=None):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.padded_dim = -(-intermediate_dim // GROUP) * GROUP
        self.act_fn = act_fn
        self.act_is_silu = is_silu(
            act_fn
        )  # the kernels fuse SiLU(gate)·up; another activation runs the reference
        gate_up_shape = (2 * self.padded_dim, hidden_dim)
        down_shape = (hidden_dim, intermediate_dim)
        self.register_buffer(
            "gate_up", torch.zeros(num_experts, *gate_up_shape, dtype=FP8_DTYPE, device=device)
        )
        self.register_buffer(
            "gate_up_scale_inv",
            torch.ones(num_experts, *scale_grid(gate_up_shape), dtype=torch.float32, device=device),
        )
        self.register_buffer("down", torch.zeros(num_experts, *down_shape, dtype=FP8_DTYPE, device=device))
        self.register_buffer(
            "down_scale_inv",
            torch.ones(num_experts, *scale_grid(down_shape), dtype=torch.float32, device=device),
        )

    @classmethod
    def from_experts(cls, experts: nn.Module) -> FP8Experts:
        """Quantize a bf16 ``DeepseekV3Experts`` (fused 3-D params) expert by expert, as DeepSeek stores them."""
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        n, two_i, hidden = gate_up.shape
        inter = two_i // 2
        module = cls(n, hidden, inter, experts.act_fn, device=gate_up.device)
        for e in range(n):
            module.set_expert(
                e,
                quantize_fp8_blocks(gate_up[e, :inter]),
                quantize_fp8_blocks(gate_up[e, inter:]),
                quantize_fp8_blocks(down[e]),
            )
        return module

    def set_expert(self, expert: int, gate, up, down) -> None:
        """One expert from its stored (e4m3 weight, scale_inv) pairs: gate and up [I, H], down [H, I]."""
        i, h, p = self.intermediate_dim, self.hidden_dim, self.padded_dim
        for name, (w, s), shape in (("gate", gate, (i, h)), ("up", up, (i, h)), ("down", down, (h, i))):
            if tuple(w.shape) != shape or tuple(s.shape) != scale_grid(shape):
                raise ValueError(
                    f"expert {expert} {name}: weight {tuple(w.shape)} with scales {tuple(s.shape)}, expected "
                    f"{shape} with {scale_grid(shape)}"
                )
        blocks = p // GROUP
        self.gate_up[expert, :i] = gate[0]
        self.gate_up[expert, p : p + i] = up[0]
        self.gate_up_scale_inv[expert, :blocks] = gate[1]
        self.gate_up_scale_inv[expert, blocks:] = up[1]
        self.down[expert] = down[0]
        self.down_scale_inv[expert] = down[1]

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        _refuse_grad(hidden_states, "FP8Experts")
        kernels = _kernels_for(hidden_states)
        if kernels is not None and self.act_is_silu:
            return kernels.experts(
                hidden_states,
                top_k_index,
                top_k_weights,
                self.gate_up,
                self.gate_up_scale_inv,
                self.down,
                self.down_scale_inv,
                self.intermediate_dim,
            )
        return self.reference(hidden_states, top_k_index, top_k_weights)

    def reference(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The kernels' arithmetic in float32, expert by expert: gate/up rounded to the hidden dtype, the
        activation quantized per 1×128 group, each routed row weighted and rounded, a token's rows summed
        in float32."""
        tokens, top_k = top_k_index.shape
        dtype, i, p = hidden_states.dtype, self.intermediate_dim, self.padded_dim
        slots = torch.zeros(tokens * top_k, self.hidden_dim, dtype=dtype, device=hidden_states.device)
        flat = top_k_index.reshape(-1)
        for expert in flat.unique().tolist():
            slot = (flat == expert).nonzero().squeeze(1)
            x = hidden_states[slot // top_k]
            gate_up = reference_linear(x, self.gate_up[expert], self.gate_up_scale_inv[expert], dtype).float()
            h = self.act_fn(gate_up[:, :i]) * gate_up[:, p : p + i]
            y = reference_linear(h, self.down[expert], self.down_scale_inv[expert], torch.float32)
            slots[slot] = (y * top_k_weights.reshape(-1)[slot, None].float()).to(dtype)
        return slots.view(tokens, top_k, -1).sum(1, dtype=torch.float32).to(dtype)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
            f"intermediate_dim={self.intermediate_dim}, e4m3 128x128 blocks"
        )


def to_fp8_(module: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Every ``nn.Linear`` (but ``skip``) and fused routed-experts module under ``module`` quantized in place
    to its FP8 twin, as R1 stores them (the router, norms and embeddings are not linears and stay); returns
    how many were replaced. For benchmarks and tests that start from bf16 weights."""
    from .experts_nf4 import is_fused_experts

    replaced = 0
    for name, child in list(module.named_children()):
        if name in skip:
            continue
        if isinstance(child, nn.Linear):
            setattr(module, name, FP8Linear.from_linear(child))
            replaced += 1
        elif is_fused_experts(child):
            setattr(module, name, FP8Experts.from_experts(child))
            replaced += 1
        else:
            replaced += to_fp8_(child, skip)
    return replaced
