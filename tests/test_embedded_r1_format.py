"""The tiny R1-style model stored as DeepSeek-R1 ships, resolved by repo id offline; merging an adapter into it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsr1kit.data import templates
from dsr1kit.embedded import r1_format
from dsr1kit.inspection.adapter import read_adapter
from dsr1kit.inspection.merge import merge_into_copy, merge_write_bytes
from dsr1kit.model.fp8 import FP8_DTYPE
from dsr1kit.model.stream_load import load_streaming

ROOT = Path(__file__).resolve().parent.parent

ADAPTED = ["model.layers.2.self_attn.q_a_proj", "model.layers.2.self_attn.q_b_proj"]


@pytest.fixture(scope="module")
def snapshot():
    return r1_format.build()


def _tensor(folder, key):
    index = json.loads((folder / r1_format.INDEX_FILE).read_text())["weight_map"]
    with safe_open(folder / index[key], "pt") as f:
        return f.get_tensor(key)


def test_stored_like_r1(snapshot):
    config = json.loads((snapshot / "config.json").read_text())
    assert config["quantization_config"] == r1_format.R1_QUANTIZATION_CONFIG
    index = json.loads((snapshot / r1_format.INDEX_FILE).read_text())["weight_map"]
    assert len(set(index.values())) > 2  # sharded
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in index  # one key per expert
    w = _tensor(snapshot, "model.layers.1.mlp.experts.7.gate_proj.weight")
    s = _tensor(snapshot, "model.layers.1.mlp.experts.7.gate_proj.weight_scale_inv")
    assert (
        w.dtype == FP8_DTYPE and s.dtype == torch.float32 and tuple(s.shape) == (1, 2)
    )  # [128, 256] in 128² blocks
    assert _tensor(snapshot, "lm_head.weight").dtype == torch.bfloat16
    assert _tensor(snapshot, "model.layers.1.mlp.gate.weight").dtype != FP8_DTYPE


def test_repo_id_resolves_offline_with_r1_tokenizer_setup(snapshot, tmp_path):
    code = (
        "from transformers import AutoTokenizer; from dsr1kit.model.load import local_checkpoint;"
        f"t = AutoTokenizer.from_pretrained({r1_format.REPO_ID!r});"
        f"print(local_checkpoint({r1_format.REPO_ID!r})); print(t.bos_token, t.eos_token, t.pad_token);"
        "print(t.convert_ids_to_tokens(t.encode('<think>x</think>', add_special_tokens=False))[0])"
    )
    env = {**r1_format.offline_env(), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    path, specials, think = proc.stdout.split("\n")[:3]
    assert path == str(snapshot)
    assert specials.split() == [templates.R1_BOS, templates.R1_EOS, templates.R1_PAD]
    assert think == "<think>"  # one added token, as in R1


@pytest.fixture(scope="module")
def adapter_dir(snapshot, tmp_path_factory):
    """A LoRA on the last layer's q_a_proj/q_b_proj with a change of ~1% of the weights: below FP8's step."""
    from peft import LoraConfig, get_peft_model

    model = load_streaming(
        snapshot, nf4_linears=False, nf4_experts=False, dtype=torch.float32, progress=False
    )
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=ADAPTED, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, q in peft.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                q.copy_(
                    torch.randn(q.shape, generator=gen)
                    * (0.05 if "lora_B" in name else 1.0)
                    / q.shape[1] ** 0.5
                )
    out = tmp_path_factory.mktemp("adapter") / "adapter"
    peft.save_pretrained(out)
    return out


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_fp8_merge_reproduces_base_plus_adapter_not_the_base(snapshot, adapter_dir, tmp_path):
    from peft import PeftModel

    adapter = read_adapter(adapter_dir)
    merged_dir = merge_into_copy(
        r1_format.REPO_ID, adapter, tmp_path / "merged"
    )  # by repo id, as on a cluster

    base = load_streaming(snapshot, nf4_linears=False, nf4_experts=False, dtype=torch.float32, progress=False)
    ids = torch.randint(3, 1000, (2, 48), generator=torch.Generator().manual_seed(1))
    base_logits = _logits(base, ids)
    adapted_logits = _logits(PeftModel.from_pretrained(base, str(adapter_dir)).eval(), ids)
    merged = load_streaming(
        merged_dir, nf4_linears=False, nf4_experts=False, dtype=torch.float32, progress=False
    )
    merged_logits = _logits(merged, ids)

    effect = (adapted_logits - base_logits).abs().mean()
    error = (merged_logits - adapted_logits).abs().mean()
    assert effect > 1e-2
    print(f"merge error {error:.3e}, adapter effect {effect:.3e}")
    assert error < 0.05 * effect, f"merged is {error:.3e} from base+adapter, whose effect is {effect:.3e}"

    quant = json.loads((merged_dir / "config.json").read_text())["quantization_config"]
    expected = sorted(ADAPTED + ["model.layers.2.self_attn.kv_a_proj_with_mqa"])  # q_a_proj's fused partner
    assert quant["modules_to_not_convert"] == quant["ignored_layers"] == expected
    for module in expected:
        assert _tensor(merged_dir, f"{module}.weight").dtype == torch.bfloat16
        assert (
            f"{module}.weight_scale_inv"
            not in json.loads((merged_dir / r1_format.INDEX_FILE).read_text())["weight_map"]
        )
    assert (
        _tensor(merged_dir, "model.layers.1.self_attn.q_a_proj.weight").dtype == FP8_DTYPE
    )  # the rest untouched


@pytest.mark.parametrize("where", ["same filesystem", "another filesystem"])
def test_a_merge_writes_only_the_shards_the_adapter_changes(snapshot, adapter_dir, tmp_path, where):
    """The merged checkpoint's other shards are the base's own files (hard links, or relative symbolic
    links where the run folder is on another filesystem than the model, as from a node-local cache to a
    shared one): the bytes written are the changed shards plus the small files. The merge still computes
    base + adapter, and redacting the run folder touches none of the base's bytes."""
    import os
    import shutil
    import tempfile

    from dsr1kit.run.redact import redact_tree

    root = Path(tempfile.mkdtemp(dir="/dev/shm")) if where == "another filesystem" else tmp_path
    try:
        assert (os.stat(root).st_dev != os.stat(snapshot).st_dev) == (where == "another filesystem")
        out = merge_into_copy(r1_format.REPO_ID, read_adapter(adapter_dir), root / "merged")
        index = json.loads((snapshot / r1_format.INDEX_FILE).read_text())["weight_map"]
        changed = {index[f"{m}.weight"] for m in ADAPTED}
        written = {
            p.name: p.stat().st_size for p in out.iterdir() if not p.is_symlink() and p.stat().st_nlink == 1
        }
        shards = {p.name for p in snapshot.glob("*.safetensors")}
        assert changed < shards and set(written) & shards == changed  # only the changed shards were written
        small = sum(size for name, size in written.items() if name not in shards)
        assert small < 64 * 1024  # index, config, MERGED_FROM.json
        for name in shards - changed:
            link = out / name
            assert link.is_symlink() if where == "another filesystem" else link.stat().st_nlink > 1
            assert link.resolve().read_bytes() == (snapshot / name).resolve().read_bytes()
            if link.is_symlink():
                assert not os.path.isabs(os.readlink(link))  # relative: the folder can move with its base
        model_bytes = sum((snapshot / n).resolve().stat().st_size for n in shards)
        print(f"{where}: wrote {sum(written.values())} of {model_bytes} bytes of shards and files")
        # the disk plan's count (headers only, before merging) holds what was written, within 10%
        planned, rewritten = merge_write_bytes(snapshot, ADAPTED)
        core = sum(size for name, size in written.items() if name != "MERGED_FROM.json")
        assert rewritten == len(changed) and core <= planned <= 1.1 * core, (core, planned)
        # a secret whose bytes occur by chance in the weights of a linked and of a written shard
        before = {n: (out / n).resolve().read_bytes() for n in shards}
        secrets = [_printable_run(before[name]) for name in (sorted(shards - changed)[0], sorted(changed)[0])]
        assert redact_tree(out, secrets) == []
        assert {n: (out / n).resolve().read_bytes() for n in shards} == before  # base and merge untouched
        merged = load_streaming(
            out, nf4_linears=False, nf4_experts=False, dtype=torch.float32, progress=False
        )
        assert merged is not None
    finally:
        if where == "another filesystem":
            shutil.rmtree(root, ignore_errors=True)


def _printable_run(shard: bytes, n: int = 5) -> str:
    """n bytes of a shard's tensor data that read as printable ASCII (what a short secret could equal)."""
    start = 8 + int.from_bytes(shard[:8], "little")  # after the safetensors header
    for i in range(start, len(shard) - n):
        chunk = shard[i : i + n]
        if all(0x21 <= b <= 0x7E and b != 0x2A for b in chunk):
            return chunk.decode()
    raise AssertionError("no printable run in the shard's data")


def test_vllm_gets_a_bf16_copy_where_fused_fp8_parts_are_not_block_aligned(snapshot):
    """vLLM places each part of a fused FP8 linear at whole 128-row scale blocks: R1's parts are aligned, the
    tiny model's q_lora_rank (64) is not, so even a CPU with AMX serves the tiny model from a bf16 copy
    (served as stored, vLLM failed loading it: "start (1) + length (5) exceeds dimension size (5)")."""
    from dsr1kit.infer.serve_form import checkpoint_config, fp8_blocks_servable, unaligned_fused_shards

    r1 = json.loads((ROOT / "dsr1kit" / "plan" / "known_configs" / "deepseek-r1.json").read_text())
    r1["quantization_config"] = r1_format.R1_QUANTIZATION_CONFIG
    assert unaligned_fused_shards(r1) == []
    tiny = checkpoint_config(r1_format.REPO_ID)
    assert tiny is not None and unaligned_fused_shards(tiny) == [
        "q_lora_rank (fused with kv_a_proj_with_mqa) = 64"
    ]
    assert not fp8_blocks_servable(tiny)
