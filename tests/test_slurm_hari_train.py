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
    return {
        "DSR1KIT_RUN_DIR": str(tmp / "run"),
        "NCCL_SOCKET_IFNAME": "lo",
        "GLOO_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "127.0.0.1",
        "NVME_DIR": str(tmp / "nvme"),
        "OMP_NUM_THREADS": "1",
    }


def _submit(slurm, tmp: Path, *params: str, extra_env: dict[str, str] | None = None) -> int:
    return slurm.sbatch(
        f"--output={tmp}/%x-%j.out",
        "-N",
        "2",
        "--cpus-per-task=2",
        "slurm/hari_train.sbatch",
        "params/tiny/20_hari_training.yaml",
        "-p",
        "sample_limit",
        "48",
        "-p",
        "epochs",
        "20",
        *params,
        env={**_env(tmp), **(extra_env or {})},
        cwd=ROOT,
    )


SENTINEL = "hf_" + "SlurmSentinel0123456789abcd"


def test_two_nodes_train_one_adapter_and_rank0_reports(slurm, tmp_path):
    job = slurm.wait_job(
        _submit(
            slurm, tmp_path, "-p", "max_steps", "4", "-p", "log_every", "1", extra_env={"HF_TOKEN": SENTINEL}
        ),
        timeout=420,
    )
    assert job.state == "COMPLETED", job.output[-4000:]
    run = tmp_path / "run"
    info = json.loads((run / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["ranks_agree"] and info["steps_done"] == 4
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((run / "status.json").read_text())["status"] == "ok"  # rank 0: the report
    assert json.loads((run / "ranks" / "rank1" / "status.json").read_text())["rank"] == 1
    assert "Verdict: OK" in (run / "report.html").read_text()
    # a secret in the job's environment is in no file of the run and not in the Slurm log
    assert SENTINEL not in job.output
    assert not [p for p in run.rglob("*") if p.is_file() and SENTINEL.encode() in p.read_bytes()]


def _metric_steps(run: Path) -> list[int]:
    return [
        json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]


def _wait_for_checkpoint(slurm, latest: Path, at_least: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if latest.is_file() and int(latest.read_text().strip().split("-")[1]) >= at_least:
            return
        time.sleep(0.5)
    raise AssertionError(f"no checkpoint at step >= {at_least}:\n{slurm.logs()}")


def _wait_for_restarts(slurm, job_id: int, n: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and int(slurm.job_fields(job_id).get("Restarts", "0")) < n:
        time.sleep(0.5)
    assert int(slurm.job_fields(job_id).get("Restarts", "0")) == n, slurm.job_fields(job_id)


def test_preemption_then_a_lost_node_each_resume_and_nothing_is_lost_or_repeated(slurm, tmp_path):
    """One job, two faults. First what Slurm does 120 s before the time limit (--signal=B:USR1@120), sent by
    hand: every rank checkpoints, the job requeues itself and resumes. Then node n2 goes down mid-training
    (Slurm kills the job, NODE_FAIL; --requeue brings it back once the node returns): the rerun starts from
    the last checkpoint. Every step is logged exactly once and the run ends complete."""
    job_id = _submit(
        slurm, tmp_path, "-p", "max_steps", "36", "-p", "save_every", "3", "-p", "log_every", "1"
    )
    run = tmp_path / "run"
    latest = run / "checkpoints" / "latest"
    _wait_for_checkpoint(slurm, latest, 3)
    slurm.run("scancel", "--batch", "--signal=USR1", str(job_id))
    # The requeued job starts again by itself once its credential expires (cred_expire, 20 s on the
    # test cluster; 120 s by default). Nudging it earlier gets "Job credential revoked": FAILED.
    _wait_for_restarts(slurm, job_id, 1)
    preempted_at = int(latest.read_text().strip().split("-")[1])
    _wait_for_checkpoint(slurm, latest, preempted_at + 6, timeout=400)  # the resumed run is training again
    down = slurm.run("scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=fault-test")
    assert down.returncode == 0, down.stderr
    try:
        _wait_for_restarts(slurm, job_id, 2)
    finally:
        slurm.run("scontrol", "update", "NodeName=n2", "State=RESUME")
    job = slurm.wait_job(job_id, timeout=600)
    out = job.output
    assert "asking every rank to checkpoint and stop" in out and f"requeueing job {job_id}" in out
    assert job.state == "COMPLETED", out[-4000:] + "\n" + slurm.logs(tail=6000)
    assert "restart 1" in out and "restart 2" in out
    info = json.loads((run / "run_info.json").read_text())
    assert info["steps_done"] == 36 and info["ranks_agree"]
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    assert preempted_at + 6 <= info["resumed_from"] < 36  # the second restart resumed, not from scratch
    steps = _metric_steps(run)
    assert steps == list(range(1, 37)), steps  # each step logged once, none missing, across both restarts
