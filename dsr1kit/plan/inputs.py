"""What each planner reads: one small frozen dataclass per step, built by that step's module in ``steps/``.

Fields carry no defaults where a notebook parameter of the same name has one (that default lives in
``dsr1kit.params`` alone); the names are the parameters' names, so the advice a planner gives
("quantize_experts: true fits") names the key to change.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainingInputs:
    """Notebook 20's load and step: the model as ``model.load`` loads it, one step of batch × max_len."""

    model: str  # HF repo, local dir, or an embedded model's name
    trust_remote_code: bool
    dtype: str  # bfloat16 | float32: the compute dtype
    quantization: str  # nf4 | none: the linears
    quantize_experts: bool  # NF4 fused MoE experts
    device_map: str  # contiguous | round_robin | cpu
    batch_size: int  # samples per micro-batch
    max_len: int  # tokens per sample
    loss_chunk: int  # tokens per chunk of the lm_head / CE / KL pass
    lora_r: int
    lora_last_k_layers: int
    lora_targets: tuple[str, ...]  # (): the attention projections, auto-detected
    from_prefix_cache: bool  # train from the prefix cache: one GPU per rank, only the adapted layers
    cached_layers_nf4: bool  # from the cache: the adapted layers in NF4
    prefix_tokens_per_batch: int  # padded tokens per micro-batch of the prefix pass
    prefix_fp8: bool = False  # the prefix pass holds the FP8 weights as stored (prefix_precision fp8)


@dataclass(frozen=True)
class InspectionInputs:
    """Notebook 30: the base loaded for probes (bf16 on GPUs, fp32 on a CPU), optionally a merged copy."""

    quantization: str  # nf4 | none
    quantize_experts: bool
    max_len: int  # tokens per probe row
    merge: bool  # a merged checkpoint is written and its logits checked in fp32 on the host


@dataclass(frozen=True)
class ServingInputs:
    """Notebook 10: what vLLM holds per GPU (TP × PP, replicated over DP; experts over TP × PP × DP with
    expert parallel) and its KV cache."""

    dtype: str  # auto | bfloat16 | float16 | float32
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enforce_eager: bool
    cpu_kv_cache_gib: float  # VLLM_CPU_KVCACHE_SPACE on vLLM-CPU (vLLM's default: 4)
    enable_expert_parallel: bool = False  # experts split over every GPU of every replica (TP × PP × DP)
