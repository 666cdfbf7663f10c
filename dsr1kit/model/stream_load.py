"""Load DeepSeek-V3/R1 layer by layer from BF16 or FP8 safetensors shards, quantizing as it goes.

``from_pretrained`` on R1 either needs a 1.3 TB BF16 copy of the FP8 release or
passes the model through host memory. Here the model is built on the meta
device (no weights), then each unit (embeddings, each decoder layer, norm +
lm_head) is read tensor by tensor from its shards, FP8 blocks are dequantized
(`fp8`), linears become bitsandbytes NF4 ``Linear4bit`` and routed experts
`NF4Experts` when asked, and every tensor goes straight to the device the
device_map gives. Shard handles are closed after each unit, so the host holds
about one layer at a time (and far less when the device is a GPU).

With ``fp8_compute`` (the prefix pass), every linear and routed expert stored
in FP8 stays as stored: ``FP8Linear`` / ``FP8Experts`` (`fp8_compute`) hold the
e4m3 weights and their block scales and run block-scaled FP8 GEMMs; nothing is
dequantized. The rest (embeddings, norms, router, lm_head) loads in ``dtype``.

Both expert layouts load: per-expert keys as in DeepSeek's own checkpoints and
what transformers 5 ``save_pretrained`` writes
(``mlp.experts.7.gate_proj.weight``), and fused keys
(``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from .checkpoint_index import CheckpointError, read_weight_map
from .experts_nf4 import (
    CHUNK_EXPERTS,
    NF4Experts,
    experts_implementation,
    is_fused_experts,
    keep_routing_fp32,
)
from .fp8 import DEFAULT_BLOCK, FP8_DTYPE, SCALE_SUFFIX, dequantize_fp8_blocks
from .fp8_compute import GROUP, FP8Experts, FP8Linear
from .prefix_layer import lean_prefix_layers_

PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<part>gate|up|down)_proj\.weight$")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
FP32_KEYS = ("e_score_correction_bias", "gate.weight")  # transformers keeps the router in fp32
DeviceMap = Mapping[str, Any] | str | int | torch.device


# -- the checkpoint on disk ----------------------------------------------------------------


class Checkpoint:
    """config.json + the tensor → shard map of a safetensors checkpoint directory."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config, self.fp8_block = read_config(self.path)
        self.weight_map = read_weight_map(self.path)

    def shard_of(self, key: str) -> Path:
        return self.path / self.weight_map[key]


def read_config(path: Path):
    """DeepseekV3Config from config.json, and the FP8 block size when the weights are FP8."""
    from transformers import DeepseekV3Config

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(
            f"{cfg_file} not found: a checkpoint directory needs config.json next to its "
            "*.safetensors shards (download the whole repository, not only the shards)."
        )
    raw = json.loads(cfg_file.read_text())
    if raw.get("model_type") != "deepseek_v3":
        raise CheckpointError(
            f"{cfg_file}: model_type is {raw.get('model_type')!r}; the streaming loader reads "
            "DeepSeek-V3/R1 checkpoints (model_type 'deepseek_v3'). Load other models with "
            "dsr1kit.model.load.load_model."
        )
    quant = raw.pop("quantization_config", None)
    fp8_block = None
    if quant is not None:
        if quant.get("quant_method") != "fp8":
            raise CheckpointError(
                f"{cfg_file}: quantization_config.quant_method {quant.get('quant_method')!r} is "
                "not supported; the loader reads BF16 checkpoints and DeepSeek's block FP8."
            )
        fp8_block = tuple(quant.get("weight_block_size") or DEFAULT_BLOCK)
    for key in ("auto_map", "architectures"):  # transformers' native DeepseekV3, never the repo's remote code
        raw.pop(key, None)
    return DeepseekV3Config.from_dict(raw), fp8_block


# -- does the checkpoint match its config? ----------------------------------------------------


def _normalised_keys(ckpt: Checkpoint) -> set[str]:
    """Checkpoint keys in the model's naming: scales dropped, per-expert keys as ``experts.E.part``."""
    n_layers = ckpt.config.num_hidden_layers
    mtp = range(n_layers, n_layers + (getattr(ckpt.config, "num_nextn_predict_layers", 0) or 0))
    keys = set()
    for key in ckpt.weight_map:
        layer = LAYER.match(key)
        if key.endswith(SCALE_SUFFIX) or (layer and int(layer.group(1)) in mtp):  # R1's MTP layer 61
            continue
        keys.add(key)
    return keys


def _expected_keys(model: nn.Module, per_expert: bool) -> set[str]:
    keys = set(model.state_dict().keys())
    if model.config.tie_word_embeddings:
        keys.discard("lm_head.weight")
    if not per_expert:
        return keys
    for name, module in model.named_modules():
        if is_fused_experts(module):
            keys -= {f"{name}.gate_up_proj", f"{name}.down_proj"}
            keys |= {
                f"{name}.{e}.{p}_proj.weight"
                for e in range(module.gate_up_proj.shape[0])
                for p in ("gate", "up", "down")
            }
    return keys


def check_matches_config(ckpt: Checkpoint, model: nn.Module) -> None:
    """Every tensor the config's model needs is in the shards, and nothing else is."""
    found = _normalised_keys(ckpt)
    per_expert = any(PER_EXPERT.match(k) for k in found)
    expected = _expected_keys(model, per_expert)
    if model.config.tie_word_embeddings:
        found.discard("lm_head.weight")
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if not missing and not unexpected:
        return
    c = ckpt.config
    lines = [
        f"the shards in {ckpt.path} do not match its config.json "
        f"(num_hidden_layers={c.num_hidden_layers}, n_routed_experts={c.n_routed_experts}, "
        f"first_k_dense_replace={c.first_k_dense_replace}):"
    ]
    for label, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            lines.append(f"  {len(keys)} {label} tensor(s), e.g. " + ", ".join(keys[:4]))
    lines.append("Use the config.json that was published with these shards (or re-download both).")
    raise CheckpointError("\n".join(lines))


def check_expected_config(config, expect: Mapping[str, Any]) -> None:
    """The checkpoint is the model the caller meant (e.g. R1's 61 layers, 256 experts): all differences at once."""
    diffs = [
        f"  {k}: expected {v!r}, checkpoint has {getattr(config, k, None)!r}"
        for k, v in expect.items()
        if getattr(config, k, None) != v
    ]
    if diffs:
        raise CheckpointError(
            "checkpoint config.json does not match the expected model:\n"
            + "\n".join(diffs)
            + "\nPoint the loader at the right checkpoint or fix the expected values."
        )


# -- placement ----------------------------------------------------------------------------


def device_for(name: str, device_map: DeviceMap, default: Any = None) -> torch.device:
    """The device of module `name`: the longest device_map prefix that covers it."""
    if not isinstance(device_map, Mapping):
        return _as_device(device_map)
    hits = [p for p in device_map if p == "" or name == p or name.startswith(p + ".")]
    if not hits:
        if default is not None:
            return _as_device(default)
        raise CheckpointError(f"device_map has no entry for {name!r}; add one, e.g. {{'{name}': 0}}.")
    return _as_device(device_map[max(hits, key=len)])


def _as_device(value: Any) -> torch.device:
    if isinstance(value, int):
        return torch.device("cuda", value)
    if str(value) in ("disk", "meta"):
        raise CheckpointError(
            f"device_map value {value!r} is not supported by the streaming loader: "
            "give every module a GPU index or 'cpu'."
        )
    return torch.device(value)


# -- reading and converting tensors ---------------------------------------------------------


class _UnitReader:
    """Tensors of one unit; shard handles (mmaps) are closed when the unit is done."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt, self.handles = ckpt, {}

    def _handle(self, key: str):
        shard = self.ckpt.shard_of(key)
        if shard not in self.handles:
            self.handles[shard] = safe_open(shard, framework="pt", device="cpu").__enter__()
        return self.handles[shard]

    def has(self, key: str) -> bool:
        return key in self.ckpt.weight_map

    def read(
        self,
        key: str,
        shape: tuple[int, ...],
        device: torch.device,
        dtype: torch.dtype,
        index: int | None = None,
        as_stored: bool = False,
    ) -> torch.Tensor:
        """Tensor `key` (row `index` of it, if given) checked against `shape`, on `device` in `dtype`;
        ``as_stored``: an FP8 tensor is not dequantized."""
        handle = self._handle(key)
        sliced = handle.get_slice(key)
        found = tuple(sliced.get_shape())
        full = shape if index is None else (found[0], *shape)
        if found != full:
            raise CheckpointError(
                f"{self.ckpt.shard_of(key).name}: tensor {key} has shape {found}, but the model built from "
                f"{self.ckpt.path / 'config.json'} expects {full}. The shards and config.json disagree: use "
                "the config.json published with these shards."
            )
        raw = handle.get_tensor(key) if index is None else sliced[index]
        tensor = raw
        if tensor.dtype == torch.float8_e4m3fn and not as_stored:
            tensor = self._dequantize(key, tensor.to(device), device, dtype)
        tensor = tensor.to(device=device, dtype=dtype)
        if tensor.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr():
            # safetensors hands out views of its mmap: one kept view keeps the whole shard resident
            tensor = tensor.clone()
        return tensor

    def stored_fp8(self, key: str) -> bool:
        """Whether the checkpoint stores ``key`` as e4m3 (with its block scales)."""
        return self.has(key) and self._handle(key).get_slice(key).get_dtype() == "F8_E4M3"

    def read_fp8(
        self, key: str, shape: tuple[int, int], device: torch.device, index: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 weight, float32 scale_inv) of ``key`` as stored (row ``index`` of both, if given)."""
        weight = self.read(key, shape, device, FP8_DTYPE, index=index, as_stored=True)
        scale_key = key + SCALE_SUFFIX
        if not self.has(scale_key):
            raise CheckpointError(
                f"{self.ckpt.shard_of(key).name}: FP8 tensor {key} has no {scale_key}; "
                "the checkpoint is incomplete (re-download the shard that holds it)."
            )
        sliced = self._handle(scale_key).get_slice(scale_key)
        scale = self._handle(scale_key).get_tensor(scale_key) if index is None else sliced[index]
        return weight, scale.to(device=device, dtype=torch.float32).contiguous()

    def _dequantize(self, key, tensor, device, dtype):
        scale_key = key + SCALE_SUFFIX
        if not self.has(scale_key):
            raise CheckpointError(
                f"{self.ckpt.shard_of(key).name}: FP8 tensor {key} has no {scale_key}; "
                "the checkpoint is incomplete (re-download the shard that holds it)."
            )
        scale = self._handle(scale_key).get_tensor(scale_key).to(device)
        return dequantize_fp8_blocks(tensor, scale, self.ckpt.fp8_block or DEFAULT_BLOCK, dtype, name=key)

    def close(self):
        for handle in self.handles.values():
            handle.__exit__(None, None, None)
        self.handles.clear()


def nf4_linear(linear: nn.Linear, weight: torch.Tensor, device: torch.device, compute_dtype) -> nn.Module:
    """A bitsandbytes Linear4bit (NF4, double quant, blocksize 64) as BitsAndBytesConfig would make."""
    import bitsandbytes as bnb

    new = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=compute_dtype,
        compress_statistics=True,
        quant_type="nf4",
        device="meta",
    )
    new.weight = bnb.nn.Params4bit(
        weight, requires_grad=False, compress_statistics=True, blocksize=64, quant_type="nf4", module=new
    ).to(device)
    new.support_avx512bf16_for_cpu = (
        False  # an eval forward on CPU repacks NF4; training then gets None grads
    )
    return new


class UnitLoader:
    """Fills one meta-device model, unit by unit."""

    def __init__(
        self,
        ckpt,
        model,
        device_map,
        nf4_linears,
        nf4_experts,
        keep_bf16,
        dtype,
        chunk_experts,
        fp8_compute=False,
    ):
        self.ckpt, self.model, self.device_map = ckpt, model, device_map
        self.nf4_linears, self.nf4_experts, self.keep_bf16 = nf4_linears, nf4_experts, tuple(keep_bf16)
        self.dtype, self.chunk_experts, self.fp8_compute = dtype, chunk_experts, fp8_compute
        self.implementation = experts_implementation(model.config)
        if fp8_compute and ckpt.fp8_block not in (None, (GROUP, GROUP)):
            raise CheckpointError(
                f"{ckpt.path / 'config.json'}: FP8 compute runs 128x128 weight blocks, this checkpoint has "
                f"{ckpt.fp8_block}; load it in bf16 or NF4 instead"
            )

    def load_unit(self, prefix: str) -> None:
        unit = self.model.get_submodule(prefix)
        device = device_for(prefix, self.device_map)
        reader = _UnitReader(self.ckpt)
        try:
            for name, module in list(unit.named_modules()):
                full = f"{prefix}.{name}" if name else prefix
                if is_fused_experts(module) and self.fp8_compute and self._experts_fp8(reader, full):
                    self._fp8_experts(reader, full, module, device)
                elif is_fused_experts(module):
                    self._experts(reader, full, module, device)
                elif (
                    isinstance(module, nn.Linear) and self.fp8_compute and reader.stored_fp8(f"{full}.weight")
                ):
                    self._fp8_linear(reader, full, module, device)
                elif isinstance(module, nn.Linear) and self._quantize_linear(full):
                    weight = reader.read(f"{full}.weight", tuple(module.weight.shape), device, self.dtype)
                    self._replace(full, nf4_linear(module, weight, device, self.dtype))
                else:
                    self._direct(reader, full, module, device)
        finally:
            reader.close()

    def _quantize_linear(self, name: str) -> bool:
        return self.nf4_linears and not any(name == s or name.endswith("." + s) for s in self.keep_bf16)

    def _dtype_for(self, key: str, tensor: torch.Tensor) -> torch.dtype:
        if not tensor.is_floating_point():
            return tensor.dtype
        return torch.float32 if key.endswith(FP32_KEYS) else self.dtype

    def _direct(self, reader, full, module, device) -> None:
        persistent = [
            (n, b)
            for n, b in module.named_buffers(recurse=False)
            if n not in module._non_persistent_buffers_set
        ]
        for pname, tensor in list(module.named_parameters(recurse=False)) + persistent:
            key = f"{full}.{pname}"
            if key == "lm_head.weight" and self.model.config.tie_word_embeddings:
                continue
            value = reader.read(key, tuple(tensor.shape), device, self._dtype_for(key, tensor))
            if isinstance(tensor, nn.Parameter):
                module._parameters[pname] = nn.Parameter(value, requires_grad=tensor.requires_grad)
            else:
                module._buffers[pname] = value

    def _experts(self, reader, full, module, device) -> None:
        n_exp, two_i, hidden = module.gate_up_proj.shape
        inter = two_i // 2
        fused = reader.has(f"{full}.gate_up_proj")
        if self.nf4_experts:
            target = NF4Experts(
                n_exp,
                hidden,
                inter,
                module.act_fn,
                implementation=self.implementation,
                dtype=self.dtype,
                chunk_experts=self.chunk_experts,
                device=device,
            )
        else:
            gate_up = torch.empty(n_exp, two_i, hidden, dtype=self.dtype, device=device)
            down = torch.empty(n_exp, hidden, inter, dtype=self.dtype, device=device)
        for e in range(n_exp):
            if fused:
                gu = reader.read(f"{full}.gate_up_proj", (two_i, hidden), device, self.dtype, index=e)
                d = reader.read(f"{full}.down_proj", (hidden, inter), device, self.dtype, index=e)
            else:
                g, u = (
                    reader.read(f"{full}.{e}.{p}_proj.weight", (inter, hidden), device, self.dtype)
                    for p in ("gate", "up")
                )
                gu = torch.cat([g, u])
                d = reader.read(f"{full}.{e}.down_proj.weight", (hidden, inter), device, self.dtype)
            if self.nf4_experts:
                target.set_expert(e, gu, d)
            else:
                gate_up[e], down[e] = gu, d
        if self.nf4_experts:
            self._replace(full, target)
        else:
            module.gate_up_proj = nn.Parameter(gate_up, requires_grad=module.gate_up_proj.requires_grad)
            module.down_proj = nn.Parameter(down, requires_grad=module.down_proj.requires_grad)

    def _experts_fp8(self, reader, full) -> bool:
        return reader.stored_fp8(f"{full}.0.gate_proj.weight")

    def _fp8_linear(self, reader, full, module, device) -> None:
        new = FP8Linear(module.in_features, module.out_features, module.bias is not None, self.dtype, device)
        new.weight, new.weight_scale_inv = reader.read_fp8(
            f"{full}.weight", tuple(module.weight.shape), device
        )
        if module.bias is not None:
            new.bias = reader.read(f"{full}.bias", tuple(module.bias.shape), device, self.dtype)
        self._replace(full, new)

    def _fp8_experts(self, reader, full, module, device) -> None:
        """Routed experts stored one key per expert in FP8 (R1's layout), kept as stored."""
        n_exp, two_i, hidden = module.gate_up_proj.shape
        inter = two_i // 2
        target = FP8Experts(n_exp, hidden, inter, module.act_fn, device=device)
        for e in range(n_exp):
            gate, up = (
                reader.read_fp8(f"{full}.{e}.{p}_proj.weight", (inter, hidden), device)
                for p in ("gate", "up")
            )
            down = reader.read_fp8(f"{full}.{e}.down_proj.weight", (hidden, inter), device)
            target.set_expert(e, gate, up, down)
        self._replace(full, target)

    def _replace(self, name: str, new: nn.Module) -> None:
        parent, _, child = name.rpartition(".")
        setattr(self.model.get_submodule(parent), child, new)


# -- the entry point ------------------------------------------------------------------------


def skeleton(config) -> nn.Module:
    """The model with every parameter on the meta device: structure only, no memory."""
    from transformers import DeepseekV3ForCausalLM

    with torch.device("meta"):
        return DeepseekV3ForCausalLM(config)


def units(model: nn.Module) -> list[str]:
    """Load order: embeddings, each decoder layer, final norm, lm_head."""
    n = len(model.model.layers)
    return ["model.embed_tokens", *(f"model.layers.{i}" for i in range(n)), "model.norm", "lm_head"]


def load_streaming(
    path: str | Path,
    device_map: DeviceMap = "cpu",
    *,
    nf4_linears: bool = True,
    nf4_experts: bool = True,
    keep_bf16: tuple[str, ...] = ("lm_head",),
    dtype: torch.dtype = torch.bfloat16,
    expect_config: Mapping[str, Any] | None = None,
    chunk_experts: int = CHUNK_EXPERTS,
    progress: bool = True,
    fp8_compute: bool = False,
    prefix_kernels: bool = True,
) -> nn.Module:
    """DeepseekV3ForCausalLM from a BF16 or FP8 checkpoint dir, one unit at a time, in eval mode.

    device_map: ``"cpu"``, a GPU index, or ``{module-name prefix: device}`` as transformers takes.
    nf4_linears / nf4_experts: NF4 (double quant, blocksize 64, `dtype` compute) for the
    ``nn.Linear`` layers except `keep_bf16`, and for the routed experts.
    expect_config: config fields the checkpoint must have, e.g. ``{"n_routed_experts": 256}``.
    fp8_compute: keep what the checkpoint stores in FP8 as stored and run it in FP8 (forward only;
    overrides the NF4 flags for those tensors).
    prefix_kernels: with ``fp8_compute``, the lean layers take the rotary/key and router kernels on a GPU.
    """
    ckpt = Checkpoint(path)
    if expect_config:
        check_expected_config(ckpt.config, expect_config)
    model = skeleton(ckpt.config)
    check_matches_config(ckpt, model)
    if fp8_compute and ckpt.fp8_block is None:
        raise CheckpointError(
            f"{ckpt.path / 'config.json'} has no FP8 quantization_config: the checkpoint is not stored in FP8, "
            "so there is nothing to compute in FP8; load it in bf16 or NF4 (prefix_precision: bf16 or nf4)"
        )
    loader = UnitLoader(
        ckpt, model, device_map, nf4_linears, nf4_experts, keep_bf16, dtype, chunk_experts, fp8_compute
    )
    for prefix in tqdm(units(model), desc=f"loading {ckpt.path.name}", unit="unit", disable=not progress):
        if prefix == "lm_head" and model.config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
            continue
        loader.load_unit(prefix)
    finish_load(model, ckpt, device_map, dtype)
    if fp8_compute:  # a prefix-pass-only model: the leaner forward (same values, fewer memory passes)
        lean_prefix_layers_(model, kernels=prefix_kernels)
    return model


def finish_load(model: nn.Module, ckpt: Checkpoint, device_map: DeviceMap, dtype: torch.dtype) -> None:
    """Rebuild the non-persistent rotary buffers, check nothing stayed on meta, mark 4-bit for PEFT."""
    import bitsandbytes as bnb

    rotary = model.model.rotary_emb
    embed_device = device_for("model.embed_tokens", device_map)
    model.model.rotary_emb = type(rotary)(config=model.config).to(
        device_for("model.rotary_emb", device_map, default=embed_device)
    )
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"internal: {len(left)} tensors were not loaded, e.g. {left[:3]}")
    keep_routing_fp32(model)
    model.is_loaded_in_4bit = any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    model.config.dtype = dtype
    model.config._name_or_path = str(ckpt.path)
    _load_generation_config(model, ckpt.path)
    model.eval()


def _load_generation_config(model: nn.Module, path: Path) -> None:
    if (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
