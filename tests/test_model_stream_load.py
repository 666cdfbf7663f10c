"""Streaming loader: FP8 and BF16 checkpoints, both expert layouts, clear errors, one layer of host memory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsr1kit.embedded.r1_format import (
    R1_QUANTIZATION_CONFIG,
    is_fp8_weight,
    read_tensors,
    shard_name,
    to_fp8,
    write_checkpoint,
)
from dsr1kit.model.checkpoint_index import INDEX_FILE, read_index, read_weight_map
from dsr1kit.model.fp8 import FP8_DTYPE, dequantize_fp8_blocks, quantize_fp8_blocks
from dsr1kit.model.stream_load import CheckpointError, device_for, load_streaming

ROOT = Path(__file__).resolve().parent.parent


def tiny_config(tiny_dir: Path) -> dict:
    return json.loads((tiny_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """The tiny model through transformers' own loader, and a fixed batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits.float()
    return model, ids, logits


@pytest.fixture(scope="module")
def fp8_dir(tiny_dir, tmp_path_factory):
    """The tiny model as DeepSeek ships R1: per-expert keys, FP8 linears with 128x128 block scales."""
    return write_checkpoint(
        tmp_path_factory.mktemp("fp8") / "tiny-fp8", read_tensors(tiny_dir), tiny_config(tiny_dir), fp8=True
    )


def logits_of(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


# -- FP8 block dequantization ---------------------------------------------------------------


def test_fp8_dequant_matches_blockwise_formula_including_edge_blocks():
    torch.manual_seed(0)
    w = torch.randn(200, 300) * 0.02  # 2x3 blocks, the last row and column of blocks partial
    q, scale = quantize_fp8_blocks(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (2, 3)
    manual = q.float().clone()
    for i in range(2):
        for j in range(3):
            manual[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= scale[i, j]
    assert torch.equal(dequantize_fp8_blocks(q, scale, dtype=torch.float32), manual)


def test_fp8_roundtrip_error_is_within_e4m3_half_ulp():
    """e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself."""
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(1)) * 0.05
    q, scale = quantize_fp8_blocks(w)
    back = dequantize_fp8_blocks(q, scale, dtype=torch.float32)
    # below e4m3's smallest normal (2^-6 · scale) the step is absolute: 2^-9 · scale, half of it at most
    subnormal_step = 2.0**-10 * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert ((back - w).abs() <= w.abs() * 2.0**-4 + subnormal_step).all()


def test_fp8_scale_with_wrong_shape_names_the_tensor():
    q, scale = quantize_fp8_blocks(torch.randn(200, 300))
    with pytest.raises(ValueError, match=r"q_b_proj.weight_scale_inv has shape \(3, 3\).*needs \(2, 3\)"):
        dequantize_fp8_blocks(q, torch.ones(3, 3), name="model.layers.0.self_attn.q_b_proj.weight")


# -- loading ----------------------------------------------------------------------------------


def test_bf16_checkpoint_streams_to_the_same_logits_as_from_pretrained(tiny_dir, reference):
    _, ids, expected = reference
    model = load_streaming(tiny_dir, nf4_linears=False, nf4_experts=False, progress=False)
    assert torch.equal(logits_of(model, ids), expected)


def with_weights_rounded(tiny_dir, rounding):
    """The tiny model with `rounding` applied to every weight R1 stores in FP8 (experts one by one)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.copy_(torch.stack([rounding(w) for w in param]))
            elif is_fp8_weight(name, param):
                param.copy_(rounding(param))
    return model


def test_fp8_checkpoint_loads_with_logits_close_to_bf16(fp8_dir, reference, tiny_dir):
    """Exactly the BF16 model with FP8-rounded weights, and within FP8's precision of the original.

    Exact: the loaded model equals, bit for bit, the original with every FP8 weight replaced
    in memory by dequantize(quantize(w)), so scales, edge blocks and key mapping are right.
    Close: e4m3 rounding moves each weight by at most 2^-4 of itself. The tolerance is what
    that worst case does to this (random, chaotic) model: every weight moved by the full
    ±2^-4 with a random sign gives a relative RMS logit error of ~0.23; FP8's errors are no
    larger and mostly smaller, so its logits must move less (measured: 0.10-0.13). A wrong
    scale or a misplaced block moves them by order 1.
    """
    _, ids, expected = reference
    model = load_streaming(fp8_dir, nf4_linears=False, nf4_experts=False, progress=False)
    got = logits_of(model, ids)
    fake_quantized = with_weights_rounded(tiny_dir, lambda w: dequantize_fp8_blocks(*quantize_fp8_blocks(w)))
    assert torch.equal(got, logits_of(fake_quantized, ids))

    gen = torch.Generator().manual_seed(0)
    worst_case = with_weights_rounded(
        tiny_dir,
        lambda w: (w.float() * (1 + 2.0**-4 * (torch.randint(0, 2, w.shape, generator=gen) * 2 - 1))).to(
            w.dtype
        ),
    )

    def rel(logits):
        return ((logits - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()

    assert 0 < rel(got) < rel(logits_of(worst_case, ids)), (rel(got), rel(logits_of(worst_case, ids)))


def test_fp8_checkpoint_loads_into_nf4(fp8_dir, reference):
    model = load_streaming(fp8_dir, progress=False)
    import bitsandbytes as bnb

    from dsr1kit.model.experts_nf4 import NF4Experts

    assert isinstance(model.model.layers[1].mlp.experts, NF4Experts)
    assert isinstance(model.model.layers[2].self_attn.q_b_proj, bnb.nn.Linear4bit)
    assert not isinstance(model.lm_head, bnb.nn.Linear4bit)  # kept bf16 like BitsAndBytesConfig's default
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert torch.isfinite(logits_of(model, reference[1])).all()


def test_fused_and_per_expert_layouts_load_the_same_nf4_experts(tiny_dir, reference, tmp_path):
    """transformers' in-memory (fused) names load like DeepSeek's per-expert keys."""
    fused = {k: v.contiguous() for k, v in reference[0].state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused
    fused_dir = write_checkpoint(tmp_path / "fused", fused, tiny_config(tiny_dir))
    a = load_streaming(fused_dir, progress=False).model.layers[1].mlp.experts
    b = load_streaming(tiny_dir, progress=False).model.layers[1].mlp.experts
    for name, buf in a.named_buffers():
        assert torch.equal(buf, dict(b.named_buffers())[name]), name


def test_device_map_prefixes_place_modules_like_transformers():
    dm = {"model.embed_tokens": "cpu", "model.layers.1": "cuda:0", "model.layers.10": 1, "lm_head": "cpu"}
    assert device_for("model.layers.1", dm) == torch.device("cuda", 0)
    assert device_for("model.layers.10.mlp", dm) == torch.device("cuda", 1)  # not matched by "layers.1"
    assert device_for("model.norm", "cpu") == torch.device("cpu")
    with pytest.raises(CheckpointError, match=r"no entry for 'model.norm'"):
        device_for("model.norm", dm)


# -- errors that say what to fix --------------------------------------------------------------


def test_missing_shard_is_named_with_what_to_do(fp8_dir, tmp_path):
    broken = Path(shutil.copytree(fp8_dir, tmp_path / "broken"))
    (broken / "layer-002.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"layer-002\.safetensors .*model\.layers\.2\.(?s:.*)Download them"
    ):
        load_streaming(broken, progress=False)


def test_one_index_reader_for_sharded_and_single_file_checkpoints(fp8_dir, tmp_path):
    """Loader, adapter merge and serving copy read the shard map the same way; a rewrite keeps the metadata."""
    stored = json.loads((fp8_dir / INDEX_FILE).read_text())
    assert read_index(fp8_dir) == stored and read_weight_map(fp8_dir) == stored["weight_map"]
    single = tmp_path / "single"
    single.mkdir()
    save_file({"a": torch.zeros(2), "b": torch.ones(1)}, single / "model.safetensors")
    assert read_index(single) == {"weight_map": {"a": "model.safetensors", "b": "model.safetensors"}}
    with pytest.raises(CheckpointError, match=f"has neither {INDEX_FILE} nor model.safetensors"):
        read_weight_map(tmp_path)


def test_tensor_with_unexpected_shape_names_file_tensor_and_shapes(tiny_dir, tmp_path):
    tensors = read_tensors(tiny_dir)
    tensors["model.layers.2.self_attn.q_a_proj.weight"] = torch.zeros(32, 256, dtype=torch.bfloat16)
    bad = write_checkpoint(tmp_path / "bad", tensors, tiny_config(tiny_dir))
    with pytest.raises(
        CheckpointError,
        match=r"layer-002\.safetensors: tensor model\.layers\.2\.self_attn\."
        r"q_a_proj\.weight has shape \(32, 256\).*expects \(64, 256\)",
    ):
        load_streaming(bad, progress=False)


def test_checkpoint_whose_config_does_not_match_is_refused(fp8_dir, tmp_path):
    bad = Path(shutil.copytree(fp8_dir, tmp_path / "bad"))
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(config, n_routed_experts=4)))
    with pytest.raises(
        CheckpointError,
        match=r"do not match its config\.json.*n_routed_experts=4(?s:.*)"
        r"unexpected tensor\(s\), e\.g\. model\.layers\.1\.mlp\.experts\.4",
    ):
        load_streaming(bad, progress=False)


def test_expected_config_differences_are_listed_together(fp8_dir):
    with pytest.raises(
        CheckpointError,
        match=r"num_hidden_layers: expected 61, checkpoint has 3(?s:.*)"
        r"n_routed_experts: expected 256, checkpoint has 8",
    ):
        load_streaming(
            fp8_dir, expect_config={"num_hidden_layers": 61, "n_routed_experts": 256}, progress=False
        )


def test_non_deepseek_checkpoint_points_to_the_other_loader(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type is 'llama'.*load_model"):
        load_streaming(tmp_path, progress=False)


# -- host memory --------------------------------------------------------------------------------

# One MoE layer is ~15 MiB in bf16, the whole model (8 layers) ~115 MiB; ~60M weights to
# quantize keep the test near 10 s on the 2-core CI machine.
BIG = dict(
    model_type="deepseek_v3",
    vocab_size=1024,
    hidden_size=1024,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=8,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_rope_head_dim=32,
    qk_nope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)

RSS_PROBE = r"""
import json, sys, torch
import bitsandbytes.functional as bnbf
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from dsr1kit.model.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from dsr1kit.model.stream_load import load_streaming

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

# warm up what any loader pays once (kernels, thread pools, lazy imports), then reset the high-water mark
w = torch.randn(1024, 1024, dtype=torch.bfloat16)
bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
dequantize_fp8_blocks(*quantize_fp8_blocks(w))
from transformers import GenerationConfig
del w
with torch.device("meta"):
    DeepseekV3ForCausalLM(DeepseekV3Config(num_hidden_layers=1, hidden_size=256, moe_intermediate_size=64,
                                           n_routed_experts=8, n_group=1, topk_group=1))
try:
    open("/proc/self/clear_refs", "w").write("5")
except OSError:
    pass
base = status("VmRSS:")
model = load_streaming(sys.argv[1], progress=False)
peak = status("VmHWM:")
held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
print(json.dumps({"base": base, "peak": peak, "held": held}))
"""


def write_big_checkpoint(out: Path) -> tuple[int, int]:
    """A random FP8 DeepSeek-V3 written layer by layer (the test never holds the whole model).

    Returns (bytes of the largest unit in bf16, bytes of the whole model in bf16).
    """
    from transformers import DeepseekV3Config

    from dsr1kit.model.stream_load import skeleton

    model = skeleton(DeepseekV3Config(**BIG))
    shapes = {}
    for key, t in model.state_dict().items():
        if key.endswith("experts.gate_up_proj") or key.endswith("experts.down_proj"):
            prefix, kind = key.rsplit(".", 1)
            for e in range(t.shape[0]):
                if kind == "gate_up_proj":
                    for part in ("gate", "up"):
                        shapes[f"{prefix}.{e}.{part}_proj.weight"] = (t.shape[1] // 2, t.shape[2])
                else:
                    shapes[f"{prefix}.{e}.down_proj.weight"] = tuple(t.shape[1:])
        else:
            shapes[key] = tuple(t.shape)
    by_shard: dict[str, list[str]] = {}
    for key in shapes:
        by_shard.setdefault(shard_name(key), []).append(key)
    gen = torch.Generator().manual_seed(0)
    unit_bytes = []
    for shard, keys in by_shard.items():
        tensors = {k: (torch.randn(shapes[k], generator=gen) * 0.02).to(torch.bfloat16) for k in keys}
        unit_bytes.append(sum(t.numel() * 2 for t in tensors.values()))
        out.mkdir(parents=True, exist_ok=True)
        save_file(to_fp8(tensors), out / shard, metadata={"format": "pt"})
    weight_map = {}
    for shard in by_shard:
        with safe_open(out / shard, framework="pt") as f:
            weight_map.update({k: shard for k in f.keys()})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(dict(BIG, quantization_config=R1_QUANTIZATION_CONFIG)))
    return max(unit_bytes), sum(unit_bytes)


@pytest.mark.slow
def test_peak_host_memory_is_about_one_layer_not_the_model(tmp_path):
    """Peak RSS above what the loaded NF4 model itself holds stays within two bf16 layers + 40 MiB.

    The whole model in bf16 is larger than that bound, so a loader that ever held the model
    (or kept the shards mapped) would fail; allocator and bitsandbytes temporaries are the slack.
    """
    layer, whole = write_big_checkpoint(tmp_path / "big")
    proc = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(tmp_path / "big")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    transient_bound = 2 * layer + 40 * 2**20
    assert whole > transient_bound + m["held"]  # the test can tell streaming from loading it all
    extra = m["peak"] - m["base"] - m["held"]
    assert extra <= transient_bound, (
        f"peak {m['peak'] / 2**20:.0f} MiB - base {m['base'] / 2**20:.0f} - held {m['held'] / 2**20:.0f} "
        f"= {extra / 2**20:.0f} MiB > {transient_bound / 2**20:.0f} MiB (layer {layer / 2**20:.0f} MiB)"
    )
