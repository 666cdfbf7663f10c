"""Chat rendering for training: the labels start where the served prompt ends, and every rationale token is trained.

Three templates: the tiny model's own (renders the turn as written), a
Llama-3-style one (likewise, different framing), and DeepSeek-R1's (drops the
reasoning before ``</think>`` and opens ``<think>`` in its generation prompt).
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from dsr1kit.data import chat, labels, render, templates
from dsr1kit.embedded.tiny import resolve_model

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

ROW = {
    "id": "mcq-1",
    "question": "Which planet is red?",
    "options": ["Venus", "Mars", "Jupiter"],
    "answer": "B",
    "cot": "Mars looks red because of iron oxide on its surface.",
}
PLAIN_ROW = {"id": "plain-1", "question": "What is 2 + 3?", "answer": "5"}


@pytest.fixture(scope="module")
def tokenizers():
    tiny = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    r1 = AutoTokenizer.from_pretrained(resolve_model("tiny-r1"))
    llama = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    llama.add_special_tokens(
        {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    llama.chat_template = LLAMA3_TEMPLATE
    return {"tiny": tiny, "r1": r1, "llama3": llama}


def _rationale_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


@pytest.mark.parametrize("name", ["tiny", "r1", "llama3"])
def test_labels_start_exactly_where_the_served_prompt_ends(tokenizers, name):
    tok = tokenizers[name]
    messages = chat.to_messages(ROW)
    ids, labs, _ = labels.encode_messages(tok, messages, max_len=10_000)
    served = tok.apply_chat_template(
        messages[:-1], tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]  # what a server is sent, computed by transformers itself
    first = next(i for i, t in enumerate(labs) if t != labels.IGNORE)
    assert ids[:first] == served
    assert all(t != labels.IGNORE for t in labs[first:])  # everything after the prompt is trained


@pytest.mark.parametrize("name", ["tiny", "r1", "llama3"])
def test_every_rationale_token_is_labelled(tokenizers, name):
    tok = tokenizers[name]
    ids, labs, _ = labels.encode_messages(tok, chat.to_messages(ROW), max_len=10_000)
    trained = [t for t in labs if t != labels.IGNORE]
    decoded = tok.decode(trained)
    assert ROW["cot"] in decoded and "</think>" in decoded and "<answer>\nB\n</answer>" in decoded
    assert _contains(trained, _rationale_ids(tok, "iron oxide on its surface"))


def test_r1_template_drops_the_reasoning_that_training_keeps(tokenizers):
    """The template alone trains on the answer only; the rendering keeps the reasoning, after one <think>."""
    tok = tokenizers["r1"]
    messages = chat.to_messages(ROW)
    assert ROW["cot"] not in tok.apply_chat_template(messages, tokenize=False)
    r = render.render_chat(tok, messages)
    assert r.how == "served prompt + content"
    assert r.prompt_text.endswith(templates.R1_GENERATION_PROMPT)
    assert r.prompt_text.startswith(templates.R1_BOS + "You are DeepSeek-R1." + templates.R1_USER)
    text = r.prompt_text + r.target_text
    assert text.count("<think>") == 1
    assert text.endswith(
        "<｜Assistant｜><think>\n" + chat.assistant_text(ROW).removeprefix("<think>\n") + templates.R1_EOS
    )
    assert r.target_ids[-1] == tok.eos_token_id


def test_r1_row_without_reasoning_closes_the_opened_block_empty(tokenizers):
    r = render.render_chat(tokenizers["r1"], chat.to_messages(PLAIN_ROW))
    assert r.target_text == "\n</think>\n<answer>\n5\n</answer>" + templates.R1_EOS


@pytest.mark.parametrize("name", ["tiny", "llama3"])
def test_templates_that_keep_the_content_render_it_as_written(tokenizers, name):
    r = render.render_chat(tokenizers[name], chat.to_messages(ROW))
    assert r.how == "template" and r.target_text.startswith(chat.assistant_text(ROW))


def test_training_prompt_is_the_evaluation_prompt(tokenizers):
    from dsr1kit.infer.evaluate import build_prompts, items_of

    for tok in tokenizers.values():
        [prompt] = build_prompts(items_of([ROW]), tok, chat.DEFAULT_SYSTEM)
        ids, labs, _ = labels.encode_messages(tok, chat.to_messages(ROW), max_len=10_000)
        assert ids[: len(prompt.token_ids)] == prompt.token_ids
        assert (
            labs[len(prompt.token_ids) - 1] == labels.IGNORE and labs[len(prompt.token_ids)] != labels.IGNORE
        )
    assert build_prompts(items_of([ROW]), tokenizers["r1"], chat.DEFAULT_SYSTEM)[0].reasoning_open
    assert not build_prompts(items_of([ROW]), tokenizers["tiny"], chat.DEFAULT_SYSTEM)[0].reasoning_open


def test_template_without_generation_prompt_that_rewrites_content_is_refused(tokenizers):
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1] }}"
        "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    with pytest.raises(render.TemplateError, match="no generation prompt"):
        render.render_chat(tok, chat.to_messages(ROW))


def test_template_that_fails_to_render_names_the_problem():
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    tok.chat_template = (
        "{% for m in messages %}{{ raise_exception('system role not supported') }}{% endfor %}"
    )
    with pytest.raises(
        render.TemplateError, match="does not render these messages.*system role not supported"
    ):
        render.render_chat(tok, chat.to_messages(ROW))


def test_data_report_splits_trained_tokens_into_reasoning_and_answer(tokenizers):
    rows = [dict(ROW, _source="s@train"), dict(PLAIN_ROW, _source="s@train")]
    for name, tok in tokenizers.items():
        enc = labels.encode_rows(tok, rows, max_len=10_000, system_prompt=chat.DEFAULT_SYSTEM)
        c = enc.per_source["s@train"]
        trained = sum(sum(t != labels.IGNORE for t in e.labels) for e in enc.examples)
        assert c["reasoning_tokens"] + c["answer_tokens"] == trained, name
        reasoning = len(_rationale_ids(tok, ROW["cot"]))
        # the rationale plus its tags and newlines (and R1's empty "\n</think>\n" for the plain row)
        assert reasoning - 3 <= c["reasoning_tokens"] <= reasoning + 10, (name, c, reasoning)
        assert c["no_reasoning"] == 1 and c["kept"] == 2
        assert ROW["cot"] in enc.example["reasoning"] and "<answer>" in enc.example["answer"]
    assert enc.rendering == {"template": 2}  # llama3, the last one
