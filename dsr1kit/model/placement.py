"""Where each part of a decoder model goes on one node's GPUs (an explicit device_map).

``contiguous`` (default): embeddings on the first GPU, decoder layers in
contiguous blocks balanced by parameter count, final norm and lm_head on the
last GPU — the hidden state crosses a GPU boundary n_gpus-1 times per forward.
``round_robin``: the recipe's ``layer i → cuda:{i % n}``, which crosses at
every layer; kept to compare. ``device_map="auto"`` OOMed on R1 in the field
reports, which is why we place explicitly.
"""

from __future__ import annotations

from typing import Literal

Scheme = Literal["contiguous", "round_robin"]


def layer_sizes(config) -> list[int]:
    """Approximate parameter count per decoder layer from the config (no weights needed)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    return [sum(p.numel() for p in layer.parameters()) for layer in skeleton.model.layers]


def contiguous_blocks(sizes: list[int], n_devices: int, head: int = 0, tail: int = 0) -> list[int]:
    """Device index per layer: contiguous blocks with balanced totals.

    ``head``/``tail`` are the sizes already on the first/last device (embeddings,
    norm + lm_head), so those devices take fewer layers.
    """
    if n_devices < 1:
        raise ValueError("need at least one device")
    target = (sum(sizes) + head + tail) / n_devices
    out, cum = [], head
    for size in sizes:  # a layer goes where its midpoint falls on the balanced cumulative scale
        out.append(min(n_devices - 1, int((cum + size / 2) // target)))
        cum += size
    return out


def device_map(
    config, n_devices: int, scheme: Scheme = "contiguous", sizes: list[int] | None = None
) -> dict[str, int]:
    """A transformers device_map for a causal LM with ``model.layers``."""
    n_layers = config.num_hidden_layers
    if scheme == "round_robin":
        assignment = [i % n_devices for i in range(n_layers)]
    elif scheme == "contiguous":
        sizes = sizes or layer_sizes(config)
        embed = config.vocab_size * config.hidden_size
        assignment = contiguous_blocks(sizes, n_devices, head=embed, tail=embed)
    else:
        raise ValueError(f"unknown placement {scheme!r}; use contiguous or round_robin")
    dm: dict[str, int] = {"model.embed_tokens": 0, "model.rotary_emb": 0}
    dm.update({f"model.layers.{i}": d for i, d in enumerate(assignment)})
    dm.update({"model.norm": n_devices - 1, "lm_head": n_devices - 1})
    return dm


def boundary_crossings(dm: dict[str, int]) -> int:
    """How many times the hidden state changes device in one forward pass."""
    order = (
        ["model.embed_tokens"]
        + sorted((k for k in dm if k.startswith("model.layers.")), key=lambda k: int(k.rsplit(".", 1)[1]))
        + ["lm_head"]
    )
    return sum(dm[a] != dm[b] for a, b in zip(order, order[1:]))
