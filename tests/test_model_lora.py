"""LoRA targets, placement and quirks on tiny toy modules and on the embedded model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsr1kit.model import lora, placement, quirks


def _toy(names: list[str], n_layers: int = 3) -> nn.Module:
    """A decoder-shaped toy: model.layers[i].self_attn.<name> = Linear."""

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            for n in names:
                setattr(self, n, nn.Linear(8, 8))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attn()
            self.mlp = nn.Linear(8, 8)

    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList([Layer() for _ in range(n_layers)])
    return root


@pytest.mark.parametrize(
    "present,chosen",
    [
        (["q_a_proj", "q_b_proj", "kv_b_proj", "o_proj"], ["q_a_proj", "q_b_proj"]),
        (["q_proj", "kv_b_proj", "o_proj"], ["kv_b_proj"]),
        (["q_proj", "k_proj", "v_proj", "o_proj"], ["q_proj", "v_proj"]),
        (["wq", "wk", "wv", "wo"], ["wq", "wv"]),
        (["qkv_proj", "o_proj"], ["qkv_proj"]),
        (["query_key_value", "dense"], ["query_key_value"]),
        (["q_proj", "o_proj"], ["o_proj"]),  # q_proj without v_proj: the group does not match
        (["wo", "other"], ["wo"]),
    ],
)
def test_targets_follow_the_recipe_preference(present, chosen):
    plan = lora.plan_lora(_toy(present), last_k=1)
    assert plan.targets == chosen
    assert plan.modules == sorted(f"model.layers.2.self_attn.{t}" for t in chosen)


def test_last_k_layers_and_explicit_targets():
    plan = lora.plan_lora(_toy(["q_proj", "v_proj", "o_proj"], 4), last_k=2, targets=["o_proj"])
    assert plan.layers == [2, 3]
    assert plan.modules == ["model.layers.2.self_attn.o_proj", "model.layers.3.self_attn.o_proj"]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"targets": ["nope"]},
            r"lora_targets \['nope'\] not found in layers \[2\]; linears there: \['mlp', 'other'\]",
        ),
        ({"last_k": 9}, "lora_last_k_layers=9 but the model has 3 layers"),
        ({}, "no attention linear from the preference list"),
    ],
)
def test_target_errors_say_what_exists(kwargs, message):
    with pytest.raises(lora.LoraTargetError, match=message):
        lora.plan_lora(_toy(["other"]), **kwargs)


def test_apply_lora_on_tiny_adapts_only_the_last_layer(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    cfg = lora.LoraConfig(r=4, alpha=8.0, dropout=0.0, last_k_layers=1, targets=())
    peft_model, plan = lora.apply_lora(model, cfg)
    trainable = [n for n, q in peft_model.named_parameters() if q.requires_grad]
    assert trainable and all("layers.2.self_attn.q_" in n and "lora_" in n for n in trainable)
    summary = lora.lora_summary(peft_model, plan)
    assert summary["trainable_params"] == sum(q.numel() for q in peft_model.parameters() if q.requires_grad)
    # q_a_proj 256→64 and q_b_proj 64→384 at r=4: A is r×in, B is out×r
    assert summary["trainable_params"] == 4 * 256 + 64 * 4 + 4 * 64 + 384 * 4


@pytest.mark.parametrize(
    "sizes,n,head,tail,expected",
    [
        ([1] * 8, 2, 0, 0, [0, 0, 0, 0, 1, 1, 1, 1]),
        ([1] * 8, 4, 0, 0, [0, 0, 1, 1, 2, 2, 3, 3]),
        ([1] * 6, 2, 2, 2, [0, 0, 0, 1, 1, 1]),
        ([1] * 6, 3, 2, 0, [0, 1, 1, 2, 2, 2]),  # embeddings on GPU 0: it takes fewer layers (loads 3, 2, 3)
        ([1, 1, 4, 4, 4, 4], 2, 0, 0, [0, 0, 0, 0, 1, 1]),  # balanced by size (10 vs 8), not by count
        ([1] * 3, 1, 5, 5, [0, 0, 0]),
    ],
)
def test_contiguous_blocks_balance_by_size(sizes, n, head, tail, expected):
    assert placement.contiguous_blocks(sizes, n, head, tail) == expected


def test_device_maps_and_their_crossings(tiny_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_dir)
    config.num_hidden_layers = 8
    contiguous = placement.device_map(config, 4, "contiguous", sizes=[10] * 8)
    robin = placement.device_map(config, 4, "round_robin")
    assert [robin[f"model.layers.{i}"] for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert contiguous["model.embed_tokens"] == 0 and contiguous["lm_head"] == 3 == contiguous["model.norm"]
    assert placement.boundary_crossings(contiguous) == 3
    assert placement.boundary_crossings(robin) == 7  # every layer-to-layer step


class MoEGate(nn.Module):
    """Stands in for DeepSeek's remote-code gate, which asserts it is never trained."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, 4))

    def forward(self, x):
        assert not self.training
        return x @ self.weight.T


def test_remote_gates_stay_frozen_in_eval_after_every_train_call():
    model = nn.Sequential(nn.Linear(4, 4), MoEGate())
    done = quirks.apply_quirks(model)
    assert done["remote_gates_frozen"] == 1
    for _ in range(2):
        model.train()
        assert model[0].training and not model[1].training
        assert not model[1].weight.requires_grad
        model(torch.ones(1, 4))  # the gate's assert would fire in training mode


def _remote_moe(error: Exception):
    cls = type(
        "DeepseekV3MoE",
        (nn.Module,),
        {
            "__module__": "transformers_modules.deepseek.modeling_deepseek",
            "forward": lambda self, x: (_ for _ in ()).throw(error),
        },
    )
    module = cls()
    module.lin = nn.Linear(2, 2)
    return module


def test_unbound_y_falls_back_to_identity_only_for_that_error():
    moe = _remote_moe(UnboundLocalError("local variable 'y' referenced before assignment"))
    guards = quirks.guard_remote_moe(moe)
    x = torch.randn(3, 2)
    assert torch.equal(moe(x), x) and guards[0].fallbacks == 1
    assert not moe.lin.weight.requires_grad
    other = _remote_moe(UnboundLocalError("local variable 'z' referenced before assignment"))
    quirks.guard_remote_moe(other)
    with pytest.raises(UnboundLocalError, match="'z'"):
        other(x)


def test_native_modules_get_no_remote_quirk(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert quirks.apply_quirks(model)["remote_gates_frozen"] == 0
    assert quirks.apply_quirks(model)["remote_moe_guarded"] == 0


def test_router_computes_in_fp32_under_bf16_weights(tiny_dir):
    """Routing decisions must not change with bf16 (bf16 router logits changed 6-33% of the choices)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.float32
    logits, _, _ = gate(torch.randn(5, model.config.hidden_size, dtype=torch.bfloat16))
    assert logits.dtype == torch.float32
