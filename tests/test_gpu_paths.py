"""The CUDA paths R1 takes, on the tiny DeepSeek-V3: NF4 + bf16 + device_map, fast == naive, a real training run.

Skipped without CUDA (tests/conftest.py), so CI on CPU stays green; run on a GPU node with
``pytest -m gpu`` (docs/benchmarks.md records the last run, on an H100).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hari_support import adapted_model_and_batch

from dsr1kit import params
from dsr1kit.train.hari import fast_loss, naive_loss

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.gpu


def _qlora_on_cuda():
    p = params.HariParams(quantization="nf4", dtype="bfloat16", device_map="contiguous", lora_last_k_layers=1)
    return adapted_model_and_batch(p, n_rows=4, max_len=128)


def _grads(model, parts) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    parts.loss.backward()
    grads = [q.grad for q in model.parameters() if q.requires_grad]
    assert all(g is not None for g in grads), "a LoRA parameter got no gradient"
    return torch.cat([g.float().reshape(-1) for g in grads])


def test_nf4_model_is_quantized_on_cuda_with_fp32_routing():
    model, _, batch = _qlora_on_cuda()
    import bitsandbytes as bnb

    linears4 = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert linears4 and all(m.weight.device.type == "cuda" for m in linears4)
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    seen: list[torch.dtype] = []
    hooks = [
        g.register_forward_hook(
            lambda _m, _i, out: seen.append((out[0] if isinstance(out, tuple) else out).dtype)
        )
        for g in gates
    ]
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    for h in hooks:
        h.remove()
    # routing in fp32: bf16 logits change the chosen experts
    assert gates and seen and set(seen) == {torch.float32}


def test_fast_equals_naive_on_cuda_nf4_bf16():
    model, plan, batch = _qlora_on_cuda()
    naive = naive_loss(model, batch, 0.9, 1.5, "all")
    g_naive = _grads(model, naive)
    fast = fast_loss(model, batch, 0.9, 1.5, min(plan.layers), "all", chunk=64)
    g_fast = _grads(model, fast)
    assert abs(float(fast.loss) - float(naive.loss)) <= 1e-2 * abs(float(naive.loss))
    cosine = float(torch.nn.functional.cosine_similarity(g_fast, g_naive, dim=0))
    assert cosine >= 0.999, f"LoRA gradient cosine fast vs naive {cosine:.6f} (bf16 weights)"


def test_qlora_training_run_on_cuda(tmp_path):
    """`python -m dsr1kit train` with NF4 on the GPU: PagedAdamW8bit, per-GPU peak memory, a learned adapter."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsr1kit",
            "train",
            "-f",
            "params/tiny/20_hari_training.yaml",
            "--run-dir",
            str(run_dir),
            "-p",
            "quantization",
            "nf4",
            "-p",
            "dtype",
            "bfloat16",
            "-p",
            "device_map",
            "contiguous",
            "-p",
            "max_steps",
            "6",
            "-p",
            "log_every",
            "2",
            "-p",
            "sample_limit",
            "64",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows and all("cuda:0" in r["peak_memory_gib"] for r in rows)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert json.loads((run_dir / "run_info.json").read_text())["optimizer"] == "PagedAdamW8bit"
    from safetensors.torch import load_file

    tensors = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    lora_b = [t for k, t in tensors.items() if "lora_B" in k]
    assert lora_b and all(t.abs().sum() > 0 for t in lora_b)  # it learned (lora_B starts at zero)


def _train_on_cuda(run_dir: Path, *extra: str) -> list[dict]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsr1kit",
            "train",
            "-f",
            "params/tiny/20_hari_training.yaml",
            "--run-dir",
            str(run_dir),
            "-p",
            "dtype",
            "bfloat16",
            "-p",
            "device_map",
            "contiguous",
            "-p",
            "max_steps",
            "6",
            "-p",
            "log_every",
            "1",
            "-p",
            "sample_limit",
            "64",
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("cached_nf4", [False, True])
def test_training_from_a_prefix_cache_built_with_nf4_experts_on_cuda(tmp_path, cached_nf4):
    """R1's way: the prefix pass on the NF4 model (linears and experts), training from the cache with the adapted
    layer in bf16 (default) or NF4, on cuda:0, with PagedAdamW8bit; the first step's loss is the uncached one's."""
    nf4 = ["-p", "quantization", "nf4", "-p", "quantize_experts", "true"]
    plain = _train_on_cuda(tmp_path / "plain", *nf4)
    cached = _train_on_cuda(
        tmp_path / "cached",
        *nf4,
        "-p",
        "prefix_cache",
        str(tmp_path / "cache"),
        "-p",
        "cached_layers_nf4",
        str(cached_nf4).lower(),
    )
    info = json.loads((tmp_path / "cached" / "run_info.json").read_text())
    assert info["optimizer"] == "PagedAdamW8bit" and info["model"]["placement"] == "cuda:0"
    assert info["model"]["quantize_experts"] is cached_nf4 and info["prefix_cache"]["dtype"] == "bfloat16"
    assert all("cuda:0" in r["peak_memory_gib"] for r in cached)
    # step 1 starts from the same weights: with an NF4 adapted layer the loss is the uncached (NF4) one up to bf16
    # noise; with the layer in bf16 it is the better-precision layer, so only close
    tolerance = 2e-2 if cached_nf4 else 1e-1
    assert abs(cached[0]["loss"] - plain[0]["loss"]) <= tolerance * plain[0]["loss"], (cached[0], plain[0])
    from safetensors.torch import load_file

    lora_b = [
        t
        for k, t in load_file(tmp_path / "cached" / "adapter" / "adapter_model.safetensors").items()
        if "lora_B" in k
    ]
    assert lora_b and all(t.abs().sum() > 0 for t in lora_b)
