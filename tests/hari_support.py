"""A LoRA-adapted tiny model with a non-zero adapter and a padded batch: the setting the HARI loss tests share."""

from __future__ import annotations

import torch

from dsr1kit.data.labels import collate, encode_rows
from dsr1kit.data.plan import load_rows
from dsr1kit.model.load import load_model
from dsr1kit.model.lora import apply_lora
from dsr1kit.steps.hari_configs import load_config, lora_config


def adapted_model_and_batch(p, n_rows: int, max_len: int):
    """(model in train mode, LoRA plan, batch on the model's input device) for HariParams ``p``."""
    loaded = load_model(load_config(p))
    torch.manual_seed(0)
    model, plan = apply_lora(loaded.model, lora_config(p))
    with torch.no_grad():  # a non-zero adapter, so student and reference really differ
        for name, q in model.named_parameters():
            if "lora_B" in name:
                q.normal_(std=0.3)
    rows = load_rows("data/sft_tiny.jsonl").rows[:n_rows]
    enc = encode_rows(loaded.tokenizer, rows, max_len, "You are DeepSeek-R1.")
    batch = collate(enc.examples, loaded.tokenizer.pad_token_id, model.config.vocab_size)
    device = model.get_input_embeddings().weight.device
    model.train()
    return model, plan, {k: v.to(device) for k, v in batch.items()}
