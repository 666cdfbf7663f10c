"""HARI fast path on R1-width layers spread over the GPUs of one node: placement and scaling.

    python bench/hari_multigpu.py --layers 24 --gpus 8 --seq 4096 --out hari_multigpu.json
    python bench/hari_multigpu.py --layers 4 --gpus 1            # what one H200 holds

A random-init DeepSeek-V3 with R1's real widths (hidden 7168, 256 experts
top-8 × 2048, MLA 1536/512/64/128/128, vocab 129,280, first 3 layers dense)
and ``--layers`` decoder layers is materialized one layer at a time on the GPU
the kit's explicit device_map gives it; routed experts go to NF4
(``NF4Experts``), other linears to bitsandbytes NF4, lm_head and the router
stay in full precision. Then, for each placement (contiguous blocks vs the
recipe's ``i % n_gpus``): per-GPU memory after load and at the peak of a HARI
fast-path step (LoRA on the last layer's q_a_proj/q_b_proj, λ=0.9, T=1.5),
median step time and tokens/s at ``--seq``. No checkpoint is written: 24
R1-width layers would be ~270 GB even in FP8, more than the machine's disk.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dsr1kit.model import placement  # noqa: E402
from dsr1kit.model.load import dispatch_across_gpus  # noqa: E402
from dsr1kit.model.lora import apply_lora  # noqa: E402
from dsr1kit.train.hari import fast_loss  # noqa: E402

GiB = 2**30


def r1_config(layers: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=layers, first_k_dense_replace=min(3, layers - 1), num_attention_heads=128,
        num_key_value_heads=128, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8,
        topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=16384,
        tie_word_embeddings=False, use_cache=False,
    )


def _quantize_linears(module: torch.nn.Module, device) -> None:
    import bitsandbytes as bnb

    from dsr1kit.model.stream_load import _nf4_linear

    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, _nf4_linear(child, child.weight.data, device, torch.bfloat16))
        elif not isinstance(child, bnb.nn.Linear4bit):
            _quantize_linears(child, device)


def _init_(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                t.fill_(1.0)
            elif "e_score_correction_bias" in name:
                t.zero_()
            elif t.is_floating_point():
                t.normal_(std=0.02)


def build(layers: int, n_gpus: int, scheme: str):
    """Skeleton on meta, then each unit materialized, initialized and quantized on its GPU."""
    from transformers import DeepseekV3ForCausalLM

    from dsr1kit.model.experts_nf4 import keep_routing_fp32, quantize_experts_

    config = r1_config(layers)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    model.to(torch.bfloat16)  # still on meta: each unit then materializes in bf16, never in fp32 (2x transient)
    dm = placement.device_map(config, n_gpus, scheme)
    for unit, device in dm.items():
        module = model.get_submodule(unit)
        module.to_empty(device=f"cuda:{device}")
        _init_(module)
        if unit.startswith("model.layers."):
            quantize_experts_(module)
            _quantize_linears(module, torch.device("cuda", device))
        torch.cuda.empty_cache()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config).to(f"cuda:{dm['model.rotary_emb']}")
    keep_routing_fp32(model)
    model.is_loaded_in_4bit = True
    for q in model.parameters():
        q.requires_grad_(False)
    dispatch_across_gpus(model, dm)
    p = SimpleNamespace(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_last_k_layers=1, lora_targets=[])
    model, plan = apply_lora(model, p)
    model.train()
    return model, plan, dm


def per_gpu(fn) -> list[float]:
    return [round(fn(i) / GiB, 2) for i in range(torch.cuda.device_count())]


def run(layers: int, n_gpus: int, scheme: str, seq: int, iters: int) -> dict:
    gc.collect()  # the previous configuration's model (accelerate hooks hold reference cycles)
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    model, plan, dm = build(layers, n_gpus, scheme)
    torch.cuda.synchronize()
    row = {"placement": scheme, "gpus": n_gpus, "layers": layers, "seq": seq,
           "build_s": round(time.perf_counter() - t0, 1),
           "boundary_crossings": placement.boundary_crossings(dm),
           "layers_per_gpu": [sum(1 for k, v in dm.items() if k.startswith("model.layers.") and v == g)
                              for g in range(n_gpus)],
           "memory_after_load_gib": per_gpu(torch.cuda.memory_allocated)}
    ids = torch.randint(0, 129280, (1, seq), device=f"cuda:{dm['model.embed_tokens']}")
    labels = ids.clone()
    labels[:, : seq // 2] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    for i in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(i)
    times = []
    for i in range(iters + 2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fast_loss(model, batch, 0.9, 1.5, min(plan.layers), chunk=1024).loss.backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t)
    step = statistics.median(times)
    row.update(step_ms=round(step * 1e3, 1), tokens_per_s=round(seq / step, 1),
               peak_memory_gib=per_gpu(torch.cuda.max_memory_allocated))
    del model, batch
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--gpus", type=int, nargs="+", default=None, help="GPU counts to compare (default: all)")
    ap.add_argument("--placements", nargs="+", default=["contiguous", "round_robin"])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="hari_multigpu.json")
    args = ap.parse_args()
    counts = args.gpus or [torch.cuda.device_count()]
    rows = []
    for n in counts:
        for scheme in args.placements if n > 1 else ["contiguous"]:
            row = run(args.layers, n, scheme, args.seq, args.iters)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"{'placement':>12} {'gpus':>4} {'layers/GPU':>24} {'step ms':>8} {'tok/s':>8}  peak GiB per GPU")
    for r in rows:
        print(f"{r['placement']:>12} {r['gpus']:>4} {str(r['layers_per_gpu']):>24} {r['step_ms']:>8} "
              f"{r['tokens_per_s']:>8}  {r['peak_memory_gib']}")
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
