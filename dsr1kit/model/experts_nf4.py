"""Routed MoE experts held in NF4, the ~95% of DeepSeek-R1 that bitsandbytes' Linear4bit cannot reach.

transformers 5 stores a layer's routed experts as two fused 3-D parameters
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), and bitsandbytes only
quantizes ``nn.Linear``, so "4-bit" loading leaves them in bf16 (measured:
bitsandbytes alone saves about 4%). `NF4Experts` replaces such a module:

- storage: each expert quantized on its own with ``quantize_4bit`` (NF4, double
  quantization, blocksize 64 like the linears), stacked as ``[E, …]`` buffers so
  any group of experts dequantizes in four bitsandbytes calls; 0.258× bf16;
- forward: only experts that received tokens are dequantized, at most
  `chunk_experts` (64) at a time and < 2^31 elements per call (bnb kernels
  count in 32 bits), then the same math as transformers' ``eager`` or
  ``grouped_mm`` experts forward, so the output equals the bf16 module run on
  the dequantized weights bit for bit;
- backward: frozen weights (buffers, never parameters) but gradients reach the
  hidden states and routing weights, so LoRA below an NF4 layer trains. A
  custom autograd function keeps no bf16 weights: it re-dequantizes chunk by
  chunk in backward and recomputes that chunk's expert MLP.

On CPU bitsandbytes has no ``dequantize_4bit.out``, so dequantization always
allocates; the same code runs on CPU (tests) and CUDA.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from math import prod

import torch
from bitsandbytes import functional as bnbf
from torch import nn
from torch.nn import functional as F

BLOCKSIZE = 64  # NF4 block, same as BitsAndBytesConfig's default for the linears
NESTED_BLOCKSIZE = 256  # double-quantization block bitsandbytes uses for the absmax
CHUNK_EXPERTS = 64  # experts dequantized per call (measured: as fast as all at once, ~1/4 the peak)
MAX_DEQUANT_ELEMENTS = 2**31 - 1
IMPLEMENTATIONS = ("eager", "grouped_mm")


try:  # the dispatcher the bf16 module uses, so both pick the same kernel (CPU alignment fallback)
    from transformers.integrations.moe import _grouped_mm
except ImportError:  # pragma: no cover - older/newer transformers

    def _grouped_mm(input, weight, offs):
        return F.grouped_mm(input.to(weight.dtype), weight, offs=offs)


def experts_implementation(config) -> str:
    """The forward our module mirrors: transformers' ``eager`` loop, else its ``grouped_mm``."""
    impl = getattr(config, "_experts_implementation", None) or "grouped_mm"
    return "eager" if impl == "eager" else "grouped_mm"


@dataclass
class _Chunk:
    experts: list[int]  # active experts, ascending
    counts: list[int]  # routed rows per expert
    start: int  # first row of the chunk in the expert-sorted order
    stop: int


@dataclass
class _Routing:
    tokens: torch.Tensor  # [S] token of each expert-sorted row
    slots: torch.Tensor  # [S] its index into top_k_weights.reshape(-1)
    chunks: list[_Chunk]


class NF4Experts(nn.Module):
    """Drop-in for ``DeepseekV3Experts`` with NF4 weights; call signature unchanged."""

    def __init__(
        self,
        num_experts: int,
        hidden_dim: int,
        intermediate_dim: int,
        act_fn,
        *,
        implementation: str = "grouped_mm",
        dtype: torch.dtype = torch.bfloat16,
        chunk_experts: int = CHUNK_EXPERTS,
        device=None,
    ):
        super().__init__()
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.act_fn, self.implementation, self.dtype = act_fn, implementation, dtype
        self.shapes = {"gate_up": (2 * intermediate_dim, hidden_dim), "down": (hidden_dim, intermediate_dim)}
        for which, shape in self.shapes.items():
            n = prod(shape)
            if n % BLOCKSIZE:
                raise ValueError(
                    f"{which}: {shape} has {n} elements, not a multiple of the NF4 block {BLOCKSIZE}"
                )
            blocks = n // BLOCKSIZE
            nested = -(-blocks // NESTED_BLOCKSIZE)
            self.register_buffer(
                f"{which}_nf4",
                torch.zeros(num_experts, n // 2, dtype=torch.uint8, device=device),
                persistent=False,
            )
            self.register_buffer(
                f"{which}_absmax",
                torch.zeros(num_experts, blocks, dtype=torch.uint8, device=device),
                persistent=False,
            )
            self.register_buffer(
                f"{which}_absmax2",
                torch.zeros(num_experts, nested, dtype=torch.float32, device=device),
                persistent=False,
            )
            self.register_buffer(
                f"{which}_offset",
                torch.zeros(num_experts, dtype=torch.float32, device=device),
                persistent=False,
            )
        self.register_buffer(
            "nested_code", torch.zeros(256, dtype=torch.float32, device=device), persistent=False
        )
        largest = max(prod(s) for s in self.shapes.values())
        self.chunk_experts = max(1, min(chunk_experts, MAX_DEQUANT_ELEMENTS // largest))

    @classmethod
    def from_experts(
        cls, experts: nn.Module, *, implementation: str = "grouped_mm", chunk_experts: int = CHUNK_EXPERTS
    ) -> "NF4Experts":
        """Quantize a bf16 ``DeepseekV3Experts`` (fused 3-D params) expert by expert, on its device."""
        gate_up, down = experts.gate_up_proj, experts.down_proj
        module = cls(
            gate_up.shape[0],
            gate_up.shape[2],
            down.shape[2],
            experts.act_fn,
            implementation=implementation,
            dtype=gate_up.dtype,
            chunk_experts=chunk_experts,
            device=gate_up.device,
        )
        for e in range(gate_up.shape[0]):
            module.set_expert(e, gate_up[e].detach(), down[e].detach())
        return module

    def set_expert(self, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Quantize one expert (`gate_up` = cat(gate, up) [2I, H], `down` [H, I]) into its slot."""
        for which, w in (("gate_up", gate_up), ("down", down)):
            if tuple(w.shape) != self.shapes[which]:
                raise ValueError(
                    f"expert {expert} {which} has shape {tuple(w.shape)}, expected {self.shapes[which]}"
                )
            packed, state = bnbf.quantize_4bit(
                w.to(device=self.nested_code.device, dtype=self.dtype).contiguous(),
                blocksize=BLOCKSIZE,
                compress_statistics=True,
                quant_type="nf4",
            )
            getattr(self, f"{which}_nf4")[expert] = packed.view(-1)
            getattr(self, f"{which}_absmax")[expert] = state.absmax
            getattr(self, f"{which}_absmax2")[expert] = state.state2.absmax
            getattr(self, f"{which}_offset")[expert] = state.offset
            self.nested_code.copy_(state.state2.code)

    def _rows(self, name: str, experts: list[int] | torch.Tensor) -> torch.Tensor:
        """Rows of a stacked buffer: a view for a contiguous run of experts, else a gather."""
        buf = getattr(self, name)
        if isinstance(experts, list) and experts == list(range(experts[0], experts[0] + len(experts))):
            return buf[experts[0] : experts[0] + len(experts)]
        index = torch.as_tensor(experts, device=buf.device)
        return buf.index_select(0, index)

    def absmax(self, which: str, experts: list[int] | torch.Tensor) -> torch.Tensor:
        """float32 ``[G, blocks]``: the NF4 blocks' absmax of the given experts, undoing the double quantization."""
        q, q2 = self._rows(f"{which}_absmax", experts), self._rows(f"{which}_absmax2", experts)
        nested = bnbf.QuantState(
            absmax=q2.reshape(-1), code=self.nested_code, blocksize=NESTED_BLOCKSIZE, dtype=torch.float32
        )
        if q.shape[1] % NESTED_BLOCKSIZE == 0:  # nested blocks never straddle two experts
            absmax = bnbf.dequantize_blockwise(q.reshape(-1), nested).view(q.shape)
        else:
            absmax = torch.stack(
                [
                    bnbf.dequantize_blockwise(
                        q[g],
                        bnbf.QuantState(
                            absmax=q2[g],
                            code=self.nested_code,
                            blocksize=NESTED_BLOCKSIZE,
                            dtype=torch.float32,
                        ),
                    )
                    for g in range(q.shape[0])
                ]
            )
        return absmax + self._rows(f"{which}_offset", experts)[:, None]

    def dequantize(self, which: str, experts: list[int] | torch.Tensor) -> torch.Tensor:
        """bf16 weights ``[G, *shape]`` of the given experts, in two bitsandbytes calls."""
        absmax = self.absmax(which, experts)
        packed = self._rows(f"{which}_nf4", experts)
        return torch.ops.bitsandbytes.dequantize_4bit.default(
            packed.reshape(-1, 1),
            absmax.reshape(-1),
            BLOCKSIZE,
            "nf4",
            (absmax.shape[0], *self.shapes[which]),
            self.dtype,
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        with torch.autocast(device_type=hidden_states.device.type, enabled=False):
            if torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad):
                return _NF4ExpertsFunction.apply(hidden_states, top_k_index, top_k_weights, self)
            return self._forward_impl(hidden_states, top_k_index, top_k_weights)

    # -- the MoE math, shared by forward and the recomputing backward --------------------

    def _routing(self, top_k_index: torch.Tensor) -> _Routing:
        """Rows sorted by expert in the order the matching transformers forward uses."""
        tokens_n, k = top_k_index.shape
        if self.implementation == "eager":  # torch.where over the [K, T] one-hot: by slot k, then token
            ids = top_k_index.t().reshape(-1)
            order = torch.argsort(ids, stable=True)
            tokens = order % tokens_n
            slots = tokens * k + order // tokens_n
            ids = ids[order]
        else:  # grouped_mm_experts_forward: torch.sort over the flat [T, K] ids
            ids, slots = torch.sort(top_k_index.reshape(-1))
            tokens = slots // k
        counts = torch.bincount(ids, minlength=self.num_experts).tolist()  # one host sync per layer
        chunks, row, current = [], 0, _Chunk([], [], 0, 0)
        for expert, count in enumerate(counts):
            if not count:
                continue
            if len(current.experts) == self.chunk_experts:
                chunks.append(current)
                current = _Chunk([], [], row, row)
            current.experts.append(expert)
            current.counts.append(count)
            row += count
            current.stop = row
        if current.experts:
            chunks.append(current)
        return _Routing(tokens, slots, chunks)

    def _mlp(self, x: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
        """Expert MLP over expert-sorted rows, with just this chunk's weights dequantized."""
        gate_up, down = self.dequantize("gate_up", experts), self.dequantize("down", experts)
        if self.implementation == "grouped_mm":
            offs = torch.tensor(counts, device=x.device).cumsum(0, dtype=torch.int32)
            gate, up = _grouped_mm(x, gate_up.transpose(-2, -1), offs).chunk(2, dim=-1)
            return _grouped_mm(self.act_fn(gate) * up, down.transpose(-2, -1), offs)
        outs, start = [], 0
        for j, count in enumerate(counts):
            gate, up = F.linear(x[start : start + count], gate_up[j]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, down[j]))
            start += count
        return torch.cat(outs)

    def _chunk_rows(self, hidden, weights_flat, routing: _Routing, chunk: _Chunk) -> torch.Tensor:
        """Routing-weighted expert outputs for the chunk's rows (fp32 when the weights are)."""
        rows = slice(chunk.start, chunk.stop)
        x = hidden[routing.tokens[rows]].to(self.dtype)
        return self._mlp(x, chunk.experts, chunk.counts) * weights_flat[routing.slots[rows]].unsqueeze(-1)

    def _forward_impl(self, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        routing = self._routing(top_k_index)
        weights_flat = top_k_weights.reshape(-1)
        if self.implementation == "eager":  # bf16 index_add_, expert by expert, as the eager loop
            out = torch.zeros_like(hidden)
            for chunk in routing.chunks:
                rows = self._chunk_rows(hidden, weights_flat, routing, chunk).to(out.dtype)
                start = chunk.start
                for count in chunk.counts:
                    out.index_add_(
                        0, routing.tokens[start : start + count], rows[start - chunk.start :][:count]
                    )
                    start += count
            return out
        tokens_n, k = top_k_index.shape  # grouped: rows back to [T, K] slots, summed in fp32
        dtype = torch.promote_types(self.dtype, weights_flat.dtype)
        out = hidden.new_zeros(tokens_n * k, hidden.shape[-1], dtype=dtype)
        for chunk in routing.chunks:
            out[routing.slots[chunk.start : chunk.stop]] = self._chunk_rows(
                hidden, weights_flat, routing, chunk
            )
        return out.view(tokens_n, k, -1).sum(dim=1).to(hidden.dtype)

    def _backward_impl(self, hidden, top_k_index, top_k_weights, grad_out, need_hidden, need_weights):
        """Input and routing-weight grads, recomputing one chunk at a time (no bf16 weights kept)."""
        routing = self._routing(top_k_index)
        weights_flat = top_k_weights.reshape(-1)
        grad_hidden = (
            torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
        )
        grad_weights = torch.zeros_like(weights_flat) if need_weights else None
        for chunk in routing.chunks:
            tokens = routing.tokens[chunk.start : chunk.stop]
            slots = routing.slots[chunk.start : chunk.stop]
            with torch.enable_grad():
                x = hidden[tokens].detach().requires_grad_(need_hidden)
                w = weights_flat[slots].detach().requires_grad_(need_weights)
                rows = self._mlp(x.to(self.dtype), chunk.experts, chunk.counts) * w.unsqueeze(-1)
                if self.implementation == "eager":
                    rows = rows.to(hidden.dtype)
                wanted = [t for t, need in ((x, need_hidden), (w, need_weights)) if need]
                grads = list(torch.autograd.grad(rows, wanted, grad_out[tokens].to(rows.dtype)))
            if need_hidden:
                grad_hidden.index_add_(0, tokens, grads.pop(0).float())
            if need_weights:
                grad_weights[slots] = grads.pop(0).to(grad_weights.dtype)
        return (
            grad_hidden.to(hidden.dtype) if need_hidden else None,
            grad_weights.view_as(top_k_weights) if need_weights else None,
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
            f"nf4 blocksize={BLOCKSIZE} double-quant, {self.implementation}, chunk={self.chunk_experts}"
        )


class _NF4ExpertsFunction(torch.autograd.Function):
    """Frozen NF4 experts: saves only the inputs; backward re-dequantizes chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, top_k_index, top_k_weights, module):
        ctx.module = module
        ctx.save_for_backward(hidden, top_k_index, top_k_weights)
        return module._forward_impl(hidden, top_k_index, top_k_weights)

    @staticmethod
    def backward(ctx, grad_out):
        hidden, top_k_index, top_k_weights = ctx.saved_tensors
        grad_hidden, grad_weights = ctx.module._backward_impl(
            hidden, top_k_index, top_k_weights, grad_out, ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        )
        return grad_hidden, None, grad_weights, None


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers fused-experts module (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3


def quantize_experts_(model: nn.Module, *, chunk_experts: int = CHUNK_EXPERTS) -> int:
    """Replace every fused bf16 experts module of a loaded model by `NF4Experts`, layer by layer.

    Extra memory while it runs is one layer's experts in bf16 (freed as it goes).
    Returns how many modules were replaced.
    """
    implementation = experts_implementation(getattr(model, "config", None))
    targets = [(name, m) for name, m in model.named_modules() if is_fused_experts(m)]
    for name, experts in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        with torch.no_grad():
            nf4 = NF4Experts.from_experts(experts, implementation=implementation, chunk_experts=chunk_experts)
        setattr(parent, child, nf4)
        del experts
    keep_routing_fp32(model)
    return len(targets)


def keep_routing_fp32(model: nn.Module) -> int:
    """Router weights in fp32 and its forward outside autocast (measured: bf16 routing flips 6–33% of choices)."""
    count = 0
    for module in model.modules():
        if not type(module).__name__.endswith("TopkRouter") or getattr(module, "_dsr1kit_fp32", False):
            continue
        module.float()
        module.forward = types.MethodType(_forward_without_autocast, module)
        module._dsr1kit_fp32 = True
        count += 1
    return count


def _forward_without_autocast(self, hidden_states, *args, **kwargs):
    """The class's forward as it is at call time, so a later class swap (the prefix pass's lean router) is
    taken, and a bound method, so ``deepcopy`` rebinds it to the copy."""
    with torch.autocast(device_type=hidden_states.device.type, enabled=False):
        return type(self).forward(self, hidden_states, *args, **kwargs)


def nf4_bytes(module: nn.Module) -> int:
    """Bytes held by a module's parameters and buffers (NF4 storage included)."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
