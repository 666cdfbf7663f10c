"""dsr1kit.cluster.slurm and .rendezvous: node lists, rendezvous, the job's request and the --gpus-per-task trap.

Tests that need `scontrol` use the session's real two-node Slurm (tests/slurm_cluster.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from slurm_cluster import slurm  # noqa: F401  (session fixture)

from dsr1kit.cluster import rendezvous as R
from dsr1kit.cluster import slurm as S

NODELISTS = [
    ("n1", ["n1"]),
    ("n[1-2]", ["n1", "n2"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("gpu[8-10],login1", ["gpu8", "gpu9", "gpu10", "login1"]),
    ("rack[1-2]-node[1-2]", ["rack1-node1", "rack1-node2", "rack2-node1", "rack2-node2"]),
]


@pytest.mark.parametrize("nodelist,hosts", NODELISTS)
def test_scontrol_expands_the_nodelist(slurm, nodelist, hosts):
    assert R.expand_nodelist(nodelist, env=slurm.env) == hosts


@pytest.mark.parametrize("nodelist,hosts", NODELISTS)
def test_python_expansion_gives_the_same_hosts_without_scontrol(nodelist, hosts):
    assert R.expand_nodelist(nodelist, use_scontrol=False) == hosts


@pytest.mark.parametrize(
    "job_id,port", [(1, 15001), (12345, 17345), (9999, 24999), (10000, 15000), (987654, 22654)]
)
def test_rendezvous_port_is_15000_plus_jobid_mod_10000(job_id, port):
    assert R.rendezvous_port(job_id) == port


def test_host_in_dns_resolves_to_ipv4():
    assert R.resolve_ipv4("localhost") == ("127.0.0.1", "dns")


def test_slurm_node_not_in_dns_resolves_through_its_nodeaddr(slurm):
    assert R.resolve_ipv4("n1", env=slurm.env) == ("127.0.0.1", "slurm NodeAddr")


def test_unresolvable_host_is_an_error_naming_it(slurm):
    with pytest.raises(R.ResolveError, match="'nowhere-node.invalid'.*not in DNS"):
        R.resolve_ipv4("nowhere-node.invalid", env=slurm.env)


def test_rendezvous_is_first_host_as_ipv4_and_port_from_job_id(slurm):
    env = {**slurm.env, "SLURM_JOB_ID": "12345", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2"}
    job = S.SlurmJob.from_env(env)
    assert job.hostnames == ["n1", "n2"]
    assert S.rendezvous(job, env) == ("127.0.0.1", 17345)
    assert R.job_master_endpoint(env) == ("127.0.0.1", 17345)  # what training uses, without SlurmJob


def test_job_layout_is_read_from_slurm_env():
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_TASKS_PER_NODE": "8(x2)",
        "SLURM_NTASKS": "16",
        "SLURM_GPUS_PER_TASK": "1",
        "SLURM_PROCID": "9",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURMD_NODENAME": "n2",
    }
    job = S.SlurmJob.from_env(env, expand=False)
    assert (job.num_nodes, job.ntasks, job.ntasks_per_node, job.gpus_per_task) == (2, 16, 8, 1)
    assert (job.proc_id, job.local_id, job.node_name) == (9, 1, "n2")
    assert job.layout() == "--nodes=2 --ntasks-per-node=8 --gpus-per-task=1"


def test_outside_slurm_there_is_no_job():
    assert S.SlurmJob.from_env({}) is None


def test_job_request_comes_from_the_controller_not_the_step_env(slurm):
    """Inside `srun --ntasks-per-node=1` the env says 1; the job asked for 8 per node."""
    job_id = slurm.sbatch("--hold", "-N", "2", "--ntasks-per-node=8", "--gpus-per-task=1", "--wrap", "true")
    try:
        assert S.job_request(job_id, env=slurm.env) == {
            "ntasks_per_node": 8,
            "gpus_per_node": None,
            "gpus_per_task": 1,
        }
    finally:
        slurm.run("scancel", str(job_id))


def test_prelude_env_gives_each_node_its_ip_and_the_shared_rendezvous(slurm):
    env = {
        **slurm.env,
        "SLURM_JOB_ID": "12345",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURMD_NODENAME": "n2",
        "SLURM_NODEID": "0",
        S.NODE_IPS_ENV: "127.0.0.2 127.0.0.3",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "dsr1kit.cluster.slurm", "env"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert set(proc.stdout.splitlines()) == {
        "export NODE_IP=127.0.0.3",
        "export NODE_INDEX=1",
        "export MASTER_ADDR=127.0.0.1",
        "export MASTER_PORT=17345",
    }


# -- the --gpus-per-task trap ------------------------------------------------------------------
def _job(per_node: int, gpus_per_node: int | None = None, gpus_per_task: int | None = None) -> S.SlurmJob:
    return S.SlurmJob(
        job_id=1,
        nodelist="n[1-2]",
        num_nodes=2,
        ntasks=2 * per_node,
        ntasks_per_node=per_node,
        gpus_per_node=gpus_per_node,
        gpus_per_task=gpus_per_task,
        hostnames=["n1", "n2"],
    )


@pytest.mark.parametrize(
    "job,cvd,expected,status",
    [
        (_job(1, gpus_per_node=8), "0,1,2,3,4,5,6,7", 8, "pass"),  # the kit's layout
        (_job(8, gpus_per_task=1), "0", 8, "fail"),  # the recipe's trap
        (
            _job(8, gpus_per_node=8, gpus_per_task=1),
            "0,1,2,3,4,5,6,7",
            0,
            "fail",
        ),  # trap, even on a CPU check
        (_job(1, gpus_per_task=1), "0", 8, "fail"),  # one process, one GPU of eight
        (None, "0,1", 8, "fail"),  # narrowed by hand
        (None, None, 0, "pass"),  # laptop, CPU
    ],
    ids=["gpus-per-node", "gpus-per-task-8-tasks", "trap-cpu-run", "gpus-per-task-1-task", "narrowed", "cpu"],
)
def test_gpu_visibility(job, cvd, expected, status):
    env = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
    row = S.gpu_visibility(job, expected, env)
    assert row.status == status, row
    if status == "fail":
        assert "#SBATCH --gpus-per-node=8" in row.fix and "#SBATCH --ntasks-per-node=1" in row.fix
        assert "--gpus-per-task=1" in row.fix


def test_trap_row_says_how_many_gpus_each_process_would_see():
    row = S.gpu_visibility(_job(8, gpus_per_task=1), 8, {"CUDA_VISIBLE_DEVICES": "0"})
    assert "each of the 8 processes per node would see 1 GPU" in row.measured
    assert "--gpus-per-task=1" in row.measured and "invalid device ordinal" in row.fix
