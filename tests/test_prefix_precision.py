"""prefix_precision: how the prefix pass holds the frozen model, in the fingerprint and the memory plan."""

from __future__ import annotations

import pytest

from dsr1kit import params as P
from dsr1kit.plan import Machine, prefix_pass_plan
from dsr1kit.steps.hari_configs import prefix_setup
from dsr1kit.train.prefix import digest, precision

R1 = "params/r1-671b-2x8h100/20_hari_training.yaml"


def _key(p):
    return prefix_setup(p).key


def _load(p):
    return prefix_setup(p).load


def _pass_inputs(p):
    return prefix_setup(p).plan_inputs


def _tiny_r1(**changes) -> P.HariParams:
    from dsr1kit.embedded import r1_format

    return P.load("20_hari_training", overrides={"model": str(r1_format.build()), **changes})


def test_auto_loads_as_training_does_on_a_node_without_fp8_units(monkeypatch):
    monkeypatch.setattr(precision, "gpu_has_fp8", lambda: False)
    p = _tiny_r1(prefix_cache="auto")
    assert precision.resolve("auto", p.model) == "as loaded"
    cfg = _key(p)
    assert not cfg.fp8 and (cfg.quantization, cfg.quantize_experts) == (p.quantization, p.quantize_experts)
    # caches built before prefix_precision existed keep their fingerprint
    assert (
        digest.fingerprint(cfg, p.model, _Tok(), [], 2)["quantization"] == "linears none, experts as stored"
    )


def test_auto_runs_r1s_fp8_shards_as_stored_on_fp8_gpus(monkeypatch):
    monkeypatch.setattr(precision, "gpu_has_fp8", lambda: True)
    p = _tiny_r1(prefix_cache="auto")
    load = _load(p)
    assert load.fp8_compute and (load.quantization, load.quantize_experts) == ("none", False)
    fp8 = digest.fingerprint(_key(p), p.model, _Tok(), [], 2)
    assert fp8["quantization"] == digest.FP8_PASS
    nf4 = _key(p.model_copy(update={"prefix_precision": "nf4"}))
    assert (nf4.quantization, nf4.quantize_experts, nf4.fp8) == ("nf4", True, False)
    assert digest.fingerprint(nf4, p.model, _Tok(), [], 2)["quantization"] != fp8["quantization"]


def test_fp8_is_refused_for_a_checkpoint_not_stored_in_fp8():
    p = P.load("20_hari_training", overrides={"prefix_cache": "auto", "prefix_precision": "fp8"})
    with pytest.raises(ValueError, match="not stored in FP8.*prefix_precision"):
        _load(p)


def test_the_prefix_plan_holds_r1_in_fp8_on_8_h200s_and_says_nf4_on_8_80gb_gpus():
    p = P.load("20_hari_training", [R1], overrides={"prefix_cache": "auto", "prefix_precision": "fp8"})
    inputs = _pass_inputs(p)
    assert inputs.prefix_fp8 and inputs.quantization == "none"
    h200 = prefix_pass_plan(inputs, Machine(8, 141 * 2**30, 1000 * 2**30))
    assert h200.fits and "fp8 as stored" in h200.facts["weights"]
    weights = h200.devices[0].parts["weights"] / 2**30
    assert 70 < weights < 90  # ~640 GB of e4m3 over 8 GPUs
    h100 = prefix_pass_plan(inputs, Machine(8, 80 * 2**30, 1000 * 2**30))
    assert not h100.fits  # R1 in FP8 is more than 8 x 78 GiB: one node of 80 GB GPUs needs NF4
    assert any(a.startswith("prefix_precision: nf4") and ": fits" in a for a in h100.advice), h100.advice
    nf4 = _pass_inputs(p.model_copy(update={"prefix_precision": "nf4"}))
    assert prefix_pass_plan(nf4, Machine(8, 80 * 2**30, 1000 * 2**30)).fits


class _Tok:
    """The little of a tokenizer the fingerprint reads."""

    bos_token = eos_token = pad_token = "<s>"
    chat_template = ""

    def get_vocab(self):
        return {"<s>": 0}
