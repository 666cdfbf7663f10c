"""The prefix pass's leaner DeepSeek layer: transformers' values with fewer memory passes.

On CPU the norms run the module's own arithmetic, so the leaner layer must give transformers' hidden states
bit for bit (the only changes there are where query, key and value live, and RoPE written in place). The
one-pass norm kernel runs here through Triton's interpreter, held to the module within its rounding; the CUDA
test holds the whole layer, kernel and cuDNN attention included, to transformers' layer on a GPU.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

from dsr1kit.model import prefix_layer
from dsr1kit.model.prefix_layer import PrefixAttention, PrefixDecoderLayer, PrefixRouter, lean_prefix_layers_

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_deepseek(attn: str, interleave: bool, dtype=torch.float32, **changes) -> DeepseekV3ForCausalLM:
    widths = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4) | changes
    config = DeepseekV3Config(
        vocab_size=512,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_rope_head_dim=32,
        qk_nope_head_dim=32,
        v_head_dim=48,  # unlike the key's 64, as R1's 128 against 192
        rope_interleave=interleave,
        **widths,
    )
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # a trained router's correction bias: routing then depends on it, as in R1
        for layer in model.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    return model.to(dtype).eval()


def padded_batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding: the attention mask is not the plain causal one
    return dict(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attn, interleave", [("sdpa", True), ("eager", True), ("sdpa", False)])
def test_lean_layers_give_transformers_hidden_states_bit_for_bit(attn, interleave, dtype, monkeypatch):
    model = tiny_deepseek(attn, interleave, dtype)
    lean = copy.deepcopy(model)
    assert lean_prefix_layers_(lean) == 8  # 3 layers, 3 attention modules, 2 routers
    assert all(type(layer) is PrefixDecoderLayer for layer in lean.model.layers)
    assert all(type(layer.self_attn) is PrefixAttention for layer in lean.model.layers)
    assert all(type(layer.mlp.gate) is PrefixRouter for layer in lean.model.layers[1:])

    norms = []
    real = prefix_layer.add_rms_norm
    monkeypatch.setattr(prefix_layer, "add_rms_norm", lambda *a, **k: norms.append(1) or real(*a, **k))
    batch = padded_batch(model.config.vocab_size)
    with torch.no_grad():
        want = model(**batch, output_hidden_states=True, use_cache=False).hidden_states
        got = lean(
            **batch, output_hidden_states=True, use_cache=False
        ).hidden_states  # as the prefix pass runs
    assert len(norms) == 4 * 3  # the lean path ran: two layer norms and two latent norms per layer
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), (
            f"hidden state {i}: max difference {float((a.float() - b.float()).abs().max())}"
        )


def test_lean_layers_leave_autograd_and_the_kv_cache_to_transformers(monkeypatch):
    model = tiny_deepseek("sdpa", True)
    lean = copy.deepcopy(model)
    lean_prefix_layers_(lean)
    calls = []
    monkeypatch.setattr(prefix_layer, "add_rms_norm", lambda *a, **k: calls.append(1))
    batch = padded_batch(model.config.vocab_size)
    lean.train()
    loss = lean(**batch, labels=batch["input_ids"]).loss  # grad on: transformers' own forward, trainable
    loss.backward()
    assert not calls and lean.model.layers[0].self_attn.q_b_proj.weight.grad is not None
    lean.eval()
    with torch.no_grad():
        out = lean.generate(batch["input_ids"][:1, :5], max_new_tokens=3, do_sample=False)  # with a KV cache
        ref = model.generate(batch["input_ids"][:1, :5], max_new_tokens=3, do_sample=False)
    assert torch.equal(out, ref) and not calls


def test_lean_layers_swap_only_transformers_deepseek_modules():
    model = tiny_deepseek("sdpa", True)
    lean_prefix_layers_(model)
    assert lean_prefix_layers_(model) == 0  # already swapped: nothing left to swap
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, vocab_size=64)
    )
    assert lean_prefix_layers_(llama) == 0


def test_whether_the_lean_modules_take_their_kernels_is_each_modules_own_setting(monkeypatch):
    """The loader passes ``LoadConfig.prefix_kernels`` on: each swapped attention and router keeps the choice
    (a copy too), and the router hands it to ``router_logits``."""
    model = tiny_deepseek("sdpa", True)
    lean_prefix_layers_(model)
    swapped = [m for m in model.modules() if isinstance(m, (PrefixAttention, PrefixRouter))]
    assert swapped and all(m.kernels for m in swapped)  # on by default
    lean_prefix_layers_(model, kernels=False)  # already swapped: the setting still changes
    twin = copy.deepcopy(model)
    assert not any(getattr(m, "kernels", False) for m in twin.modules())
    seen = []
    real = prefix_layer.router_logits
    monkeypatch.setattr(prefix_layer, "router_logits", lambda h, w, k: seen.append(k) or real(h, w, k))
    with torch.no_grad():
        twin(**padded_batch(model.config.vocab_size), use_cache=False)
    assert seen and not any(seen)


INTERPRETED_SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
    from dsr1kit.model import norm_kernels as nk, rope_kernels as rk
    from dsr1kit.model import router_kernels
    from dsr1kit.model.prefix_layer import lean_prefix_layers_
    from tests.test_prefix_layer import padded_batch, tiny_deepseek, torch_rope_and_key


    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())


    def worst(a, b):
        return float(((a.float() - b.float()).abs() / b.float().abs().clamp(min=1e-2)).max())


    torch.manual_seed(0)
    out = {"norm": {}, "rope": {}, "layers": {}}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        norm = DeepseekV3RMSNorm(300, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.1)
            wide = torch.randn(5, 7, 320).to(dtype)
            x, r = wide[..., :300], torch.randn(5, 7, 300).to(dtype)  # x strided: a slice of wider rows
            assert nk.runs_kernel(x, norm)
            s, y = nk.add_rms_norm(x, norm, r)
            alone_s, alone = nk.add_rms_norm(x, norm)
            out["norm"][name] = dict(
                sum=worst(s, r + x), norm=worst(y, norm(r + x)), alone=worst(alone, norm(x)),
                alone_sum_is_input=bool(torch.equal(alone_s, x)), shapes=[list(s.shape), list(y.shape)],
            )
        g = torch.Generator().manual_seed(0)
        for interleave in (True, False):
            b, sq, h, nope, rope, v = 2, 5, 6, 32, 16, 24  # 6 heads: a partial block of heads
            q = torch.randn(b, sq, h * (nope + rope), generator=g).to(dtype).view(b, sq, h, nope + rope)
            kv = torch.randn(b, sq, h * (nope + v), generator=g).to(dtype).view(b, sq, h, nope + v)
            k_rot = torch.randn(b, sq, 40 + rope, generator=g).to(dtype)[..., 40:]  # strided, as split leaves it
            angle = torch.randn(1, sq, rope // 2, generator=g)
            cos = torch.cat([angle.cos()] * 2, -1).to(dtype)
            sin = torch.cat([angle.sin()] * 2, -1).to(dtype)
            with torch.no_grad():
                assert rk.runs_kernel(q, cos, nope, rope)
                q1, q2 = q.clone(), q.clone()
                key1 = rk.rope_and_key(q1, kv, k_rot, cos, sin, nope, interleave)
                key2 = torch_rope_and_key(q2, kv, k_rot, cos, sin, nope, interleave)
            out["rope"][f"{name} interleave={interleave}"] = dict(
                q=rel(q1, q2), key=rel(key1, key2), q_nope_kept=bool(torch.equal(q1[..., :nope], q[..., :nope])),
                key_nope_equal=bool(torch.equal(key1[..., :nope], key2[..., :nope])),
            )
        if dtype == torch.bfloat16:
            hidden = torch.randn(70, 200, generator=g).to(dtype)  # partial tiles both ways
            weight = torch.randn(40, 200, generator=g) * 0.02
            with torch.no_grad():
                assert router_kernels.runs_kernel(hidden, weight)
                want = torch.nn.functional.linear(hidden.float(), weight)
                out["router"] = rel(router_kernels.logits(hidden, weight), want)
        model = tiny_deepseek("sdpa", True, dtype)
        lean = tiny_deepseek("sdpa", True, dtype)
        lean_prefix_layers_(lean)
        batch = padded_batch(model.config.vocab_size)
        with torch.no_grad():
            want = model(**batch, output_hidden_states=True, use_cache=False).hidden_states
            got = lean(**batch, output_hidden_states=True, use_cache=False).hidden_states
        out["layers"][name] = max(rel(a, c) for a, c in zip(want[1:], got[1:]))
    print(json.dumps(out))
    """
)


def torch_rope_and_key(q, kv, k_rot, cos, sin, nope: int, interleave: bool) -> torch.Tensor:
    """The rotary step and key assembly with transformers' functions (the CPU path of ``PrefixAttention``)."""
    batch, seq, heads, width = q.shape
    rotate = ds.apply_rotary_pos_emb_interleave if interleave else ds.apply_rotary_pos_emb
    q_rot, k_rot = rotate(
        q[..., nope:], k_rot.reshape(batch, seq, 1, width - nope), cos, sin, unsqueeze_dim=2
    )
    q[..., nope:].copy_(q_rot)
    key = kv.new_empty(batch, seq, heads, width)
    key[..., :nope].copy_(kv[..., :nope])
    key[..., nope:].copy_(k_rot.expand(-1, -1, heads, -1))
    return key


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """The Triton kernels on CPU through Triton's interpreter, against the torch path (one fresh process)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    done = subprocess.run(
        [sys.executable, "-c", INTERPRETED_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    print(got)
    return got


def test_one_pass_norm_kernel_matches_the_module_interpreted(interpreted):
    """float32: the order of the mean's additions only (1e-6). bf16: the interpreter truncates where a GPU
    rounds, and the kernel rounds three times (sum, normalized row, product): within 3 bf16 steps."""
    got = interpreted["norm"]
    assert got["float32"]["sum"] == 0 and got["float32"]["norm"] < 1e-6 and got["float32"]["alone"] < 1e-6
    assert got["bfloat16"]["sum"] <= 2**-7 and got["bfloat16"]["norm"] <= 3 * 2**-7
    assert got["bfloat16"]["alone"] <= 3 * 2**-7
    assert all(g["alone_sum_is_input"] and g["shapes"] == [[5, 7, 300]] * 2 for g in got.values())


def test_rope_and_key_kernel_matches_transformers_rotary_interpreted(interpreted):
    """float32: the same operations in the same order, so equal. bf16: within the interpreter's truncation."""
    for case, got in interpreted["rope"].items():
        assert got["q_nope_kept"] and got["key_nope_equal"], case
        limit = 0.0 if case.startswith("float32") else 1e-2
        assert got["q"] <= limit and got["key"] <= limit, (case, got)


def test_router_logits_kernel_is_the_float32_gemm_interpreted(interpreted):
    """The weight's three bf16 parts are exact, so only the float32 additions' order differs."""
    assert interpreted["router"] < 1e-6


def test_lean_layers_with_their_kernels_match_transformers_interpreted(interpreted):
    assert interpreted["layers"]["float32"] < 1e-5  # the norm's mean added in another order
    assert interpreted["layers"]["bfloat16"] < 3e-2  # and the interpreter's truncating bf16 (measured 1.8%)


@pytest.mark.parametrize("interleave", [True, False])
def test_the_rotary_kernel_compiles_to_separately_rounded_products_and_sums(interleave):
    """Bit-exactness with torch needs each bf16 product rounded before the sum: compiled for an H100 (no GPU
    needed) with the options it is launched with, the kernel's PTX multiplies and adds in bf16 and has no fused
    multiply-add."""
    import re

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsr1kit.model import rope_kernels

    strides = ("qt", "qh", "kvt", "kvh", "krt", "ct", "st", "kt", "kh")
    signature = {p: "*bf16" for p in ("Q", "KV", "KR", "COS", "SIN", "KEY")}
    signature |= {"H": "i32"} | {f"stride_{p}": "i32" for p in strides}
    constants = {"NOPE": 128, "HALF": 32, "INTERLEAVE": interleave, "BLOCK_H": 16}
    signature |= {p: "constexpr" for p in constants}
    source = ASTSource(fn=rope_kernels._rope_key, signature=signature, constexprs=constants)
    try:
        ptx = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options=rope_kernels.COMPILE_OPTIONS
        ).asm["ptx"]
    except Exception as err:  # a Triton without the NVIDIA backend or its ptxas
        pytest.skip(f"cannot compile for sm_90 here: {err}")
    ops = re.findall(r"^\s*([a-z][a-z0-9_.]+)\s", ptx, re.M)
    assert not [op for op in ops if op.startswith("fma")], "a product fused into a sum"
    assert any(op.startswith("mul.rn.bf16") for op in ops) and any(op.startswith("sub.rn.bf16") for op in ops)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_lean_layers_match_transformers_on_a_gpu(attn, kernels):
    """The norm kernel and cuDNN's attention on strided query/key/value: within bf16 rounding of transformers'
    layer (the mean's addition order may move a normalized element by one bf16 step)."""
    model = tiny_deepseek(
        attn, True, torch.bfloat16, hidden_size=512, num_attention_heads=8, num_key_value_heads=8
    )
    model = model.cuda()
    lean = copy.deepcopy(model)
    lean_prefix_layers_(lean, kernels=kernels)  # with and without the rotary/router kernels
    batch = {k: v.cuda() for k, v in padded_batch(model.config.vocab_size).items()}
    batch_causal = {k: v.clone() for k, v in batch.items()}
    batch_causal["attention_mask"].fill_(1)  # no padding: sdpa takes its is_causal path
    for b in (batch, batch_causal):
        with torch.no_grad():
            want = model(**b, output_hidden_states=True, use_cache=False).hidden_states
            got = lean(**b, output_hidden_states=True, use_cache=False).hidden_states
        for a, c in zip(want[1:], got[1:]):
            err = float((a.float() - c.float()).norm() / a.float().norm())
            assert err < 1e-2, err


@pytest.mark.gpu
def test_router_logits_kernel_equals_the_float32_gemm_on_a_gpu():
    """Three bf16 parts hold the float32 weight exactly, and each slice's sum is added outside the tensor
    cores: float32 GEMM-level error (a bf16 GEMM's, for scale, is ~2e-3), the same top-8 for nearly every row."""
    from dsr1kit.model import router_kernels
    from dsr1kit.model.prefix_layer import router_logits

    g = torch.Generator(device="cuda").manual_seed(5)
    hidden = torch.randn(4096, 7168, generator=g, device="cuda").to(torch.bfloat16)
    weight = torch.randn(256, 7168, generator=g, device="cuda") * 0.02
    with torch.no_grad():
        assert router_kernels.runs_kernel(hidden, weight)
        got = router_logits(hidden, weight)
        want = torch.nn.functional.linear(hidden.float(), weight)
    assert got.dtype == torch.float32
    error = float((got - want).norm() / want.norm())
    assert error < 2e-6, error
    same = (got.topk(8, dim=-1).indices.sort(-1).values == want.topk(8, dim=-1).indices.sort(-1).values).all(
        -1
    )
    assert float(same.float().mean()) > 0.999


@pytest.mark.gpu
@pytest.mark.parametrize("interleave", [True, False])
def test_rope_and_key_kernel_is_transformers_rotary_bit_for_bit_on_a_gpu(interleave):
    """R1's widths (128 heads, 128 + 64 key dims, 128 value dims): the kernel rounds as torch's elementwise
    kernels round, so query and key are the same bits."""
    from dsr1kit.model import rope_kernels

    g = torch.Generator(device="cuda").manual_seed(6)
    b, s, h, nope, rope, v = 2, 300, 128, 128, 64, 128
    q = torch.randn(b, s, h * (nope + rope), generator=g, device="cuda").bfloat16().view(b, s, h, nope + rope)
    kv = torch.randn(b, s, h * (nope + v), generator=g, device="cuda").bfloat16().view(b, s, h, nope + v)
    k_rot = torch.randn(b, s, 512 + rope, generator=g, device="cuda").bfloat16()[..., 512:]
    angle = torch.randn(b, s, rope // 2, generator=g, device="cuda")
    cos, sin = torch.cat([angle.cos()] * 2, -1).bfloat16(), torch.cat([angle.sin()] * 2, -1).bfloat16()
    with torch.no_grad():
        assert rope_kernels.runs_kernel(q, cos, nope, rope)
        q1, q2 = q.clone(), q.clone()
        key1 = rope_kernels.rope_and_key(q1, kv, k_rot, cos, sin, nope, interleave)
        key2 = torch_rope_and_key(q2, kv, k_rot, cos, sin, nope, interleave)
    assert torch.equal(q1, q2), float((q1.float() - q2.float()).abs().max())
    assert torch.equal(key1, key2), float((key1.float() - key2.float()).abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", [False, True])
def test_the_lean_fp8_layers_never_wait_for_the_host_on_a_gpu(kernels):
    """A host sync inside a layer (torch.bincount, a boolean index) drains the GPU's queue once per layer, so the
    next kernels wait on Python to launch them. After the autotuner's first call, none may remain."""
    from dsr1kit.model.fp8_compute import to_fp8_

    model = tiny_deepseek(
        "sdpa", True, torch.bfloat16, hidden_size=512, num_attention_heads=8, num_key_value_heads=8
    ).cuda()
    to_fp8_(model)
    lean_prefix_layers_(model, kernels=kernels)
    hidden = torch.randn(2, 256, 512, device="cuda", dtype=torch.bfloat16)
    position_ids = torch.arange(256, device="cuda")[None].expand(2, -1)

    def layers(h):
        pe = model.model.rotary_emb(h, position_ids)
        for layer in model.model.layers:
            h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=pe)
        return h

    with torch.no_grad():
        want = layers(hidden)  # autotuning reads timings back: allowed once
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = layers(hidden)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2  # the same forward
