"""The HARI loop for real on CPU: outputs, two gloo ranks, SIGKILL + resume, NaN stop, notebook 20."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsr1kit.cluster.rendezvous import free_port

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "params" / "tiny" / "20_hari_training.yaml")
SMALL = ["-p", "sample_limit", "96", "-p", "max_steps", "12", "-p", "save_every", "3", "-p", "log_every", "2"]


def _train(run_dir: Path, *extra: str, env: dict | None = None, wait: bool = True):
    cmd = [sys.executable, "-m", "dsr1kit", "train", "-f", TINY, *SMALL, *extra, "--run-dir", str(run_dir)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One uninterrupted single-rank run, with a secret sentinel in the environment."""
    run_dir = tmp_path_factory.mktemp("full")
    sentinel = "hf_" + secrets.token_hex(16)
    proc = _train(run_dir, env={"HF_TOKEN": sentinel})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, sentinel


def test_outputs_are_a_loadable_peft_adapter_with_run_info(full_run, tiny_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir, _ = full_run
    adapter = run_dir / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert (adapter / "tokenizer.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter)
    b_norms = [float(q.norm()) for n, q in model.named_parameters() if "lora_B" in n]
    assert len(b_norms) == 2 and all(v > 0 for v in b_norms)
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["steps_done"] == info["total_steps"] == 12 and info["optimizer"] == "AdamW"  # CPU
    assert info["samples"] == 96 and info["sources"][0]["rows"] == 360
    assert (info["batch_size"], info["grad_accum"], info["max_len"], info["epochs"]) == (4, 2, 256, 1)
    assert info["hosts"] == [socket.gethostname()] and info["ranks_agree"]
    assert info["lora"]["modules"] == [
        "model.layers.2.self_attn.q_a_proj",
        "model.layers.2.self_attn.q_b_proj",
    ]


def test_metrics_are_written_as_training_goes(full_run):
    run_dir, _ = full_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 10, 12]
    for key in ("loss", "ce", "kl", "lr", "grad_norm", "tokens_per_s", "peak_memory_gib"):
        assert key in rows[0]
    assert rows[0]["lr"] < rows[1]["lr"] > rows[-1]["lr"]  # warmup, then linear decay


def test_no_secret_in_any_output(full_run):
    run_dir, sentinel = full_run
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert sentinel.encode() not in path.read_bytes(), path


def test_two_gloo_ranks_end_with_identical_adapters(tmp_path, full_run):
    port = free_port()
    procs = [
        _train(
            tmp_path,
            env={
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
            wait=False,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["world_size"] == 2 and len(info["hosts"]) == 2
    assert len(info["rank_digests"]) == 2 and info["ranks_agree"]
    # each rank took 96 // 2 = 48 samples: 48 / (4 × 2) = 6 steps per epoch
    assert info["total_steps"] == 6
    single = (full_run[0] / "adapter" / "adapter_model.safetensors").read_bytes()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes() != single


def test_sigkill_then_resume_is_bit_identical(tmp_path, full_run):
    proc = _train(tmp_path, wait=False)
    latest = tmp_path / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() >= "step-0000006":
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (tmp_path / "adapter").exists()
    resumed = _train(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["resumed_from"] >= 6 and info["steps_done"] == 12
    want = (full_run[0] / "adapter" / "adapter_model.safetensors").read_bytes()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes() == want
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6, 8, 10, 12]  # no duplicated lines from the killed attempt


def _two_ranks(run_dir: Path, *extra: str) -> list[subprocess.Popen]:
    port = free_port()
    env = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return [_train(run_dir, *extra, env={**env, "RANK": str(r)}, wait=False) for r in range(2)]


def test_two_ranks_with_dropout_resume_bit_identically(tmp_path):
    """Every rank's RNG is in the checkpoint: with lora_dropout > 0 the ranks draw different masks (their
    batches differ in length), so a resume that gave every rank rank 0's state would train another adapter."""
    extra = ("-p", "lora_dropout", "0.1", "-p", "epochs", "2")  # 2 ranks: 6 steps per epoch, 12 in all
    procs = _two_ranks(tmp_path / "whole", *extra)
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    run = tmp_path / "cut"
    procs, latest = _two_ranks(run, *extra), run / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if latest.is_file() and latest.read_text().strip() >= "step-0000003":
            break
        time.sleep(0.02)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2, (
        "the run finished before it could be killed"
    )
    procs = _two_ranks(run, *extra)
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    info = json.loads((run / "run_info.json").read_text())
    assert 3 <= info["resumed_from"] < 12 and info["steps_done"] == 12 and info["ranks_agree"]
    want = (tmp_path / "whole" / "adapter" / "adapter_model.safetensors").read_bytes()
    assert (run / "adapter" / "adapter_model.safetensors").read_bytes() == want


def test_stop_file_checkpoints_and_reports_preemption(tmp_path):
    (tmp_path / "checkpoints").mkdir(parents=True)
    proc = _train(tmp_path, wait=False)
    latest = tmp_path / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while not latest.is_file() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    (tmp_path / "STOP").touch()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    summary = json.loads(out.decode().strip().splitlines()[-1])
    assert summary["preempted"] and summary["steps_done"] < 12
    assert latest.read_text().strip() == f"step-{summary['steps_done']:07d}"


def test_non_finite_loss_stops_with_step_and_batch_after_saving(tmp_path):
    proc = _train(tmp_path, "-p", "lr", "1e30", "-p", "warmup_ratio", "0")
    assert proc.returncode != 0
    assert "NonFiniteLoss: non-finite loss at step" in proc.stderr
    assert "batch ids: ['sft-" in proc.stderr
    step = int(proc.stderr.split("last good state saved at step ")[1].split(".")[0])
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"step-{step:07d}"


def test_notebook_20_report_shows_data_curves_and_verdict(tmp_path, cli):
    proc = cli(
        "run", "notebooks/20_hari_training.ipynb", "-f", TINY, *SMALL, "--runs-dir", str(tmp_path), "-q"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = next(tmp_path.iterdir())
    html = (run_dir / "report.html").read_text()
    for text in (
        "sft_tiny.jsonl",
        "truncated",
        "trainable parameters",
        "q_a_proj",
        "Verdict: OK",
        "steps done: 12 of 12",
        "‖lora_B‖",
        "data:image/png",
    ):
        assert text in html, text
    assert (run_dir / "figures" / "training_curves.png").is_file()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "ok" and "loss" in status["summary"]["headline"]


def test_qlora_nf4_trains_on_cpu(tmp_path):
    """NF4 base (bitsandbytes on CPU, incl. the eval-mode reference pass) still gets LoRA gradients."""
    proc = _train(
        tmp_path,
        "-p",
        "quantization",
        "nf4",
        "-p",
        "dtype",
        "bfloat16",
        "-p",
        "max_steps",
        "3",
        "-p",
        "log_every",
        "1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["model"]["quantization"] == "nf4" and info["model"]["quirks"]["nf4_cpu_repack_disabled"] > 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["grad_norm"] > 0 for r in rows)
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert all(float(w.float().norm()) > 0 for k, w in weights.items() if "lora_B" in k)


def test_hari_trains_on_the_nf4_experts_model(tmp_path):
    """quantize_experts: the streaming loader puts the fused experts in NF4; HARI still learns."""
    proc = _train(
        tmp_path,
        "-p",
        "quantization",
        "nf4",
        "-p",
        "quantize_experts",
        "true",
        "-p",
        "dtype",
        "bfloat16",
        "-p",
        "max_steps",
        "3",
        "-p",
        "log_every",
        "1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["model"]["quantize_experts"] and info["model"]["memory_gib"] > 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["grad_norm"] > 0 for r in rows)


def test_snapshots_keep_the_adapter_along_training_without_changing_the_run(tmp_path, full_run):
    """Early stopping traced (notebook 40): snapshots at the listed steps and every N, each with its cost; the
    run's own adapter is bit-identical to the same run without snapshots."""
    from safetensors.torch import load_file

    proc = _train(tmp_path, "-p", "snapshot_every", "6", "-p", "snapshot_steps", "[2]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    snaps = sorted(p.name for p in (tmp_path / "snapshots").iterdir())
    assert snaps == ["step-0000002", "step-0000006"]  # step 12 is the end: the run's adapter
    costs = [json.loads((tmp_path / "snapshots" / s / "cost.json").read_text()) for s in snaps]
    assert [c["step"] for c in costs] == [2, 6] and all(c["total_steps"] == 12 for c in costs)
    assert 0 < costs[0]["tokens"] < costs[1]["tokens"] and 0 < costs[0]["train_s"] <= costs[1]["train_s"]
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["tokens"] > costs[1]["tokens"] and info["train_s"] > 0

    def weights(folder: Path) -> dict:
        return load_file(folder / "adapter_model.safetensors")

    end, plain = weights(tmp_path / "adapter"), weights(full_run[0] / "adapter")
    assert end.keys() == plain.keys() and all((end[k] == plain[k]).all() for k in end)
    early = weights(tmp_path / "snapshots" / "step-0000002")
    assert any(not (early[k] == end[k]).all() for k in end)
