"""Load a causal LM for HARI: plain or NF4, explicit placement, no fp32 upcast.

What differs from a plain ``from_pretrained``, and why:

- NF4 with double quantization and bf16 compute (QLoRA), but *no*
  ``prepare_model_for_kbit_training``: it upcasts every non-4-bit weight to
  fp32 and doubled a 4.7B model's memory (8.4 → 16.6 GiB).
- An explicit device_map for one node (``placement``), ``max_memory`` per GPU
  and one offload folder per rank (ranks of one node must not share it).
- Routing stays fp32 (native router computes in fp32; no autocast here).
- bf16 routed experts run the kit's grouped forward (``experts_grouped``,
  ``kit_experts``): transformers' values and gradients bit for bit, without
  reordering fp32 copies of every routed row.
- Tokenizer: pad = eos when missing, right padding; the embeddings are resized
  when the tokenizer has more tokens than the model (an out-of-range id is a
  device-side assert on a GPU).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..embedded import tiny
from . import placement, quirks
from .experts_grouped import use_kit_experts_

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class LoadConfig:
    """What a model load reads; the names are notebook 20's parameters, so an error names the key to change."""

    model: str  # HF repo, local dir, or an embedded model's name
    dtype: str  # bfloat16 | float32: the compute dtype
    quantization: str  # nf4 | none: the linears
    quantize_experts: bool  # NF4 fused MoE experts (DeepSeek-V3 only), streamed from the shards
    device_map: str  # contiguous | round_robin | cpu
    trust_remote_code: bool = False  # run the checkpoint's own modeling code
    grad_checkpointing: bool = False  # recompute activations in backward
    offload_dir: str = ""  # per-rank offload folder root; "": none
    max_memory_gib_per_gpu: float = 78.0  # GiB per GPU the placement may fill
    cpu_max_memory_gib: float = 300.0  # GiB of host memory the placement may fill
    cached_layers_nf4: bool = False  # load_adapted: the adapted layers in NF4
    fp8_compute: bool = (
        False  # FP8 weights kept as stored, block-scaled FP8 GEMMs (the prefix pass, forward only)
    )
    # bf16 routed experts through the kit's grouped forward (experts_grouped); on since an H100 measured it
    # (docs/benchmarks.md): gradients equal, 1.01x the cached step, a frozen forward's peak 2.8 GiB lower at 16k
    # tokens. Benchmarks set it to compare with transformers' grouped_mm forward.
    kit_experts: bool = True
    # the FP8 prefix pass's lean layers (prefix_layer) take the rotary/key and router Triton kernels on a GPU;
    # on since their GPU tests passed on an H100 and bench.prefix_fp8 measured them there
    prefix_kernels: bool = True

    @classmethod
    def for_evaluation(
        cls, model: str, quantization: str = "none", quantize_experts: bool = False
    ) -> LoadConfig:
        """How a trained adapter's base is loaded to be measured: bf16 over the GPUs, fp32 on a CPU."""
        on_gpu = torch.cuda.is_available()
        return cls(
            model=model,
            dtype="bfloat16" if on_gpu else "float32",
            quantization=quantization,
            quantize_experts=quantize_experts,
            device_map="contiguous" if on_gpu else "cpu",
        )


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    path: str
    device_map: dict[str, Any] | str | None
    info: dict[str, Any] = field(default_factory=dict)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The kit's one tokenizer loader: token from the environment, pad = eos when missing, right padding."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        path, trust_remote_code=trust_remote_code, token=os.environ.get("HF_TOKEN")
    )
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


def ensure_vocab(model, tokenizer) -> bool:
    """Resize the embeddings when the tokenizer has ids the model cannot embed; True if resized."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) <= rows:
        return False
    warnings.warn(
        f"tokenizer has {len(tokenizer)} tokens but the model embeds {rows}: resizing the "
        f"embeddings (new rows are untrained)",
        stacklevel=2,
    )
    model.resize_token_embeddings(len(tokenizer))
    return True


def quantization_config(compute_dtype: torch.dtype):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
        llm_int8_skip_modules=["lm_head", "gate"],  # logits and routing stay in full precision
    )


def resolve_device_map(cfg: LoadConfig, config) -> tuple[dict[str, Any] | str | None, dict[Any, str] | None]:
    """device_map and max_memory for this node (CPU when there is no GPU or device_map=cpu)."""
    n_gpus = torch.cuda.device_count()
    if cfg.device_map == "cpu" or n_gpus == 0:
        return None, None
    dm = placement.device_map(config, n_gpus, cfg.device_map)
    max_memory: dict[Any, str] = {i: f"{cfg.max_memory_gib_per_gpu}GiB" for i in range(n_gpus)}
    max_memory["cpu"] = f"{cfg.cpu_max_memory_gib}GiB"
    return dm, max_memory


def local_checkpoint(name: str) -> str:
    """A local folder for ``name``: as given when it exists, else the hub snapshot (clusters only)."""
    path = tiny.resolve_model(name)
    if Path(path).is_dir():
        return path
    from huggingface_hub import snapshot_download

    return snapshot_download(path, token=os.environ.get("HF_TOKEN"))


def _load_streaming(cfg: LoadConfig, path: str, dm, dtype):
    """DeepSeek-V3 read layer by layer from BF16 or FP8 shards (R1 fits on one node): NF4 experts, or FP8
    weights kept as stored (``fp8_compute``)."""
    from .stream_load import load_streaming

    model = load_streaming(
        local_checkpoint(path),
        device_map=dm if dm is not None else "cpu",
        nf4_linears=cfg.quantization == "nf4",
        nf4_experts=cfg.quantize_experts,
        dtype=dtype,
        fp8_compute=cfg.fp8_compute,
        prefix_kernels=cfg.prefix_kernels,
    )
    return dispatch_across_gpus(model, dm)


def dispatch_across_gpus(model, dm):
    """Hooks that move activations between the GPUs of an explicit device_map (as from_pretrained does)."""
    if isinstance(dm, dict) and len(set(dm.values())) > 1:
        from accelerate import dispatch_model

        dispatch_model(model, device_map=dm)
    return model


def load_model(cfg: LoadConfig, rank: int = 0, tokenizer=None) -> LoadedModel:
    """Model + tokenizer as ``cfg`` says; a tokenizer already loaded by load_tokenizer is reused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tiny.resolve_model(cfg.model)
    token = os.environ.get("HF_TOKEN")
    config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code, token=token)
    dtype = DTYPES[cfg.dtype]
    dm, max_memory = resolve_device_map(cfg, config)
    if cfg.quantize_experts and config.model_type != "deepseek_v3":
        raise ValueError(
            f"quantize_experts needs a DeepSeek-V3 checkpoint (R1, V3); {cfg.model} is "
            f"{config.model_type}: set quantize_experts: false"
        )
    kwargs: dict[str, Any] = dict(
        dtype=dtype, trust_remote_code=cfg.trust_remote_code, token=token, low_cpu_mem_usage=True
    )
    if dm is not None:
        kwargs.update(device_map=dm, max_memory=max_memory)
    if cfg.offload_dir:
        folder = Path(cfg.offload_dir) / f"rank{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        kwargs["offload_folder"] = str(folder)
    if cfg.quantization == "nf4":
        kwargs["quantization_config"] = quantization_config(dtype)
    if cfg.fp8_compute and config.model_type != "deepseek_v3":
        raise ValueError(
            f"FP8 compute reads DeepSeek-V3 checkpoints (R1, V3); {cfg.model} is {config.model_type}: set "
            "prefix_precision to nf4 or bf16"
        )
    if cfg.quantize_experts or cfg.fp8_compute:
        model = _load_streaming(cfg, path, dm, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.config.use_cache = False
    for param in model.parameters():
        param.requires_grad_(False)
    tokenizer = tokenizer or load_tokenizer(path, cfg.trust_remote_code)
    resized = ensure_vocab(model, tokenizer)
    if cfg.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    applied = quirks.apply_quirks(model)
    kit_experts = cfg.kit_experts and use_kit_experts_(model)
    info = {
        "path": path,
        "dtype": cfg.dtype,
        "quantization": cfg.quantization,
        "resized_vocab": resized,
        "quantize_experts": cfg.quantize_experts,
        "fp8_compute": cfg.fp8_compute,
        "n_layers": config.num_hidden_layers,
        "parameters": sum(x.numel() for x in model.parameters()),
        "memory_gib": round(model.get_memory_footprint() / 2**30, 3),
        "quirks": applied,
        "kit_experts": kit_experts,
        "placement": cfg.device_map if dm is not None else "cpu",
        "boundary_crossings": placement.boundary_crossings(dm) if dm else 0,
    }
    return LoadedModel(model, tokenizer, path, dm, info)


def load_adapted(cfg: LoadConfig, first_layer: int, local_rank: int = 0, tokenizer=None) -> LoadedModel:
    """Training from the prefix cache: layers ≥ ``first_layer``, norm and lm_head on this rank's own device
    (GPU ``local_rank``, or the host), bf16/fp32 or NF4 (``cached_layers_nf4``); nothing else is read."""
    from .partial import load_adapted_layers, loaded_parameters

    path = local_checkpoint(cfg.model)
    on_gpu = torch.cuda.is_available() and cfg.device_map != "cpu"
    # one GPU per task shows each task its GPU as cuda:0; all of the node's GPUs: cuda:local_rank
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    model = load_adapted_layers(
        path,
        first_layer,
        device,
        dtype=DTYPES[cfg.dtype],
        nf4=cfg.cached_layers_nf4,
        progress=local_rank == 0,
    )
    model.config.use_cache = False
    for param in model.parameters():
        param.requires_grad_(False)
    tokenizer = tokenizer or load_tokenizer(path, cfg.trust_remote_code)
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but {path} embeds {model.config.vocab_size}: "
            f"the prefix cache needs a tokenizer that fits the model (prefix_cache: off resizes)"
        )
    if cfg.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n = model.config.num_hidden_layers
    info = {
        "path": path,
        "dtype": cfg.dtype,
        "quantization": "nf4" if cfg.cached_layers_nf4 else "none",
        "quantize_experts": cfg.cached_layers_nf4,
        "n_layers": n,
        "loaded_layers": f"{first_layer}-{n - 1} of {n}",
        "parameters": loaded_parameters(model),
        "memory_gib": round(model.get_memory_footprint() / 2**30, 3),
        "quirks": quirks.apply_quirks(model),
        "kit_experts": cfg.kit_experts and use_kit_experts_(model),
        "placement": str(device),
        "boundary_crossings": 0,
    }
    return LoadedModel(model, tokenizer, path, None, info)


def load_with_adapter(cfg: LoadConfig, adapter_dir: str | Path) -> tuple[Any, Any, LoadedModel]:
    """(PeftModel in eval mode, tokenizer, LoadedModel): the base through ``load_model``, the adapter on it;
    the tokenizer saved with the adapter when there is one, else the base's."""
    from peft import PeftModel

    loaded = load_model(cfg)
    model = PeftModel.from_pretrained(loaded.model, str(adapter_dir))
    model.eval()
    tok_dir = adapter_dir if (Path(adapter_dir) / "tokenizer_config.json").is_file() else loaded.path
    return model, load_tokenizer(str(tok_dir)), loaded
