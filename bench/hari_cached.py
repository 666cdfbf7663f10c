"""HARI with a prefix cache on one GPU: the cached step, the full-depth step and the prefix pass, at R1's widths.

    python -m bench.hari_cached --out hari_cached.json                   # one H200, S=4096 (< 5 min)
    python -m bench.hari_cached --seq 4096 --full-layers 8 --iters 5 --warmup 2 --out hari_cached.json
    python -m bench.hari_cached --device cpu --tiny --out /tmp/hc.json   # smoke test of every code path

The hidden state entering the first adapted (LoRA) layer depends on the sample
only, so a forward-only *prefix pass* computes it once and writes it to a cache;
training then runs just the adapted layer + final norm + lm_head from the
cached hidden states. Random-init DeepSeek-V3 with R1's real widths (hidden
7168, 256 routed experts × 2048 top-8, 1 shared expert, n_group 8 / topk_group
4, MLA q_lora 1536 / kv_lora 512 / rope 64 / nope 128 / v 128, 128 heads,
vocab 129,280, dense intermediate 18432), every weight materialized directly on
the GPU unit by unit (never a full model on the host). One run measures:

1. **cached step** — a model with ONE MoE decoder layer (num_hidden_layers=1,
   first_k_dense_replace=0) + final norm + lm_head (bf16), entered at
   ``inputs_embeds`` with a random bf16 hidden state [1, S, 7168] (first_layer=0);
   the kit's HARI fast path (``fast_loss``: λ=0.9, T=1.5, KL over all tokens, CE
   on the second half, chunk 1024), LoRA r=4 on the layer's q_a_proj/q_b_proj
   (lora_B drawn N(0, 0.02) so both LoRA factors get gradients), batch 1.
   Two variants: routed experts as transformers' plain fused bf16 parameters
   (~22.5 GB) and as ``NF4Experts``. In BOTH variants the layer's other linears
   (attention, shared expert) stay bf16 and the router fp32; lm_head is bf16.
   The embedding table is not materialized (a 1-row placeholder): a model
   entered at ``inputs_embeds`` never reads it.
2. **full-depth step** — the kit's uncached fast step (prefix under no_grad,
   last layer twice, chunked CE/KL) on ``--full-layers`` layers (3 dense + MoE),
   built by ``bench.common.build`` as bench/hari_multigpu.py builds, on 1 GPU: NF4 experts, bitsandbytes
   NF4 linears, bf16 embeddings / lm_head, fp32 router. Beside it, a constant
   from an EARLIER run (not measured here): 61 layers on 4 H200s, 2,133.6 ms per
   4096-token step = 1,920 tokens/s per step = 480 tokens/s per GPU.
3. **prefix pass** — the same full-depth model (nothing freed in between),
   ``prefix_forward(model, batch, first_layer=last_layer)`` from input_ids
   (forward only, no_grad) for [1, S], [4, S] and [1, 4S] tokens; also up to
   the first MoE layer (embeddings + dense layers only), which splits the time
   into dense and MoE layers and extrapolates to R1's 60-layer prefix
   (3 dense + 57 MoE). Bytes per token written to the cache: hidden × 2 (bf16).

Each timing: median of ``--iters`` after ``--warmup``, CUDA-synchronized.
Step = forward + backward (no optimizer). Memory: torch.cuda.memory_allocated
after the build, max_memory_allocated after a reset at the start of the part.
Every step variant asserts that each LoRA parameter's gradient is non-None and
non-zero. CUDA OOM is caught per part (per shape for the prefix) and recorded.
Random weights route tokens about uniformly over the experts (every expert
active at S=4096); real routing is more skewed, which changes NF4's
dequantization work little (all experts are touched either way).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from dsr1kit.model.lora import decoder_layers
from dsr1kit.train.hari import HariLoss, hari_loss, prefix_forward, reference_states

from .common import (
    CHUNK,
    LAMBDA,
    LORA,
    T,
    add_lora,
    allocated_gib,
    build,
    check_lora_grads,
    empty_cache,
    fmt,
    free,
    is_cuda,
    labels_for,
    peak_gib,
    r1_config,
    reset_peak,
    sync,
    timed,
    tiny_config,
)

TARGET_TOKENS_PER_S_PER_GPU = 25_000
EARLIER_61 = {
    "source": "earlier run, not measured here",
    "layers": 61,
    "gpus": 4,
    "seq": 4096,
    "step_ms": 2133.6,
    "tokens_per_s": 1920.0,
    "tokens_per_s_per_gpu": 480.0,
}
R1_PREFIX = {"layers": 60, "dense": 3, "moe": 57}  # layers below R1's last (61st) layer


# -- configs and the build -----------------------------------------------------------------


def make_config(layers: int, tiny: bool, cached: bool):
    """Cached: one MoE layer. Full depth: first 3 dense (1 in tiny mode), then MoE."""
    if tiny:
        return tiny_config(layers, 0 if cached else min(1, layers - 1))
    config = r1_config(layers)
    if cached:
        config.first_k_dense_replace = 0
    return config


def build_one_device(
    config, device: torch.device, experts: str, linears: str, embed: bool, kit_experts: bool = True
):
    """``common.build`` on one device, then ``LORA`` with a trained-looking lora_B.

    ``embed=False`` leaves a 1-row placeholder for the embedding table.
    """
    units = (["model.embed_tokens"] if embed else []) + [
        f"model.layers.{i}" for i in range(config.num_hidden_layers)
    ]
    model = build(
        config,
        {u: device for u in units + ["model.norm", "lm_head"]},
        experts=experts,
        linears=linears,
        kit_experts=kit_experts,
    )
    return add_lora(model)


def oom_types() -> tuple[type[BaseException], ...]:
    return (torch.cuda.OutOfMemoryError,)


# -- the HARI step ---------------------------------------------------------------------------


def cached_batch(config, seq: int, device: torch.device, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(1, seq, config.hidden_size, generator=g, device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=g, device=device)
    return {"inputs_embeds": hidden, "attention_mask": torch.ones_like(ids), "labels": labels_for(ids)}


def token_batch(
    config, shape: tuple[int, int], device: torch.device, seed: int = 0, labels: bool = True
) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, shape, generator=g, device=device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if labels:
        batch["labels"] = labels_for(ids)
    return batch


# the reference's last hidden states read from a cache instead of run in the step (``reference_route``)
REFERENCE: dict[str, torch.Tensor | None] = {"states": None}
# the step's loss config; ``vocab_route`` is set by ``vocab_route`` (bench.cached_step_profile compares them)
STEP_LOSS = {
    "config": HariLoss(lambda_kl=LAMBDA, kl_temperature=T, kl_tokens="all", loss_chunk=CHUNK, impl="fast")
}


def hari_step(model, batch, first_layer: int) -> None:
    loss = hari_loss(model, batch, STEP_LOSS["config"], first_layer, ref_hidden=REFERENCE["states"])
    loss.loss.backward()


def vocab_route(name: str) -> None:
    """A switch for ``cached_step_profile.compare_routes``: the step's loss over the vocabulary by ``name``
    (``HariLoss.vocab_route``: torch ops, the fused kernel, or auto)."""
    STEP_LOSS["config"] = replace(STEP_LOSS["config"], vocab_route=name)


def reference_route(model, batch, first_layer: int):
    """A switch for ``cached_step_profile.compare_routes``: ``in-step`` runs the adapted layers a second time with
    the adapter off (today's step); ``cached`` hands the step this batch's reference states, computed once here
    as a reference cache would hold them."""
    states = reference_states(model, batch, first_layer)

    def switch(name: str) -> None:
        REFERENCE["states"] = states if name == "cached" else None

    return switch


def measure_step(model, batch, first_layer: int, seq: int, device, warmup: int, iters: int) -> dict:
    hari_step(model, batch, first_layer)  # first step: check the gradients (untimed, counts as warm-up)
    n_lora = len(check_lora_grads(model, f"step from layer {first_layer}"))
    model.zero_grad(set_to_none=True)

    def one():
        hari_step(model, batch, first_layer)
        model.zero_grad(set_to_none=True)

    step = timed(one, device, max(warmup - 1, 0), iters)
    return {
        "step_ms": round(step * 1e3, 1),
        "tokens_per_s": round(seq / step, 1),
        "lora_tensors_with_grad": n_lora,
    }


# -- the three parts ------------------------------------------------------------------------------


def part_cached(args, device, experts: str) -> dict:
    row = {"part": "cached", "experts": experts, "linears": "bf16", "layers": 1, "seq": args.seq, "batch": 1}
    free(device)
    model = batch = None
    try:
        t0 = time.perf_counter()
        config = make_config(1, args.tiny, cached=True)
        model, plan = build_one_device(config, device, experts=experts, linears="bf16", embed=False)
        sync(device)
        row.update(
            build_s=round(time.perf_counter() - t0, 1),
            gib_after_build=allocated_gib(device),
            lora_modules=plan.modules,
            experts_module=type(decoder_layers(model)[0].mlp.experts).__name__,
            attn_implementation=config._attn_implementation,
            experts_implementation=getattr(config, "_experts_implementation", None),
        )
        batch = cached_batch(config, args.seq, device)
        reset_peak(device)
        row.update(measure_step(model, batch, min(plan.layers), args.seq, device, args.warmup, args.iters))
        row["peak_gib"] = peak_gib(device)
    except oom_types() as e:
        row["error"] = f"OOM: {str(e).splitlines()[0]}"
    finally:
        del model, batch
        free(device)
    return row


def part_full_and_prefix(args, device) -> tuple[dict, list[dict]]:
    full = {
        "part": "full_depth",
        "experts": "nf4",
        "linears": "nf4",
        "layers": args.full_layers,
        "seq": args.seq,
        "batch": 1,
    }
    prefix_rows: list[dict] = []
    free(device)
    model = batch = None
    try:
        t0 = time.perf_counter()
        config = make_config(args.full_layers, args.tiny, cached=False)
        model, plan = build_one_device(config, device, experts="nf4", linears="nf4", embed=True)
        sync(device)
        full.update(
            build_s=round(time.perf_counter() - t0, 1),
            gib_after_build=allocated_gib(device),
            dense_layers=config.first_k_dense_replace,
            lora_modules=plan.modules,
            experts_module=type(decoder_layers(model)[-1].mlp.experts).__name__,
        )
    except oom_types() as e:
        full["error"] = f"OOM in build: {str(e).splitlines()[0]}"
        del model
        free(device)
        return full, [{"part": "prefix", "error": "no model (full-depth build failed)"}]
    last = min(plan.layers)
    try:  # part 2
        batch = token_batch(config, (1, args.seq), device)
        reset_peak(device)
        full.update(measure_step(model, batch, last, args.seq, device, args.warmup, args.iters))
        full["peak_gib"] = peak_gib(device)
    except oom_types() as e:
        full["error"] = f"OOM: {str(e).splitlines()[0]}"
    del batch
    gc.collect()
    empty_cache(device)
    try:  # part 3: same model, frozen layers below the last one
        stops = [("all_below_last", last)]
        if 0 < config.first_k_dense_replace < last:
            stops.append(("dense_only", config.first_k_dense_replace))
        for shape in args.prefix_shapes:
            for what, stop in stops:
                prefix_rows.append(measure_prefix(model, config, shape, what, stop, device, args))
    finally:
        del model
        free(device)
    return full, prefix_rows


def measure_prefix(model, config, shape, what: str, stop: int, device, args) -> dict:
    b, s = shape
    tokens = b * s
    row = {"part": "prefix", "shape": [b, s], "tokens": tokens, "stop": what, "layers_run": stop}
    batch = None
    try:
        batch = token_batch(config, (b, s), device, seed=tokens, labels=False)
        reset_peak(device)
        with torch.no_grad():
            t = timed(lambda: prefix_forward(model, batch, first_layer=stop), device, args.warmup, args.iters)
        row.update(
            ms=round(t * 1e3, 1),
            tokens_per_s_per_gpu=round(tokens / t, 1),
            layer_tokens_per_s_per_gpu=round(tokens * stop / t, 1),
            ms_per_layer_per_4096_tokens=round(t * 1e3 / stop * 4096 / tokens, 2),
            peak_gib=peak_gib(device),
        )
    except oom_types() as e:
        row["error"] = f"OOM: {str(e).splitlines()[0]}"
    finally:
        batch = None  # not ``del``: the timed closure reads the name
        gc.collect()
        empty_cache(device)
    return row


def prefix_extrapolation(prefix_rows: list[dict], dense_layers: int, layers_run: int) -> list[dict]:
    """Per shape: dense and MoE layer time from the two stops; R1's 60-layer prefix, tokens/s per GPU.

    tokens/s per GPU of a prefix spread over N GPUs (each with its share of layers, pipelined)
    = tokens / (time of all 60 layers at one GPU's rate).
    """
    out = []
    for shape in dict.fromkeys(tuple(r["shape"]) for r in prefix_rows if "shape" in r):  # in run order
        by = {r["stop"]: r for r in prefix_rows if tuple(r.get("shape", ())) == shape and "ms" in r}
        if "all_below_last" not in by:
            continue
        tokens = shape[0] * shape[1]
        full_ms = by["all_below_last"]["ms"]
        uniform = tokens * layers_run / full_ms * 1e3 / R1_PREFIX["layers"]
        row = {
            "shape": list(shape),
            "tokens": tokens,
            "r1_60_uniform_tokens_per_s_per_gpu": round(uniform, 1),
        }
        n_moe = layers_run - dense_layers
        if "dense_only" in by and n_moe > 0:
            dense_ms = by["dense_only"]["ms"]  # embeddings + dense layers
            moe_layer_ms = (full_ms - dense_ms) / n_moe
            r1_ms = dense_ms / dense_layers * R1_PREFIX["dense"] + moe_layer_ms * R1_PREFIX["moe"]
            row.update(
                dense_layer_ms=round(dense_ms / dense_layers, 2),
                moe_layer_ms=round(moe_layer_ms, 2),
                r1_60_split_ms=round(r1_ms, 1),
                r1_60_split_tokens_per_s_per_gpu=round(tokens / r1_ms * 1e3, 1),
            )
        out.append(row)
    return out


# -- report --------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=None, help="tokens per step (default 4096; 64 with --tiny)")
    ap.add_argument("--full-layers", type=int, default=8)
    ap.add_argument(
        "--prefix-shapes",
        nargs="+",
        default=None,
        help="BxS batches of the prefix pass (default 1xSEQ 4xSEQ 1x(4·SEQ))",
    )
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (smoke test, e.g. with --device cpu)")
    ap.add_argument("--skip-nf4-cached", action="store_true")
    ap.add_argument("--out", default="hari_cached.json")
    args = ap.parse_args()
    args.seq = args.seq or (64 if args.tiny else 4096)
    shapes = args.prefix_shapes or [f"1x{args.seq}", f"4x{args.seq}", f"1x{4 * args.seq}"]
    args.prefix_shapes = [tuple(int(x) for x in s.lower().split("x")) for s in shapes]
    device = torch.device(args.device)
    if is_cuda(device):
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    t_start = time.perf_counter()
    name = torch.cuda.get_device_name(device) if is_cuda(device) else "cpu"
    print(
        f"{name}  {'TINY widths' if args.tiny else 'R1 widths'}  S={args.seq}  "
        f"full-depth layers={args.full_layers}  iters={args.iters} warmup={args.warmup}",
        flush=True,
    )

    cached = [part_cached(args, device, "bf16")]
    print(json.dumps(cached[-1]), flush=True)
    if args.skip_nf4_cached:
        cached.append({"part": "cached", "experts": "nf4", "skipped": "--skip-nf4-cached"})
    else:
        cached.append(part_cached(args, device, "nf4"))
    print(json.dumps(cached[-1]), flush=True)
    full, prefix_rows = part_full_and_prefix(args, device)
    print(json.dumps(full), flush=True)
    for r in prefix_rows:
        print(json.dumps(r), flush=True)
    dense = full.get("dense_layers", 0)
    extrap = (
        prefix_extrapolation(prefix_rows, dense, args.full_layers - 1) if "gib_after_build" in full else []
    )

    hidden = 128 if args.tiny else 7168
    cache_bytes_per_token = hidden * 2
    bf16 = cached[0]
    tps = bf16.get("tokens_per_s")
    ratios = {
        "cached_bf16_over_full_depth_here": round(tps / full["tokens_per_s"], 1)
        if tps and full.get("tokens_per_s")
        else None,
        "cached_bf16_over_earlier_61_layer_per_gpu": round(tps / EARLIER_61["tokens_per_s_per_gpu"], 1)
        if tps
        else None,
        "cached_nf4_over_full_depth_here": round(cached[1]["tokens_per_s"] / full["tokens_per_s"], 1)
        if cached[1].get("tokens_per_s") and full.get("tokens_per_s")
        else None,
    }
    target = {
        "tokens_per_s_per_gpu": TARGET_TOKENS_PER_S_PER_GPU,
        "seq": 4096,
        "measured_seq": args.seq,
        "meaningful": (not args.tiny) and is_cuda(device) and args.seq == 4096,
        "met": bool(tps and tps >= TARGET_TOKENS_PER_S_PER_GPU),
    }

    print("\n### 1–2. HARI step, batch 1, S =", args.seq, "(forward + backward, no optimizer)\n")
    print("| step | layers | experts | linears | step ms | tokens/s (per GPU) | GiB after build | peak GiB |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    for r in [*cached, full]:
        label = "cached (from inputs_embeds)" if r["part"] == "cached" else "full depth, uncached"
        if "step_ms" in r:
            print(
                f"| {label} | {r['layers']} | {r['experts']} | {r['linears']} | {r['step_ms']} | "
                f"{r['tokens_per_s']:,.0f} | {fmt(r.get('gib_after_build'))} | {fmt(r.get('peak_gib'))} |"
            )
        else:
            print(
                f"| {label} | {r.get('layers', '')} | {r.get('experts', '')} | {r.get('linears', '')} | "
                f"{r.get('error') or r.get('skipped')} | | {fmt(r.get('gib_after_build'))} | |"
            )
    e = EARLIER_61
    print(
        f"| full depth, earlier run, NOT measured here ({e['gpus']} H200) | {e['layers']} | nf4 | nf4 | "
        f"{e['step_ms']:,} | {e['tokens_per_s']:,.0f} per step = {e['tokens_per_s_per_gpu']:,.0f} per GPU | | |"
    )

    print(
        f"\n### 3. Prefix pass (forward only, no_grad, from input_ids), full-depth model of "
        f"{args.full_layers} layers\n"
    )
    print(
        "| batch | tokens | layers run | ms | tokens/s per GPU | layer·tokens/s per GPU | "
        "ms per layer per 4096 tokens | peak GiB |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in prefix_rows:
        if "ms" in r:
            print(
                f"| {r['shape'][0]}×{r['shape'][1]} | {r['tokens']} | {r['layers_run']} ({r['stop']}) | {r['ms']} | "
                f"{r['tokens_per_s_per_gpu']:,.0f} | {r['layer_tokens_per_s_per_gpu']:,.0f} | "
                f"{r['ms_per_layer_per_4096_tokens']} | {fmt(r.get('peak_gib'))} |"
            )
        else:
            print(
                f"| {'×'.join(map(str, r.get('shape', [])))} | {r.get('tokens', '')} | {r.get('stop', '')} | "
                f"{r.get('error')} | | | | |"
            )
    if extrap:
        print("\nExtrapolation to R1's 60-layer prefix (3 dense + 57 MoE), tokens/s per GPU:\n")
        print(
            "| batch | uniform (layer·tokens/s ÷ 60) | dense layer ms | MoE layer ms | split estimate ms | "
            "split estimate tokens/s per GPU |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for x in extrap:
            print(
                f"| {x['shape'][0]}×{x['shape'][1]} | {x['r1_60_uniform_tokens_per_s_per_gpu']:,.0f} | "
                f"{fmt(x.get('dense_layer_ms'))} | {fmt(x.get('moe_layer_ms'))} | {fmt(x.get('r1_60_split_ms'))} | "
                f"{fmt(x.get('r1_60_split_tokens_per_s_per_gpu'), ',.0f')} |"
            )
    print(
        f"\nCache written per token: hidden {hidden} × 2 B (bf16) = {cache_bytes_per_token:,} B "
        f"({cache_bytes_per_token * 1e6 / 1e9:.1f} GB per million tokens)"
    )

    print("\n### Ratios\n")
    print(
        f"- cached bf16 tokens/s ÷ full-depth ({args.full_layers} layers) tokens/s measured here: "
        f"{fmt(ratios['cached_bf16_over_full_depth_here'])}×"
    )
    print(
        f"- cached nf4 tokens/s ÷ full-depth tokens/s measured here: "
        f"{fmt(ratios['cached_nf4_over_full_depth_here'])}×"
    )
    print(
        f"- cached bf16 tokens/s per GPU ÷ 480 tokens/s per GPU (61 layers, 4 H200, earlier run, not measured "
        f"here): {fmt(ratios['cached_bf16_over_earlier_61_layer_per_gpu'])}×"
    )
    verdict = "MET" if target["met"] else "NOT met"
    note = "" if target["meaningful"] else "  (not meaningful: tiny widths / CPU / S ≠ 4096)"
    print(
        f"- target ≥ {TARGET_TOKENS_PER_S_PER_GPU:,} tokens/s per GPU for the cached bf16 step at S=4096: "
        f"{fmt(tps, ',.0f')} at S={args.seq} → {verdict}{note}"
    )
    wall = round(time.perf_counter() - t_start, 1)
    print(f"\nwall {wall} s")

    Path(args.out).write_text(
        json.dumps(
            {
                "device": name,
                "tiny": args.tiny,
                "seq": args.seq,
                "iters": args.iters,
                "warmup": args.warmup,
                "lambda_kl": LAMBDA,
                "temperature": T,
                "kl_tokens": "all",
                "loss_chunk": CHUNK,
                "lora_r": LORA.r,
                "cached": cached,
                "full_depth": full,
                "prefix": prefix_rows,
                "prefix_r1_extrapolation": extrap,
                "cache_bytes_per_token": cache_bytes_per_token,
                "earlier_61_layer": EARLIER_61,
                "ratios": ratios,
                "target": target,
                "wall_s": wall,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
