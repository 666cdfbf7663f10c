"""R1 dress rehearsal: notebooks 00, 20, 10 and 30 with DeepSeek-R1's params apart from size, on the tiny R1-style
model stored as R1 ships, by repo id, hub offline (see conftest).

vLLM's CPU backend cannot run FP8 block-scaled linears without AMX tiles (this CI machine has none), so on
such a CPU notebook 10 serves a bf16 copy dequantized from the FP8 checkpoint, and the merged adapter the
same way; the served-form line says so and this test checks it says so. On GPUs the FP8 form is served.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, run_cli
from slurm_cluster import slurm  # noqa: F401  (session fixture)

from dsr1kit.data import templates
from dsr1kit.infer.serve_form import fp8_blocks_servable
from dsr1kit.r1_format import REPO_ID, build

R1 = Path("params/r1-671b-2x8h100")
REHEARSAL = Path("params/r1-rehearsal")


def _run(runs: Path, notebook: str, *extra: str) -> Path:
    run_dir = runs / f"20261202T000000Z-{notebook}-r1rehe"
    proc = run_cli("run", f"notebooks/{notebook}.ipynb", "-f", str(R1 / f"{notebook}.yaml"),
               "-f", str(REHEARSAL / f"{notebook}.yaml"), *extra, "--run-dir", str(run_dir), "-q", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"
    return run_dir


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    build()  # the R1-format checkpoint in the offline hub cache (cached)
    return tmp_path_factory.mktemp("r1-runs")


@pytest.fixture(scope="module")
def hari(runs):
    return _run(runs, "20_hari_training")


NOTEBOOKS = ["00_cluster_check", "10_vllm_inference", "20_hari_training", "30_adapter_inspection"]


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_rehearsal_params_change_only_what_size_forces(notebook):
    """Every R1 key keeps R1's value unless the rehearsal file names it; the rehearsal adds only known keys."""
    from dsr1kit import params

    r1 = yaml.safe_load((R1 / f"{notebook}.yaml").read_text())
    rehearsal = yaml.safe_load((REHEARSAL / f"{notebook}.yaml").read_text())
    merged = params.load(f"notebooks/{notebook}.ipynb", [R1 / f"{notebook}.yaml", REHEARSAL / f"{notebook}.yaml"])
    for key, value in r1.items():
        assert getattr(merged, key) == rehearsal.get(key, value), key
    if notebook != "00_cluster_check":
        assert REPO_ID in (rehearsal.get("model"), rehearsal.get("base_model"))


def test_cluster_check_with_r1_preflight(runs):
    _run(runs, "00_cluster_check")


def test_hari_on_r1_format_trains_the_reasoning(hari):
    s = _summary(hari)
    [counts] = s["data"].values()
    assert counts["reasoning_tokens"] > counts["answer_tokens"] > 0  # R1's template alone would train no reasoning
    assert s["rendering"] == {"served prompt + content": counts["kept"]}
    used = yaml.safe_load((hari / "params.yaml").read_text())
    assert (used["model"], used["quantization"], used["quantize_experts"], used["lambda_kl"]) == (
        REPO_ID, "nf4", True, 0.9)
    assert (hari / "adapter" / "adapter_model.safetensors").is_file()
    plan = s["memory_plan"]  # the report's plan, computed from R1-format config before loading
    assert plan["fits"] and plan["facts"]["weights"] == "bfloat16, linears nf4, experts nf4"
    assert [r["device"] for r in plan["rows"]] == ["host"]


def test_serving_and_eval_on_r1_format(runs, hari):
    run_dir = _run(runs, "10_vllm_inference", "-p", "lora_adapter", str(hari / "adapter"))
    s = _summary(run_dir)
    prompt = s["served_prompt_example"]
    assert prompt.startswith(templates.R1_BOS + "You are DeepSeek-R1." + templates.R1_USER)
    assert prompt.endswith(templates.R1_GENERATION_PROMPT)  # the checkpoint's own template, R1's
    assert set(s["served_forms"]) == {"base", "adapter (merged)"}
    for form in s["served_forms"].values():
        if fp8_blocks_servable():
            assert form == "served as stored"
        else:
            assert form.startswith("FP8 block-scaled weights cannot run on this CPU") and "bf16 copy" in form
    n = yaml.safe_load((REHEARSAL / "10_vllm_inference.yaml").read_text())["eval_limit"]
    for model in ("base", "adapter"):
        assert sum(r[model] for r in s["answer_rules"]) == n  # every answer read by a rule or unparseable
    assert "adapter" in s["headline"]
    assert s["memory_plan"]["step"] == "vLLM serving" and s["memory_plan"]["fits"]


def test_inspection_job_loads_r1_as_training_does(slurm, runs, hari, tmp_path):
    """slurm/adapter_inspection.sbatch with R1's params file and the rehearsal's on top (extra args pass through)."""
    run_dir = runs / "20261202T000000Z-30_adapter_inspection-r1rehe"
    notebook = "30_adapter_inspection"
    job_id = slurm.sbatch(f"--output={tmp_path}/%x-%j.out", "--cpus-per-task=2", "slurm/adapter_inspection.sbatch",
                          str(R1 / f"{notebook}.yaml"), "-f", str(REHEARSAL / f"{notebook}.yaml"),
                          "-p", "adapter_dir", str(hari / "adapter"), "--run-dir", str(run_dir), "-q",
                          env={"NVME_DIR": str(tmp_path / "nvme"), "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    job = slurm.wait_job(job_id, timeout=540)
    assert job.state == "COMPLETED", job.output[-4000:]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"
    load = _summary(run_dir)["base_load"]
    assert (load["quantization"], load["quantize_experts"]) == ("nf4", True)
    assert _summary(run_dir)["memory_plan"]["inspect"]["fits"]
