"""The HARI loss: CE on assistant tokens + λ·T²·KL(p_ref,T ‖ p_student,T).

The reference is the same model with its adapter disabled, so the KL term
pulls the adapted model towards its own base outputs and limits forgetting.
The KL is averaged over attention-masked tokens (``kl_tokens="all"``) or over
the positions that predict assistant tokens (``"assistant"``); it is computed
in fp32 (a bf16 KL is unreliable near zero: 8.3e-5 against 3.96e-5 in fp32).

Two implementations with the same value and gradients:

``naive`` (the recipe): a full forward with the adapter, a full forward
without it, KL over full [B, S, V] logits.

``fast`` (default): layers below the first adapted layer carry no adapter, so
their output is the same for student and reference: run them once under
``no_grad``; run only the adapted layers twice (adapter on with grad, off
without); then norm → lm_head → CE/KL over chunks of the needed positions
with the logits' gradient in closed form, so full [S, V] logits never exist
and no chunk is recomputed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ..data.labels import IGNORE
from ..model.lora import decoder_layers
from . import vocab_loss

KlTokens = Literal["all", "assistant"]
VocabRoute = Literal["auto", "torch", "fused"]


@dataclass(frozen=True)
class HariLoss:
    """Which loss a step minimises (notebook 20's loss parameters)."""

    lambda_kl: float  # weight of the KL term; 0: plain CE
    kl_temperature: float  # softmax temperature T of the KL term (scaled by T²)
    kl_tokens: KlTokens  # all: attention-masked tokens; assistant: positions predicting the answer
    loss_chunk: int  # tokens per chunk of the lm_head / CE / KL pass (fast)
    impl: Literal["fast", "naive"]  # fast: frozen prefix once, logits in chunks; naive: the recipe
    # fast: the CE/KL terms and the logits' gradient over the vocabulary (vocab_loss): the fused Triton kernel
    # (fused), torch ops (torch), or the kernel where it runs, i.e. on CUDA (auto); benchmarks compare them
    vocab_route: VocabRoute = "auto"


@dataclass
class LossParts:
    loss: torch.Tensor  # differentiable
    ce: float
    kl: float
    ce_tokens: int
    kl_tokens: int


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """targets[t] = labels[t+1]; the last position predicts nothing."""
    out = torch.full_like(labels, IGNORE)
    out[:, :-1] = labels[:, 1:]
    return out


def kl_mask(batch: dict[str, torch.Tensor], kl_tokens: KlTokens) -> torch.Tensor:
    if kl_tokens == "all":
        return batch["attention_mask"].bool()
    if kl_tokens == "assistant":
        return next_token_targets(batch["labels"]) != IGNORE
    raise ValueError(f"kl_tokens must be 'all' or 'assistant', got {kl_tokens!r}")


def token_terms(
    logits: torch.Tensor,
    ref_logits: torch.Tensor | None,
    targets: torch.Tensor,
    kl_select: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of CE over targeted positions and sum of KL over selected positions, in fp32."""
    logits = logits.float()
    ce_sum = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    if ref_logits is None:
        return ce_sum, logits.new_zeros(())
    log_p = vocab_loss.log_probs(logits, temperature)
    kl = vocab_loss.forward_kl(vocab_loss.log_probs(ref_logits, temperature), log_p)
    return ce_sum, (kl * kl_select).sum()


def _combine(ce_sum, kl_sum, n_ce, n_kl, lambda_kl, temperature) -> LossParts:
    ce = ce_sum / max(n_ce, 1)
    kl = kl_sum / max(n_kl, 1)
    loss = ce + lambda_kl * temperature**2 * kl if lambda_kl > 0 else ce
    return LossParts(loss, float(ce.detach()), float(kl.detach()), n_ce, n_kl)


def naive_loss(
    model, batch: dict[str, torch.Tensor], lambda_kl: float, temperature: float, kl_tokens: KlTokens = "all"
) -> LossParts:
    """The recipe: two full forwards, full-vocab KL."""
    ids, attn = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    ref = None
    if lambda_kl > 0:
        was_training = model.training
        model.eval()
        with torch.no_grad(), model.disable_adapter():
            ref = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        model.train(was_training)
    targets = next_token_targets(batch["labels"]).to(logits.device)
    select = kl_mask(batch, kl_tokens).to(logits.device)
    v = logits.shape[-1]
    ce_sum, kl_sum = token_terms(
        logits.reshape(-1, v),
        None if ref is None else ref.reshape(-1, v),
        targets.reshape(-1),
        select.reshape(-1).float(),
        temperature,
    )
    return _combine(ce_sum, kl_sum, int((targets != IGNORE).sum()), int(select.sum()), lambda_kl, temperature)


class _StopAtLayer(Exception):
    def __init__(self, args, kwargs):
        self.args_, self.kwargs_ = args, kwargs


def prefix_forward(model, batch: dict[str, torch.Tensor], first_layer: int):
    """Run the frozen layers below ``first_layer``; return the hidden state and the layer kwargs.

    The model's own forward prepares the inputs (embeddings, causal mask,
    rotary embeddings); a pre-hook on the first adapted layer captures what it
    would receive and stops there. This works for any decoder whose layers take
    (hidden_states, **kwargs), whatever the transformers version.

    A batch that carries ``inputs_embeds`` (hidden states read from the prefix
    cache, on a model whose frozen layers are passthroughs) enters there
    instead of at the embeddings.
    """
    layer = decoder_layers(model)[first_layer]
    me = threading.get_ident()

    def stop(_module, args, kwargs):
        if threading.get_ident() == me:  # another thread may be running this layer (the prefix wavefront)
            raise _StopAtLayer(args, kwargs)

    handle = layer.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with torch.no_grad():
            inputs = (
                {"inputs_embeds": batch["inputs_embeds"]}
                if "inputs_embeds" in batch
                else {"input_ids": batch["input_ids"]}
            )
            model(**inputs, attention_mask=batch["attention_mask"], use_cache=False)
    except _StopAtLayer as captured:
        args, kwargs = captured.args_, captured.kwargs_
    else:
        raise RuntimeError("the first adapted layer was never called")
    finally:
        handle.remove()
    hidden = args[0] if args else kwargs.pop("hidden_states")
    return hidden, args[1:], kwargs


def run_layers(
    model, first_layer: int, hidden: torch.Tensor, args, kwargs, end: int | None = None
) -> torch.Tensor:
    """Layers ``first_layer`` .. ``end`` (default: the last) on ``hidden``."""
    for layer in decoder_layers(model)[first_layer:end]:
        out = layer(hidden, *args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def _head(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", base)
    return inner.norm, base.get_output_embeddings()


def chunk_terms_and_grad(
    norm, lm_head, h, ref_h, targets, kl_select, temperature, w_ce, w_kl, vocab_route: VocabRoute = "auto"
):
    """CE/KL sums of one chunk (device scalars) and d(loss)/d(h), with the logits' gradient in closed form.

    Only norm → lm_head goes through autograd, so no [chunk, V] activation is
    kept for a backward pass and nothing is recomputed; the terms and the
    logits' gradient come from ``vocab_loss`` (one fused kernel on a GPU; ``vocab_route``).
    """
    h = h.detach().requires_grad_(True)
    with torch.enable_grad():
        logits = lm_head(norm(h))
    # lm_head may sit on another GPU
    targets, kl_select = targets.to(logits.device), kl_select.to(logits.device)
    with torch.no_grad():
        ref_logits = None if ref_h is None else lm_head(norm(ref_h)).to(logits.device)
        ce, kl, grad = vocab_loss.terms_and_grad(
            logits.detach(), ref_logits, targets, kl_select, temperature, w_ce, w_kl, vocab_route
        )
        del ref_logits
    logits.backward(grad)
    return ce.sum(), kl.sum(), h.grad


def reference_states(model, batch: dict[str, torch.Tensor], first_layer: int) -> torch.Tensor:
    """The reference's last hidden states for ``batch`` ([B, S, H], before the final norm): the adapted layers
    with the adapter off, as ``fast_loss`` runs them. They depend on the frozen weights and the batch alone, so
    they can be computed once and handed to every later step on the same batch."""
    hidden, args, kwargs = prefix_forward(model, batch, first_layer)
    with torch.no_grad(), model.disable_adapter():
        return run_layers(model, first_layer, hidden, args, kwargs)


def fast_loss(
    model,
    batch: dict[str, torch.Tensor],
    lambda_kl: float,
    temperature: float,
    first_layer: int,
    kl_tokens: KlTokens = "all",
    *,
    chunk: int,
    ref_hidden: torch.Tensor | None = None,
    vocab_route: VocabRoute = "auto",
) -> LossParts:
    """Same value and gradients as ``naive_loss``; frozen prefix once, logits in chunks.

    The returned loss is a surrogate: its value is the true loss and its
    gradient with respect to the adapted layers' output is the one computed
    chunk by chunk, so ``loss.backward()`` works as for ``naive_loss``.
    ``ref_hidden`` (``reference_states`` of this batch, computed earlier) saves
    running the adapted layers a second time with the adapter off; ``vocab_route``:
    ``HariLoss.vocab_route``.
    """
    # the counts and positions the loss needs, read before the layers run: the step's only other wait for the
    # device comes at its end, so the GPU is not left idle between the layers and the loss
    targets = next_token_targets(batch["labels"]).flatten()
    select = kl_mask(batch, kl_tokens).flatten()
    has_ce = targets != IGNORE
    needed = has_ce | (select if lambda_kl > 0 else torch.zeros_like(select))
    n_ce, n_kl = (int(v) for v in torch.stack([has_ce.sum(), select.sum()]).tolist())
    positions = needed.nonzero().squeeze(1)
    tg, sel = targets[positions], select[positions].float()

    hidden, args, kwargs = prefix_forward(model, batch, first_layer)
    student = run_layers(model, first_layer, hidden, args, kwargs)
    ref = None
    if lambda_kl > 0 and ref_hidden is not None:
        if ref_hidden.shape != student.shape:
            raise ValueError(
                f"reference states {tuple(ref_hidden.shape)} do not match this batch's {tuple(student.shape)}"
            )
        ref = ref_hidden.to(device=student.device, dtype=student.dtype)
    elif lambda_kl > 0:
        with torch.no_grad(), model.disable_adapter():
            ref = run_layers(model, first_layer, hidden, args, kwargs)
    dev = student.device
    positions, tg, sel = positions.to(dev), tg.to(dev), sel.to(dev)
    hs = student.flatten(0, -2).index_select(0, positions)
    hr = ref.flatten(0, -2).index_select(0, positions) if ref is not None else None
    del ref
    norm, lm_head = _head(model)
    w_ce = 1.0 / max(n_ce, 1)
    w_kl = lambda_kl * temperature**2 / max(n_kl, 1) if lambda_kl > 0 else 0.0
    ce_sum = kl_sum = torch.zeros((), dtype=torch.float32, device=dev)
    grads = []
    for start in range(0, hs.shape[0], chunk):
        end = start + chunk
        c, k, g = chunk_terms_and_grad(
            norm,
            lm_head,
            hs[start:end],
            None if hr is None else hr[start:end],
            tg[start:end],
            sel[start:end],
            temperature,
            w_ce,
            w_kl,
            vocab_route,
        )
        ce_sum, kl_sum = ce_sum + c.to(dev), kl_sum + k.to(dev)
        grads.append(g)
    grad_hs = torch.cat(grads) if grads else torch.zeros_like(hs)
    ce_sum, kl_sum = torch.stack([ce_sum, kl_sum]).tolist()  # the step's one wait for the device
    ce, kl = ce_sum / max(n_ce, 1), kl_sum / max(n_kl, 1)
    value = ce + (lambda_kl * temperature**2 * kl if lambda_kl > 0 else 0.0)
    surrogate = (hs.float() * grad_hs.float()).sum()  # fp32, so the value below is not rounded
    loss = surrogate - surrogate.detach() + value
    return LossParts(loss, ce, kl, n_ce, n_kl)


def hari_loss(
    model, batch, loss: HariLoss, first_layer: int, ref_hidden: torch.Tensor | None = None
) -> LossParts:
    """Dispatch on ``loss.impl``; ``ref_hidden``: the reference's last hidden states read from a cache (fast only)."""
    if loss.impl == "naive":
        return naive_loss(model, batch, loss.lambda_kl, loss.kl_temperature, loss.kl_tokens)
    return fast_loss(
        model,
        batch,
        loss.lambda_kl,
        loss.kl_temperature,
        first_layer,
        loss.kl_tokens,
        chunk=loss.loss_chunk,
        ref_hidden=ref_hidden,
        vocab_route=loss.vocab_route,
    )
