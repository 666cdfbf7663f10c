"""slurm/forgetting_sweep.sh on the session's two-node test Slurm: a job array of slurm/forgetting_sweep.sbatch,
one (λ, seed) point per task, then, only after every task completed, the same script once more without an
array id, which runs notebook 40 over the measured points and only reports."""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from pathlib import Path

import pytest
from slurm_cluster import slurm  # noqa: F401  (session fixture)

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

LAMBDAS, SEEDS = [0, 0.9], [0, 1]
SWEEP = [
    "params/tiny/40_forgetting_sweep.yaml",
    "-p",
    "lambdas",
    "[0, 0.9]",
    "-p",
    "seeds",
    "[0, 1]",
    "-p",
    "hari",
    "{max_steps: 4, sample_limit: 32, log_every: 2}",
    "-p",
    "eval_limit",
    "24",
]


def _env(tmp: Path) -> dict[str, str]:
    return {
        "DSR1KIT_RUN_DIR": str(tmp / "run"),
        "NCCL_SOCKET_IFNAME": "lo",
        "GLOO_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "127.0.0.1",
        "NVME_DIR": str(tmp / "nvme"),
        "OMP_NUM_THREADS": "1",
        # a CPU sweep: no GPU request for the points (nor the report), 2 of a test node's 16 CPUs each
        "GPUS_PER_TASK": "0",
        "CPUS_PER_TASK": "2",
        "REPORT_CPUS_PER_TASK": "2",
        "SBATCH_ARGS": f"--output={tmp}/%x-%j.out",
    }


def _time(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value)


def _canonical(rows: list[dict]) -> list[str]:
    """Order-insensitive and NaN-safe (json.loads makes a new NaN each time, and NaN != NaN)."""
    return sorted(json.dumps(r, sort_keys=True) for r in rows)


def test_one_point_per_array_task_then_a_report_that_trains_nothing(slurm, tmp_path):
    submit = slurm.run("bash", "slurm/forgetting_sweep.sh", *SWEEP, env=_env(tmp_path), cwd=ROOT, timeout=60)
    assert submit.returncode == 0, submit.stderr
    array_id = int(re.search(r"^array job: (\d+) \(4 points", submit.stdout, re.M).group(1))
    report_id = int(re.search(r"^report job: (\d+)", submit.stdout, re.M).group(1))
    run = tmp_path / "run"
    assert f"run folder: {run}\n" in submit.stdout and f"report: {run}/report.html" in submit.stdout

    # what was asked of Slurm: the report waits for the whole array; nobody asked for a GPU
    report_fields = slurm.job_fields(report_id)
    assert f"afterok:{array_id}" in report_fields["Dependency"], report_fields
    assert "gpu:0" in report_fields.get("TresPerNode", "gpu:0"), report_fields

    points = [(lam, seed) for lam in LAMBDAS for seed in SEEDS]  # λ-major: array task k is points[k]
    tasks = {}
    for k, (lam, seed) in enumerate(points):
        task = slurm.wait_job(f"{array_id}_{k}", timeout=150)
        fields = slurm.job_fields(f"{array_id}_{k}")
        assert task.state == "COMPLETED", task.output[-4000:]
        assert fields["ArrayJobId"] == str(array_id) and fields["ArrayTaskId"] == str(k), fields
        assert "gpu:0" in fields.get("TresPerNode", "gpu:0") and fields["NumNodes"] == "1", fields
        printed = json.loads([line for line in task.output.splitlines() if line.startswith("{")][-1])
        assert (printed["lambda_kl"], printed["seed"]) == (lam, seed), printed  # the point of this task id
        tasks[k] = fields

    report = slurm.wait_job(report_id, timeout=150)
    assert report.state == "COMPLETED", report.output[-4000:]
    start = _time(slurm.job_fields(report_id)["StartTime"])
    assert start >= max(_time(f["EndTime"]) for f in tasks.values()), (start, tasks)

    results = []
    for lam, seed in points:
        folder = run / "points" / f"lambda{lam:g}-seed{seed}"
        results.append(json.loads((folder / "result.json").read_text()))
        assert (results[-1]["lambda_kl"], results[-1]["seed"]) == (lam, seed)
        assert (folder / "adapter" / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in (run / "points").iterdir() if p.is_dir()) == sorted(
        f"lambda{lam:g}-seed{seed}" for lam, seed in points
    )

    summary = json.loads((run / "summary.json").read_text())
    from dsr1kit.run.tidy import MachinePaths  # summary.json writes the adapters' folders relative

    assert _canonical(summary["points"]) == _canonical(MachinePaths.here(run).walk(results))
    assert "Verdict" in (run / "report.html").read_text()
    # the report's numbers are computed from the points' own results: per-λ statistics, the fit, the verdict
    from dsr1kit.measure import sweep

    measured = [sweep.PointResult.from_dict(r) for r in results]
    assert _canonical(summary["by_lambda"]) == _canonical([s.to_dict() for s in sweep.by_lambda(measured)])
    fit = sweep.fit_line([r.kl_a for r in measured], [r.a_drop for r in measured])
    assert _canonical([summary["forgetting_vs_kl"]]) == _canonical(
        [{"slope": fit.slope, "intercept": fit.intercept, "r2": fit.r2}]
    )
    assert summary["headline"] == sweep.sweep_verdict(measured).headline
    assert (run / "figures" / "frontier.png").is_file() and (
        run / "figures" / "forgetting_vs_kl.png"
    ).is_file()

    # the report job trained nothing: no HARI steps in its log, and nothing under points/ was written after
    # it started (the times Slurm shows are whole seconds: one of slack for what the array wrote last)
    assert "sweep points" in report.output and "HARI steps" not in report.output, report.output[-3000:]
    late = [
        str(f)
        for f in (run / "points").rglob("*")
        if dt.datetime.fromtimestamp(f.stat().st_mtime) >= start + dt.timedelta(seconds=1)
    ]
    assert not late, late


def _wait_for_training(slurm, job: str, timeout: float = 120) -> None:
    """Until the task's log shows HARI steps: its training loop then takes USR1 as "checkpoint and stop"."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = Path(slurm.job_fields(job).get("StdOut", "/nonexistent"))
        if out.is_file() and re.search(
            r"HARI steps: +\d+%\|[^|]*\| [1-9]\d*/", out.read_text(errors="replace")
        ):
            return
        time.sleep(0.2)
    raise AssertionError(f"{job} started no training: {slurm.job_fields(job)}")


def test_a_point_warned_before_its_time_limit_checkpoints_requeues_and_resumes(slurm, tmp_path):
    """What Slurm sends 120 s before an array task's limit (--signal=B:USR1@120), by hand while the point
    trains: it checkpoints, the task requeues itself, the report keeps waiting, and the requeued task (same
    point folder) resumes from the checkpoint instead of starting over."""
    sweep = [
        "params/tiny/40_forgetting_sweep.yaml",
        "-p",
        "lambdas",
        "[0, 0.9]",
        "-p",
        "seeds",
        "[0]",
        "-p",
        "hari",
        "{max_steps: 60, epochs: 50, sample_limit: 32, log_every: 2}",
        "-p",
        "eval_limit",
        "24",
    ]
    submit = slurm.run("bash", "slurm/forgetting_sweep.sh", *sweep, env=_env(tmp_path), cwd=ROOT, timeout=60)
    assert submit.returncode == 0, submit.stderr
    array_id = int(re.search(r"^array job: (\d+) \(2 points", submit.stdout, re.M).group(1))
    report_id = int(re.search(r"^report job: (\d+)", submit.stdout, re.M).group(1))
    run = tmp_path / "run"

    _wait_for_training(slurm, f"{array_id}_0")
    slurm.run("scancel", "--batch", "--signal=USR1", f"{array_id}_0")
    task = slurm.wait_job(f"{array_id}_0", timeout=240)  # restarts once its credential expires (20 s here)
    assert task.state == "COMPLETED", task.output[-4000:]
    assert "requeueing job" in task.output and "restart 1" in task.output, task.output[-4000:]
    assert slurm.job_fields(f"{array_id}_0")["Restarts"] == "1"
    assert slurm.wait_job(f"{array_id}_1", timeout=120).state == "COMPLETED"

    folder = run / "points" / "lambda0-seed0"
    info = json.loads((folder / "run_info.json").read_text())
    assert 0 < info["resumed_from"] < 60 and info["steps_done"] == 60, info
    steps = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines() if line]
    assert steps == list(range(2, 61, 2)), steps  # resumed, not restarted: each logged step once
    assert json.loads((folder / "result.json").read_text())["lambda_kl"] == 0

    report = slurm.wait_job(report_id, timeout=150)
    assert report.state == "COMPLETED", report.output[-4000:]
    assert _time(slurm.job_fields(report_id)["StartTime"]) >= _time(
        slurm.job_fields(f"{array_id}_0")["EndTime"]
    )
    assert len(json.loads((run / "summary.json").read_text())["points"]) == 2
