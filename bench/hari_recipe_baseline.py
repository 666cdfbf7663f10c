"""The honest baseline: the seed HARI recipe as the field ran it (NF4 + prepare_model_for_kbit_training)
beside bench/hari_step.py's bf16 "recipe" row and the kit's fast path, at several depths.

    python -m bench.hari_recipe_baseline [--layers 8 16] [--seq 4096] [--iters 5] [--out recipe_baseline.json]
    python -m bench.hari_recipe_baseline --device cpu --tiny --layers 2 3 --out /tmp/rb.json   # CPU smoke test

A random-init DeepSeek-V3-architecture model (the widths of bench/hari_step.py: hidden 2048, 64 experts
top-6, MLA, vocab 129,280) with ``--layers`` layers is saved once per depth (bf16, ``save_pretrained``
into ``--workdir``, removed at the end) and loaded from there for each row, one model at a time; LoRA
r=4 (alpha 8) on the last layer's q_a_proj/q_b_proj, lora_B drawn N(0, 0.02) so the KL is not zero.
Batch 1, the second half of the sequence is the assistant (CE) part. Rows, per depth:

field  = the seed recipe as the field ran it: bitsandbytes NF4 (double quant, bf16 compute;
         ``dsr1kit.model.load.quantization_config``), then ``peft.prepare_model_for_kbit_training``
         with its defaults (gradient checkpointing, input grads, every non-4-bit parameter cast to
         fp32: in transformers 5 DeepSeek-V3's routed experts are fused 3-D parameters that
         bitsandbytes does not quantize, so they stay bf16 on load and become fp32 here), then LoRA;
         step = full forward with the adapter + full forward without it (no_grad) + KL(ref‖student)
         at T=1.5 ·T²·λ=0.9 over full [S, V] logits + HF CE on the labels, backward
bf16   = bench/hari_step.py's "recipe": the same step on the bf16 model, no quantization, no
         prepare helper, the embedding output made to require grad (backward through every layer)
fast   = the kit's fast path (``dsr1kit.train.hari.fast_loss``, first layer = the adapted one), bf16

Per row: model GiB after load (and after prepare for the field row), peak GiB during the step (model
included, torch's count) and above the model, median step ms over ``--iters`` steps after
``--warmup``, tokens/s, and step-time ratios (×) against the field row and, for the fast path,
against the bf16 recipe. A row that runs out of GPU memory is recorded as "out of memory". Every row
asserts that the LoRA gradients are present and non-zero after a step. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from dsr1kit.model.load import quantization_config
from dsr1kit.train.hari import fast_loss

from .common import (
    GIB,
    LAMBDA,
    T,
    add_lora,
    check_lora_grads,
    fmt,
    free,
    h2048_config,
    make_batch,
    recipe_loss,
    sync,
    tiny_config,
)

warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5's gradient_checkpointing_* renames
ROWS = ("field", "bf16", "fast")
LABELS = {
    "field": "field recipe (NF4 + prepare_model_for_kbit_training)",
    "bf16": "bf16 recipe",
    "fast": "kit fast path",
}


def make_config(layers: int, tiny: bool):
    if tiny:  # bitsandbytes on CPU: every Linear's in % 64 == 0, out % 32 == 0
        return tiny_config(
            layers, 1, n_shared_experts=2, n_group=4, topk_group=2, max_position_embeddings=1024
        )
    return h2048_config(layers)  # bench/hari_step.py's model


def save_checkpoint(config, folder: Path, device: str) -> int:
    """Random-init bf16 model saved to ``folder``; returns the parameter count."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    n = sum(q.numel() for q in model.parameters())
    model.save_pretrained(folder)
    del model
    free()
    return n


# ---------------------------------------------------------------------------------------------- helpers


def bytes_by_dtype(model) -> dict[str, float]:
    out: dict[str, float] = {}
    for q in model.parameters():
        kind = str(q.dtype).removeprefix("torch.")
        if q.__class__.__name__ == "Params4bit":
            kind = "nf4 (uint8)"
        elif q.dim() == 3:
            kind += " (fused experts)"
        out[kind] = out.get(kind, 0.0) + q.numel() * q.element_size()
    return {k: round(v / GIB, 4) for k, v in sorted(out.items())}


def model_gib(model, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() / GIB
    return sum(q.numel() * q.element_size() for q in list(model.parameters()) + list(model.buffers())) / GIB


def load(folder: Path, row: str, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    kwargs = dict(dtype=dtype, device_map={"": 0} if device == "cuda" else "cpu")
    if row == "field":
        kwargs["quantization_config"] = quantization_config(dtype)
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs)


def no_cpu_repack(model) -> int:
    """bitsandbytes on CPU: a no_grad forward repacks NF4 for AVX512-BF16 and training then gets None grads."""
    import bitsandbytes as bnb

    n = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
            n += 1
    return n


def step(model, batch, row: str, first_layer: int, chunk: int) -> None:
    if row == "field":  # prepare_model_for_kbit_training registered the input-grad hook already
        loss = recipe_loss(model, batch)
    elif row == "bf16":
        handle = model.get_input_embeddings().register_forward_hook(lambda m, i, o: o.requires_grad_(True))
        try:
            loss = recipe_loss(model, batch)
        finally:
            handle.remove()
    else:
        loss = fast_loss(model, batch, LAMBDA, T, first_layer, chunk=chunk).loss
    loss.backward()


def grad_norm(norms: dict[str, float]) -> float:
    return sum(v * v for v in norms.values()) ** 0.5


# ---------------------------------------------------------------------------------------------- rows


def run_row(folder: Path, row: str, batch, args, dtype: torch.dtype) -> dict:
    from peft import prepare_model_for_kbit_training

    dev = args.device
    res: dict = {}
    t0 = time.perf_counter()
    model = load(folder, row, dev, dtype)
    for q in model.parameters():
        q.requires_grad_(False)
    res["load_s"] = round(time.perf_counter() - t0, 1)
    res["model_gib"] = round(model_gib(model, dev), 3)
    res["params_gib_by_dtype"] = bytes_by_dtype(model)
    if row == "field":
        res["linear4bit_modules"] = (
            no_cpu_repack(model)
            if dev == "cpu"
            else sum(type(m).__name__ == "Linear4bit" for m in model.modules())
        )
        model = prepare_model_for_kbit_training(model)  # the defaults, as the recipe calls it
        res["model_after_prepare_gib"] = round(model_gib(model, dev), 3)
        res["params_gib_by_dtype_after_prepare"] = bytes_by_dtype(model)
        res["gradient_checkpointing"] = bool(getattr(model, "is_gradient_checkpointing", False))
        func = next(
            (
                getattr(m, "_gradient_checkpointing_func", None)
                for m in model.modules()
                if getattr(m, "_gradient_checkpointing_func", None) is not None
            ),
            None,
        )
        res["checkpoint_kwargs"] = repr(getattr(func, "keywords", None))  # {} → torch's default (reentrant)
    torch.manual_seed(1)  # the same adapter in every row
    model, plan = add_lora(model)
    res["lora_modules"] = plan.modules
    res["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    first = min(plan.layers)

    # warm-up; the first step also proves that the LoRA weights get gradients
    for i in range(args.warmup):
        step(model, batch, row, first, args.chunk)
        if i == 0:
            res["lora_grad_norm"] = grad_norm(check_lora_grads(model, row))
        model.zero_grad(set_to_none=True)
    sync(dev)
    base = torch.cuda.memory_allocated() if dev == "cuda" else 0
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.iters):
        sync(dev)
        t0 = time.perf_counter()
        step(model, batch, row, first, args.chunk)
        sync(dev)
        times.append(time.perf_counter() - t0)
        if len(times) == args.iters:
            norm = grad_norm(check_lora_grads(model, row))
            res.setdefault("lora_grad_norm", norm)
            res["lora_grads_nonzero"] = True
        model.zero_grad(set_to_none=True)
    t = statistics.median(times)
    res["step_ms"] = round(t * 1e3, 1)
    res["tokens_per_s"] = round(batch["input_ids"].numel() / t, 1)
    if dev == "cuda":
        peak = torch.cuda.max_memory_allocated()
        res["peak_gib"] = round(peak / GIB, 2)
        res["peak_above_model_gib"] = round((peak - base) / GIB, 2)
    else:
        res["peak_gib"] = res["peak_above_model_gib"] = None
    del model
    return res


def run_depth(layers: int, args, workdir: Path, dtype: torch.dtype) -> dict:
    config = make_config(layers, args.tiny)
    folder = workdir / f"layers{layers}"
    t0 = time.perf_counter()
    n_params = save_checkpoint(config, folder, args.device)
    out: dict = {
        "layers": layers,
        "seq": args.seq,
        "params": n_params,
        "save_s": round(time.perf_counter() - t0, 1),
        "rows": {},
    }
    print(f"-- {layers} layers: {n_params / 1e9:.3f}B params, saved in {out['save_s']} s", flush=True)
    batch = make_batch(args.seq, config.vocab_size, args.device)
    for row in ROWS:
        free()
        try:
            res = run_row(folder, row, batch, args, dtype)
        except torch.cuda.OutOfMemoryError as err:
            res = {"error": "out of memory", "detail": str(err).splitlines()[0][:200]}
        free()
        res["label"] = LABELS[row]
        out["rows"][row] = res
        print(f"   {row}: {json.dumps(res)}", flush=True)
    ms = {r: out["rows"][r].get("step_ms") for r in ROWS}
    for r in ROWS:  # how many times faster than the field recipe
        out["rows"][r]["x_vs_field"] = round(ms["field"] / ms[r], 2) if ms["field"] and ms[r] else None
    out["fast_vs_bf16_recipe_x"] = round(ms["bf16"] / ms["fast"], 2) if ms["bf16"] and ms["fast"] else None
    out["fast_vs_field_recipe_x"] = out["rows"]["fast"]["x_vs_field"]
    del batch
    shutil.rmtree(folder, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--seq", type=int, default=None, help="default 4096 (64 with --tiny)")
    ap.add_argument("--iters", type=int, default=None, help="measured steps (default 5; 2 with --tiny)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=1024, help="the fast path's loss chunk")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny widths: a smoke test of the script")
    ap.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="model/compute dtype (float32 only for a CPU smoke test)",
    )
    ap.add_argument("--workdir", default=None, help="checkpoint folder (default: a new temp dir in /tmp)")
    ap.add_argument("--out", default="hari_recipe_baseline.json")
    args = ap.parse_args()
    args.seq = args.seq or (64 if args.tiny else 4096)
    args.iters = args.iters or (2 if args.tiny else 5)
    args.warmup = max(args.warmup, 1)
    dtype = getattr(torch, args.dtype)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --device cpu --tiny for a smoke test")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    import bitsandbytes
    import peft
    import transformers

    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "bitsandbytes": bitsandbytes.__version__,
    }
    print(
        f"{device_name}  seq {args.seq}, batch 1, {args.iters} steps after {args.warmup} warm-up; {versions}"
    )
    own = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="hari_recipe_baseline_", dir="/tmp") if own else args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results = []

    def write():  # after every depth, so a crash at a later depth keeps the earlier results
        Path(args.out).write_text(
            json.dumps(
                {
                    "device": device_name,
                    "versions": versions,
                    "seq": args.seq,
                    "iters": args.iters,
                    "warmup": args.warmup,
                    "tiny": args.tiny,
                    "dtype": args.dtype,
                    "results": results,
                },
                indent=2,
            )
        )

    try:
        for layers in args.layers:
            results.append(run_depth(layers, args, workdir, dtype))
            write()
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(
        "| layers | row | model GiB (after prepare) | peak GiB (above model) | step ms | tokens/s "
        "| × vs field recipe |"
    )
    print("|---:|:---|---:|---:|---:|---:|---:|")
    for d in results:
        for r in ROWS:
            x = d["rows"][r]
            if "error" in x:
                print(f"| {d['layers']} | {x['label']} | {x['error']} | | | | |")
                continue
            mem = f"{x['model_gib']:.4g}"
            if "model_after_prepare_gib" in x:
                mem += f" ({x['model_after_prepare_gib']:.4g})"
            peak = "—" if x["peak_gib"] is None else f"{x['peak_gib']:.2f} ({x['peak_above_model_gib']:.2f})"
            print(
                f"| {d['layers']} | {x['label']} | {mem} | {peak} | {x['step_ms']} | {x['tokens_per_s']} "
                f"| {fmt(x['x_vs_field'])} |"
            )
    print()
    print("| layers | fast vs field recipe × | fast vs bf16 recipe × |")
    print("|---:|---:|---:|")
    for d in results:
        print(f"| {d['layers']} | {fmt(d['fast_vs_field_recipe_x'])} | {fmt(d['fast_vs_bf16_recipe_x'])} |")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
