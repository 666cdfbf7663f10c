"""Adapter inspection on an adapter made by a real (short) tiny HARI run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dsr1kit import params, steps
from dsr1kit.inspection.adapter import AdapterError, inspect_adapter, read_adapter
from dsr1kit.inspection.merge import merge_into_copy, verify_merge
from dsr1kit.measure.compare import compare_on, encode_probe
from dsr1kit.steps import adapter_inspection

ROOT = Path(__file__).resolve().parent.parent
KEY = "base_model.model.model.layers.2.self_attn.q_a_proj.lora_{}.weight"


@pytest.fixture(scope="module")
def hari_run(tmp_path_factory):
    """runs/<…-20_hari_training-…>/adapter from 6 HARI steps on 48 rows (rows 48+ are held out)."""
    runs = tmp_path_factory.mktemp("runs")
    run_dir = runs / "20261129T000000Z-20_hari_training-abcdef"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsr1kit",
            "train",
            "-f",
            "params/tiny/20_hari_training.yaml",
            "-p",
            "sample_limit",
            "48",
            "-p",
            "max_steps",
            "6",
            "--run-dir",
            str(run_dir),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return runs, run_dir / "adapter"


@pytest.fixture(scope="module")
def adapted(hari_run):
    p = params.InspectParams(adapter_dir=str(hari_run[1]), max_len=128, n_probe=6)
    adapter = read_adapter(hari_run[1])
    model, tok, loaded = adapter_inspection.load_adapted(p, adapter)
    return p, adapter, model, tok, loaded


def test_module_table_matches_an_independent_computation(adapted, tiny_dir):
    _, adapter, model, _, _ = adapted
    stats = {s.module: s for s in inspect_adapter(adapter, model)}
    raw = load_file(adapter.path / "adapter_model.safetensors")
    base = load_file(tiny_dir / "model.safetensors")
    cfg = json.loads((adapter.path / "adapter_config.json").read_text())
    assert set(stats) == {"model.layers.2.self_attn.q_a_proj", "model.layers.2.self_attn.q_b_proj"}
    for module, s in stats.items():
        a = raw[f"base_model.model.{module}.lora_A.weight"].double().numpy()
        b = raw[f"base_model.model.{module}.lora_B.weight"].double().numpy()
        delta = cfg["lora_alpha"] / cfg["r"] * b @ a
        w = base[f"{module}.weight"].double().numpy()
        sv = np.linalg.svd(delta, compute_uv=False)
        prob = sv / sv.sum()
        assert s.rank == cfg["r"] == a.shape[0]
        assert s.norm_a == pytest.approx(np.linalg.norm(a), rel=1e-5)
        assert s.norm_b == pytest.approx(np.linalg.norm(b), rel=1e-5)
        assert s.norm_delta == pytest.approx(np.linalg.norm(delta), rel=1e-4)
        assert s.ratio == pytest.approx(np.linalg.norm(delta) / np.linalg.norm(w), rel=1e-4)
        assert s.effective_rank == pytest.approx(np.exp(-(prob * np.log(prob)).sum()), rel=1e-3)
        assert s.zero_share_b == pytest.approx(float((b == 0).mean()))


def test_training_slice_held_out_and_retain_probes(adapted):
    p, adapter, model, tok, _ = adapted
    sets = adapter_inspection.probe_sets(p, adapter.path)
    assert list(sets) == ["training slice", "held-out", "retain"]
    assert sets["held-out"][0]["id"] == "sft-0048"  # the first row the 48-sample run never saw
    results = adapter_inspection.compare_all(model, tok, sets, p)
    for r in results:
        assert r.kl_mean > 0 and 0 < r.top1_agreement <= 1 and r.tokens == len(r.kl_per_token)
    verdict = adapter_inspection.verdict(
        adapter_inspection.Inspection(inspect_adapter(adapter, model), results)
    )
    assert verdict.headline.startswith("CE on the training slice") and verdict.status in ("ok", "warn")
    assert verdict.lines[0] == "lora_B is non-zero in every module"
    steps.finish(verdict)  # not a failure


def test_kl_and_agreement_equal_an_independent_computation(adapted, tiny_dir):
    """Base and merged adapter loaded afresh from disk (no disable_adapter), KL by F.kl_div: same numbers."""
    import torch.nn.functional as F
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    p, adapter, model, tok, _ = adapted
    examples = encode_probe(tok, adapter_inspection.probe_sets(p, adapter.path)["retain"], 128, "")
    res = compare_on(model, examples, "retain")
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    merged = (
        PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32), str(adapter.path)
        )
        .merge_and_unload()
        .eval()
    )
    kls, agree, n = [], 0, 0
    with torch.no_grad():
        for ids, _ in examples:
            x = torch.tensor([ids])
            log_b, log_a = (
                base(input_ids=x).logits[0].log_softmax(-1),
                merged(input_ids=x).logits[0].log_softmax(-1),
            )
            kls.append(F.kl_div(log_a, log_b, log_target=True, reduction="none").sum(-1))
            agree += int((log_a.argmax(-1) == log_b.argmax(-1)).sum())
            n += len(ids)
    kl = torch.cat(kls)
    assert kl.mean() > 1e-5  # the trained adapter moved the model
    assert res.tokens == n and res.kl_mean == pytest.approx(float(kl.mean()), rel=1e-3)
    assert res.kl_per_token == pytest.approx(kl.tolist(), rel=1e-2, abs=1e-6)  # fp32 noise of the merge
    assert res.top1_agreement == pytest.approx(agree / n, abs=1.5 / n)  # at most one near-tie may flip


def test_zero_adapter_moves_nothing(adapted, tmp_path):
    p, adapter, _, tok, _ = adapted
    zero = tmp_path / "zero"
    shutil.copytree(adapter.path, zero)
    weights = load_file(zero / "adapter_model.safetensors")
    save_file(
        {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in weights.items()},
        zero / "adapter_model.safetensors",
    )
    z = read_adapter(zero)
    model, tok, _ = adapter_inspection.load_adapted(p, z)
    rows = adapter_inspection.probe_sets(p, z.path)["retain"]
    res = compare_on(model, encode_probe(tok, rows, 128, ""), "retain")
    assert res.kl_mean == pytest.approx(0.0, abs=1e-9) and res.top1_agreement == 1.0
    assert res.ce_adapted == pytest.approx(res.ce_base)
    verdict = adapter_inspection.verdict(adapter_inspection.Inspection(inspect_adapter(z, model), [res]))
    assert verdict.status == "fail" and "all zero" in verdict.headline
    with pytest.raises(adapter_inspection.InspectionFailed, match="all zero"):
        steps.finish(verdict)  # notebook 30's last call: the run fails


def test_merged_checkpoint_equals_base_plus_adapter(adapted, tmp_path, tiny_dir):
    """In fp32 the merge is exact up to float rounding; in the base's bf16 within bf16 rounding."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, adapter, _, tok, _ = adapted
    fp32_base = tmp_path / "base32"
    AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).save_pretrained(fp32_base)
    for f in tiny_dir.glob("tokenizer*"):
        shutil.copy(f, fp32_base / f.name)
    merged_dir = merge_into_copy(fp32_base, adapter, tmp_path / "merged32")
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(fp32_base, dtype=torch.float32), str(adapter.path)
    )
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    ids = torch.tensor(
        [encode_probe(tok, [{"text": "The old mill stood beside the harbour."}], 64, "")[0][0]]
    )
    check = verify_merge(peft, merged, ids)
    assert check["max_abs_diff"] < 1e-4 and check["top1_agreement"] == 1.0
    # untouched shards are links/copies; only the adapted weights differ from the base
    base_w, merged_w = load_file(fp32_base / "model.safetensors"), load_file(merged_dir / "model.safetensors")
    changed = {k for k in base_w if not torch.equal(base_w[k], merged_w[k])}
    assert changed == {f"{m}.weight" for m in adapter.modules}


def test_not_an_adapter_folder(tmp_path):
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        read_adapter(tmp_path)
    with pytest.raises(AdapterError, match="is not a folder"):
        read_adapter(tmp_path / "nope")


def test_truncated_safetensors(adapted, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(adapted[1].path, bad)
    data = (bad / "adapter_model.safetensors").read_bytes()
    (bad / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match="truncated or corrupt"):
        read_adapter(bad)


def test_adapter_for_another_base_model(adapted, tmp_path):
    _, adapter, model, _, _ = adapted
    weights = load_file(adapter.path / "adapter_model.safetensors")
    other = tmp_path / "other"
    shutil.copytree(adapter.path, other)
    wrong = dict(weights)
    wrong[KEY.format("A")] = torch.zeros(4, 128)  # this model's q_a_proj takes 256 inputs
    save_file(wrong, other / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"another base model"):
        inspect_adapter(read_adapter(other), model)
    renamed = {k.replace("q_a_proj", "q_z_proj"): v for k, v in weights.items()}
    save_file(renamed, other / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"no module model.layers.2.self_attn.q_z_proj"):
        inspect_adapter(read_adapter(other), model)


def test_notebook_30_report(hari_run, cli, tmp_path):
    runs, adapter_dir = hari_run
    proc = cli(
        "run",
        "notebooks/30_adapter_inspection.ipynb",
        "-f",
        "params/tiny/30_adapter_inspection.yaml",
        "-p",
        "n_probe",
        "6",
        "-p",
        "n_generate",
        "2",
        "-p",
        "max_new_tokens",
        "8",
        "--runs-dir",
        str(runs),
        "-q",
    )  # adapter_dir latest → the newest HARI adapter in runs/
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = next(d for d in runs.iterdir() if "30_adapter_inspection" in d.name)
    html = (run_dir / "report.html").read_text()
    for text in (
        "norm_delta",
        "effective_rank",
        "KL(base‖adapted) mean",
        "held-out",
        "retain",
        "max_abs_diff",
        "Verdict: ",
    ):
        assert text in html, text
    from dsr1kit.run.tidy import (
        MachinePaths,
    )  # the report names the adapter as runs/…, not this machine's path

    assert MachinePaths.here(run_dir)(str(adapter_dir)) in html and str(adapter_dir) not in html
    assert (run_dir / "merged" / "model.safetensors").is_file()
    assert {f.name for f in (run_dir / "figures").iterdir()} == {"adapter_norms.png", "kl_histogram.png"}
