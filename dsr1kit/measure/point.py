"""One sweep point measured: an adapter's accuracy on A and B rows, its base's, and its KL to the base.

- accuracy: the share of rows whose whole assistant turn greedy decoding reproduces (``accuracy``), for
  the adapted model and for its base (adapter off);
- KL(base ‖ adapted) per token on A and on B prompts (``kl``), with the training code's masks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..model.load import LoadConfig, load_model, load_with_adapter
from .accuracy import accuracy, answer_matches
from .kl import KlSpan, kl_to_base
from .sweep import PointResult
from .training_run import run_settings


def on_cpu_fp32(model: str) -> LoadConfig:
    """How a sweep measures: the model in fp32 on the host, whatever GPUs the node has."""
    return LoadConfig(
        model=model, dtype="float32", quantization="none", quantize_experts=False, device_map="cpu"
    )


def measure_point(
    peft_model,
    tokenizer,
    rows_a: list[dict[str, Any]],
    rows_b: list[dict[str, Any]],
    system_prompt: str,
    lambda_kl: float,
    seed: int,
    max_len: int = 256,
    batch_size: int = 16,
    kl_span: KlSpan = "answer",
    base_acc: tuple[float, float] | None = None,
    adapter_dir: str = "",
) -> PointResult:
    """All of a point's numbers from a model already loaded (any loader: fp32 on CPU, NF4 on GPUs).

    ``base_acc`` = (A, B) base accuracies from an earlier point of the same sweep skips re-measuring
    the base, which is the same for every point.
    """

    def matches(rows):
        return answer_matches(peft_model, tokenizer, rows, system_prompt, max_len, batch_size)

    if base_acc is None:
        with peft_model.disable_adapter():
            base_acc = (accuracy(matches(rows_a)), accuracy(matches(rows_b)))
    on_a, on_b = matches(rows_a), matches(rows_b)
    kl = [
        kl_to_base(peft_model, tokenizer, rows, system_prompt, max_len, batch_size, kl_span)
        for rows in (rows_a, rows_b)
    ]
    return PointResult(
        float(lambda_kl),
        int(seed),
        accuracy(on_a),
        accuracy(on_b),
        kl[0],
        kl[1],
        float(base_acc[0]),
        float(base_acc[1]),
        len(on_a),
        len(on_b),
        str(adapter_dir),
    )


def evaluate_point(
    adapter_dir: str | Path,
    rows_a: list[dict[str, Any]],
    rows_b: list[dict[str, Any]],
    system_prompt: str,
    lambda_kl: float | None = None,
    seed: int | None = None,
    base_model: str = "",
    max_len: int = 256,
    batch_size: int = 16,
    kl_span: KlSpan = "answer",
    base_acc: tuple[float, float] | None = None,
) -> PointResult:
    """Load the base (fp32, on CPU) and the adapter once, and measure the point.

    λ and seed default to the training run's ``params.yaml`` beside the adapter; the base to the
    adapter's ``base_model_name_or_path``; the tokenizer to the one saved with the adapter.
    For a model that does not fit fp32 in host memory, load it yourself and call `measure_point`.
    """
    adapter_dir = Path(adapter_dir)
    config_file = adapter_dir / "adapter_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{adapter_dir} has no adapter_config.json: give a PEFT adapter folder")
    settings = run_settings(adapter_dir)
    lambda_kl = settings.get("lambda_kl") if lambda_kl is None else lambda_kl
    seed = settings.get("seed") if seed is None else seed
    if lambda_kl is None or seed is None:
        raise ValueError(
            f"no lambda_kl/seed given and none in {adapter_dir.parent / 'params.yaml'}: "
            "pass lambda_kl= and seed="
        )
    base = base_model or json.loads(config_file.read_text())["base_model_name_or_path"]
    model, tokenizer, _ = load_with_adapter(on_cpu_fp32(base), adapter_dir)
    return measure_point(
        model,
        tokenizer,
        rows_a,
        rows_b,
        system_prompt,
        lambda_kl,
        seed,
        max_len,
        batch_size,
        kl_span,
        base_acc,
        str(adapter_dir),
    )


def base_accuracy(
    model: str,
    rows_a: list[dict[str, Any]],
    rows_b: list[dict[str, Any]],
    system_prompt: str,
    max_len: int = 256,
) -> tuple[float, float]:
    """The base model's accuracy on A and on B (fp32, on CPU): the same for every point of a sweep."""
    loaded = load_model(on_cpu_fp32(model))
    return tuple(
        accuracy(answer_matches(loaded.model, loaded.tokenizer, rows, system_prompt, max_len))
        for rows in (rows_a, rows_b)
    )
