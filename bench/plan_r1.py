"""The kit's memory plan against measured peaks at R1 widths: the cached HARI step and a prefix-pass micro-batch.

    python -m bench.plan_r1 --out plan_r1.json                                  # one H100 or H200 (~1 min with builds)
    python -m bench.plan_r1 --reference in-step --out p.json                    # as results/plan_r1.h100.json was run
    python -m bench.plan_r1 --experts bf16 --grid 1x4096,1x16384 --out p.json   # a part of the grid
    python -m bench.plan_r1 --replan plan_r1.json --out plan_r1.json            # the plan again, on a CPU
    python -m bench.plan_r1 --device cpu --tiny --out /tmp/p.json               # smoke test (no measured peaks)

For each experts kind (``--experts``) and each batch × seq of ``--grid``:

- **cached step**: what a training rank runs from the prefix cache, as
  bench/hari_cached.py runs it: a model of ONE MoE decoder layer + final norm
  + lm_head (R1 widths, random weights built on the GPU), entered at
  ``inputs_embeds`` with a random bf16 hidden state [batch, seq, 7168]; the
  kit's HARI fast path (λ=0.9, T=1.5, KL over all tokens, CE on the second
  half, loss chunk 1024), LoRA r=4 on q_a_proj/q_b_proj; forward + backward,
  no optimizer. ``--reference cached`` (the default, as the kit runs with a
  reference cache) computes the batch's reference states first and holds
  them through the step, which then reads them; ``in-step`` runs the adapted
  layer a second time with the adapter off. Beside it the kit's plan of that
  step: ``hari_plan_for_config`` with ``from_prefix_cache``
  (``_cached_hari_plan``), batch_size × max_len.
- **prefix micro-batch**: one micro-batch of the prefix pass, forward only
  under no_grad, from input_ids: ``prefix_forward`` through the embeddings,
  one dense layer and one MoE layer of a 3-layer model (dense, MoE, MoE; the
  pass stops at the last layer, the adapted one). Beside it
  ``prefix_pass_plan`` of that 3-layer model with ``prefix_tokens_per_batch``
  = batch × seq.

Experts kinds: ``bf16`` (everything bf16) and ``nf4`` (NF4 experts and NF4
linears, lm_head and embeddings bf16, the router fp32), as the kit loads
them: ``cached_layers_nf4`` and ``quantization: nf4`` + ``quantize_experts``.

Measured: ``torch.cuda.max_memory_allocated`` after a reset, the model
included, of the second step (the first one warms up and checks that every
LoRA factor got a gradient). A third step runs with hooks that split the peak
by phase (attention / MLP of each layer call, the loss, the backward), to see
which term of the plan is off. The plan's ``runtime`` row (CUDA context and
workspaces outside torch's count) is left out, as in the other plan tables.
CUDA OOM is caught and recorded per row. On a CPU nothing is measured (the
rows carry the plan only). ``--replan`` recomputes the plan columns of a
measured JSON with the kit's current formulas (no model is built).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from dsr1kit.model.load import LoadConfig
from dsr1kit.model.lora import decoder_layers
from dsr1kit.plan import GIB, Machine, hari_plan_for_config, prefix_pass_plan
from dsr1kit.plan.inventory import inventory, strip_quantization
from dsr1kit.train.hari import fast_loss, prefix_forward, reference_states

from .common import (
    CHUNK,
    LAMBDA,
    T,
    allocated_gib,
    build,
    check_lora_grads,
    free,
    is_cuda,
    labels_for,
    peak_gib,
    r1_config,
    reset_peak,
    sync,
    tiny_config,
    training_inputs,
)
from .hari_cached import REFERENCE, build_one_device, hari_step

GRID = "1x2048,1x4096,2x4096,1x8192,4x4096,1x16384"
# the bf16 experts forward the loaders run by default, which the plan models (Workload.kit_experts)
KIT_EXPERTS = LoadConfig.__dataclass_fields__["kit_experts"].default
H200_BYTES = 139.8 * GIB  # what torch reports for an H200 (the plan's "fits" only; the rows do not use it)


# -- configs and the plan ----------------------------------------------------------------------------


def config_for(what: str, tiny: bool):
    """cached: one MoE layer. prefix: dense, MoE, MoE (the pass runs the first two)."""
    layers, dense = (1, 0) if what == "cached" else (3, 1)
    if tiny:
        return tiny_config(layers, dense)
    config = r1_config(layers)
    config.first_k_dense_replace = dense
    return config


def plan_inputs(what: str, experts: str, batch: int, seq: int):
    nf4 = experts == "nf4"
    base = training_inputs(seq, quantization="nf4" if nf4 else "none", quantize_experts=nf4)
    return replace(
        base,
        batch_size=batch,
        from_prefix_cache=what == "cached",
        cached_layers_nf4=nf4 and what == "cached",
        prefix_tokens_per_batch=batch * seq,
    )


def plan_of(what: str, experts: str, batch: int, seq: int, tiny: bool, gpu_bytes: float) -> dict:
    """The kit's plan of the row: its GPU's parts (GiB) without the runtime row, the total and the phase."""
    config = config_for(what, tiny)
    machine = Machine(1, gpu_bytes, 0.0, "bench GPU")
    inputs = plan_inputs(what, experts, batch, seq)
    if what == "cached":
        plan = hari_plan_for_config(config, machine, inputs)
    else:
        plan = prefix_pass_plan(
            inputs, machine, inventory(strip_quantization(copy.deepcopy(config))), advise=False
        )
    gpu = next(d for d in plan.devices if d.name.startswith("gpu"))
    parts = {k: round(v / GIB, 3) for k, v in gpu.parts.items() if k != "runtime"}
    return {"plan_gib": round(sum(parts.values()), 3), "plan_parts_gib": parts, "plan_phase": gpu.phase}


# -- measuring -------------------------------------------------------------------------------------------


class Phases:
    """Peak and allocated memory between hook marks: each segment's peak is where the step spends it."""

    def __init__(self, device):
        self.device, self.marks, self.handles, self.calls = device, [], [], {}

    def mark(self, name: str) -> None:
        sync(self.device)
        self.marks.append(
            {
                "until": name,
                "peak_gib": peak_gib(self.device, 3),
                "allocated_gib": allocated_gib(self.device, 3),
            }
        )
        reset_peak(self.device)

    def watch(self, module, label: str) -> None:
        def pre(_m, _a):
            n = self.calls.get(label, 0) + 1
            self.calls[label] = n
            self.mark(f"{label}#{n} in")

        def post(_m, _a, _o):
            self.mark(f"{label}#{self.calls[label]} out")

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def watch_layers(self, model) -> None:
        for i, layer in enumerate(decoder_layers(model)):
            self.watch(layer.self_attn, f"layer{i}.attn")
            self.watch(layer.mlp, f"layer{i}.mlp")

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def oom_types() -> tuple[type[BaseException], ...]:
    return (torch.cuda.OutOfMemoryError,)


def cached_batch(config, batch: int, seq: int, device) -> dict:
    g = torch.Generator(device=device).manual_seed(seq + batch)
    hidden = torch.randn(batch, seq, config.hidden_size, generator=g, device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g, device=device)
    return {"inputs_embeds": hidden, "attention_mask": torch.ones_like(ids), "labels": labels_for(ids)}


def token_batch(config, batch: int, seq: int, device) -> dict:
    g = torch.Generator(device=device).manual_seed(seq + batch)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g, device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def measure_cached(model, config, batch: int, seq: int, device, reference: str = "in-step") -> dict:
    """The step's peak; with ``reference="cached"`` the batch's reference states are computed first and held
    (as the step holds those read from the reference cache), so the peak counts them."""
    data = cached_batch(config, batch, seq, device)
    ref_hidden = reference_states(model, data, 0) if reference == "cached" else None
    REFERENCE["states"] = ref_hidden
    try:
        return _measure_cached(model, data, batch, seq, device, ref_hidden)
    finally:
        REFERENCE["states"] = None


def _measure_cached(model, data, batch: int, seq: int, device, ref_hidden) -> dict:
    hari_step(model, data, 0)  # warm-up, and the proof that it trains
    check_lora_grads(model, f"cached {batch}x{seq}")
    model.zero_grad(set_to_none=True)
    free(device)
    reset_peak(device)
    t0 = time.perf_counter()
    hari_step(model, data, 0)
    sync(device)
    out = {"measured_gib": peak_gib(device, 3), "step_ms": round((time.perf_counter() - t0) * 1e3, 1)}
    model.zero_grad(set_to_none=True)
    free(device)
    phases = Phases(device)
    phases.watch_layers(model)
    norm = model.get_base_model().model.norm if hasattr(model, "get_base_model") else model.model.norm
    phases.watch(norm, "final_norm")
    try:
        phases.mark("start")
        loss = fast_loss(model, data, LAMBDA, T, 0, kl_tokens="all", chunk=CHUNK, ref_hidden=ref_hidden).loss
        phases.mark("loss computed")
        loss.backward()
        phases.mark("backward done")
    finally:
        phases.remove()
        model.zero_grad(set_to_none=True)
    out["phases"] = _squash(phases.marks)
    return out


def measure_prefix(model, config, batch: int, seq: int, device) -> dict:
    data = token_batch(config, batch, seq, device)
    stop = config.num_hidden_layers - 1
    with torch.no_grad():
        prefix_forward(model, data, first_layer=stop)  # warm-up
        free(device)
        reset_peak(device)
        t0 = time.perf_counter()
        prefix_forward(model, data, first_layer=stop)
        sync(device)
        out = {"measured_gib": peak_gib(device, 3), "ms": round((time.perf_counter() - t0) * 1e3, 1)}
        free(device)
        phases = Phases(device)
        phases.watch_layers(model)
        try:
            phases.mark("start")
            prefix_forward(model, data, first_layer=stop)
            phases.mark("end")
        finally:
            phases.remove()
    out["phases"] = _squash(phases.marks)
    return out


def _squash(marks: list[dict]) -> list[dict]:
    """Segments (the first mark only resets): the peak reached before each mark, and what is held at it."""
    return marks[1:]


# -- the run ------------------------------------------------------------------------------------------------


def build_for(what: str, experts: str, config, device, kit_experts: bool):
    linears = "nf4" if experts == "nf4" else "bf16"
    if what == "cached":
        model, _ = build_one_device(
            config, device, experts=experts, linears=linears, embed=False, kit_experts=kit_experts
        )
        return model
    units = ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(config.num_hidden_layers)]
    model = build(
        config,
        {u: device for u in units + ["model.norm", "lm_head"]},
        experts=experts,
        linears=linears,
        kit_experts=kit_experts,
    )
    model.eval()
    return model


def run_part(what: str, experts: str, grid, args, device, gpu_bytes: float) -> list[dict]:
    rows = [
        {
            "experts": experts,
            "what": what,
            "batch": b,
            "seq": s,
            "tokens": b * s,
            **plan_of(what, experts, b, s, args.tiny, gpu_bytes),
        }
        for b, s in grid
    ]
    config = config_for(what, args.tiny)
    free(device)
    model = None
    try:
        t0 = time.perf_counter()
        model = build_for(what, experts, config, device, args.kit_experts)
        sync(device)
        build_s, after_build = round(time.perf_counter() - t0, 1), allocated_gib(device, 3)
    except oom_types() as e:
        for r in rows:
            r["error"] = f"OOM in build: {str(e).splitlines()[0]}"
        del model
        free(device)
        return rows
    for r in rows:
        r.update(build_s=build_s, gib_after_build=after_build)
        try:
            if what == "cached":
                r["reference"] = args.reference
                r.update(measure_cached(model, config, r["batch"], r["seq"], device, args.reference))
            else:
                r.update(measure_prefix(model, config, r["batch"], r["seq"], device))
            if r["measured_gib"]:
                r["plan_over_measured"] = round(r["plan_gib"] / r["measured_gib"], 3)
            else:
                r["measured"] = "skipped: a CPU has no peak counter (the step ran; plan only)"
        except oom_types() as e:
            r["error"] = f"OOM: {str(e).splitlines()[0]}"
        finally:
            gc.collect()
            free(device)
        print(json.dumps({k: v for k, v in r.items() if k != "phases"}), flush=True)
    del model
    free(device)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| experts | batch × seq | tokens | what | plan GiB | measured GiB | plan / measured | plan peaks in |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        what = "cached step" if r["what"] == "cached" else "prefix micro-batch"
        measured = r.get("measured_gib")
        ratio = r.get("plan_over_measured")
        lines.append(
            f"| {r['experts']} | {r['batch']} × {r['seq']} | {r['tokens']:,} | {what} | {r['plan_gib']:.2f} | "
            f"{'%.2f' % measured if measured is not None else r.get('error') or 'not measured'} | "
            f"{'%.3f' % ratio if ratio is not None else '—'} | {r.get('plan_phase') or '—'} |"
        )
    return "\n".join(lines)


def replan(path: str, out: str) -> None:
    data = json.loads(Path(path).read_text())
    # the bf16 experts' forward the rows were measured with (files from before the key: transformers'); the
    # plan models the loaders' default
    if data.get("kit_experts", False) != KIT_EXPERTS:
        print(
            f"note: {path} was measured with kit_experts={data.get('kit_experts', False)}; the plan models the "
            f"loaders' default, kit_experts={KIT_EXPERTS}"
        )
    for r in data["rows"]:
        r.update(plan_of(r["what"], r["experts"], r["batch"], r["seq"], data["tiny"], data["gpu_bytes"]))
        if r.get("measured_gib"):
            r["plan_over_measured"] = round(r["plan_gib"] / r["measured_gib"], 3)
    data["replanned"] = (
        "plan columns recomputed on a CPU from the kit's current formulas; measurements unchanged"
    )
    print(table(data["rows"]))
    Path(out).write_text(json.dumps(data, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (smoke test, e.g. with --device cpu)")
    ap.add_argument("--experts", default="bf16,nf4")
    ap.add_argument(
        "--grid", default=None, help=f"batch x seq points (default {GRID}; 1x64,2x64 with --tiny)"
    )
    ap.add_argument("--what", default="cached,prefix", help="cached, prefix or both")
    ap.add_argument(
        "--reference",
        default="cached",
        choices=("cached", "in-step"),
        help="the cached step's KL reference: read from its cache (the kit's default) or run in the step",
    )
    ap.add_argument(
        "--kit-experts",
        action=argparse.BooleanOptionalAction,
        default=KIT_EXPERTS,
        help="bf16 experts through the kit's grouped forward (dsr1kit.model.experts_grouped), as the loaders "
        "run them by default (LoadConfig.kit_experts); --no-kit-experts: transformers' grouped_mm forward "
        "(the plan models the default either way)",
    )
    ap.add_argument("--replan", default=None, help="a measured JSON: recompute its plan columns (no GPU)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.replan:
        replan(args.replan, args.out)
        return
    grid = [
        tuple(int(x) for x in p.lower().split("x"))
        for p in (args.grid or ("1x64,2x64" if args.tiny else GRID)).split(",")
    ]
    device = torch.device(args.device)
    if is_cuda(device):
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
        gpu_bytes = float(torch.cuda.get_device_properties(device).total_memory)
        name = torch.cuda.get_device_name(device)
    else:
        gpu_bytes, name = H200_BYTES, "cpu (plan only: nothing measured)"
    torch.manual_seed(0)
    t_start = time.perf_counter()
    print(f"{name}  {'TINY widths' if args.tiny else 'R1 widths'}  grid {grid}", flush=True)
    rows: list[dict] = []

    def save(done: bool) -> None:  # after every part, so a run stopped by a time limit keeps what it measured
        record = {
            "device": name,
            "tiny": args.tiny,
            "gpu_bytes": gpu_bytes,
            "torch": torch.__version__,
            "measured": is_cuda(device),
            "complete": done,
            "kit_experts": args.kit_experts,
            "rows": rows,
            "wall_s": round(time.perf_counter() - t_start, 1),
        }
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")

    for experts in args.experts.split(","):
        for what in args.what.split(","):
            rows += run_part(what, experts, grid, args, device, gpu_bytes)
            save(False)
    save(True)
    print()
    print(table(rows))
    print(f"\nwall {round(time.perf_counter() - t_start, 1)} s")


if __name__ == "__main__":
    main()
