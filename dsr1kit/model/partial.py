"""Only what training from the prefix cache needs: the adapted layers, the final norm, lm_head.

The frozen layers below the first adapted one become ``Passthrough`` modules
(their output is read from the cache) and the embeddings an empty stand-in,
so the model keeps its structure, its module names (an adapter trained here
is saved as ``model.layers.60…``, loadable on the full model) and its own
forward, which builds the causal mask and rotary embeddings for the adapted
layers from ``inputs_embeds``. For R1 that is one layer (about 22 GB in bf16,
6 GB with NF4 experts) plus lm_head, instead of 61 layers: every GPU can hold
its own copy and train data-parallel.

Weights stream from the checkpoint's shards as the full loader reads them
(``stream_load``): BF16 or FP8 blocks, dequantized to ``dtype``, NF4 when
asked.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .checkpoint_index import CheckpointError
from .experts_nf4 import CHUNK_EXPERTS
from .stream_load import Checkpoint, UnitLoader, finish_load, skeleton


class Passthrough(nn.Module):
    """Stands in for a frozen decoder layer whose output comes from the prefix cache."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states

    def extra_repr(self) -> str:
        return f"layer {self.index}: read from the prefix cache"


class NoEmbeddings(nn.Module):
    """The embeddings' place when inputs are cached hidden states: knows the vocab size, holds no weights."""

    def __init__(self, num_embeddings: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.register_buffer(
            "weight", torch.empty(num_embeddings, 0, device=device, dtype=dtype), persistent=False
        )

    def forward(self, input_ids):
        raise RuntimeError(
            "this model trains from the prefix cache and has no embeddings: pass inputs_embeds"
        )


def load_adapted_layers(
    path: str | Path,
    first_layer: int,
    device: torch.device | str | int = "cpu",
    *,
    dtype: torch.dtype = torch.bfloat16,
    nf4: bool = False,
    progress: bool = False,
) -> nn.Module:
    """DeepseekV3ForCausalLM with layers ≥ ``first_layer``, norm and lm_head loaded on ``device``; eval mode."""
    from tqdm.auto import tqdm

    ckpt = Checkpoint(path)
    if ckpt.config.tie_word_embeddings:
        raise CheckpointError(
            f"{path}: lm_head is tied to the embeddings; training from the prefix cache loads "
            "lm_head alone and needs an untied checkpoint (DeepSeek-V3/R1 are untied)"
        )
    n = ckpt.config.num_hidden_layers
    if not 0 <= first_layer < n:
        raise ValueError(f"first adapted layer {first_layer} is outside the model's {n} layers")
    model = skeleton(ckpt.config)
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    for i in range(first_layer):
        model.model.layers[i] = Passthrough(i)
    model.model.embed_tokens = NoEmbeddings(ckpt.config.vocab_size, device, dtype)
    loader = UnitLoader(
        ckpt,
        model,
        device,
        nf4_linears=nf4,
        nf4_experts=nf4,
        keep_bf16=("lm_head",),
        dtype=dtype,
        chunk_experts=CHUNK_EXPERTS,
    )
    names = [f"model.layers.{i}" for i in range(first_layer, n)] + ["model.norm", "lm_head"]
    for prefix in tqdm(
        names,
        desc=f"loading layers {first_layer}-{n - 1} of {ckpt.path.name}",
        unit="unit",
        disable=not progress,
    ):
        loader.load_unit(prefix)
    finish_load(model, ckpt, device, dtype)
    return model


def loaded_parameters(model: nn.Module) -> int:
    return sum(t.numel() for t in model.parameters())
