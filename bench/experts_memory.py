"""NF4 experts + streaming loader on one GPU: memory, MoE speed, load time and host RSS, HARI step.

Run (one H200, ~5-8 min, ~20 GiB disk under --workdir, < 40 GiB GPU, < 30 GiB host):

    .venv/bin/python -m bench.experts_memory --out runs/bench/experts_memory.json

Smoke test on a CPU (small model, minutes): ``--smoke``.

The model is a random DeepSeek-V3-architecture model of ~4.7B parameters (see
``CONFIG``: hidden 2048, 8 layers with the first dense, 64 routed experts of
width 1408, top-8 in 8 groups of which 4, 1 shared expert, MLA with q_lora 1536 /
kv_lora 512, vocab 129,280): 83% of its weights are routed experts (R1: ~95%).
It is saved twice: BF16 with ``save_pretrained`` (per-expert keys) and FP8 as
DeepSeek ships R1 (float8_e4m3fn linears + 128×128 ``weight_scale_inv``;
embeddings, norms, router and lm_head bf16). Then:

1. every load variant runs in its own process: GPU memory after load, load time,
   peak host RSS (VmHWM, reset after imports) — from_pretrained bf16 / with
   bitsandbytes NF4 linears, and the streaming loader from BF16 and FP8;
2. one MoE layer at S tokens: forward and forward+backward, bf16 vs NF4 experts,
   and whether the NF4 output equals the bf16 module on the dequantized weights;
3. HARI fast-path step (``dsr1kit.train.hari.fast_loss``, LoRA r=4 on the last
   layer's q_a_proj/q_b_proj) with NF4 linears and bf16 vs NF4 experts, each with the
   kit's memory plan (``dsr1kit.plan``) of that step beside the measured peak.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from dsr1kit.embedded.r1_format import R1_QUANTIZATION_CONFIG, is_fp8_weight

from .common import (
    CHUNK,
    GIB,
    R1_SHAPE,
    add_lora,
    allocated_gib,
    free,
    peak_gib,
    plan_on_gpu0,
    sync,
    timed,
    training_inputs,
)

ROOT = Path(__file__).resolve().parent.parent  # the children run ``python -m bench.experts_memory`` from here

CONFIG = dict(
    R1_SHAPE,
    vocab_size=129280,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=8,
    first_k_dense_replace=1,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_routed_experts=64,
    num_experts_per_tok=8,
    n_shared_experts=1,
    max_position_embeddings=4096,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
)
SMOKE = dict(
    CONFIG,
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=3,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    q_lora_rank=64,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    num_attention_heads=4,
    num_key_value_heads=4,
)
MODES = (
    "hf_bf16",
    "hf_nf4_linears",
    "stream_bf16_to_bf16",
    "stream_bf16_to_nf4",
    "stream_fp8_to_nf4",
    "stream_fp8_to_nf4_incl_lm_head",
)


# -- small helpers ----------------------------------------------------------------------------


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def ms(fn, warmup: int = 2, iters: int = 8) -> float:
    """Median milliseconds of fn() on this bench's device."""
    return timed(fn, device(), warmup, iters) * 1e3


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- 0. the test model on disk ------------------------------------------------------------------


def build_model(config_dict: dict, seed: int = 0):
    """Random DeepSeek-V3 in bf16 on the device; every weight N(0, 0.02), norms 1, biases 0."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(**config_dict)
    with torch.device(device()):
        model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for q in model.parameters():
            if q.dim() >= 2:
                q.normal_(0, 0.02)
            else:
                q.fill_(1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
    return model.eval()


def save_fp8(model, out: Path) -> None:
    """R1's layout: per-expert keys, FP8 linears with block scales, one shard per decoder layer."""
    from safetensors.torch import save_file

    from dsr1kit.model.fp8 import quantize_fp8_blocks

    out.mkdir(parents=True, exist_ok=True)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in model.state_dict().items():
        parts = key.split(".")
        shard = (
            f"layer-{int(parts[2]):03d}.safetensors"
            if key.startswith("model.layers.")
            else "other.safetensors"
        )
        named = {key: t}
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix, kind = key.rsplit(".", 1)
            named = {}
            for e in range(t.shape[0]):
                if kind == "gate_up_proj":
                    gate, up = t[e].chunk(2, dim=0)
                    named[f"{prefix}.{e}.gate_proj.weight"], named[f"{prefix}.{e}.up_proj.weight"] = gate, up
                else:
                    named[f"{prefix}.{e}.down_proj.weight"] = t[e]
        for k, v in named.items():
            if is_fp8_weight(k, v):
                q, s = quantize_fp8_blocks(v)
                shards.setdefault(shard, {}).update({k: q.cpu(), k + "_scale_inv": s.cpu()})
            else:
                shards.setdefault(shard, {})[k] = v.contiguous().cpu()
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, out / shard, metadata={"format": "pt"})
        weight_map.update({k: shard for k in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = model.config.to_dict()
    config["quantization_config"] = R1_QUANTIZATION_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=1, default=str))


def dir_gib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir()) / GIB


# -- 1. one load per process ----------------------------------------------------------------------


def load(mode: str, bf16_dir: Path, fp8_dir: Path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from dsr1kit.model.stream_load import load_streaming

    dm = {"": 0} if torch.cuda.is_available() else "cpu"
    if mode == "hf_bf16":
        return AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16, device_map=dm)
    if mode == "hf_nf4_linears":
        bnb = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
            llm_int8_skip_modules=["lm_head", "gate"],
        )
        return AutoModelForCausalLM.from_pretrained(
            bf16_dir, dtype=torch.bfloat16, device_map=dm, quantization_config=bnb
        )
    stream_dm = 0 if torch.cuda.is_available() else "cpu"
    kwargs = {
        "stream_bf16_to_bf16": dict(nf4_linears=False, nf4_experts=False),
        "stream_bf16_to_nf4": {},
        "stream_fp8_to_nf4": {},
        "stream_fp8_to_nf4_incl_lm_head": dict(keep_bf16=()),
    }[mode]
    source = fp8_dir if "fp8" in mode else bf16_dir
    return load_streaming(source, stream_dm, progress=False, **kwargs)


def breakdown_gib(model) -> dict[str, float]:
    """Bytes by kind of weight (bnb quant states included), to see where the rest of the memory is."""
    import bitsandbytes as bnb

    from dsr1kit.model.experts_nf4 import NF4Experts, nf4_bytes

    out = {"routed_experts": 0, "linears": 0, "embed_and_lm_head": 0, "other": 0}
    for name, m in model.named_modules():
        own = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        size = sum(t.numel() * t.element_size() for t in own)
        if isinstance(m, NF4Experts):
            out["routed_experts"] += nf4_bytes(m)
            continue
        if isinstance(m, bnb.nn.Linear4bit) and m.weight.quant_state is not None:
            qs = m.weight.quant_state
            size += qs.absmax.numel() * qs.absmax.element_size()
            size += qs.state2.absmax.numel() * 4 if qs.nested else 0
        if ".mlp.experts" in name and not name.endswith("act_fn"):
            kind = "routed_experts"
        elif name in ("lm_head", "model.embed_tokens"):
            kind = "embed_and_lm_head"
        elif isinstance(m, (torch.nn.Linear, bnb.nn.Linear4bit)):
            kind = "linears"
        else:
            kind = "other"
        out[kind] += size
    return {k: round(v / GIB, 3) for k, v in out.items()}


def child(mode: str, bf16_dir: Path, fp8_dir: Path) -> None:
    """Runs in a fresh process: imports first, then reset the RSS peak, then load and measure."""
    import bitsandbytes  # noqa: F401 - imported before the baseline, as in any real job
    import transformers  # noqa: F401

    import dsr1kit.model.stream_load  # noqa: F401

    if torch.cuda.is_available():
        torch.empty(1, device="cuda")  # CUDA context outside the measurement
    reset = reset_peak_rss()
    base = status_bytes("VmRSS:")
    t = time.perf_counter()
    model = load(mode, bf16_dir, fp8_dir)
    sync(device())
    seconds = time.perf_counter() - t
    peak = status_bytes("VmHWM:")
    result = {
        "mode": mode,
        "load_s": round(seconds, 1),
        "host_peak_rss_gib": round(peak / GIB, 2),
        "host_peak_over_start_gib": round((peak - base) / GIB, 2),
        "rss_peak_reset": reset,
        "breakdown_gib": breakdown_gib(model),
    }
    if torch.cuda.is_available():
        result["gpu_gib"] = allocated_gib(device(), 3)
        result["gpu_peak_during_load_gib"] = peak_gib(device(), 3)
    else:
        result["gpu_gib"] = round(sum(result["breakdown_gib"].values()), 3)
    print("RESULT " + json.dumps(result), flush=True)


def run_child(mode: str, bf16_dir: Path, fp8_dir: Path, cold: bool) -> dict:
    if cold:
        drop_page_cache(fp8_dir if "fp8" in mode else bf16_dir)
    cmd = [
        sys.executable,
        "-m",
        "bench.experts_memory",
        "--child",
        mode,
        "--bf16-dir",
        str(bf16_dir.resolve()),
        "--fp8-dir",
        str(fp8_dir.resolve()),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"mode": mode, "error": (proc.stderr or proc.stdout)[-1500:]}
    return json.loads(lines[-1][len("RESULT ") :])


def drop_page_cache(path: Path) -> None:
    """Evict the checkpoint's pages so the load reads from disk (needs no root)."""
    for f in path.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- 2. one MoE layer -------------------------------------------------------------------------------


def moe_layer(model, seq: int) -> dict:
    """bf16 vs NF4 experts in layer 1's MoE block: ms per forward and forward+backward, equality."""
    from dsr1kit.model.experts_nf4 import NF4Experts, experts_implementation

    moe = model.model.layers[1].mlp
    impl = experts_implementation(model.config)
    hidden = (torch.randn(1, seq, model.config.hidden_size, device=device()) * 0.5).to(torch.bfloat16)
    grad = torch.randn_like(hidden)
    sync(device())
    t = time.perf_counter()
    nf4_experts = NF4Experts.from_experts(moe.experts, implementation=impl)
    sync(device())
    quant_s = time.perf_counter() - t
    moe_nf4 = copy.copy(moe)  # shares router and shared experts; own experts
    moe_nf4._modules = dict(moe._modules, experts=nf4_experts)
    every = torch.arange(nf4_experts.num_experts, device=device())
    out = {"tokens": seq, "experts_implementation": impl, "quantize_layer_s": round(quant_s, 3)}
    out["dequantize_all_experts_ms"] = round(
        ms(lambda: (nf4_experts.dequantize("gate_up", every), nf4_experts.dequantize("down", every))), 2
    )
    with torch.no_grad():
        _, w, idx = moe.gate(hidden.view(-1, hidden.shape[-1]))
        reference = copy.deepcopy(moe.experts)
        reference.gate_up_proj.copy_(nf4_experts.dequantize("gate_up", every))
        reference.down_proj.copy_(nf4_experts.dequantize("down", every))
        flat = hidden.view(-1, hidden.shape[-1])
        diff = (nf4_experts(flat, idx, w).float() - reference(flat, idx, w).float()).abs().max().item()
        out["nf4_vs_bf16_on_dequantized_max_abs_diff"] = diff
        del reference
    for label, block in (("bf16", moe), ("nf4", moe_nf4)):
        with torch.no_grad():
            out[f"{label}_fwd_ms"] = round(ms(lambda block=block: block(hidden)), 2)

        def fwd_bwd(block=block):
            h = hidden.detach().requires_grad_()
            block(h).backward(grad)

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        out[f"{label}_fwd_bwd_ms"] = round(ms(fwd_bwd), 2)
        if torch.cuda.is_available():
            out[f"{label}_fwd_bwd_extra_peak_gib"] = round(
                (torch.cuda.max_memory_allocated() - before) / GIB, 2
            )
    for chunk in (16, 64):
        nf4_experts.chunk_experts = chunk
        with torch.no_grad():
            out[f"nf4_fwd_ms_chunk{chunk}"] = round(ms(lambda: moe_nf4(hidden)), 2)
    out["fwd_ratio_nf4_over_bf16"] = round(out["nf4_fwd_ms"] / out["bf16_fwd_ms"], 2)
    out["fwd_bwd_ratio_nf4_over_bf16"] = round(out["nf4_fwd_bwd_ms"] / out["bf16_fwd_bwd_ms"], 2)
    return out


# -- 3. HARI fast-path step ---------------------------------------------------------------------------


def hari_step(model, seq: int, steps: int = 5) -> dict:
    """ms per optimizer step of dsr1kit's HARI fast path, LoRA r=4 on the last layer's q_a/q_b_proj."""
    from dsr1kit.train.hari import fast_loss

    last = model.config.num_hidden_layers - 1
    model.requires_grad_(False)
    model.config.use_cache = False
    peft_model, plan = add_lora(model, trained_looking=False)  # lora_B = 0, as PEFT initializes it
    assert plan.modules == [
        f"model.layers.{last}.self_attn.q_a_proj",
        f"model.layers.{last}.self_attn.q_b_proj",
    ]
    params = [q for q in peft_model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=5e-5)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device=device())
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    peft_model.train()
    losses = []

    def step():
        parts = fast_loss(peft_model, batch, lambda_kl=0.1, temperature=1.5, first_layer=last, chunk=CHUNK)
        parts.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(parts.ce)

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    step_ms = ms(step, warmup=2, iters=steps)
    out = {
        "tokens": seq,
        "step_ms": round(step_ms, 1),
        "first_ce": round(losses[0], 4),
        "last_ce": round(losses[-1], 4),
    }
    if torch.cuda.is_available():
        out["peak_gpu_gib"] = peak_gib(device())
    return out


def hari_compare(bf16_dir: Path, fp8_dir: Path, seq: int) -> dict:
    results = {}
    for label, mode in (
        ("nf4_linears_bf16_experts", "hf_nf4_linears"),
        ("nf4_linears_nf4_experts", "stream_fp8_to_nf4"),
    ):
        try:
            model = load(mode, bf16_dir, fp8_dir)
            results[label] = hari_step(model, seq)
            if torch.cuda.is_available():
                inputs = training_inputs(seq, quantization="nf4", quantize_experts=mode.startswith("stream"))
                plan = plan_on_gpu0(model.config, inputs)
                planned = plan.peak_gpu_bytes / GIB
                results[label].update(
                    plan_peak_gib=round(planned, 2),
                    plan_over_measured=round(planned / results[label]["peak_gpu_gib"], 3),
                    plan_parts_gib={k: round(v / GIB, 3) for k, v in plan.devices[0].parts.items()},
                )
        except Exception as exc:  # keep the other figures when the concurrently developed loop moves
            results[label] = {"error": f"{type(exc).__name__}: {exc}"}
        model = None
        free()
    a, b = results.values()
    if "step_ms" in a and "step_ms" in b:
        results["step_ratio_nf4_over_bf16_experts"] = round(b["step_ms"] / a["step_ms"], 2)
    return results


# -- the run and its table ----------------------------------------------------------------------------


def print_summary(r: dict) -> None:
    loads = [x for x in r["loads"] if "error" not in x]
    base = next((x["gpu_gib"] for x in loads if x["mode"] == "hf_bf16"), None)
    print("\n== model memory and loading (one process each; bf16 = hf_bf16) ==")
    print(
        f"{'variant':34} {'GPU GiB':>8} {'x bf16':>7} {'load s':>7} {'host peak GiB':>14} {'over start':>10}"
        f"   experts/linears/embed+head/other GiB"
    )
    for x in r["loads"]:
        if "error" in x:
            print(f"{x['mode']:34} ERROR {x['error'][-300:]}")
            continue
        ratio = f"{x['gpu_gib'] / base:.3f}" if base else "-"
        b = x["breakdown_gib"]
        print(
            f"{x['mode']:34} {x['gpu_gib']:8.2f} {ratio:>7} {x['load_s']:7.1f} {x['host_peak_rss_gib']:14.2f} "
            f"{x['host_peak_over_start_gib']:10.2f}   {b['routed_experts']}/{b['linears']}/"
            f"{b['embed_and_lm_head']}/{b['other']}"
        )
    m = r["moe"]
    print(f"\n== one MoE layer, {m['tokens']} tokens, {m['experts_implementation']} ==")
    for k in (
        "bf16_fwd_ms",
        "nf4_fwd_ms",
        "fwd_ratio_nf4_over_bf16",
        "bf16_fwd_bwd_ms",
        "nf4_fwd_bwd_ms",
        "fwd_bwd_ratio_nf4_over_bf16",
        "bf16_fwd_bwd_extra_peak_gib",
        "nf4_fwd_bwd_extra_peak_gib",
        "dequantize_all_experts_ms",
        "nf4_fwd_ms_chunk16",
        "nf4_fwd_ms_chunk64",
        "quantize_layer_s",
        "nf4_vs_bf16_on_dequantized_max_abs_diff",
    ):
        print(f"  {k:42} {m.get(k)}")
    print(f"\n== HARI fast-path step, {r['hari_tokens']} tokens ==")
    for label, h in r["hari"].items():
        print(f"  {label:42} {h}")
    print(
        f"\ncheckpoints: bf16 {r['bf16_dir_gib']:.2f} GiB, fp8 {r['fp8_dir_gib']:.2f} GiB; "
        f"page cache {'dropped before each load' if r['cold'] else 'warm (files just written)'}"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "dsr1kit-bench")
    ap.add_argument("--out", type=Path, help="write all figures as JSON here")
    ap.add_argument("--seq", type=int, default=4096, help="tokens for the MoE-layer timing")
    ap.add_argument(
        "--hari-seq",
        type=int,
        default=2048,
        help="tokens per HARI step (2048: as in the recorded HARI-step figures)",
    )
    ap.add_argument("--modes", default=",".join(MODES), help="load variants, comma-separated")
    ap.add_argument(
        "--cold", action="store_true", help="evict the checkpoint from the page cache before loads"
    )
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints in --workdir")
    ap.add_argument("--smoke", action="store_true", help="small model, for a quick run on a CPU")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--bf16-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--fp8-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.bf16_dir, args.fp8_dir)
        return 0
    if args.smoke:
        args.seq, args.hari_seq = min(args.seq, 256), min(args.hari_seq, 128)
    import bitsandbytes
    import transformers

    r = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "bitsandbytes": bitsandbytes.__version__,
        },
        "config": SMOKE if args.smoke else CONFIG,
        "cold": args.cold,
        "hari_tokens": args.hari_seq,
    }
    log(f"{r['device']}; {r['versions']}")
    bf16_dir, fp8_dir = args.workdir / "bf16", args.workdir / "fp8"
    shutil.rmtree(args.workdir, ignore_errors=True)
    model = build_model(r["config"])
    r["parameters_b"] = round(sum(q.numel() for q in model.parameters()) / 1e9, 3)
    log(f"model: {r['parameters_b']}B parameters; saving BF16 and FP8 checkpoints to {args.workdir}")
    t = time.perf_counter()
    model.save_pretrained(bf16_dir)
    save_fp8(model, fp8_dir)
    r["save_s"] = round(time.perf_counter() - t, 1)
    r["bf16_dir_gib"], r["fp8_dir_gib"] = dir_gib(bf16_dir), dir_gib(fp8_dir)
    log(f"saved in {r['save_s']} s; MoE layer timing at {args.seq} tokens")
    r["moe"] = moe_layer(model, args.seq)
    model = None
    free()
    r["loads"] = []
    for mode in args.modes.split(","):
        log(f"load: {mode}")
        r["loads"].append(run_child(mode, bf16_dir, fp8_dir, args.cold))
        log(f"  {r['loads'][-1]}")
    log(f"HARI fast-path steps at {args.hari_seq} tokens")
    r["hari"] = hari_compare(bf16_dir, fp8_dir, args.hari_seq)
    print_summary(r)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(r, indent=1, default=str))
        log(f"wrote {args.out}")
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
