"""Memory plan: the bytes each heavy step needs per GPU and on the host, checked before anything loads.

A wasted multi-node allocation is the expensive failure, so each step asks
first: from the model's config (no weights), its quantization and placement,
the sequence length, batch and step, what will each GPU and the host hold,
and does it fit this machine? A plan that does not fit stops the step with
the table and what to change. ``dsr1kit plan PARAMS.yaml`` prints the same
plan without running anything (``--gpus/--gpu-gib/--host-gib`` for another
machine than this one).

Steps: ``hari_plan`` (notebook 20: load + one HARI step), ``inspection_plans``
(notebook 30: load + probe forwards, and the merged checkpoint's logits in
fp32 on the host), ``serve_plan`` (notebook 10: vLLM weights, activations and
KV cache), ``reference_plan`` (a model in fp32 on the host, e.g. the PEFT copy
the parity check scores with).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .inventory import Inventory, inventory, resolve_config
from .devices import GIB, H100_BYTES, Device, lora_parameters, reference_devices, serving_devices, training_devices

__all__ = ["Machine", "Plan", "PlanError", "hari_plan", "prefix_pass_plan", "inspect_plan", "inspection_plans", "reference_plan",
           "serve_plan", "plans_for_files",
           "plan_for_params", "Device", "GIB"]


class PlanError(RuntimeError):
    """A step's memory plan does not fit: raised before loading, with the table and what to change."""

    def __init__(self, plan: "Plan"):
        self.plan = plan
        super().__init__(plan.refusal())


@dataclass(frozen=True)
class Machine:
    """What one node offers: GPUs, bytes per GPU, host bytes available."""

    gpus: int
    gpu_bytes: float
    host_bytes: float
    label: str = "this node"

    @classmethod
    def detect(cls) -> "Machine":
        """This node as torch sees it (GPU count and size) and the host memory available now."""
        import psutil
        import torch

        gpus = torch.cuda.device_count()
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory if gpus else 0.0
        return cls(gpus, float(gpu_bytes), float(psutil.virtual_memory().available))

    def with_overrides(self, gpus: int | None = None, gpu_gib: float | None = None,
                       host_gib: float | None = None) -> "Machine":
        changed = {k: v for k, v in (("gpus", gpus), ("gpu_bytes", gpu_gib and gpu_gib * GIB),
                                     ("host_bytes", host_gib and host_gib * GIB)) if v is not None}
        return replace(self, **changed, label="as given") if changed else self

    def describe(self) -> str:
        gpus = f"{self.gpus} GPU(s) of {self.gpu_bytes / GIB:.1f} GiB" if self.gpus else "no GPU"
        return f"{self.label}: {gpus}, {self.host_bytes / GIB:.1f} GiB host memory available"


@dataclass
class Plan:
    """One step's bytes per device, the facts it was computed from, and (when it fails) what to change."""

    step: str
    devices: list[Device]
    facts: dict[str, str] = field(default_factory=dict)
    extra_problems: list[str] = field(default_factory=list)  # beyond bytes (e.g. KV cache below one sequence)
    advice: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices) and not self.extra_problems

    @property
    def peak_gpu_bytes(self) -> float:
        """Busiest GPU's total without the runtime row (what torch.cuda.max_memory_allocated can see)."""
        gpus = [d for d in self.devices if d.name != "host"]
        return max((d.total - d.parts.get("runtime", 0.0) for d in gpus), default=0.0)

    def rows(self) -> list[dict]:
        columns = sorted({k for d in self.devices for k in d.parts}, key=_column_order)
        out = []
        for d in self.devices:
            row = {"device": d.name, **({"peak at": d.phase or "-"} if any(x.phase for x in self.devices) else {}),
                   **{k: _gib(d.parts.get(k, 0.0)) for k in columns}}
            row.update(total=_gib(d.total), available=_gib(d.budget),
                       fits="yes" if d.fits else "NO")
            out.append(row)
        return out

    def text(self) -> str:
        rows = self.rows()
        cols = list(rows[0])
        width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
        lines = ["  ".join(c.rjust(width[c]) for c in cols)]
        lines += ["  ".join(str(r[c]).rjust(width[c]) for c in cols) for r in rows]
        facts = "; ".join(f"{k} {v}" for k, v in self.facts.items())
        return f"memory plan, {self.step} (GiB): {facts}\n" + "\n".join(lines)

    def busiest(self) -> str:
        """The device closest to (or furthest over) its memory, as 'gpu 7 52.9 of 79.6 GiB'."""
        d = max(self.devices, key=lambda d: d.total / max(d.budget, 1))
        return f"{d.name} {d.total / GIB:.1f} of {d.budget / GIB:.1f} GiB"

    def problems(self) -> list[str]:
        out = [f"{d.name} needs {d.total / GIB:.1f} GiB, {d.budget / GIB:.1f} GiB available"
               for d in self.devices if not d.fits]
        return out + self.extra_problems

    def refusal(self) -> str:
        advice = "\n".join(f"  - {a}" for a in self.advice) or "  - (no setting tried here fits: more nodes?)"
        return (f"the memory plan for {self.step} does not fit: " + "; ".join(self.problems())
                + f"\n{self.text()}\nWhat to change:\n{advice}")

    def check(self) -> "Plan":
        """Raise PlanError (table + what to change) when it does not fit; else return self."""
        if not self.fits:
            raise PlanError(self)
        return self

    def to_dict(self) -> dict:
        return {"step": self.step, "fits": self.fits, "facts": self.facts, "rows": self.rows(),
                "problems": self.problems(), "advice": self.advice}


def _gib(n: float) -> float:
    return round(n / GIB, 2 if n >= GIB else 3)


def _column_order(name: str) -> int:
    order = ["weights", "dequant (transient)", "activations", "loss / logits", "LoRA + optimizer",
             "weights in transit", "CUDA graphs", "KV cache", "runtime"]
    return order.index(name) if name in order else len(order)


# -- the steps ---------------------------------------------------------------------------------------

def _inv(model: str, trust_remote_code: bool = False) -> Inventory:
    return inventory(resolve_config(model, trust_remote_code))


def hari_plan_for_config(config, machine: Machine, **hari_params) -> Plan:
    """The HARI plan of a config object (benchmarks build models from configs, not from files)."""
    import copy

    from ..params import HariParams
    from .inventory import strip_quantization

    return hari_plan(HariParams(model="(config)", **hari_params), machine,
                     inventory(strip_quantization(copy.deepcopy(config))),
                     advise=False)


def hari_plan(p, machine: Machine, inv: Inventory | None = None, advise: bool = True) -> Plan:
    """Notebook 20: load (as dsr1kit.model.load does) and one HARI step of batch_size × max_len tokens.

    With a prefix cache, the step's plan is per rank (one GPU each): only the adapted layers, the final norm
    and lm_head are loaded; ``prefix_pass_plan`` is the plan of the pass that fills the cache.
    """
    inv = inv or _inv(p.model, p.trust_remote_code)
    if getattr(p, "prefix_cache", "off") != "off":
        return _cached_hari_plan(p, machine, inv)
    gpus = 0 if p.device_map == "cpu" else machine.gpus
    dtype_bytes = 2 if p.dtype == "bfloat16" else 4
    tokens = p.batch_size * p.max_len
    lora = lora_parameters(inv, p.lora_r, p.lora_last_k_layers, list(p.lora_targets))
    devices = training_devices(
        inv, n_gpus=gpus, gpu_bytes=machine.gpu_bytes, host_bytes=machine.host_bytes,
        scheme=p.device_map if gpus else "contiguous", dtype_bytes=dtype_bytes,
        nf4_linears=p.quantization == "nf4", nf4_experts=p.quantize_experts, tokens=tokens, chunk=p.loss_chunk,
        last_k=p.lora_last_k_layers, lora_params=lora, from_pretrained=not p.quantize_experts)
    plan = Plan("HARI load + step", devices, _facts(inv, p.quantization, p.quantize_experts, p.dtype, gpus,
                                                     p.device_map, f"{p.batch_size} x {p.max_len}", machine))
    if advise and not plan.fits:
        plan.advice = _training_advice(p, machine, inv, hari_plan)
    return plan


def adapted_only(inv: Inventory, last_k: int) -> Inventory:
    """The inventory with the frozen prefix and the embeddings emptied: what training from the cache loads."""
    keep = set(inv.layers[len(inv.layers) - last_k:])
    units = {u: (kinds if u in keep or not (u in inv.layers or u == "model.embed_tokens") else {})
             for u, kinds in inv.units.items()}
    return replace(inv, units=units)


def _cached_hari_plan(p, machine: Machine, inv: Inventory) -> Plan:
    gpus = 0 if p.device_map == "cpu" or not machine.gpus else 1
    dtype_bytes = 2 if p.dtype == "bfloat16" else 4
    lora = lora_parameters(inv, p.lora_r, p.lora_last_k_layers, list(p.lora_targets))
    devices = training_devices(
        adapted_only(inv, p.lora_last_k_layers), n_gpus=gpus, gpu_bytes=machine.gpu_bytes,
        host_bytes=machine.host_bytes, scheme="contiguous", dtype_bytes=dtype_bytes,
        nf4_linears=p.cached_layers_nf4, nf4_experts=p.cached_layers_nf4, tokens=p.batch_size * p.max_len,
        chunk=p.loss_chunk, last_k=p.lora_last_k_layers, lora_params=lora, from_pretrained=False)
    facts = _facts(inv, "nf4" if p.cached_layers_nf4 else "none", p.cached_layers_nf4, p.dtype, gpus, "one GPU per rank",
                   f"{p.batch_size} x {p.max_len}", machine)
    facts["loaded"] = f"the last {p.lora_last_k_layers} layer(s), norm and lm_head; the rest is read from the prefix cache"
    return Plan("HARI step from the prefix cache (per rank)", devices, facts)


def prefix_pass_plan(p, machine: Machine, inv: Inventory | None = None, advise: bool = True) -> Plan:
    """The prefix pass: the model loaded as for HARI, forward only, micro-batches of prefix_tokens_per_batch."""
    inv = inv or _inv(p.model, p.trust_remote_code)
    gpus = 0 if p.device_map == "cpu" else machine.gpus
    devices = training_devices(
        inv, n_gpus=gpus, gpu_bytes=machine.gpu_bytes, host_bytes=machine.host_bytes,
        scheme=p.device_map if gpus else "contiguous", dtype_bytes=2 if p.dtype == "bfloat16" else 4,
        nf4_linears=p.quantization == "nf4", nf4_experts=p.quantize_experts, tokens=p.prefix_tokens_per_batch,
        chunk=0, last_k=0, lora_params=0, from_pretrained=not p.quantize_experts, train=False)
    plan = Plan("prefix pass (load + forward)", devices,
                _facts(inv, p.quantization, p.quantize_experts, p.dtype, gpus, p.device_map,
                       f"{p.prefix_tokens_per_batch} per micro-batch", machine))
    if advise and not plan.fits:
        plan.advice = _training_advice(p, machine, inv, prefix_pass_plan)
    return plan


def inspect_plan(p, model: str, machine: Machine, inv: Inventory | None = None, advise: bool = True) -> Plan:
    """Notebook 30: the base loaded as notebook 30 loads it (bf16 on GPUs, fp32 on a CPU) and probe forwards."""
    inv = inv or _inv(model)
    gpus = machine.gpus
    dtype_bytes = 2 if gpus else 4
    devices = training_devices(
        inv, n_gpus=gpus, gpu_bytes=machine.gpu_bytes, host_bytes=machine.host_bytes, scheme="contiguous",
        dtype_bytes=dtype_bytes, nf4_linears=p.quantization == "nf4", nf4_experts=p.quantize_experts,
        tokens=p.max_len, chunk=p.max_len, last_k=0, lora_params=0, from_pretrained=not p.quantize_experts,
        train=False, probe_tokens=p.max_len)
    plan = Plan("adapter inspection (load + probes)", devices,
                _facts(inv, p.quantization, p.quantize_experts, "bfloat16" if gpus else "float32", gpus,
                       "contiguous", f"1 x {p.max_len}", machine))
    if advise and not plan.fits:
        plan.advice = _training_advice(p, machine, inv, lambda q, m, i, advise: inspect_plan(q, model, m, i, advise))
    return plan


def reference_plan(model: str, machine: Machine, tokens: int, step: str, inv: Inventory | None = None) -> Plan:
    """A transformers copy in fp32 on the host (parity reference, merged-logits check)."""
    inv = inv or _inv(model)
    return Plan(step, reference_devices(inv, machine.host_bytes, tokens),
                {"model": f"{_count(inv.parameters)} parameters", "dtype": "float32 on the host",
                 "machine": machine.describe()})


def serve_plan(p, model: str, machine: Machine, inv: Inventory | None = None, fp8_blocks: bool = True) -> Plan:
    """Notebook 10: vLLM's share per GPU (TP x PP, replicated over DP) and whether one sequence's KV fits.

    ``fp8_blocks=False``: this machine cannot run FP8 block-scaled linears, so an FP8 checkpoint is served as
    a bf16 copy (``dsr1kit.infer.serve_form``) and planned as one.
    """
    inv = inv or _inv(model)
    bf16_copy = not fp8_blocks and _fp8(inv)
    if bf16_copy:
        p = p.model_copy(update={"dtype": "bfloat16"})
    n = p.tensor_parallel_size * p.pipeline_parallel_size
    cpu_kv = float(p.server_env.get("VLLM_CPU_KVCACHE_SPACE", 4)) * GIB
    devices, info = serving_devices(
        inv, dtype=p.dtype, n_gpus=machine.gpus and n, gpu_bytes=machine.gpu_bytes,
        utilization=p.gpu_memory_utilization, host_bytes=machine.host_bytes, tp=p.tensor_parallel_size,
        pp=p.pipeline_parallel_size, max_model_len=p.max_model_len, max_num_seqs=p.max_num_seqs,
        batched_tokens=p.max_num_batched_tokens, enforce_eager=p.enforce_eager, cpu_kv_bytes=cpu_kv)
    facts = {"model": f"{_count(inv.parameters)} parameters",
             "weights": "FP8 blocks as stored" if p.dtype == "auto" and _fp8(inv)
             else "bfloat16 copy of the FP8 checkpoint" if bf16_copy else p.dtype,
             "GPUs": f"TP {p.tensor_parallel_size} x PP {p.pipeline_parallel_size} x DP {p.data_parallel_size}"
             if machine.gpus else "none (vLLM-CPU)",
             "KV": f"{info['kv_bytes_per_token'] / 1024:.1f} KiB/token, room for {info['kv_tokens']:,} tokens",
             "machine": machine.describe()}
    plan = Plan("vLLM serving", devices, facts)
    if info["kv_tokens"] < p.max_model_len:
        plan.extra_problems.append(
            f"the KV cache holds {info['kv_tokens']:,} tokens, fewer than one sequence of max_model_len "
            f"{p.max_model_len:,} (vLLM refuses to start)")
    if not plan.fits:
        plan.advice = _serving_advice(p, devices, info)
    return plan


def _fp8(inv: Inventory) -> bool:
    from .inventory import checkpoint_is_fp8

    return checkpoint_is_fp8(inv.config)


def _facts(inv, quantization, nf4_experts, dtype, gpus, placement, tokens, machine) -> dict[str, str]:
    return {"model": f"{_count(inv.parameters)} parameters ({len(inv.layers)} layers)",
            "weights": f"{dtype}, linears {quantization}, experts {'nf4' if nf4_experts else dtype}",
            "placement": f"{placement} over {gpus} GPU(s)" if gpus else "host (no GPU)",
            "tokens per step": tokens, "machine": machine.describe()}


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _training_advice(p, machine: Machine, inv: Inventory, planner) -> list[str]:
    """Settings that would fit, each tried with the same planner (the first that fits per kind)."""
    out = []
    tries = []
    if getattr(p, "quantize_experts", False) is False and getattr(inv.config, "n_routed_experts", 0):
        tries.append(("quantize_experts: true (NF4 experts; the fused experts are most of a MoE)",
                      {"quantize_experts": True}))
    if getattr(p, "quantization", "nf4") != "nf4":
        tries.append(("quantization: nf4", {"quantization": "nf4"}))
    for text, change in tries:
        trial = planner(p.model_copy(update=change), machine, inv, False)
        out.append(f"{text}: {'fits' if trial.fits else 'still does not fit'} "
                   f"({_busiest(trial)})")
    gpu_bytes = machine.gpu_bytes or H100_BYTES
    for gpus in (1, 2, 4, 8):
        if gpus <= machine.gpus:
            continue
        change = {"quantize_experts": True} if getattr(inv.config, "n_routed_experts", 0) else {}
        if hasattr(p, "device_map") and p.device_map == "cpu":
            change["device_map"] = "contiguous"
        trial = planner(p.model_copy(update=change), replace(machine, gpus=gpus, gpu_bytes=gpu_bytes), inv, False)
        if trial.fits:
            what = " with quantize_experts: true" if change.get("quantize_experts") else ""
            out.append(f"run on a node with {gpus} GPU(s) of {gpu_bytes / GIB:.0f} GiB{what}: fits "
                       f"({_busiest(trial)})")
            break
    if hasattr(p, "max_len") and p.max_len > 512:
        trial = planner(p.model_copy(update={"max_len": p.max_len // 2}), machine, inv, False)
        out.append(f"max_len: {p.max_len // 2}: {'fits' if trial.fits else 'still does not fit'} "
                   f"({_busiest(trial)})")
    return out


def _busiest(plan: Plan) -> str:
    return plan.busiest()


def _serving_advice(p, devices: list[Device], info: dict) -> list[str]:
    out = []
    dev = devices[0]
    if info["kv_tokens"] < p.max_model_len:
        out.append(f"max_model_len: {max(info['kv_tokens'], 0):,} or less (what the KV cache holds now)")
    if dev.name != "host":
        out.append(f"more GPUs per replica: tensor_parallel_size {2 * p.tensor_parallel_size} halves the "
                   f"{dev.parts['weights'] / GIB:.1f} GiB of weights per GPU")
        if p.gpu_memory_utilization < 0.95:
            out.append(f"gpu_memory_utilization: {min(0.95, p.gpu_memory_utilization + 0.03):.2f} "
                       f"(more room for the KV cache)")
    else:
        out.append("serve on GPUs, or a smaller model: vLLM-CPU holds the whole model in host memory")
    return out


def inspection_plans(p, base: str, machine: Machine) -> dict[str, Plan]:
    """Notebook 30's load + probes, and (with merge_out) the fp32 logits check of the merged checkpoint."""
    inv = _inv(base)
    plans = {"inspect": inspect_plan(p, base, machine, inv)}
    if p.merge_out:
        plans["merge check"] = reference_plan(base, machine, p.max_len, "merged-checkpoint logits check (fp32, host)",
                                              inv)
    return plans


def plan_for_params(notebook: str, p, machine: Machine) -> list[Plan]:
    """Every plan a notebook's run makes, for `dsr1kit plan` and notebook 00's look ahead."""
    if notebook == "20_hari_training":
        return [hari_plan(p, machine)]
    if notebook == "30_adapter_inspection":
        return list(inspection_plans(p, p.base_model or "tiny", machine).values())
    if notebook == "10_vllm_inference":
        plans = [serve_plan(p, p.model, machine)]
        if p.lora_adapter and p.adapter_mode == "lora":
            plans.append(reference_plan(p.model, machine, 512, "parity reference (PEFT, fp32, host)"))
        return plans
    return []


def plans_for_files(specs: list[str], machine: Machine) -> list[tuple[str, Plan]]:
    """(name, plan) for each params spec, 'STEP.yaml' or layered 'R1.yaml+REHEARSAL.yaml', on ``machine``.

    The notebook is the first file's name (e.g. 20_hari_training.yaml), as for ``dsr1kit plan``; notebook
    00 calls this to plan the steps an allocation is about to run against the GPUs it found.
    """
    from pathlib import Path

    from .. import params
    from ..run.paths import resolve

    out = []
    for spec in specs:
        files = [resolve(f.strip()) for f in spec.split("+")]
        notebook = Path(files[0]).stem
        for plan in plan_for_params(notebook, params.load(notebook, files), machine):
            out.append((f"{notebook}: {plan.step}", plan))
    return out
