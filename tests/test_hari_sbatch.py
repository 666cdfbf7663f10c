"""slurm/hari_train.sbatch on the session's two-node test Slurm: one notebook per node, gloo across them,
and a USR1 before the time limit → checkpoint, requeue, resume in the same run folder."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from slurm_cluster import slurm  # noqa: F401  (session fixture)

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _env(tmp: Path) -> dict[str, str]:
    return {"DSR1KIT_RUN_DIR": str(tmp / "run"), "NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo",
            "MASTER_ADDR": "127.0.0.1", "NVME_DIR": str(tmp / "nvme"), "OMP_NUM_THREADS": "1"}


def _submit(slurm, tmp: Path, *params: str) -> int:
    return slurm.sbatch(f"--output={tmp}/%x-%j.out", "-N", "2", "--cpus-per-task=2", "slurm/hari_train.sbatch",
                        "params/tiny/20_hari_training.yaml", "-p", "sample_limit", "48", "-p", "epochs", "20", *params,
                        env=_env(tmp), cwd=ROOT)


def test_two_nodes_train_one_adapter_and_rank0_reports(slurm, tmp_path):
    job = slurm.wait_job(_submit(slurm, tmp_path, "-p", "max_steps", "4", "-p", "log_every", "1"), timeout=420)
    assert job.state == "COMPLETED", job.output[-4000:]
    run = tmp_path / "run"
    info = json.loads((run / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["ranks_agree"] and info["steps_done"] == 4
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((run / "status.json").read_text())["status"] == "ok"            # rank 0: the report
    assert json.loads((run / "ranks" / "rank1" / "status.json").read_text())["rank"] == 1
    assert "Verdict: OK" in (run / "report.html").read_text()


def test_usr1_checkpoints_requeues_and_resumes(slurm, tmp_path):
    """What Slurm does 120 s before the time limit (--signal=B:USR1@120), sent by hand mid-run."""
    job_id = _submit(slurm, tmp_path, "-p", "max_steps", "40", "-p", "save_every", "2")
    latest = tmp_path / "run" / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while not latest.is_file() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert latest.is_file(), slurm.logs()
    slurm.run("scancel", "--batch", "--signal=USR1", str(job_id))
    # The requeued job starts again by itself once its credential expires (cred_expire, 20 s on the
    # test cluster; 120 s by default). Nudging it earlier gets "Job credential revoked": FAILED.
    job = slurm.wait_job(job_id, timeout=600)
    out = job.output
    assert "asking every rank to checkpoint and stop" in out and f"requeueing job {job_id}" in out
    assert job.state == "COMPLETED", out[-4000:] + "\n" + slurm.logs(tail=6000)
    assert "restart 1" in out
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["resumed_from"] and 0 < info["resumed_from"] < 40 and info["steps_done"] == 40
    assert info["ranks_agree"] and (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


def _metric_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_a_node_lost_mid_job_requeues_and_the_rerun_loses_nothing_and_repeats_nothing(slurm, tmp_path):
    """Node n2 goes down mid-training (Slurm kills the job: NODE_FAIL); --requeue brings it back once the
    node returns, and the rerun starts from the last checkpoint: every step logged once, none lost."""
    job_id = _submit(slurm, tmp_path, "-p", "max_steps", "30", "-p", "save_every", "3", "-p", "log_every", "1")
    run = tmp_path / "run"
    latest = run / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (latest.is_file() and latest.read_text().strip() >= "step-0000006"):
        time.sleep(0.5)
    assert latest.is_file(), slurm.logs()
    down = slurm.run("scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=fault-test")
    assert down.returncode == 0, down.stderr
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and slurm.job_fields(job_id).get("Restarts", "0") == "0":
            time.sleep(0.5)
        assert slurm.job_fields(job_id).get("Restarts") == "1", slurm.job_fields(job_id)
    finally:
        slurm.run("scontrol", "update", "NodeName=n2", "State=RESUME")
    job = slurm.wait_job(job_id, timeout=600)
    assert job.state == "COMPLETED", job.output[-4000:] + "\n" + slurm.logs(tail=6000)
    info = json.loads((run / "run_info.json").read_text())
    assert info["steps_done"] == 30 and info["ranks_agree"]
    assert 6 <= info["resumed_from"] < 30  # from a checkpoint written before the loss, not from scratch
    steps = _metric_steps(run)
    assert steps == sorted(set(steps)) and steps[-1] == 30 and len(steps) == 30  # each step once, none missing
