"""What to change when a plan does not fit: each suggestion is tried with the same planner before it is given."""

from __future__ import annotations

from dataclasses import replace

from .devices import GIB, H100_BYTES, Device
from .inventory import Inventory
from .machine import Machine


def training_advice(inputs, machine: Machine, inv: Inventory, planner) -> list[str]:
    """Settings that would fit, each tried with ``planner(inputs, machine, inv, advise=False)``: NF4 experts,
    NF4 linears, more GPUs, a shorter max_len (the first that fits per kind). ``inputs`` is the planner's own
    input dataclass; only the fields it has are changed."""
    out = []
    tries = []
    moe = bool(getattr(inv.config, "n_routed_experts", 0))
    if getattr(inputs, "prefix_fp8", False):  # the prefix pass at 1 byte per weight: NF4 holds ~half of that
        tries.append(
            (
                "prefix_precision: nf4 (NF4 experts and linears, dequantized per GEMM)",
                {"prefix_fp8": False, "quantization": "nf4", "quantize_experts": moe},
            )
        )
    elif getattr(inputs, "quantize_experts", False) is False and moe:
        tries.append(
            (
                "quantize_experts: true (NF4 experts; the fused experts are most of a MoE)",
                {"quantize_experts": True},
            )
        )
    if getattr(inputs, "quantization", "nf4") != "nf4" and not getattr(inputs, "prefix_fp8", False):
        tries.append(("quantization: nf4", {"quantization": "nf4"}))
    for text, change in tries:
        trial = planner(replace(inputs, **change), machine, inv, False)
        out.append(f"{text}: {'fits' if trial.fits else 'still does not fit'} ({trial.busiest()})")
    gpu_bytes = machine.gpu_bytes or H100_BYTES
    for gpus in (1, 2, 4, 8):
        if gpus <= machine.gpus:
            continue
        change = {"quantize_experts": True} if moe else {}
        if getattr(inputs, "device_map", None) == "cpu":
            change["device_map"] = "contiguous"
        trial = planner(
            replace(inputs, **change), replace(machine, gpus=gpus, gpu_bytes=gpu_bytes), inv, False
        )
        if trial.fits:
            what = " with quantize_experts: true" if change.get("quantize_experts") else ""
            out.append(
                f"run on a node with {gpus} GPU(s) of {gpu_bytes / GIB:.0f} GiB{what}: fits "
                f"({trial.busiest()})"
            )
            break
    if getattr(inputs, "max_len", 0) > 512:
        trial = planner(replace(inputs, max_len=inputs.max_len // 2), machine, inv, False)
        out.append(
            f"max_len: {inputs.max_len // 2}: {'fits' if trial.fits else 'still does not fit'} "
            f"({trial.busiest()})"
        )
    return out


def serving_advice(inputs, devices: list[Device], info: dict) -> list[str]:
    """A max_model_len the KV cache holds, more GPUs per replica, a higher gpu_memory_utilization."""
    out = []
    dev = devices[0]
    if info["kv_tokens"] < inputs.max_model_len:
        out.append(f"max_model_len: {max(info['kv_tokens'], 0):,} or less (what the KV cache holds now)")
    if dev.name != "host":
        out.append(
            f"more GPUs per replica: tensor_parallel_size {2 * inputs.tensor_parallel_size} halves the "
            f"{dev.parts['weights'] / GIB:.1f} GiB of weights per GPU"
        )
        if inputs.gpu_memory_utilization < 0.95:
            out.append(
                f"gpu_memory_utilization: {min(0.95, inputs.gpu_memory_utilization + 0.03):.2f} "
                f"(more room for the KV cache)"
            )
    else:
        out.append("serve on GPUs, or a smaller model: vLLM-CPU holds the whole model in host memory")
    return out
