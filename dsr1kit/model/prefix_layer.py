"""DeepSeek's decoder layer for the prefix pass: the same values as transformers' forward, fewer memory passes.

At R1's widths and 16k-token micro-batches, about a quarter of an FP8 MoE layer's time went to copies and
elementwise kernels around its GEMMs (``docs/benchmarks.md``). transformers' MLA builds the query and key by
concatenating transposed views, and its RMSNorm makes five float32 passes over the hidden state. Here:

- query, key and value stay in [batch, seq, heads, dim] order, the GEMMs' own output layout, and reach
  attention as transposed views: the query is never copied, and attention writes its output in the
  order ``o_proj`` reads it;
- the rotary part is computed by transformers' own functions and written back into the query in place;
  on a GPU (``kernels``, on by default), one Triton pass rotates the query in place and writes the
  whole key (``rope_kernels``), bit for bit transformers' rotary;
- the residual add and the RMSNorm after it are one pass (``norm_kernels``), and so are the latent norms;
- the router's float32 logits are transformers' float32 GEMM; on a GPU, a Triton GEMM on the tensor cores
  with the float32 weight split into three bf16 parts (``router_kernels``).

Forward only: with autograd on, or a KV cache, each module takes transformers' own forward. Applied by
``lean_prefix_layers_`` to a model that only runs the prefix pass (the FP8 one, whose weights refuse a
gradient anyway); the class of each DeepSeek layer and attention module is swapped for its subclass here, so
forward hooks, ``deepcopy`` and accelerate's dispatch hooks (attached after) see ordinary modules. Whether
the swapped modules take the kernels is an attribute of each (``kernels``), which the loader sets from
``LoadConfig.prefix_kernels``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

from . import rope_kernels, router_kernels
from .norm_kernels import add_rms_norm


def router_logits(hidden: torch.Tensor, weight: torch.Tensor, kernels: bool = True) -> torch.Tensor:
    """``hidden @ weight.T`` in float32, as transformers' router computes it: on a GPU (with ``kernels``)
    through ``router_kernels`` (bf16 rows times the float32 weight split exactly into three bf16 parts, on the
    tensor cores), elsewhere ``F.linear`` of both in float32."""
    if kernels and router_kernels.runs_kernel(hidden, weight):
        return router_kernels.logits(hidden, weight)
    return F.linear(hidden.type(torch.float32), weight.type(torch.float32))


def _takes_lean_path(cache, kwargs) -> bool:
    return not torch.is_grad_enabled() and cache is None and kwargs.get("past_key_values") is None


class PrefixAttention(ds.DeepseekV3Attention):
    """MLA with query, key and value in [batch, seq, heads, dim] order (see the module docstring)."""

    kernels = True  # the rotary/key kernel on a GPU; ``lean_prefix_layers_`` sets it per module

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        if not _takes_lean_path(cache, kwargs) or position_embeddings is None:
            return super().forward(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        kwargs.pop("past_key_values", None)
        batch, seq = hidden_states.shape[:-1]
        nope, rope = self.qk_nope_head_dim, self.qk_rope_head_dim
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(add_rms_norm(self.q_a_proj(hidden_states), self.q_a_layernorm)[1])
        q = q.view(batch, seq, -1, self.qk_head_dim)
        kv_nope, k_rot = torch.split(
            self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, rope], dim=-1
        )
        kv = self.kv_b_proj(add_rms_norm(kv_nope, self.kv_a_layernorm)[1])
        kv = kv.view(batch, seq, -1, nope + self.v_head_dim)

        cos, sin = position_embeddings
        interleave = bool(self.config.rope_interleave)
        if self.kernels and rope_kernels.runs_kernel(q, cos, nope, rope):
            key = rope_kernels.rope_and_key(q, kv, k_rot, cos, sin, nope, interleave)
        else:
            rotate = ds.apply_rotary_pos_emb_interleave if interleave else ds.apply_rotary_pos_emb
            q_rot, k_rot = rotate(q[..., nope:], k_rot.view(batch, seq, 1, rope), cos, sin, unsqueeze_dim=2)
            q[..., nope:].copy_(q_rot)
            key = kv.new_empty(batch, seq, kv.shape[2], nope + rope)
            key[..., :nope].copy_(kv[..., :nope])
            key[..., nope:].copy_(k_rot.expand(-1, -1, kv.shape[2], -1))
        value = kv[..., nope:]

        attention = ds.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, ds.eager_attention_forward
        )
        out, weights = attention(
            self,
            q.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        return self.o_proj(out.reshape(batch, seq, -1)), weights


class PrefixRouter(ds.DeepseekV3TopkRouter):
    """transformers' DeepSeek-V3 router (group-limited top-k over sigmoid scores) with ``router_logits``."""

    kernels = True  # the router kernel on a GPU; ``lean_prefix_layers_`` sets it per module

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        logits = router_logits(hidden_states, self.weight, self.kernels)
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = self.num_experts // self.num_group
        group_scores = choice.view(-1, self.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1).expand(-1, self.num_group, per_group).reshape(-1, self.num_experts)
        )
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        topk_indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_indices)
        if self.norm_topk_prob:
            topk_weights /= topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        return logits, topk_weights * self.routed_scaling_factor, topk_indices


class PrefixDecoderLayer(ds.DeepseekV3DecoderLayer):
    """The decoder layer with each residual add fused into the RMSNorm after it."""

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=False,
        position_embeddings=None,
        **kwargs,
    ):
        if not _takes_lean_path(cache, kwargs):
            return super().forward(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        kwargs.pop("past_key_values", None)
        residual, normed = add_rms_norm(hidden_states, self.input_layernorm)
        attn, _ = self.self_attn(
            hidden_states=normed,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=None,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        residual, normed = add_rms_norm(attn, self.post_attention_layernorm, residual)
        return residual + self.mlp(normed)


def lean_prefix_layers_(model: nn.Module, kernels: bool = True) -> int:
    """Swap every transformers DeepSeek-V3 decoder layer, attention module and router under ``model`` for the
    prefix pass's forward (same values, fewer passes); returns how many modules were swapped. Other classes (a
    checkpoint's own remote code) are left as they are. ``kernels``: whether the lean attention and router
    take the rotary/key and router kernels on a GPU (set on modules swapped before too)."""
    swapped = 0
    for module in model.modules():
        lean = LEAN.get(type(module))
        if lean is not None:
            module.__class__ = lean
            swapped += 1
        if isinstance(module, (PrefixAttention, PrefixRouter)):
            module.kernels = kernels
    return swapped


LEAN = {
    ds.DeepseekV3DecoderLayer: PrefixDecoderLayer,
    ds.DeepseekV3Attention: PrefixAttention,
    ds.DeepseekV3TopkRouter: PrefixRouter,
}  # transformers' class -> the prefix pass's subclass


__all__ = [
    "LEAN",
    "PrefixAttention",
    "PrefixDecoderLayer",
    "PrefixRouter",
    "lean_prefix_layers_",
    "router_logits",
]
