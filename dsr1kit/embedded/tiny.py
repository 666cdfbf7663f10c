"""The embedded tiny DeepSeek-V3: a model and tokenizer built locally in seconds.

Every code path of the kit (training, inference, inspection, reports) runs on
it on a CPU, so the model keeps DeepSeek-V3's architecture (MLA attention,
MoE with shared + routed experts, grouped top-k routing, dense first layer)
at toy widths chosen to satisfy every backend we test:

- bitsandbytes NF4 on CPU, including the eval-mode repack: every Linear has
  in_features % 64 == 0 and out_features % 32 == 0;
- vLLM CPU: head dims >= 32, MLA kv_lora_rank + qk_rope_head_dim == 576, and
  ``topk_method``/``scoring_func`` present in config.json;
- vLLM CPU computes what transformers computes: RoPE is YaRN-scaled, as in
  DeepSeek-V3/R1. With plain RoPE (``rope_type: default``) vLLM's MLA gets the
  generic ``RotaryEmbedding``, whose CPU kernel (``torch.ops._C.rotary_embedding``)
  rotates MLA's 3-D, strided ``q_pe``/``k_pe`` views wrongly (one head per
  "token", the head stride taken as the token stride; ``k_pe`` is left
  unrotated): greedy answers came out malformed (mean |Δ logprob| ≈ 2 vs
  transformers). ``yarn`` selects ``DeepseekScalingRotaryEmbedding``, which runs
  its PyTorch-native path on CPU (|Δ logprob| 0.0000 in fp32, ~0.003 in bf16).

The tokenizer is a byte-level BPE trained on the shipped datasets. It comes
in two flavours: ``tiny`` with a chat template of its own, and ``tiny-r1``
with DeepSeek-R1's tokenizer setup (BOS/EOS/pad spellings, ``<｜User｜>`` /
``<｜Assistant｜>``, ``<think>``/``</think>`` as plain added tokens, R1's chat
template verbatim), so R1's rendering, served prompt and answers run here.
The weights are pre-trained here on the chat format and on the free-form task
kinds only, so the base model speaks the format, answers some questions, and
leaves the multiple-choice kinds for HARI to learn: loss curves, accuracies
and KL values in the demo then mean something. The ``tiny`` flavour is also
taught the position questions of the forgetting experiment (a few CPU
minutes, once): task A ("Which word comes first in: …?") and two other
phrasings, "starts this list" and "ends this list", but never task B ("comes
last"). It then does A well and B poorly, B is learnable (the skill is
there under other words), and learning B can cost A (same question shape):
the demo and notebook 40 measure exactly that.
Nothing is downloaded. ``resolve_model("tiny")`` builds it once into a cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..data import templates
from ..data.chat import to_messages

VERSION = 7  # 7: a build that did not learn its position tasks is rebuilt from the next seed
TINY_NAME = "tiny"
TINY_R1_NAME = "tiny-r1"
DATA_DIR = Path(__file__).resolve().parents[2] / "data"
CORPUS_FILES = ("sft_tiny.jsonl", "eval_tiny.jsonl", "retain_tiny.jsonl", "task_b_train.jsonl")

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# Plain (non-special) added tokens: single ids, but kept when decoding with
# skip_special_tokens=True so answers can still be parsed from generations.
REASONING_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
VOCAB_SIZE = 1024

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    # R1 scales its 8-of-256 routed experts' output by 2.5; at 2-of-8 experts that factor kept the
    # pre-training from ever learning to attend (the answer stayed at chance on a one-hop copy task
    # while the same model with dense MLPs, or this factor at 1.0, learned it in ~150 steps).
    routed_scaling_factor=1.0,
    norm_topk_prob=True,
    q_lora_rank=64,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=2048,  # = original_max_position_embeddings * factor, as in R1 (4096 * 40)
    tie_word_embeddings=False,
    rope_interleave=True,
    # DeepSeek-V3/R1's YaRN RoPE at toy length. Not optional: see the module docstring (vLLM-CPU parity).
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=512,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)


@dataclass(frozen=True)
class Flavour:
    """Token spellings, chat template and pre-training of a tiny tokenizer and model."""

    name: str
    bos: str
    eos: str
    pad: str
    roles: tuple[str, ...]
    template: str
    pretrain_steps: int = 200
    pretrain_lr: float = 3e-3
    position_tasks: tuple[str, ...] = ()  # synthetic.POSITION_TASKS taught in pre-training


# tiny: the forgetting experiment's base (A and the S/E phrasings, ~3-4 CPU minutes); tiny-r1 tests R1's
# formats only and keeps the short pre-training.
FLAVOURS = {
    TINY_NAME: Flavour(
        TINY_NAME,
        BOS,
        EOS,
        PAD,
        tuple(ROLE_TOKENS),
        CHAT_TEMPLATE,
        pretrain_steps=1000,
        pretrain_lr=1.5e-3,
        position_tasks=("A", "S", "E"),
    ),
    TINY_R1_NAME: Flavour(
        TINY_R1_NAME,
        templates.R1_BOS,
        templates.R1_EOS,
        templates.R1_PAD,
        tuple(templates.R1_ROLE_TOKENS),
        templates.R1_CHAT_TEMPLATE,
    ),
}
POSITION_ROWS = 1500  # pre-training rows per position task
HELD_OUT = ("task_a_eval.jsonl", "task_b_eval.jsonl")  # their word lists never appear in pre-training

# Not read by transformers, required by vLLM's DeepSeek-V3 loader.
VLLM_CONFIG_EXTRAS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def cache_root() -> Path:
    return Path(os.environ.get("DSR1KIT_CACHE", Path.home() / ".cache" / "dsr1kit"))


def _fingerprint(flavour: Flavour = FLAVOURS[TINY_NAME]) -> str:
    h = hashlib.sha256(
        f"v{VERSION}{json.dumps(MODEL_CONFIG, sort_keys=True)}"
        f"{json.dumps(flavour.__dict__, sort_keys=True)}{POSITION_ROWS}".encode()
    )
    for name in (*CORPUS_FILES, *HELD_OUT):
        h.update((DATA_DIR / name).read_bytes())
    return h.hexdigest()[:12]


def corpus_lines() -> list[str]:
    """Training text for the BPE: formatted chats of the shipped data plus retain text."""
    lines = []
    for name in CORPUS_FILES:
        for raw in (DATA_DIR / name).read_text().splitlines():
            row = json.loads(raw)
            if "text" in row:
                lines.append(row["text"])
                continue
            for m in to_messages(row) or []:
                lines.append(m["content"])
    return lines


def build_tokenizer(out_dir: str | Path, flavour: Flavour = FLAVOURS[TINY_NAME]):
    """Train the byte-level BPE locally and save a transformers tokenizer (of `flavour`) in out_dir."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [flavour.bos, flavour.eos, flavour.pad, *flavour.roles]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(REASONING_TOKENS),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in REASONING_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=flavour.bos,
        eos_token=flavour.eos,
        pad_token=flavour.pad,
        additional_special_tokens=list(flavour.roles),
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = flavour.template
    fast.save_pretrained(out_dir)
    return fast


def pretrain_texts(flavour: Flavour = FLAVOURS[TINY_NAME]) -> tuple[list[list[dict]], list[str]]:
    """Chats of the free-form task kinds (a fresh seed, not the shipped rows), the flavour's position
    questions (lists of the held-out sets left out), plus retain text."""
    from ..data.synthetic import MAKERS, make_position_rows, make_retain, make_rows

    free_form = {
        i for i, maker in enumerate(MAKERS) if maker.__name__ in ("_addition", "_subtraction", "_reverse")
    }
    rows = [r for i, r in enumerate(make_rows(720, seed=4, prefix="pre")) if i % len(MAKERS) in free_form]
    held_out = _held_out_lists()
    for k, task in enumerate(flavour.position_tasks):
        rows += [
            r
            for r in make_position_rows(task, POSITION_ROWS, seed=100 + k)
            if _word_list(r["question"]) not in held_out
        ]
    chats = [to_messages(r) for r in rows]
    return chats, [r["text"] for r in make_retain(120, seed=5)]


def _held_out_lists() -> set[str]:
    return {
        _word_list(json.loads(line)["question"])
        for name in HELD_OUT
        for line in (DATA_DIR / name).read_text().splitlines()
        if line.strip()
    }


def _word_list(question: str) -> str:
    return question.split("\n", 1)[-1]


def pretrain(
    model, tokenizer, steps: int, seed: int = 0, batch: int = 16, flavour: Flavour = FLAVOURS[TINY_NAME]
) -> list[float]:
    """Full-parameter LM training on pretrain_texts(flavour); deterministic for a given seed."""
    import torch
    from tqdm.auto import tqdm

    from ..data.render import render_chat

    chats, texts = pretrain_texts(flavour)
    # Chats: the served prompt + the turn, as training renders it, learned on the turn only (as SFT does):
    # a loss on the prompt's random word lists would drown the one token that says which word to copy.
    seqs, starts = [], []
    for chat in chats:
        rendered = render_chat(tokenizer, chat)
        seqs.append(rendered.ids)
        starts.append(len(rendered.prompt_ids))
    for t in texts:
        seqs.append(
            [tokenizer.bos_token_id]
            + tokenizer.encode(t, add_special_tokens=False)
            + [tokenizer.eos_token_id]
        )
        starts.append(0)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=flavour.pretrain_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=flavour.pretrain_lr, total_steps=steps, pct_start=0.1
    )
    model.train()
    losses = []
    bar = tqdm(
        range(steps),
        desc=f"pre-training the {flavour.name} model (once, cached)",
        unit="step",
        disable=steps < 500,
        mininterval=5,
    )
    for _ in bar:
        pick = torch.randint(len(seqs), (batch,), generator=gen).tolist()
        width = max(len(seqs[i]) for i in pick)
        ids = torch.full((batch, width), tokenizer.pad_token_id)
        mask = torch.zeros((batch, width), dtype=torch.long)
        labels = torch.full((batch, width), -100)
        for row, i in enumerate(pick):
            ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
            mask[row, : len(seqs[i])] = 1
            labels[row, starts[i] : len(seqs[i])] = torch.tensor(seqs[i][starts[i] :])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    model.eval()
    return losses


def build_model(
    out_dir: str | Path,
    tokenizer,
    seed: int = 0,
    flavour: Flavour = FLAVOURS[TINY_NAME],
    pretrain_steps: int | None = None,
):
    """A seeded DeepSeek-V3-architecture model, briefly pre-trained, saved in out_dir (bf16)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        **MODEL_CONFIG,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    for key, value in VLLM_CONFIG_EXTRAS.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise-reproducible on any core count
    try:
        steps = flavour.pretrain_steps if pretrain_steps is None else pretrain_steps
        losses = pretrain(model, tokenizer, steps=steps, seed=seed, flavour=flavour)
    finally:
        torch.set_num_threads(threads)
    model = model.to(torch.bfloat16)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    return model, losses


# A build must have learned its position tasks: on rows of the pre-training distribution that neither
# pre-training nor the held-out sets contain. About one seed in four leaves the model near chance (~30%)
# after the same 1000 steps, and the demo's HARI then learns B far less; 400 more steps only reach ~50%.
# Such a build is replaced by one from the next seed (the same on every machine that builds alike).
LEARNED = 0.9  # teacher-forced exact answers per position task
BUILD_TRIES = 3


def position_accuracy(model, tokenizer, flavour: Flavour, n: int = 200, seed: int = 900) -> dict[str, float]:
    """Per position task, the share of fresh rows (not pre-trained on, not held out) whose answer tokens
    the model predicts exactly, teacher-forced."""
    import torch

    from ..data.render import render_chat
    from ..data.synthetic import make_position_rows

    held_out = _held_out_lists()
    scores = {}
    model.eval()
    with torch.no_grad():
        for task in flavour.position_tasks:
            rows = [r for r in make_position_rows(task, n, seed) if _word_list(r["question"]) not in held_out]
            right = 0
            for row in rows:
                rendered = render_chat(tokenizer, to_messages(row))
                ids, start = torch.tensor([rendered.ids]), len(rendered.prompt_ids)
                predicted = model(input_ids=ids).logits[0, start - 1 : -1].argmax(-1)
                right += bool((predicted == ids[0, start:]).all())
            scores[task] = round(right / len(rows), 4)
    return scores


def build(
    out_dir: str | Path,
    seed: int = 0,
    pretrain_steps: int | None = None,
    flavour: Flavour = FLAVOURS[TINY_NAME],
) -> Path:
    """Build model + tokenizer into out_dir (atomically: temp dir, then rename); a model that did not learn
    its position tasks (LEARNED) is built again from the next seed, up to BUILD_TRIES seeds."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tokenizer = build_tokenizer(tmp, flavour)
        if len(tokenizer) > VOCAB_SIZE:
            raise RuntimeError(f"tiny tokenizer has {len(tokenizer)} tokens > vocab {VOCAB_SIZE}")
        tried = []
        for attempt in range(BUILD_TRIES):
            model, losses = build_model(
                tmp, tokenizer, seed=seed + attempt, flavour=flavour, pretrain_steps=pretrain_steps
            )
            learned = position_accuracy(model.float(), tokenizer, flavour) if pretrain_steps is None else {}
            tried.append({"seed": seed + attempt, "position_accuracy": learned})
            if all(v >= LEARNED for v in learned.values()):
                break
        (tmp / "TINY_MODEL.json").write_text(
            json.dumps(
                {
                    "version": VERSION,
                    "flavour": flavour.name,
                    "seed": seed + attempt,
                    "pretrain_steps": len(losses),
                    "pretrain_loss_first": round(losses[0], 4),
                    "pretrain_loss_last": round(losses[-1], 4),
                    "position_accuracy": learned,
                    "builds": tried,
                }
            )
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model(name: str) -> str:
    """'tiny' / 'tiny-r1' → the cached embedded model dir (built on first use); anything else unchanged."""
    flavour = FLAVOURS.get(name)
    if flavour is None:
        return name
    prefix = "tiny-dsv3" if name == TINY_NAME else "tiny-r1-dsv3"
    target = cache_root() / f"{prefix}-{_fingerprint(flavour)}"
    if not (target / "TINY_MODEL.json").is_file():
        from filelock import FileLock

        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{target}.lock"):  # ranks or jobs starting together on a fresh cache build it once
            if not (target / "TINY_MODEL.json").is_file():
                build(target, flavour=flavour)
    return str(target)
