"""HARI step on one GPU: the recipe vs the kit's naive (fp32 KL) vs fast path, side by side.

    python -m bench.hari_step [--seq 2048 4096 8192] [--layers 8] [--out results.json]

A random-init DeepSeek-V3-architecture model (hidden 2048, 8 layers, 64
experts top-6, MLA, vocab 129,280; ~4.5B parameters, bf16) with LoRA on the
last layer's q_a_proj/q_b_proj (r=4). For each sequence length: median step
time (forward + backward, after warm-up), peak memory above the model, and
ratios against the recipe; the kit's memory plan (``dsr1kit.plan``) for the fast
step beside the measured peak (model + step, torch's count); plus the cosine between the fast path's LoRA
gradients and the naive path's (fp32 KL), the exactness claim of the fast
path. Prints a table and writes JSON.

recipe  = as the field reports ran it: prepare_model_for_kbit_training (which makes the
          embedding output require grad, so backward runs through every layer), a full
          forward with the adapter, a full forward without it (no_grad), full-vocab KL in
          bf16 on [S, V] logits (the fp32 upcast of that helper is left out here)
naive   = the kit's reference: the same, with the KL in fp32
fast    = frozen prefix once under no_grad, last layer twice, chunked fp32 CE+KL
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dsr1kit.train.hari import fast_loss, naive_loss

from .common import (
    CHUNK,
    GIB,
    LAMBDA,
    T,
    add_lora,
    h2048_config,
    make_batch,
    plan_on_gpu0,
    recipe_loss,
    sync,
    timed,
    training_inputs,
)


def build_model(layers: int):
    from transformers import DeepseekV3ForCausalLM

    config = h2048_config(layers)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    for q in model.parameters():
        q.requires_grad_(False)
    return add_lora(model)


def step(model, batch, impl: str, first_layer: int):
    if impl == "recipe":
        handle = model.get_input_embeddings().register_forward_hook(lambda m, i, o: o.requires_grad_(True))
        try:
            loss = recipe_loss(model, batch)
        finally:
            handle.remove()
    elif impl == "naive":
        loss = naive_loss(model, batch, LAMBDA, T).loss
    else:
        loss = fast_loss(model, batch, LAMBDA, T, first_layer, chunk=CHUNK).loss
    loss.backward()


def phases(model, batch, first_layer, reps=3) -> dict[str, float]:
    """Median ms of each phase of the fast path and of the naive path (CUDA-synchronized)."""
    from dsr1kit.train.hari import prefix_forward, run_layers

    def ms(fn):
        return round(timed(fn, "cuda", 0, reps) * 1e3, 1)

    ids, attn = batch["input_ids"], batch["attention_mask"]
    res = {"prefix_no_grad": ms(lambda: prefix_forward(model, batch, first_layer))}
    h, a, k = prefix_forward(model, batch, first_layer)
    res["last_layer_grad"] = ms(lambda: run_layers(model, first_layer, h, a, k))
    with torch.no_grad(), model.disable_adapter():
        res["last_layer_ref"] = ms(lambda: run_layers(model, first_layer, h, a, k))
    res["naive_student_fwd"] = ms(lambda: model(input_ids=ids, attention_mask=attn))
    with torch.no_grad(), model.disable_adapter():
        res["naive_ref_fwd"] = ms(lambda: model(input_ids=ids, attention_mask=attn))
    res["fast_total"] = ms(
        lambda: (
            fast_loss(model, batch, LAMBDA, T, first_layer, chunk=CHUNK).loss.backward(),
            model.zero_grad(set_to_none=True),
        )
    )
    res["naive_total"] = ms(
        lambda: (naive_loss(model, batch, LAMBDA, T).loss.backward(), model.zero_grad(set_to_none=True))
    )
    return res


def lora_grads(model):
    return torch.cat([q.grad.float().reshape(-1) for q in model.parameters() if q.requires_grad])


def measure(model, batch, impl, first_layer, warmup=2, iters=5):
    for _ in range(warmup):
        step(model, batch, impl, first_layer)
        model.zero_grad(set_to_none=True)
    sync("cuda")
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step(model, batch, impl, first_layer)
        sync("cuda")
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / GIB


MODEL_GIB = 0.0  # allocated after the model is built (set in main): the measured peaks are above it


def plan_vs_measured(model, seq: int, fast_peak_above_model_gib: float) -> dict:
    """The kit's plan of this fast step on one GPU against the measured peak (model + step)."""
    plan = plan_on_gpu0(model.config, training_inputs(seq))
    measured = MODEL_GIB + fast_peak_above_model_gib
    planned = plan.peak_gpu_bytes / GIB
    return {
        "plan_peak_gib": round(planned, 2),
        "measured_peak_gib": round(measured, 2),
        "plan_over_measured": round(planned / measured, 3),
        "plan_parts_gib": {k: round(v / GIB, 3) for k, v in plan.devices[0].parts.items()},
    }


def main() -> None:
    global MODEL_GIB
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="hari_step.json")
    args = ap.parse_args()
    model, plan = build_model(args.layers)
    first = min(plan.layers)
    n_params = sum(q.numel() for q in model.parameters())
    MODEL_GIB = torch.cuda.memory_allocated() / GIB
    print(
        f"{torch.cuda.get_device_name()}  model {n_params / 1e9:.2f}B params, "
        f"{torch.cuda.memory_allocated() / GIB:.1f} GiB; LoRA on {plan.modules}"
    )
    results = []
    for seq in args.seq:
        batch = make_batch(seq, 129280, "cuda")
        row = {"seq": seq}
        for impl in ("recipe", "naive", "fast"):
            t, mem = measure(model, batch, impl, first, iters=args.iters)
            row[f"{impl}_ms"], row[f"{impl}_peak_gib"] = round(t * 1e3, 1), round(mem, 2)
        step(model, batch, "naive", first)
        g_naive = lora_grads(model)
        model.zero_grad(set_to_none=True)
        step(model, batch, "fast", first)
        g_fast = lora_grads(model)
        model.zero_grad(set_to_none=True)
        row["grad_cosine"] = float(F.cosine_similarity(g_naive, g_fast, dim=0))
        row["grad_rel_err"] = float((g_naive - g_fast).norm() / g_naive.norm())
        row["speedup_vs_recipe"] = round(row["recipe_ms"] / row["fast_ms"], 2)
        row["memory_ratio_vs_recipe"] = round(row["recipe_peak_gib"] / row["fast_peak_gib"], 2)
        row["speedup_vs_naive"] = round(row["naive_ms"] / row["fast_ms"], 2)
        row["memory_ratio_vs_naive"] = round(row["naive_peak_gib"] / row["fast_peak_gib"], 2)
        row.update(plan_vs_measured(model, seq, row["fast_peak_gib"]))
        row["phases_ms"] = phases(model, batch, first)
        results.append(row)
        print(json.dumps(row), flush=True)
        del batch
        torch.cuda.empty_cache()
    head = (
        f"{'S':>6} {'recipe ms':>10} {'naive ms':>9} {'fast ms':>8} {'×recipe':>8} {'×naive':>7} "
        f"{'recipe GiB':>10} {'naive GiB':>9} {'fast GiB':>8} {'mem×rec':>8} {'cosine':>9}"
    )
    print(head)
    for r in results:
        print(
            f"{r['seq']:>6} {r['recipe_ms']:>10} {r['naive_ms']:>9} {r['fast_ms']:>8} "
            f"{r['speedup_vs_recipe']:>8} {r['speedup_vs_naive']:>7} {r['recipe_peak_gib']:>10} "
            f"{r['naive_peak_gib']:>9} {r['fast_peak_gib']:>8} {r['memory_ratio_vs_recipe']:>8} "
            f"{r['grad_cosine']:>9.6f}"
        )
    print(
        f"{'S':>6} {'plan GiB':>9} {'measured GiB':>13} {'plan/measured':>14}   (fast step, model included)"
    )
    for r in results:
        print(
            f"{r['seq']:>6} {r['plan_peak_gib']:>9} {r['measured_peak_gib']:>13} {r['plan_over_measured']:>14}"
        )
    Path(args.out).write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "params": n_params, "results": results}, indent=2)
    )


if __name__ == "__main__":
    main()
