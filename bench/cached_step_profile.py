"""Where the cached HARI step's time goes at R1 widths: the CUDA kernels of one step, largest first.

    python -m bench.cached_step_profile --out cached_profile.json            # one H200 (~1 min)
    python -m bench.cached_step_profile --experts nf4 --out cached_profile.nf4.json
    python -m bench.cached_step_profile --device cpu --tiny --out /tmp/c.json  # smoke test

The step is bench.hari_cached's cached step (one R1-width MoE layer, final norm
and lm_head from a [1, S, 7168] bf16 hidden state; λ=0.9, T=1.5, KL over all
tokens, CE on the second half, LoRA r=4 on q_a/q_b; forward + backward, no
optimizer). After warm-up, ``--iters`` steps run under torch.profiler; each
kernel's device time per step is listed, and summed per kind (GEMMs, attention,
the loss's work over the vocabulary, copies and elementwise, the rest), beside
the step's wall time and the arithmetic it needs.

Before the profile, the step is timed without the profiler (median of
``--time-iters``) with the loss over the vocabulary computed each way
(``dsr1kit.train.vocab_loss``: the torch ops, then the fused kernel), the two
alternating run by run, so their ratio comes from one run on one GPU; and with the
reference's last hidden states run in the step (the adapted layers a second time,
adapter off) or handed to it as a reference cache would; and with bf16 experts
run by transformers' ``grouped_mm`` forward or the kit's (``--compare`` picks).
With ``reference`` compared, the profile shows the step with the reference
read from the cache, as the kit runs it by default; the experts are the kit's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.common import free, layer_compiler, peak_gib, reset_peak, sync
from bench.hari_cached import (
    build_one_device,
    cached_batch,
    hari_step,
    make_config,
    reference_route,
    vocab_route,
)
from dsr1kit.model.experts_grouped import EXPERTS_IMPLEMENTATION

KINDS = (
    ("gemm", ("gemm", "cutlass", "xmma", "sm90_", "nvjet", "_mm", "matmul", "gemv")),
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("softmax / loss over the vocabulary", ("softmax", "log_softmax", "nll", "cross_entropy", "logsumexp")),
    ("copies and casts", ("copy", "cat", "index", "gather", "scatter", "fill", "memcpy", "memset")),
    ("elementwise and reductions", ("elementwise", "reduce", "vectorized", "unrolled")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, marks in KINDS:
        if any(m in low for m in marks):
            return kind
    return "other"


# what can be timed two ways in one run: the loss over the vocabulary (HariLoss.vocab_route)
ROUTES = {
    "loss": (vocab_route, ("torch", "fused")),
}


def experts_route(model):
    """A switch for ``compare_routes``: bf16 experts through transformers' ``grouped_mm`` forward, or the kit's
    (``dsr1kit.model.experts_grouped``: the rows back in token order before the fp32 routing weights)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model

    def switch(name: str) -> None:
        base.set_experts_implementation("grouped_mm" if name == "transformers" else EXPERTS_IMPLEMENTATION)

    return switch


def compare_routes(which: str, model, batch, first: int, device, iters: int, routes=None) -> dict:
    """Median step time each way (``ROUTES[which]``, or ``routes``: the old way, then the new one), runs
    alternating, and how far the LoRA gradients of one step each way differ."""
    if iters <= 0 or device.type != "cuda":  # the fused kernels run on CUDA only
        return {}
    set_route, names = routes or ROUTES[which]
    seq = batch["inputs_embeds"].shape[0] * batch["inputs_embeds"].shape[1]
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up, the fused kernel's compilation (and tuning) included
        set_route(name)
        hari_step(model, batch, first)
        model.zero_grad(set_to_none=True)
    for _ in range(iters):
        for name in names:
            set_route(name)
            sync(device)
            t0 = time.perf_counter()
            hari_step(model, batch, first)
            sync(device)
            times[name].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    grads = {}
    for name in names:  # the LoRA gradients of one step each way: the fused kernel changes no gradient
        set_route(name)
        hari_step(model, batch, first)
        grads[name] = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
    set_route("auto")
    out = {}
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        out[name] = {"ms_per_step": round(ms, 2), "tokens_per_s": round(seq / ms * 1e3, 1)}
    old, fused = names
    out["fused_speedup"] = round(out[old]["ms_per_step"] / out[fused]["ms_per_step"], 3)
    diff = (grads[fused] - grads[old]).norm() / grads[old].norm()
    out["lora_grad_rel_diff"] = float(diff)
    out["lora_grad_cosine"] = float(torch.nn.functional.cosine_similarity(grads[fused], grads[old], dim=0))
    print(json.dumps({"timed_without_profiler": {which: out}}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--seq", type=int, default=0)
    ap.add_argument("--experts", default="bf16", choices=("bf16", "nf4"))
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--time-iters", type=int, default=10, help="timed steps per loss route (0: no timing)")
    ap.add_argument(
        "--compare",
        default="loss,reference",
        help="what to time two ways: loss (torch | fused), reference "
        "(run in the step | read from a cache), experts (bf16 experts: transformers' grouped_mm forward | the kit's)",
    )
    ap.add_argument(
        "--compile", action="store_true", help="also time the adapted layers through torch.compile"
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    seq = args.seq or (64 if args.tiny else 4096)
    config = make_config(1, args.tiny, cached=True)
    model, plan = build_one_device(config, device, experts=args.experts, linears="bf16", embed=False)
    batch = cached_batch(config, seq, device)
    first = min(plan.layers)
    for _ in range(3):
        hari_step(model, batch, first)
        model.zero_grad(set_to_none=True)
    compare = {c.strip() for c in args.compare.split(",") if c.strip()}
    unknown = compare - {"loss", "reference", "experts"}
    if unknown:
        raise SystemExit(f"--compare: unknown {sorted(unknown)}; choose from loss, reference, experts")
    routes = {}
    if "loss" in compare:
        routes["loss"] = compare_routes("loss", model, batch, first, device, args.time_iters)
    if "reference" in compare:
        switch = reference_route(model, batch, first)
        routes["reference"] = compare_routes(
            "reference", model, batch, first, device, args.time_iters, (switch, ("in-step", "cached"))
        )
        switch("cached")  # the profile shows the kit's step: the reference read from its cache (the default)
    if "experts" in compare and args.experts == "bf16":
        switch = experts_route(model)
        routes["experts"] = compare_routes(
            "experts", model, batch, first, device, args.time_iters, (switch, ("transformers", "kit"))
        )
        switch("kit")  # the profile shows the kit's experts forward (the default)
    if args.compile:  # the adapted layers eager, then through torch.compile (the fused loss as set)
        switch = layer_compiler(model, first)
        routes["compile"] = compare_routes(
            "compile", model, batch, first, device, args.time_iters, (switch, ("eager", "compiled"))
        )
        switch("compiled")  # the profile shows what is left once compiled
    free(device)
    reset_peak(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.iters):
            hari_step(model, batch, first)
            model.zero_grad(set_to_none=True)
        sync(device)
    wall_ms = (time.perf_counter() - t0) / args.iters * 1e3
    # the device's own events only: an op on the host (aten::mm, an autograd node) reports the time of the
    # kernels it launched as its device time too, so counting it would count those kernels again
    events = [
        e
        for e in prof.key_averages()
        if getattr(e, "device_time_total", 0) > 0 and e.device_type != torch.autograd.DeviceType.CPU
    ]
    kernels = sorted(
        (
            {
                "kernel": e.key[:100],
                "kind": kind_of(e.key),
                "ms_per_step": round(e.device_time_total / args.iters / 1e3, 3),
                "calls_per_step": e.count // args.iters,
            }
            for e in events
        ),
        key=lambda r: -r["ms_per_step"],
    )
    by_kind: dict[str, float] = {}
    for k in kernels:
        by_kind[k["kind"]] = round(by_kind.get(k["kind"], 0.0) + k["ms_per_step"], 3)
    launches = sum(k["calls_per_step"] for k in kernels)
    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "experts": args.experts,
        "compiled": args.compile,
        "reference": "cached" if "reference" in compare else "in-step",
        "seq": seq,
        "wall_ms_per_step": round(wall_ms, 2),
        "tokens_per_s": round(seq / wall_ms * 1e3, 1),
        "kernel_ms_per_step": round(sum(k["ms_per_step"] for k in kernels), 2),
        "launches_per_step": launches,
        "peak_gib": peak_gib(device),
        "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "timed_without_profiler": routes,
    }
    print(json.dumps(summary, indent=1))
    for k in kernels[:30]:
        print(json.dumps(k))
    Path(args.out).write_text(json.dumps({"summary": summary, "kernels": kernels}, indent=1) + "\n")


if __name__ == "__main__":
    main()
