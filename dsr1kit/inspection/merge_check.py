"""The merged checkpoint written and checked: its logits against base + adapter on a probe, or, where an fp32
copy of the merge does not fit the host (R1), each merged weight against W + ΔW."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .adapter import Adapter
from .merge import merge_into_copy, verify_merge, verify_merged_weights


def merge_and_verify(
    model, base_path: str, adapter: Adapter, out_dir: Path, probe_ids: list[int], logits_check: bool = True
) -> dict[str, Any]:
    """Merge ``adapter`` into a copy of the base at ``base_path`` in ``out_dir``, then check it (``model``:
    the base with the adapter attached; ``probe_ids``: one probe's token ids)."""
    from transformers import AutoModelForCausalLM

    from ..model.load import local_checkpoint

    merge_into_copy(local_checkpoint(base_path), adapter, out_dir)
    if not logits_check:
        check = verify_merged_weights(base_path, out_dir, adapter)
        return {
            "checked": "weights: merged vs W + ΔW (an fp32 copy does not fit the host)",
            **check,
            "merged_dir": str(out_dir),
        }
    merged = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    device = model.get_input_embeddings().weight.device
    check = verify_merge(model, merged, torch.tensor([probe_ids], device=device))
    check["merged_dir"] = str(out_dir)
    return {"checked": "logits: merged checkpoint vs base + adapter (fp32)", **check}
