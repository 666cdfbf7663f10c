"""Toy models and adapters for the serving tests on a CPU, built locally in seconds.

vLLM on CPU cannot serve a LoRA on a MoE model (its MoE-LoRA backend is Triton's, which fails on CPU), so adapter
serving and the parity check are exercised on a tiny *dense* Llama that shares
the embedded tiny model's tokenizer; the DeepSeek-V3 tiny model covers the
merge-then-serve path. Adapters are plain PEFT LoRAs with a non-zero ``lora_B``
so that they measurably change the outputs. Nothing is downloaded.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)

# Every dim chosen for vLLM CPU: head_dim 32 (>= 32), GQA 4/2, widths multiples of 64.
LLAMA_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def copy_tokenizer(src_dir: str | Path, out_dir: str | Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(src_dir) / name).is_file():
            shutil.copy2(Path(src_dir) / name, Path(out_dir) / name)


def build_tiny_llama(out_dir: str | Path, tokenizer_dir: str | Path, seed: int = 0) -> Path:
    """A randomly initialised (seeded) bf16 Llama using the tokenizer found in tokenizer_dir."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        **LLAMA_CONFIG,
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    copy_tokenizer(tokenizer_dir, out)
    return out


def make_lora_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    target_modules: list[str],
    r: int = 8,
    alpha: float = 16.0,
    b_std: float = 0.5,
    seed: int = 1,
    layers: list[int] | None = None,
) -> Path:
    """A PEFT LoRA on ``target_modules`` whose lora_B is random (not zero), saved to out_dir."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=target_modules, layers_to_transform=layers
    )
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                param.normal_(0.0, b_std)
    model.save_pretrained(out_dir)
    copy_tokenizer(base_dir, out_dir)
    return Path(out_dir)
