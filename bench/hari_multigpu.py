"""HARI fast path on R1-width layers spread over the GPUs of one node: placement and scaling.

    python -m bench.hari_multigpu --layers 24 --gpus 8 --seq 4096 --out hari_multigpu.json
    python -m bench.hari_multigpu --layers 4 --gpus 1            # what one H200 holds

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
import json
import time
from pathlib import Path

import torch

from dsr1kit.model import placement
from dsr1kit.model.load import dispatch_across_gpus
from dsr1kit.train.hari import fast_loss

from .common import CHUNK, GIB, LAMBDA, T, add_lora, build, free, labels_for, r1_config, timed


def build_placed(layers: int, n_gpus: int, scheme: str):
    """R1 widths, each unit materialized, initialized and quantized (NF4) on the GPU ``scheme`` gives it."""
    config = r1_config(layers)
    dm = placement.device_map(config, n_gpus, scheme)
    model = build(
        config, {unit: torch.device("cuda", d) for unit, d in dm.items()}, experts="nf4", linears="nf4"
    )
    dispatch_across_gpus(model, dm)
    model, plan = add_lora(model, trained_looking=False)
    return model, plan, dm


def per_gpu(fn) -> list[float]:
    return [round(fn(i) / GIB, 2) for i in range(torch.cuda.device_count())]


def run(layers: int, n_gpus: int, scheme: str, seq: int, iters: int) -> dict:
    free()  # the previous configuration's model (accelerate hooks hold reference cycles)
    t0 = time.perf_counter()
    model, plan, dm = build_placed(layers, n_gpus, scheme)
    torch.cuda.synchronize()
    row = {
        "placement": scheme,
        "gpus": n_gpus,
        "layers": layers,
        "seq": seq,
        "build_s": round(time.perf_counter() - t0, 1),
        "boundary_crossings": placement.boundary_crossings(dm),
        "layers_per_gpu": [
            sum(1 for k, v in dm.items() if k.startswith("model.layers.") and v == g) for g in range(n_gpus)
        ],
        "memory_after_load_gib": per_gpu(torch.cuda.memory_allocated),
    }
    ids = torch.randint(0, 129280, (1, seq), device=f"cuda:{dm['model.embed_tokens']}")
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels_for(ids)}
    for i in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(i)

    def one():
        fast_loss(model, batch, LAMBDA, T, min(plan.layers), chunk=CHUNK).loss.backward()
        model.zero_grad(set_to_none=True)

    step = timed(one, None, 2, iters)  # synchronizes the current GPU, as the step ends there
    row.update(
        step_ms=round(step * 1e3, 1),
        tokens_per_s=round(seq / step, 1),
        peak_memory_gib=per_gpu(torch.cuda.max_memory_allocated),
    )
    model = batch = None  # not ``del``: the timed closure reads the names
    free()
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
        print(
            f"{r['placement']:>12} {r['gpus']:>4} {str(r['layers_per_gpu']):>24} {r['step_ms']:>8} "
            f"{r['tokens_per_s']:>8}  {r['peak_memory_gib']}"
        )
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
