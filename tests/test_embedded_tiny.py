"""The embedded tiny DeepSeek-V3: deterministic, within every backend's constraints, usable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsr1kit.embedded import tiny

MESSAGES = [
    {"role": "system", "content": "You are DeepSeek-R1."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<think>\n2 + 3 = 5\n</think>\n<answer>\n5\n</answer>"},
]


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)


def test_build_is_deterministic(tmp_path):
    a, b = tiny.build(tmp_path / "a", pretrain_steps=3), tiny.build(tmp_path / "b", pretrain_steps=3)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_pretraining_taught_the_format(tiny_dir):
    """The base model's LM loss fell during the build (it speaks the chat format before HARI)."""
    meta = json.loads((tiny_dir / "TINY_MODEL.json").read_text())
    assert meta["pretrain_steps"] == tiny.FLAVOURS[tiny.TINY_NAME].pretrain_steps
    assert meta["pretrain_loss_last"] < 0.5 * meta["pretrain_loss_first"]


def test_base_does_task_a_and_not_task_b(tiny_dir, tok, model):
    """The forgetting experiment's premise, on its held-out sets: the base knows A (and the "ends the list"
    phrasing of B's skill) but not B's own phrasing, and pre-training never saw those lists."""
    from dsr1kit.data.synthetic import make_position_rows
    from dsr1kit.measure.accuracy import accuracy, answer_matches

    def acc(rows):
        return accuracy(answer_matches(model, tok, rows, "You are DeepSeek-R1."))

    root = Path(__file__).resolve().parent.parent / "data"
    rows = {
        name: [json.loads(line) for line in (root / f"task_{name}_eval.jsonl").read_text().splitlines()]
        for name in "ab"
    }
    a, b = acc(rows["a"][:100]), acc(rows["b"][:100])
    assert a >= 0.6 and b <= 0.4 and a - b >= 0.5, (
        a,
        b,
    )  # built: A 0.99, B 0.28 (it often answers the first word)
    assert acc(make_position_rows("E", 100, seed=7)) >= 0.6
    chats, _ = tiny.pretrain_texts()
    seen = {m["content"] for chat in chats for m in chat if m["role"] == "user"}
    assert not seen & {r["question"].replace("comes last in this list", "ends this list") for r in rows["b"]}
    assert not seen & {r["question"] for r in rows["a"]}


def test_cli_builds_into_a_dir(tmp_path, cli):
    proc = cli("tiny", str(tmp_path / "m"), "--pretrain-steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "m" / "model.safetensors").is_file()


def test_architecture_is_deepseek_v3_with_moe_and_mla(model):
    cfg = model.config
    assert cfg.model_type == "deepseek_v3"
    assert cfg.n_routed_experts > cfg.num_experts_per_tok >= 2 and cfg.n_shared_experts == 1
    assert cfg.first_k_dense_replace == 1 and cfg.num_hidden_layers == 3
    assert cfg.q_lora_rank and cfg.kv_lora_rank
    kinds = {type(m).__name__ for m in model.modules()}
    assert {"DeepseekV3MoE", "DeepseekV3TopkRouter", "DeepseekV3Attention"} <= kinds


def test_every_linear_fits_bitsandbytes_cpu_repack(model):
    """NF4's eval-mode CPU path needs in % 64 == 0 and out % 32 == 0."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears
    for name, m in linears:
        assert m.in_features % 64 == 0 and m.out_features % 32 == 0, name


def test_config_satisfies_vllm_cpu(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576
    assert min(cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["qk_rope_head_dim"]) >= 32
    assert (cfg["topk_method"], cfg["scoring_func"]) == ("noaux_tc", "sigmoid")


def test_tokenizer_fits_the_vocab(tok, model):
    assert len(tok) <= model.config.vocab_size
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id


@pytest.mark.parametrize("marker", tiny.REASONING_TOKENS)
def test_reasoning_markers_are_single_tokens_kept_when_decoding(tok, marker):
    ids = tok.encode(f"x{marker}y", add_special_tokens=False)
    assert tok.convert_tokens_to_ids(marker) in ids
    assert marker in tok.decode(ids, skip_special_tokens=True)


def test_chat_template_marks_exactly_the_assistant_turn(tok):
    out = tok.apply_chat_template(
        MESSAGES, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    masked = tok.decode([i for i, m in zip(ids, mask) if m])
    assert masked == MESSAGES[2]["content"] + tok.eos_token
    assert "What is 2 + 3?" in tok.decode(ids)


def test_generation_prompt_ends_with_the_assistant_tag(tok):
    text = tok.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|assistant|>")


def test_trains_and_generates(model, tok):
    ids = torch.tensor([tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=True)["input_ids"]])
    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    model.zero_grad()
    model.eval()
    out = model.generate(ids[:, :10], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 14)


def test_loads_in_nf4_on_cpu_including_eval_forward(tiny_dir):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    m = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=q, dtype=torch.bfloat16)
    assert any(isinstance(x, bnb.nn.Linear4bit) for x in m.modules())
    m.eval()
    with torch.no_grad():
        logits = m(torch.randint(0, 1000, (2, 16))).logits
    assert logits.shape == (2, 16, m.config.vocab_size) and torch.isfinite(logits).all()
