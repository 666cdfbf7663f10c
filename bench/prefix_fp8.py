"""The prefix pass in FP8 as R1 stores it, beside NF4 and bf16, one R1-width layer at a time.

    python -m bench.prefix_fp8 --out prefix_fp8.json               # one H200 (~3 min incl. builds, tuning)
    python -m bench.prefix_fp8 --device cpu --tiny --out /tmp/p.json   # smoke test of every code path

One decoder layer with R1's real widths (hidden 7168, MLA with 128 heads,
256 routed experts of width 2048 top-8 + 1 shared, or the dense MLP of width
18432 for the dense layers), random N(0, 0.02) weights, built on the GPU. Its
linears and routed experts are quantized as R1 ships them (e4m3, 128×128
block scales), and the same layer is run three ways, forward only under
no_grad as the prefix pass runs it:

- **fp8**: ``FP8Linear`` / ``FP8Experts`` as the prefix pass runs them: the
  dense linears through torch's block-scaled ``scaled_mm`` (a bf16 GEMM of the
  dequantized operands where it refuses the shape), the routed experts
  through the kit's grouped Triton GEMM
  (activations quantized per token and 128-column group);
- **fp8-lean**: the fp8 layer with the prefix pass's leaner forward
  (``prefix_layer``: query, key and value in the GEMMs' own layout, the
  residual add and RMSNorm in one pass), which the FP8 prefix pass runs;
- **fp8-lean-kernels**: fp8-lean with the rotary/key kernel and the router
  kernel (``rope_kernels``, ``router_kernels``), as the loader sets the lean
  layers by default (``LoadConfig.prefix_kernels``); fp8-lean runs without them;
- **nf4-lean**: the nf4 layer with that forward, to show what it would give
  the NF4 path (which keeps transformers' forward);
- **nf4**: today's prefix pass, NF4 experts (``NF4Experts``) and bitsandbytes
  NF4 linears, from the bf16 weights below;
- **fp8-compiled** (``--compile``): the fp8 layer through ``torch.compile``
  (dynamic shapes), which fuses the copies and elementwise kernels between
  its GEMMs;
- **bf16**: the reference, every FP8 weight dequantized to bf16 (what the
  streaming loader does without NF4).

For each of 1×4096 and 4×4096 tokens: the layer's median time (``--iters``
after ``--warmup``, CUDA-synchronized), tokens/s, peak memory, and each path's
error against the bf16 reference on the same input, ‖out_path − out_ref‖ / ‖out_ref‖,
of the layer's output (the hidden state the cache stores), and the same for
the concatenated outputs of its attention and MLP (the layer's own
contribution, which the residual stream would otherwise dilute). The kernels are also
checked against their float32 emulation (``reference_linear``,
``FP8Experts.reference``), which computes the same quantized products.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
from pathlib import Path

import torch

from bench.common import build, free, peak_gib, quantize_linears_, r1_config, reset_peak, timed, tiny_config
from dsr1kit.model import fp8_compute
from dsr1kit.model.experts_nf4 import NF4Experts
from dsr1kit.model.fp8 import dequantize_fp8_blocks
from dsr1kit.model.fp8_compute import FP8Experts, FP8Linear
from dsr1kit.model.prefix_layer import LEAN, lean_prefix_layers_


@contextlib.contextmanager
def lean_forward(layer: torch.nn.Module, on: bool = True, kernels: bool = False):
    """The layer with the prefix pass's leaner forward (its classes swapped), with or without its rotary/key and
    router kernels (fp8-lean-kernels, fp8-lean), put back afterwards."""
    if not on:
        yield
        return
    lean_prefix_layers_(layer, kernels=kernels)
    try:
        yield
    finally:
        original = {lean: plain for plain, lean in LEAN.items()}
        for module in layer.modules():
            module.__class__ = original.get(type(module), type(module))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def one_layer_model(kind: str, tiny: bool, device: torch.device):
    """A 1-layer model (the layer, final norm, rotary; lm_head unused) whose layer is MoE or dense."""
    dense = 1 if kind == "dense" else 0
    config = tiny_config(1, dense) if tiny else r1_config(1)
    config.first_k_dense_replace = dense
    config._attn_implementation = "sdpa"
    units = ["model.layers.0", "model.norm", "lm_head"]
    return build(config, {u: device for u in units}, experts="bf16", linears="bf16"), config


def dequantize_from_(bf16: torch.nn.Module, fp8: torch.nn.Module) -> None:
    """Every weight of ``bf16`` set to its FP8 twin's dequantized value: the reference of the same FP8 weights."""
    with torch.no_grad():
        for name, module in fp8.named_modules():
            if isinstance(module, FP8Linear):
                target = bf16.get_submodule(name)
                target.weight.copy_(dequantize_fp8_blocks(module.weight, module.weight_scale_inv))
            elif isinstance(module, FP8Experts):
                target, i, p = bf16.get_submodule(name), module.intermediate_dim, module.padded_dim
                for e in range(module.num_experts):
                    gu = dequantize_fp8_blocks(module.gate_up[e], module.gate_up_scale_inv[e])
                    target.gate_up_proj[e] = torch.cat([gu[:i], gu[p : p + i]])
                    target.down_proj[e] = dequantize_fp8_blocks(module.down[e], module.down_scale_inv[e])


def kernel_checks(layer_fp8: torch.nn.Module, hidden: torch.Tensor) -> dict:
    """Kernels against their float32 emulation on the layer's own weights (GPU only)."""
    out = {}
    x = hidden.reshape(-1, hidden.shape[-1])
    with torch.no_grad():
        for name, module in layer_fp8.named_modules():
            if isinstance(module, FP8Linear) and module.in_features == x.shape[-1]:
                ref = fp8_compute.reference_linear(x, module.weight, module.weight_scale_inv)
                out[f"linear {name} vs emulation"] = rel(module(x), ref)
            elif isinstance(module, FP8Experts):
                top_k = layer_fp8.mlp.gate.top_k
                g = torch.Generator(device=x.device).manual_seed(1)
                index = torch.stack(
                    [
                        torch.randperm(module.num_experts, generator=g, device=x.device)[:top_k]
                        for _ in range(len(x))
                    ]
                )
                weights = torch.rand(index.shape, generator=g, device=x.device)
                out[f"experts {name} vs emulation"] = rel(
                    module(x, index, weights), module.reference(x, index, weights)
                )
    return {k: round(v, 6) for k, v in out.items()}


def measure(args, kind: str, device: torch.device) -> list[dict]:
    model, config = one_layer_model(kind, args.tiny, device)
    layer = model.model.layers[0]
    fp8_layer = copy.deepcopy(layer)
    replaced = fp8_compute.to_fp8_(fp8_layer)
    dequantize_from_(layer, fp8_layer)  # the bf16 reference now holds exactly the FP8 weights
    nf4_layer = copy.deepcopy(layer)
    if kind == "moe":
        nf4_layer.mlp.experts = NF4Experts.from_experts(nf4_layer.mlp.experts)
    quantize_linears_(nf4_layer, device)
    variants = {
        "bf16": layer,
        "nf4": nf4_layer,
        "nf4-lean": nf4_layer,
        "fp8": fp8_layer,
        "fp8-lean": fp8_layer,
        "fp8-lean-kernels": fp8_layer,
    }
    if args.compile:  # the FP8 layer through torch.compile: the elementwise work between its GEMMs fused
        from torch._dynamo.utils import counters

        counters.clear()  # this layer kind's compiles and graph breaks only
        variants["fp8-compiled"] = torch.compile(fp8_layer, dynamic=True)
    captured = {}

    def capture(part):
        def hook(_module, _inputs, output):
            captured[part] = (output[0] if isinstance(output, tuple) else output).detach().clone()

        return hook

    rows = []
    for batch, seq in args.shapes:
        g = torch.Generator(device=device).manual_seed(batch * seq)
        hidden = torch.randn(batch, seq, config.hidden_size, generator=g, device=device, dtype=torch.bfloat16)
        outputs = {}
        for name, variant in variants.items():
            model.model.layers[0] = variant
            hooks = [
                m.register_forward_hook(capture(p))
                for p, m in (("layer", variant), ("attn", variant.self_attn), ("mlp", variant.mlp))
            ]
            free(device)
            reset_peak(device)
            with (
                torch.no_grad(),
                lean_forward(variant, "-lean" in name, kernels=name.endswith("-kernels")),
            ):
                model.model(inputs_embeds=hidden, use_cache=False)  # as the prefix pass calls it
                outputs[name] = dict(captured)
                for h in hooks:
                    h.remove()
                seconds = timed(
                    lambda m=model.model, x=hidden: m(inputs_embeds=x, use_cache=False),
                    device,
                    args.warmup,
                    args.iters,
                )
                stacked = None
                if args.stack > 1:  # back to back, as the prefix pass runs its layers

                    def back_to_back(m=model.model, x=hidden, n=args.stack):
                        for _ in range(n):
                            m(inputs_embeds=x, use_cache=False)

                    stacked = timed(back_to_back, device, 1, max(3, args.iters // 2)) / args.stack
            rows.append(
                {
                    "layer": kind,
                    "path": name,
                    "batch": batch,
                    "seq": seq,
                    "tokens": batch * seq,
                    "ms": round(seconds * 1e3, 2),
                    "tokens_per_s": round(batch * seq / seconds, 1),
                    "ms_back_to_back": None if stacked is None else round(stacked * 1e3, 2),
                    "peak_gib": peak_gib(device),
                }
            )
        ref = outputs["bf16"]
        for row in rows[-len(variants) :]:
            mine = outputs[row["path"]]
            row["hidden_error_vs_bf16"] = round(rel(mine["layer"], ref["layer"]), 5)
            row["sublayer_error_vs_bf16"] = round(
                rel(torch.cat([mine["attn"], mine["mlp"]], -1), torch.cat([ref["attn"], ref["mlp"]], -1)), 5
            )
            row["fp8_modules"] = replaced
        if device.type == "cuda" and (batch, seq) == args.shapes[0]:
            rows[-1]["kernel_checks"] = kernel_checks(fp8_layer, hidden[:1, : min(seq, 2048)])
    if args.compile:  # how often dynamo compiled and where it broke the graph (the FP8 GEMMs are meant to)
        from torch._dynamo.utils import counters

        rows[-1]["dynamo"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break")}
    model.model.layers[0] = layer
    del model, variants, layer, nf4_layer, fp8_layer
    free(device)
    return rows


def torch_blockwise(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor):
    """torch's own block-scaled FP8 GEMM (1x128 activations, 128x128 weights) as a callable, or why it refused."""
    import torch.nn.functional as F

    from dsr1kit.model import fp8_kernels

    kinds = getattr(F, "ScalingType", None)
    if kinds is None or not hasattr(F, "scaled_mm"):
        return "torch.nn.functional.scaled_mm is missing"
    a_kind = getattr(kinds, "BlockWise1x128", None) or getattr(kinds, "Blockwise_1x128", None)
    b_kind = getattr(kinds, "BlockWise128x128", None) or getattr(kinds, "Blockwise_128x128", None)

    def variant(a_outer: bool, b_view: bool):
        scale_b = scale_inv.t() if b_view else scale_inv.t().contiguous()

        def run():
            q, s = fp8_kernels.quantize(x)
            if a_outer:
                s = s.t().contiguous().t()  # outer-dim-major: (M, K/128) with strides (1, M)
            return F.scaled_mm(q, weight.t(), s, a_kind, scale_b, b_kind, output_dtype=torch.bfloat16)

        return run

    errors = []
    for a_outer in (True, False):
        for b_view in (True, False):
            run = variant(a_outer, b_view)
            try:
                run()
                return run
            except Exception as err:  # noqa: BLE001 - the probe records whatever torch says
                errors.append(f"a_outer={a_outer} b_view={b_view}: {type(err).__name__}: {str(err)[:200]}")
    return " | ".join(errors)


def experts_by_torch(fp8: FP8Experts, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor):
    """The routed experts with torch's block-scaled GEMM, one expert at a time (a callable), or why not."""
    import torch.nn.functional as F

    from dsr1kit.model import fp8_kernels

    kinds = getattr(F, "ScalingType", None)
    if kinds is None:
        return "no torch.nn.functional.ScalingType"
    a_kind = getattr(kinds, "BlockWise1x128", None) or getattr(kinds, "Blockwise_1x128", None)
    b_kind = getattr(kinds, "BlockWise128x128", None) or getattr(kinds, "Blockwise_128x128", None)
    tokens, top_k = index.shape
    i, p = fp8.intermediate_dim, fp8.padded_dim

    def mm(a, w, w_scale):
        q, s = fp8_kernels.quantize(a)
        return F.scaled_mm(
            q, w.t(), s.t().contiguous().t(), a_kind, w_scale.t(), b_kind, output_dtype=x.dtype
        )

    def run():
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=fp8.num_experts).tolist()  # one host sync per layer
        slots = torch.empty(tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            mine = order[start : start + c]
            start += c
            gu = mm(x[mine // top_k], fp8.gate_up[e], fp8.gate_up_scale_inv[e])
            h = F.silu(gu[:, :i].float()) * gu[:, p : p + i].float()
            y = mm(h, fp8.down[e], fp8.down_scale_inv[e])
            slots[mine] = (y.float() * weights.reshape(-1)[mine, None]).to(x.dtype)
        return slots.view(tokens, top_k, -1).sum(1)

    try:
        run()
    except Exception as err:  # noqa: BLE001 - the probe records whatever torch says
        return f"{type(err).__name__}: {str(err)[:300]}"
    return run


def gemm_rows(args, device: torch.device) -> list[dict]:
    """The GEMMs alone at prefix-pass shapes (16k-token micro-batch): the kit's FP8 linear and torch's
    block-scaled GEMM (activation quantization included, and alone) beside torch's bf16 matmul, and the routed
    experts on the kit's grouped kernel, as TFLOP/s."""
    from dsr1kit.model import fp8_kernels

    tokens = 64 if args.tiny else 16384
    shapes = [(7168, 18432), (18432, 7168), (7168, 1536), (16384, 7168)] if not args.tiny else [(128, 256)]
    rows = []
    g = torch.Generator(device=device).manual_seed(7)
    for k, n in shapes:
        x = torch.randn(tokens, k, generator=g, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, generator=g, device=device, dtype=torch.bfloat16) * 0.02
        q, s = fp8_compute.quantize_fp8_blocks(w)
        flop = 2 * tokens * k * n
        blockwise = torch_blockwise(x, q, s)
        if isinstance(blockwise, str):
            rows.append(
                {"gemm": f"{tokens}x{k} @ {k}x{n}", "what": "torch scaled_mm blockwise", "error": blockwise}
            )
        else:
            ref = fp8_compute.reference_linear(x, q, s, torch.float32)
            rows.append(
                {
                    "gemm": f"{tokens}x{k} @ {k}x{n}",
                    "what": "torch scaled_mm blockwise vs emulation",
                    "rel_error": round(rel(blockwise(), ref), 6),
                }
            )
        for what, fn in (
            ("torch scaled_mm blockwise incl. activation quant", blockwise),
            ("bf16 torch.mm", lambda x=x, w=w: x @ w.T),
            (
                "kit's linear incl. activation quant",
                lambda x=x, q=q, s=s: fp8_kernels.linear(x, q, s),
            ),
            ("activation quant alone", lambda x=x: fp8_kernels.quantize(x)),
        ):
            if isinstance(fn, str):
                continue
            sec = timed(fn, device, args.warmup, args.iters)
            rows.append(
                {
                    "gemm": f"{tokens}x{k} @ {k}x{n}",
                    "what": what,
                    "ms": round(sec * 1e3, 3),
                    "tflops": round(flop / sec / 1e12, 1),
                }
            )
    # the routed experts of one MoE layer: 256 experts, top-8, gate_up then down
    experts, top_k, hidden, inter = (8, 2, 128, 64) if args.tiny else (256, 8, 7168, 2048)
    gu = torch.randn(experts, 2 * inter, hidden, generator=g, device=device, dtype=torch.bfloat16) * 0.02
    dn = torch.randn(experts, hidden, inter, generator=g, device=device, dtype=torch.bfloat16) * 0.02
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    config = DeepseekV3Config(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts)
    config._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        bf16 = DeepseekV3Experts(config)
    bf16.gate_up_proj, bf16.down_proj = torch.nn.Parameter(gu, False), torch.nn.Parameter(dn, False)
    bf16.config = config
    fp8 = FP8Experts.from_experts(bf16)
    x = torch.randn(tokens, hidden, generator=g, device=device, dtype=torch.bfloat16)
    index = torch.rand(tokens, experts, generator=g, device=device).topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, generator=g, device=device)
    flop = 2 * tokens * top_k * 3 * hidden * inter
    with torch.no_grad():
        loop = experts_by_torch(fp8, x, index, weights)
        if isinstance(loop, str):
            rows.append({"gemm": "experts", "what": "torch scaled_mm per expert", "error": loop})
        else:
            rows.append(
                {
                    "gemm": "experts",
                    "what": "torch scaled_mm per expert vs emulation",
                    "rel_error": round(rel(loop(), fp8.reference(x, index, weights)), 6),
                }
            )
        for what, fn in (
            ("bf16 transformers experts (grouped_mm)", lambda: bf16(x, index, weights)),
            ("fp8 kernels", lambda: fp8(x, index, weights)),
            ("torch scaled_mm per expert", loop),
        ):
            if isinstance(fn, str):
                continue
            sec = timed(fn, device, args.warmup, args.iters)
            rows.append(
                {
                    "gemm": f"experts {experts}x top-{top_k}, {tokens} tokens",
                    "what": what,
                    "ms": round(sec * 1e3, 3),
                    "tflops": round(flop / sec / 1e12, 1),
                }
            )
    return rows


def profile_rows(args, device: torch.device, kind: str = "moe", lean: bool = False, kernels: bool = False):
    """Where the FP8 layer's time goes at 4×4096 tokens: CUDA time per kernel name, largest first."""
    from torch.profiler import ProfilerActivity, profile

    model, config = one_layer_model(kind, args.tiny, device)
    fp8_compute.to_fp8_(model.model.layers[0])
    if lean:
        lean_prefix_layers_(model.model.layers[0], kernels=kernels)
    forward = "lean+kernels" if kernels else "lean" if lean else "transformers"
    seq = 64 if args.tiny else 4096
    hidden = torch.randn(4, seq, config.hidden_size, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(2):
            model.model(inputs_embeds=hidden, use_cache=False)
        free(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                model.model(inputs_embeds=hidden, use_cache=False)
            torch.cuda.synchronize(device)
    rows = [
        {
            "kernel": e.key[:90],
            "ms_per_forward": round(e.device_time_total / 3 / 1e3, 3),
            "calls": e.count // 3,
        }
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    rows.sort(key=lambda r: -r["ms_per_forward"])
    total = sum(r["ms_per_forward"] for r in rows)
    del model
    free(device)
    return [{"layer": kind, "forward": forward, "total_kernel_ms": round(total, 2)}] + [
        dict(r, forward=forward) for r in rows[:25]
    ]


def router_rows(device: torch.device, tokens: int = 16384) -> list[dict]:
    """The router's float32 logits at R1's widths: transformers' float32 GEMM beside ``router_logits``."""
    import torch.nn.functional as F

    from dsr1kit.model.prefix_layer import router_logits

    g = torch.Generator(device=device).manual_seed(9)
    hidden = torch.randn(tokens, 7168, generator=g, device=device).to(torch.bfloat16)
    weight = torch.randn(256, 7168, generator=g, device=device) * 0.02
    rows = []
    with torch.no_grad():
        want = F.linear(hidden.float(), weight)
        rows.append(
            {"router": "router_logits vs float32", "rel_error": rel(router_logits(hidden, weight), want)}
        )
        for what, fn in (
            ("float32 F.linear (transformers)", lambda: F.linear(hidden.type(torch.float32), weight)),
            ("router_logits", lambda: router_logits(hidden, weight)),
        ):
            rows.append({"router": what, "ms": round(timed(fn, device, 3, 10) * 1e3, 3)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (CPU smoke test)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", default="moe,dense")
    ap.add_argument("--gemm", action="store_true", help="also time the GEMMs alone")
    ap.add_argument("--profile", action="store_true", help="also profile the FP8 MoE layer's kernels")
    ap.add_argument("--compile", action="store_true", help="also run the FP8 layer through torch.compile")
    ap.add_argument(
        "--stack",
        type=int,
        default=4,
        help="also time this many forwards back to back, without a sync between them (per forward)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    seq = 64 if args.tiny else 4096
    args.shapes = [(1, seq), (4, seq)]
    torch.manual_seed(0)
    rows, gemms = [], []
    if args.gemm and device.type == "cuda":
        gemms = gemm_rows(args, device)
        for r in gemms:
            print(json.dumps(r), flush=True)
    profiled = []
    if args.profile and device.type == "cuda":
        profiled = router_rows(device) + profile_rows(args, device) + profile_rows(args, device, lean=True)
        profiled += profile_rows(args, device, lean=True, kernels=True)
    for r in profiled:
        print(json.dumps(r), flush=True)
    for kind in [k for k in args.layers.split(",") if k]:
        rows += measure(args, kind, device)
        for r in [r for r in rows if r["layer"] == kind]:
            print(json.dumps(r), flush=True)
    summary = {}
    for kind in [k for k in args.layers.split(",") if k]:
        for batch, seq in args.shapes:
            by = {
                r["path"]: r for r in rows if r["layer"] == kind and r["batch"] == batch and r["seq"] == seq
            }
            summary[f"{kind} {batch}x{seq}"] = {
                "fp8_over_nf4": round(by["nf4"]["ms"] / by["fp8"]["ms"], 2),
                "fp8_over_bf16": round(by["bf16"]["ms"] / by["fp8"]["ms"], 2),
                "fp8_lean_over_nf4": round(by["nf4"]["ms"] / by["fp8-lean"]["ms"], 2),
                "fp8_lean_over_fp8": round(by["fp8"]["ms"] / by["fp8-lean"]["ms"], 2),
                "nf4_lean_over_nf4": round(by["nf4"]["ms"] / by["nf4-lean"]["ms"], 2),
                "fp8_lean_over_nf4_lean": round(by["nf4-lean"]["ms"] / by["fp8-lean"]["ms"], 2),
                "fp8_lean_kernels_over_nf4": round(by["nf4"]["ms"] / by["fp8-lean-kernels"]["ms"], 2),
            }
            if by["fp8-lean"].get("ms_back_to_back"):
                b2b = {k: r["ms_back_to_back"] for k, r in by.items() if r.get("ms_back_to_back")}
                summary[f"{kind} {batch}x{seq}"].update(
                    fp8_lean_over_nf4_back_to_back=round(b2b["nf4"] / b2b["fp8-lean"], 2),
                    fp8_lean_kernels_over_nf4_back_to_back=round(b2b["nf4"] / b2b["fp8-lean-kernels"], 2),
                    fp8_over_nf4_back_to_back=round(b2b["nf4"] / b2b["fp8"], 2),
                    fp8_lean_over_nf4_lean_back_to_back=round(b2b["nf4-lean"] / b2b["fp8-lean"], 2),
                )
            if "fp8-compiled" in by:
                summary[f"{kind} {batch}x{seq}"]["fp8_compiled_over_nf4"] = round(
                    by["nf4"]["ms"] / by["fp8-compiled"]["ms"], 2
                )
    print(json.dumps(summary, indent=1))
    meta = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "device_count": torch.cuda.device_count() if device.type == "cuda" else 0,
        "torch": torch.__version__,
        "tiny": args.tiny,
        "iters": args.iters,
        "warmup": args.warmup,
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    Path(args.out).write_text(
        json.dumps(
            {"meta": meta, "gemms": gemms, "profile": profiled, "rows": rows, "speedups": summary}, indent=1
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
