"""slurm/vllm_inference.sbatch on the suite's real Slurm: an evaluation that Slurm stops before its time limit
(USR1, as --signal=B:USR1@120 sends it) requeues itself into the same run folder and asks only the (id,
sample) pairs not answered yet, each ending in the answers file once (real vLLM-CPU, the tiny model); a
VLLM_HOST_IP that is not Ray's address for a node stops the job before vLLM starts."""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
from conftest import ROOT
from infer_support import assert_no_server_left, vllm_processes
from slurm_cluster import slurm  # noqa: F401  (session fixture)

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

# rows of tasks A and B, each asked K times at T 0.7: the test freezes the server (SIGSTOP) once a few
# answers are in and only then sends USR1, so the evaluation cannot finish before the batch shell has seen
# the signal, however fast the machine or slow slurmctld (a race a fast machine once won: 400 of 400)
PER_SET = 50
N = 2 * PER_SET
K = 2


def _lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def test_an_evaluation_requeued_before_its_time_limit_resumes_and_answers_each_id_once(slurm, tmp_path):
    env = _ray_env(tmp_path, "127.0.0.2")
    job_id = slurm.sbatch(
        f"--output={tmp_path}/%x-%j.out", "-N", "1", "--cpus-per-task=2",
        "slurm/vllm_inference.sbatch", "params/tiny/10_vllm_inference.yaml",
        "-p", "lora_adapter", "", "-p", "eval_dataset", "data/task_a_eval.jsonl,data/task_b_eval.jsonl",
        "-p", "eval_limit", str(PER_SET), "-p", "samples_per_question", str(K), "-p", "temperature", "0.7",
        "-p", "concurrency", "1", "-p", "max_new_tokens", "48",
        env=env, cwd=ROOT,
    )  # fmt: skip
    run_dir = tmp_path / "runs" / f"eval-{job_id}"
    answers = run_dir / "answers" / "base.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(_lines(answers)) < 5:
        time.sleep(0.2)
    assert len(_lines(answers)) >= 5, slurm.logs()
    frozen = vllm_processes()
    for proc in frozen:  # the server answers nothing more until the batch shell has seen USR1
        proc.suspend()
    before = len(_lines(answers))
    slurm.run("scancel", "--batch", "--signal=USR1", str(job_id))  # what Slurm sends 120 s before the limit
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and "requeueing before the time limit" not in _output(tmp_path, job_id):
        time.sleep(0.2)
    for proc in frozen:  # the job's own cleanup stops it now
        try:
            proc.resume()
        except psutil.NoSuchProcess:
            pass
    print(f"answered before the requeue: {before} of {K * N}")
    job = slurm.wait_job(job_id, timeout=600)
    out = job.output
    assert job.state == "COMPLETED", out[-4000:]
    assert "requeueing before the time limit" in out and "restart 1" in out
    assert before < K * N
    rows = [row for row in _lines(answers) if not row.get("error")]
    counts = Counter(row["id"] for row in rows)
    expected = {f"{q}#{j}" for q in {row["question"] for row in rows} for j in range(K)}
    assert len(counts) == K * N and set(counts) == expected, counts.most_common(3)
    assert set(counts.values()) == {1}, counts.most_common(3)  # each (id, sample) once
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["n_total"] == N and f"scored on {N} of {N} × {K} samples" in summary["headline"]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"
    assert not list(run_dir.glob("logs/*.pid"))
    assert_no_server_left()


def _output(tmp_path: Path, job_id: int) -> str:
    return "".join(p.read_text(errors="replace") for p in tmp_path.glob(f"*-{job_id}.out"))


def _ray_env(tmp_path: Path, ips: str) -> dict[str, str]:
    return {
        "DSR1KIT_RUNS_DIR": str(tmp_path / "runs"),
        "DSR1KIT_NODE_IPS": ips,
        "NVME_DIR": str(tmp_path / "nvme"),
        "OMP_NUM_THREADS": "1",
        "DSR1KIT_RAY_STOP_ALL": "0",
        "DSR1KIT_RAY_OBJECT_STORE_BYTES": str(100 * 10**6),
        "RAY_TMP_ROOT": tempfile.mkdtemp(prefix="rh"),  # short: Ray socket paths
        "DSR1KIT_EXPECTED_GPUS": "0",
    }


def test_a_vllm_host_ip_exported_for_the_whole_job_stops_it_before_vllm_starts(slurm, tmp_path):
    """VLLM_HOST_IP exported at submit time is one address for every node: right on n1 at most. The job
    stops after Ray is up, naming n2 and both addresses, before any server or model load."""
    env = {**_ray_env(tmp_path, "127.0.0.2 127.0.0.3"), "VLLM_HOST_IP": "127.0.0.2"}
    job_id = slurm.sbatch(
        f"--output={tmp_path}/%x-%j.out", "-N", "2", "--cpus-per-task=2",
        "slurm/vllm_inference.sbatch", "params/tiny/10_vllm_inference.yaml", "-p", "lora_adapter", "",
        env=env, cwd=ROOT,
    )  # fmt: skip
    job = slurm.wait_job(job_id, timeout=300)
    out = job.output
    assert job.state == "FAILED", out[-3000:]
    assert "error: n2: VLLM_HOST_IP=127.0.0.2, but this node's Ray runs at 127.0.0.3" in out, out[-3000:]
    assert "n1: VLLM_HOST_IP 127.0.0.2 is Ray's address for this node" in out
    run_dir = tmp_path / "runs" / f"eval-{job_id}"
    assert not (run_dir / "logs").exists() and not (run_dir / "report.html").exists()  # no server, no run
    assert "ray stopped on n1" in out and "ray stopped on n2" in out


def test_host_ip_problems_name_the_node_and_both_addresses():
    from dsr1kit.cluster.host_ip import problems

    state = {"nodes": [{"ip": "10.0.0.1"}, {"ip": "10.0.0.2"}]}
    assert problems(state, "10.0.0.2", "10.0.0.2", "n2") == []
    (wrong,) = problems(state, "10.0.0.1", "10.0.0.2", "n2")
    assert wrong.startswith("n2: VLLM_HOST_IP=10.0.0.1, but this node's Ray runs at 10.0.0.2")
    (rewritten,) = problems(state, "10.0.0.3", "10.0.0.3", "n3")  # Ray registered another address
    assert rewritten == (
        "n3: Ray registered 10.0.0.1, 10.0.0.2, not this node's address 10.0.0.3: start Ray with "
        "--node-ip-address=10.0.0.3 (slurm/ray_cluster.sh does)"
    )


def test_the_data_parallel_command_of_a_two_node_job_puts_a_replica_on_each_node(slurm, tmp_path):
    """Inside a 2-node job, the plan of notebook 10 with two Ray-placed replicas gives the line the notebook
    would start (the same server_spec): one replica per node, reached at the first node's address, accepted
    by vLLM's parser. (vLLM-CPU cannot start it: its platform has no Ray device to place replicas on.)"""
    env = _ray_env(tmp_path, "127.0.0.2 127.0.0.3")
    job_id = slurm.sbatch(
        f"--output={tmp_path}/%x-%j.out", "-N", "2", "--cpus-per-task=2", "--wrap",
        "bash -c 'source slurm/prelude.sh && dsr1kit plan params/tiny/10_vllm_inference.yaml "
        "-p data_parallel_size 2 -p data_parallel_backend ray -p host $NODE_IP'",
        env=env, cwd=ROOT,
    )  # fmt: skip
    job = slurm.wait_job(job_id, timeout=300)
    out = job.output
    assert job.state == "COMPLETED", out[-3000:]
    assert "vLLM server on 2 node(s), 2 replica(s) × TP 1, 1 per node, replicas reach 127.0.0.2:" in out, out
    assert "--data-parallel-size 2 " in out and "--data-parallel-address 127.0.0.2 " in out
    assert "--data-parallel-backend ray " in out and "accepts it" in out
