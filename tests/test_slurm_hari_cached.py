"""slurm/hari_cached.sh on the session's two-node test Slurm: the prefix pass (one task per node, each its
share of the shards; preempted once and requeued), then, only after it completed, the training from the
cache with one process per GPU (2 emulated GPUs per node here: 4 gloo ranks), in one run folder."""

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

NODES, GPUS_PER_NODE = 2, 2


def _env(tmp: Path) -> dict[str, str]:
    return {
        "DSR1KIT_RUN_DIR": str(tmp / "run"),
        "NCCL_SOCKET_IFNAME": "lo",
        "GLOO_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "127.0.0.1",
        "NVME_DIR": str(tmp / "nvme"),
        "OMP_NUM_THREADS": "1",
        # the test nodes: 16 CPUs and 8 emulated GPUs each; 2 GPUs per node → 2 training tasks per node
        "GPUS_PER_NODE": str(GPUS_PER_NODE),
        "PREFIX_CPUS_PER_TASK": "2",
        "CPUS_PER_TASK": "2",
        "SBATCH_ARGS": f"--output={tmp}/%x-%j.out",
    }


def _time(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for_step(slurm, job_id: int, timeout: float = 120) -> None:
    """Until the job's first srun step (<id>.0, not the batch step) runs: the USR1 trap is set by then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if f"{job_id}.0" in slurm.run("squeue", "-h", "-s", "-j", str(job_id), "-o", "%i").stdout.split():
            return
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} started no step: {slurm.job_fields(job_id)}")


def test_prefix_job_then_one_process_per_gpu_trains_from_the_complete_cache(slurm, tmp_path):
    cache = tmp_path / "cache"
    # small micro-batches and shards: the tiny data makes several shards, so both prefix tasks write some
    submit = slurm.run(
        "bash",
        "slurm/hari_cached.sh",
        "params/tiny/20_hari_training.yaml",
        "-N",
        str(NODES),
        "-p",
        "sample_limit",
        "48",
        "-p",
        "epochs",
        "20",
        "-p",
        "max_steps",
        "4",
        "-p",
        "log_every",
        "1",
        "-p",
        "prefix_tokens_per_batch",
        "512",
        "-p",
        "prefix_shard_mib",
        "0.25",
        "-p",
        "prefix_cache",
        str(cache),
        env=_env(tmp_path),
        cwd=ROOT,
        timeout=60,
    )
    assert submit.returncode == 0, submit.stderr
    prefix_id = int(re.search(r"^prefix job: (\d+)", submit.stdout, re.M).group(1))
    train_id = int(re.search(r"^training job: (\d+)", submit.stdout, re.M).group(1))
    run = tmp_path / "run"
    assert f"report: {run}/report.html" in submit.stdout

    # the shapes asked of Slurm: one task per node with the node's GPUs; one task per GPU
    prefix_fields, train_fields = slurm.job_fields(prefix_id), slurm.job_fields(train_id)
    assert prefix_fields["NumNodes"].startswith("2") and prefix_fields["NumTasks"] == "2", prefix_fields
    assert train_fields["NumTasks"] == str(NODES * GPUS_PER_NODE), train_fields
    gpus = f"gpu:{GPUS_PER_NODE}"
    assert gpus in prefix_fields["TresPerNode"] and gpus in train_fields["TresPerNode"]
    assert f"afterok:{prefix_id}" in train_fields["Dependency"], train_fields

    # What Slurm sends 120 s before the prefix job's limit (--signal=B:USR1@120), by hand while its step runs:
    # the job requeues itself, the training keeps waiting, and the requeued pass completes the cache.
    _wait_for_step(slurm, prefix_id)
    slurm.run("scancel", "--batch", "--signal=USR1", str(prefix_id))
    prefix_job = slurm.wait_job(prefix_id, timeout=240)  # restarts once its credential expires (20 s here)
    assert prefix_job.state == "COMPLETED", prefix_job.output[-4000:]
    assert f"requeueing job {prefix_id}" in prefix_job.output and "restart 1" in prefix_job.output
    assert slurm.job_fields(prefix_id)["Restarts"] == "1"
    layout = json.loads((cache / "cache.json").read_text())
    built = {}
    for task in range(NODES):  # each task built its own share (shard i % 2 == task), in one pass or two
        rows = _jsonl(cache / f"passes-task{task}.jsonl")
        assert rows and all(r["tasks"] == NODES for r in rows), rows
        built[task] = sum(r["shards_built"] for r in rows)
        assert built[task] >= 1
        printed = _jsonl(run / "prefix-pass" / f"task{task}.jsonl")  # its JSON line, kept in the run folder
        assert printed[-1]["task"] == task
    assert sum(built.values()) == len(layout["shards"]) >= 2  # no shard built twice

    train_job = slurm.wait_job(train_id, timeout=420)
    assert train_job.state == "COMPLETED", train_job.output[-4000:] + "\n" + prefix_job.output[-2000:]
    train_fields = slurm.job_fields(train_id)
    assert _time(train_fields["StartTime"]) >= _time(slurm.job_fields(prefix_id)["EndTime"]), train_fields
    assert "prefix cache complete: " in train_job.output  # the batch script's check, before any task started

    info = json.loads((run / "run_info.json").read_text())
    assert info["world_size"] == NODES * GPUS_PER_NODE and info["ranks_agree"] and info["steps_done"] == 4, (
        info
    )
    pc = info["prefix_cache"]
    assert pc["folder"] == str(cache) and pc["shards"] == len(layout["shards"])
    assert pc["built_here"] is None, pc  # complete before training started: nothing rebuilt on rank 0
    assert sorted({r["task"] for r in pc["passes"]}) == list(range(NODES))
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((run / "status.json").read_text())["status"] == "ok"
    for rank in range(1, NODES * GPUS_PER_NODE):  # every other rank ran the notebook, in its own folder
        status = json.loads((run / "ranks" / f"rank{rank}" / "status.json").read_text())
        assert status["rank"] == rank and status["status"] == "ok", status
        assert (
            "cache hit" in (run / "ranks" / f"rank{rank}" / "report.html").read_text()
        )  # nothing rebuilt there
    # no rank wrote a pass of its own: the only passes are the prefix job's two
    assert sorted(p.name for p in cache.glob("passes-task*.jsonl")) == [
        f"passes-task{t}.jsonl" for t in range(NODES)
    ]
    html = (run / "report.html").read_text()
    for text in ("Prefix cache", "cache hit", "Verdict: OK"):
        assert text in html, text


def test_training_job_without_a_complete_cache_stops_before_any_task(slurm, tmp_path):
    """Submitted by hand with no prefix pass before it: the batch script refuses, with the cause, instead of
    letting every task load the whole model to fill the cache."""
    empty = tmp_path / "no-cache"
    job_id = slurm.sbatch(
        f"--output={tmp_path}/%x-%j.out",
        "-N",
        "1",
        "--ntasks-per-node=2",
        "--gpus-per-node=2",
        "--cpus-per-task=2",
        "slurm/hari_cached.sbatch",
        "params/tiny/20_hari_training.yaml",
        "-p",
        "sample_limit",
        "48",
        "-p",
        "prefix_cache",
        str(empty),
        env=_env(tmp_path),
        cwd=ROOT,
    )
    job = slurm.wait_job(job_id, timeout=120)
    assert job.state == "FAILED", job.output[-3000:]
    assert "holds no prefix cache" in job.output and "hari_cached.sh" in job.output, job.output[-3000:]
    assert not (tmp_path / "run" / "status.json").exists()  # no notebook started
