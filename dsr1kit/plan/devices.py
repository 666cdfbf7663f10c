"""Bytes per device for each heavy step, from the inventory and the step's parameters.

Every term is counted from what the code allocates, not fitted: the weights
as the loaders store them, placed by the same ``placement.device_map`` the
loader uses; the NF4 experts dequantized ``CHUNK_EXPERTS`` at a time; the
activations of one layer's forward for the frozen prefix; the saved
activations of the adapted layers; the chunked loss's fp32 [chunk, vocab]
temporaries; LoRA weights, gradients and optimizer state. Tokens per step are
``batch_size × max_len`` (the worst batch). What torch's allocator does not
count (CUDA context, cuBLAS workspaces) is one ``runtime`` row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..model.experts_nf4 import CHUNK_EXPERTS
from .inventory import FP8_BLOCK_BYTES, Inventory, bytes_per_param, served_bytes_per_param

GIB = 2**30
H100_BYTES = 79.6 * GIB  # an H100-80GB as torch reports it: the GPU size advice assumes without one
# cuBLAS and cuBLASLt keep a workspace each (32 MiB on Hopper) that torch allocates, and counts, in its own
# allocator from the first GEMM on; measured: 0.064 GiB above the weights once a GEMM has run (bench/plan_r1.py)
CUBLAS_WORKSPACES = 64 * 2**20
CUDA_RUNTIME = 1.0 * GIB - CUBLAS_WORKSPACES  # CUDA context, NCCL buffers: outside torch's count
HOST_RUNTIME = 1.5 * GIB  # python + torch + transformers (+ CUDA libraries) in the host process
VLLM_HOST_RUNTIME = 3.0 * GIB  # api server, engine core and worker processes on a CPU
# fp32 [chunk, V] alive at once in the vocab loss's torch ops (z, grad, log_q, log_p, q, p−q)
LOSS_FP32_TEMPS = 6
# on a GPU the fused vocab-loss kernel keeps only the logits, the reference's logits and their gradient ([chunk, V]
# in the model's dtype each); the torch ops above run where there is no GPU
LOSS_FUSED_TEMPS = 3
PROBE_FP32_TEMPS = 7  # compare_on: two fp32 logits, two log-softmaxes, three elementwise temporaries
LORA_BYTES_PER_PARAM = 16  # fp32 weight + fp32 grad + two fp32 Adam moments (8-bit Adam needs less)


@dataclass
class Device:
    """One device's share: named parts in bytes against what the device has."""

    name: str
    parts: dict[str, float] = field(default_factory=dict)
    budget: float = 0.0
    phase: str = ""  # when the peak happens: "layer" (a layer's forward/backward) or "loss"

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.budget


# -- per-token activation sizes ------------------------------------------------------------------


def _attention_per_token(c) -> int:
    """Elements of one attention block's intermediates per token (MLA or multi-head)."""
    heads, h = c.num_attention_heads, c.hidden_size
    if getattr(c, "kv_lora_rank", None):
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        return (
            (c.q_lora_rank or h)
            + 3 * heads * qk
            + c.kv_lora_rank
            + c.qk_rope_head_dim
            + 2 * heads * (c.qk_nope_head_dim + c.v_head_dim)
            + heads * c.v_head_dim
            + 3 * h
        )
    head_dim = getattr(c, "head_dim", None) or h // heads
    kv = getattr(c, "num_key_value_heads", heads) or heads
    return 3 * heads * head_dim + 4 * kv * head_dim + 3 * h


def _routed_per_token(
    c, nf4_experts: bool, saved: bool, forward_only: bool = False, kit_experts: bool = True
) -> int:
    """The routed experts, in 2-byte units per token: held until backward (``saved``), else the peak of a
    forward and backward (``forward_only``: of a forward under no_grad, as the prefix pass and frozen layers run).

    bf16 (transformers' grouped_mm forward): per (token, k) row, the forward peaks while it reorders the
    routing-weighted rows, which the fp32 routing weights (``keep_routing_fp32``) make fp32: the gathered
    input and the down projection's output (bf16, h each) and the weighted rows and their reordered copy
    (fp32, 2h each) are alive at once: 6h. The kit's grouped forward (``experts_grouped``, ``kit_experts``:
    ``LoadConfig.kit_experts``, on by default) reorders the bf16 rows before weighting them: under no_grad the
    gathered input, the rows in token order (bf16, h each) and the weighted rows (fp32, 2h) are alive while
    the fp32 sum per token (2h) is written: 4h per row + 2h per token. Its backward still peaks at 6h per
    row (measured at R1's widths: the same peak as transformers' forward). Autograd keeps gate/up's output
    (2i), the activation (i), the product (i) and the down output (h, for the routing weights' gradient).
    NF4 (``NF4Experts``): the forward writes fp32 rows per (token, k) and each chunk's gate/up/down rows
    (h + 3i); the backward recomputes the experts, so only the layer's input (h) is kept.
    """
    h, k, inter = c.hidden_size, c.num_experts_per_tok, c.moe_intermediate_size
    if nf4_experts:
        return h if saved else k * (h + 3 * inter)
    if saved:
        return k * (h + 4 * inter)
    if forward_only and kit_experts:
        return k * 4 * h + 2 * h
    return k * 6 * h


def _mlp_per_token(
    c, moe: bool, nf4_experts: bool, saved: bool, forward_only: bool = False, kit_experts: bool = True
) -> int:
    h = c.hidden_size
    if not moe:
        return 3 * c.intermediate_size + h
    inter = c.moe_intermediate_size
    shared = 3 * (getattr(c, "n_shared_experts", 0) or 0) * inter
    router = 2 * c.n_routed_experts * 2  # fp32 logits and scores, counted in 2-byte units
    return _routed_per_token(c, nf4_experts, saved, forward_only, kit_experts) + shared + router + h


def _is_moe(c, layer: int) -> bool:
    return bool(getattr(c, "n_routed_experts", 0)) and layer >= (getattr(c, "first_k_dense_replace", 0) or 0)


# hidden states a frozen layer's forward holds besides its own intermediates, per token (measured at the MoE's
# entry, bench/plan_r1.py): the embedding output (the model's forward keeps it), the layer's input, the
# residual sum after attention and the normed input of the MLP
HELD_STATES = 4


def layer_forward_bytes(
    c, layer: int, tokens: int, act: int, nf4_experts: bool, kit_experts: bool = True
) -> float:
    """Peak of one layer's forward under no_grad: attention or MLP intermediates, plus the states it holds."""
    mlp = _mlp_per_token(
        c, _is_moe(c, layer), nf4_experts, saved=False, forward_only=True, kit_experts=kit_experts
    )
    inner = max(_attention_per_token(c), mlp)
    return tokens * act * (inner + HELD_STATES * c.hidden_size)


def adapted_layer_transient_bytes(
    c, layer: int, tokens: int, act: int, nf4_experts: bool
) -> tuple[float, float]:
    """An adapted layer's peak on top of what autograd keeps (``layer_saved_bytes``, which holds its input and
    output too), as (dequantized experts, activations): the reference forward (no_grad, adapters off) and the
    backward run the attention or the MLP at a time, and NF4 experts are dequantized only while the MLP runs."""
    attention = tokens * act * _attention_per_token(c)
    mlp = tokens * act * _mlp_per_token(c, _is_moe(c, layer), nf4_experts, saved=False)
    dequant = dequant_bytes(c, nf4_experts, act) if _is_moe(c, layer) else 0.0
    return (dequant, mlp) if mlp + dequant >= attention else (0.0, attention)


def fp8_moe_forward_bytes(c, tokens: int, act: int) -> float:
    """The FP8 experts' forward (``model.fp8_kernels.experts``): the quantized input and its scales, then per
    routed row (padded: each expert's rows rounded up to 64) gate/up out in ``act`` bytes, the quantized
    activation and its scales, and the weighted output per (token, k) slot; plus the residual."""
    h, inter, k = c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok
    rows = tokens * k + c.n_routed_experts * 63
    per_row = 2 * inter * act + inter + inter / 32  # gate_up out, e4m3 activation, fp32 scale per 128
    return tokens * (h + h / 32 + 2 * h * act) + rows * per_row + tokens * k * h * act


def layer_saved_bytes(c, layer: int, tokens: int, act: int, nf4_experts: bool) -> float:
    """What autograd keeps of an adapted layer until backward: both blocks' intermediates."""
    return (
        tokens
        * act
        * (_attention_per_token(c) + _mlp_per_token(c, _is_moe(c, layer), nf4_experts, saved=True))
    )


def dequant_bytes(c, nf4_experts: bool, act: int) -> float:
    """NF4 experts are dequantized CHUNK_EXPERTS at a time (gate_up and down) for each MoE layer's forward."""
    if not (nf4_experts and getattr(c, "n_routed_experts", 0)):
        return 0.0
    return min(CHUNK_EXPERTS, c.n_routed_experts) * 3 * c.moe_intermediate_size * c.hidden_size * act


def lora_parameters(inv: Inventory, r: int, last_k: int, targets: list[str]) -> int:
    """LoRA A and B of the targets (or the auto-detected ones) in each of the last K layers."""
    from ..model.lora import PREFERENCE

    names = targets or next((list(g) for g in PREFERENCE if all(n in inv.adapted_linears for n in g)), [])
    return last_k * sum(r * sum(inv.adapted_linears[n]) for n in names if n in inv.adapted_linears)


# -- placement ---------------------------------------------------------------------------------------


def unit_devices(inv: Inventory, n_gpus: int, scheme: str) -> dict[str, int]:
    """Unit -> GPU index from the loader's own placement (one GPU: everything on 0)."""
    from ..model.placement import device_map

    if n_gpus <= 1:
        return {u: 0 for u in inv.units}
    dm = device_map(inv.config, n_gpus, scheme, sizes=inv.layer_sizes())
    return {u: dm.get(u, 0 if u == "model.embed_tokens" else n_gpus - 1) for u in inv.units}


# -- the steps ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What a step holds and runs on one node's devices, in the terms the byte counts need."""

    dtype_bytes: int  # bytes per element of the compute dtype (activations, unquantized weights)
    nf4_linears: bool  # the linears are NF4
    nf4_experts: bool  # the fused MoE experts are NF4 (dequantized CHUNK_EXPERTS at a time)
    tokens: int  # tokens per forward (batch x length)
    chunk: int = 0  # tokens per chunk of the loss pass (train only)
    last_k: int = 0  # adapted layers (train only)
    lora_params: int = 0  # trainable LoRA parameters (train only)
    from_pretrained: bool = True  # weights pass through the host on their way to the GPUs
    train: bool = True  # one HARI fast-path step; False: a forward only
    probe_tokens: int = 0  # forward only: tokens whose fp32 logits are compared
    fp8: bool = False  # forward only: linears and experts held as stored in FP8, block-scaled FP8 GEMMs
    kit_experts: bool = True  # bf16 experts run the kit's grouped forward (``LoadConfig.kit_experts``)


def training_devices(
    inv: Inventory, work: Workload, *, n_gpus: int, scheme: str, gpu_bytes: float, host_bytes: float
) -> list[Device]:
    """HARI load + one fast-path step (train=True) or an inspection forward (train=False), per device."""
    c, act = inv.config, work.dtype_bytes
    dtype_bytes, nf4_linears, nf4_experts, tokens = (
        work.dtype_bytes,
        work.nf4_linears,
        work.nf4_experts,
        work.tokens,
    )
    chunk, last_k, lora_params, train = work.chunk, work.last_k, work.lora_params, work.train
    per_kind = bytes_per_param(dtype_bytes, nf4_linears, nf4_experts)
    if work.fp8:
        per_kind |= {"experts": FP8_BLOCK_BYTES, "linear": FP8_BLOCK_BYTES}
    weights = {u: inv.unit_bytes(u, per_kind) for u in inv.units}
    n_layers = len(inv.layers)
    adapted = set(range(n_layers - last_k, n_layers))
    vocab = c.vocab_size
    linear_dequant = inv.largest_linear * act if nf4_linears else 0.0

    on_gpu = n_gpus > 0
    where = unit_devices(inv, n_gpus, scheme) if on_gpu else {u: 0 for u in inv.units}
    slots = max(n_gpus, 1)
    dev_weights, dequant, act_peak = [0.0] * slots, [0.0] * slots, [0.0] * slots
    adapted_peak = [(0.0, 0.0)] * slots  # (dequantized experts, activations) of the adapted layers' transient
    for unit, d in where.items():
        dev_weights[d] += weights[unit]
        if unit.startswith("model.layers."):
            i = int(unit.rsplit(".", 1)[1])
            moe = _is_moe(c, i)
            if train and i in adapted:
                # the reference forward and the backward run through it while the saved activations are held
                deq, fwd = adapted_layer_transient_bytes(c, i, tokens, act, nf4_experts)
                if deq + linear_dequant + fwd > sum(adapted_peak[d]):
                    adapted_peak[d] = (deq + linear_dequant, fwd)
                continue
            dequant[d] = max(
                dequant[d], (dequant_bytes(c, nf4_experts, act) if moe else 0.0) + linear_dequant
            )
            forward = layer_forward_bytes(c, i, tokens, act, nf4_experts, work.kit_experts)
            if work.fp8 and moe:
                forward = max(forward, fp8_moe_forward_bytes(c, tokens, act))
            act_peak[d] = max(act_peak[d], forward)
    last = where.get("lm_head", where[inv.layers[-1]])
    saved = 0.0
    if train:
        saved = sum(layer_saved_bytes(c, i, tokens, act, nf4_experts) for i in adapted)
        saved += tokens * c.hidden_size * (6 * act + 8)  # input, student, ref, gathered pair, grads (+fp32)
        per_logit = LOSS_FUSED_TEMPS * act if on_gpu else 4 * LOSS_FP32_TEMPS + 2 * act
        loss = min(chunk, tokens) * vocab * per_logit
    else:
        loss = work.probe_tokens * vocab * (4 * PROBE_FP32_TEMPS + act)
    devices = []
    for d in range(slots):
        # the peak is one phase: a layer's forward/backward (dequantized experts + its transient) or the loss
        # the frozen layers' forward or the adapted layers' reference forward / backward, whichever is larger
        deq, fwd = max((dequant[d], act_peak[d]), adapted_peak[d], key=sum)
        layer_phase = {
            "dequant (transient)": deq,
            "activations": fwd + (saved if d == last else 0),
        }
        loss_phase = {"activations": saved, "loss / logits": loss} if d == last else {}
        phase, parts = (
            ("layer", layer_phase)
            if sum(layer_phase.values()) >= sum(loss_phase.values())
            else ("loss", loss_phase)
        )
        parts = {"weights": dev_weights[d], **parts}
        if d == last and train:
            parts["LoRA + optimizer"] = lora_params * LORA_BYTES_PER_PARAM
        if on_gpu:
            parts["cuBLAS workspaces"] = CUBLAS_WORKSPACES
            parts["runtime"] = CUDA_RUNTIME
            devices.append(Device(f"gpu {d}", parts, gpu_bytes, phase))
        else:
            parts["runtime"] = HOST_RUNTIME
            devices.append(Device("host", parts, host_bytes, phase))
    if on_gpu:  # the host only loads: from_pretrained passes the checkpoint through it, streaming one tensor
        host = {"runtime": HOST_RUNTIME}
        if work.from_pretrained:
            host["weights in transit"] = sum(
                inv.unit_bytes(u, bytes_per_param(dtype_bytes, False, False)) for u in inv.units
            )
        devices.append(Device("host", host, host_bytes))
    return devices


def reference_devices(inv: Inventory, host_bytes: float, tokens: int) -> list[Device]:
    """A transformers model in fp32 on the host (the parity reference, the merged-logits check)."""
    per_kind = bytes_per_param(4, False, False)
    weights = sum(inv.unit_bytes(u, per_kind) for u in inv.units)
    parts = {
        "weights": weights,
        "activations": layer_forward_bytes(inv.config, len(inv.layers) - 1, tokens, 4, False),
        "loss / logits": tokens * inv.config.vocab_size * 4 * 3,
        "runtime": HOST_RUNTIME,
    }
    return [Device("host", parts, host_bytes)]


def serving_devices(
    inv: Inventory,
    *,
    dtype: str,
    n_gpus: int,
    gpu_bytes: float,
    utilization: float,
    host_bytes: float,
    tp: int,
    pp: int,
    max_model_len: int,
    max_num_seqs: int,
    batched_tokens: int,
    enforce_eager: bool,
    cpu_kv_bytes: float,
    expert_shards: int = 0,
) -> tuple[list[Device], dict]:
    """vLLM: weights sharded over TP x PP, the profiling activations, and the KV cache the rest leaves.

    ``expert_shards``: GPUs the routed experts are split over (TP x PP x DP with expert parallel, where
    each replica keeps its own attention and dense layers but holds only its share of the experts);
    0: as the other weights, over TP x PP."""
    c = inv.config
    per_kind = served_bytes_per_param(c, dtype)
    weights = sum(inv.unit_bytes(u, per_kind) for u in inv.units)
    experts = inv.kind_total("experts") * per_kind["experts"]
    layers = len(inv.layers)
    if getattr(c, "kv_lora_rank", None):  # MLA caches the latent, replicated on every TP rank
        kv_token = layers / pp * (c.kv_lora_rank + c.qk_rope_head_dim) * 2
    else:
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = max(1, (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) // tp)
        kv_token = layers / pp * 2 * kv_heads * head_dim * 2
    activations = (
        batched_tokens
        * 2
        * max(
            _attention_per_token(c),
            _mlp_per_token(c, True, False, False)
            if getattr(c, "n_routed_experts", 0)
            else 4 * c.intermediate_size,
        )
        / tp
        + max_num_seqs * c.vocab_size * 4 * 2
    )
    info = {"kv_bytes_per_token": kv_token}
    if n_gpus == 0:  # vLLM-CPU: weights and a fixed KV space in host memory
        parts = {
            "weights": weights,
            "activations": activations,
            "KV cache": cpu_kv_bytes,
            "runtime": VLLM_HOST_RUNTIME,
        }
        info["kv_tokens"] = int(cpu_kv_bytes // kv_token)
        return [Device("host", parts, host_bytes)], info
    budget = utilization * gpu_bytes
    parts = {
        "weights": (weights - experts) / (tp * pp) + experts / (expert_shards or tp * pp),
        "activations": activations,
        "CUDA graphs": 0.0 if enforce_eager else 1.0 * GIB,
        "runtime": CUDA_RUNTIME,
    }
    kv = max(0.0, budget - sum(parts.values()))
    parts["KV cache"] = kv
    info["kv_tokens"] = int(kv // kv_token)
    dev = Device("each gpu", parts, budget)
    return [dev, Device("host", {"runtime": VLLM_HOST_RUNTIME}, host_bytes)], info
