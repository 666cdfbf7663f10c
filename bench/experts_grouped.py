"""bf16 routed experts, forward + backward: transformers' ``grouped_mm`` forward beside the kit's, in one run.

    python -m bench.experts_grouped --out experts_grouped.json                  # one H100 / H200, R1 widths
    python -m bench.experts_grouped --device cpu --tiny --out /tmp/e.json       # smoke test (CPU)

R1's routed experts (256 × width 2048, hidden 7168, top 8; ``--tiny``: 32 × 256, hidden 1024) in bf16, random
weights, ``--tokens`` tokens routed uniformly at random with float32 routing weights, as the router gives them.
Each way runs the experts forward and the backward to the hidden states and routing weights (the weights
frozen, as in HARI), alternating run by run; the median time per step, the peak memory above the inputs (CUDA)
and whether the outputs and gradients are equal bit for bit are printed, with the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

from bench.common import deepseek_v3_config, is_cuda, r1_config, sync
from dsr1kit.model.experts_grouped import EXPERTS_IMPLEMENTATION

WAYS = {"transformers": "grouped_mm", "kit": EXPERTS_IMPLEMENTATION}


def experts_module(tiny: bool, device: torch.device) -> DeepseekV3Experts:
    tiny_widths = dict(
        hidden_size=1024, moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=8
    )
    config = deepseek_v3_config(**tiny_widths) if tiny else r1_config(1)
    config._experts_implementation = "grouped_mm"
    with torch.device(device):
        experts = DeepseekV3Experts(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.02).requires_grad_(False)
    return experts


def routed(experts, tokens: int, device: torch.device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    c = experts.config
    hidden = torch.randn(tokens, c.hidden_size, generator=g, device=device).to(torch.bfloat16)
    scores = torch.rand(tokens, c.n_routed_experts, generator=g, device=device)
    weights, index = scores.topk(c.num_experts_per_tok, dim=-1)
    grad = torch.randn(tokens, c.hidden_size, generator=g, device=device).to(torch.bfloat16)
    return hidden, index, weights, grad


def step(experts, way: str, hidden, index, weights, grad):
    experts.config._experts_implementation = WAYS[way]
    h, w = hidden.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    out = experts(h, index, w)
    out.backward(grad)
    return out.detach(), h.grad, w.grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    experts = experts_module(args.tiny, device)
    inputs = routed(experts, args.tokens, device)
    results = {way: step(experts, way, *inputs) for way in WAYS}  # warm-up, and what each way computes
    equal = {
        name: torch.equal(a, b)
        for name, a, b in zip(
            ("output", "hidden grad", "weights grad"), results["transformers"], results["kit"]
        )
    }
    del results
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    peaks: dict[str, float | None] = {way: None for way in WAYS}
    for _ in range(args.iters):
        for way in WAYS:
            sync(device)
            if is_cuda(device):
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            step(experts, way, *inputs)
            sync(device)
            times[way].append(time.perf_counter() - t0)
            if is_cuda(device):
                peaks[way] = round((torch.cuda.max_memory_allocated(device) - base) / 2**30, 3)
    ms = {way: round(statistics.median(ts) * 1e3, 2) for way, ts in times.items()}
    record = {
        "device": torch.cuda.get_device_name(device) if is_cuda(device) else "cpu",
        "widths": "tiny" if args.tiny else "R1",
        "tokens": args.tokens,
        "ms_forward_backward": ms,
        "peak_gib_above_inputs": peaks,
        "speedup": round(ms["transformers"] / ms["kit"], 3),
        "bit_for_bit": equal,
    }
    print(json.dumps(record, indent=1))
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
