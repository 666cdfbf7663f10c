"""The real slurm/cluster_check.sbatch on the session's two-node Slurm, with the tiny params.

Two jobs, each shared by the tests of one behaviour:
- the kit's layout, `sbatch -N 2`: completes, 2 nodes, all-reduce across them, Ray saw both;
- the recipe's mistakes at once, `--ntasks-per-node=8 --gpus-per-task=1`, a /dev/shm threshold
  above what exists and a scratch dir that does not: the job fails with a complete report whose
  failing rows carry their fixes.
Before both, slurm/stage.sbatch stages the R1-format tiny checkpoint on both nodes from a "shared" hub cache,
each into its own folder ({node} in the path); the first job checks both copies complete, the second a copy
whose shard on n2 was cut short.
Both "nodes" live on this host, so each gets a loopback alias for Ray (DSR1KIT_NODE_IPS) and the
collectives use `lo`; DSR1KIT_RAY_STOP_ALL=0 keeps other Ray users on this machine alive.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from slurm_cluster import slurm  # noqa: F401  (session fixture)

from dsr1kit.embedded import r1_format
from dsr1kit.model import staging

ROOT = Path(__file__).resolve().parent.parent
SBATCH = "slurm/cluster_check.sbatch"
TINY = "params/tiny/00_cluster_check.yaml"
NODE_IPS = {"n1": "127.0.0.2", "n2": "127.0.0.3"}


def submit(slurm, tmp: Path, *sbatch_args: str, params: tuple[str, ...] = ()) -> dict:
    """Run one job to its end; return its state, output, run folder, summary and status."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="rj"))  # short: Ray socket paths
    env = {
        "DSR1KIT_RUNS_DIR": str(tmp / "runs"),
        "DSR1KIT_NODE_IPS": " ".join(NODE_IPS.values()),
        "NCCL_SOCKET_IFNAME": "lo",
        "GLOO_SOCKET_IFNAME": "lo",
        "NVME_DIR": str(tmp / "nvme"),
        "OMP_NUM_THREADS": "1",
        "DSR1KIT_RAY_STOP_ALL": "0",
        "DSR1KIT_RAY_OBJECT_STORE_BYTES": str(100 * 10**6),
        "RAY_TMP_ROOT": str(ray_tmp),
    }
    job_id = slurm.sbatch(f"--output={tmp}/%x-%j.out", *sbatch_args, SBATCH, TINY, *params, env=env, cwd=ROOT)
    job = slurm.wait_job(job_id, timeout=420)
    runs = list((tmp / "runs").iterdir()) if (tmp / "runs").is_dir() else []
    assert len(runs) == 1, f"job {job.state}:\n{job.output[-4000:]}"
    status = json.loads((runs[0] / "status.json").read_text())
    left = sorted(p.name for p in ray_tmp.iterdir())
    ray_tmp.rmdir() if not left else None
    return {
        "job": job,
        "run_dir": runs[0],
        "status": status,
        "summary": status.get("summary", {}),
        "ray_tmp_left": left,
    }


def rows(result: dict, name: str) -> list[dict]:
    return [r for r in result["summary"]["checks"] if r["name"] == name]


REPO = r1_format.REPO_ID


@pytest.fixture(scope="module")
def staged(slurm, tmp_path_factory):
    """`sbatch -N 2 slurm/stage.sbatch REPO --from SHARED --to NODES/{node}/hub`: (job, NODES)."""
    tmp = tmp_path_factory.mktemp("stage")
    r1_format.build()
    shared = r1_format.hf_home() / "hub"  # the rehearsal's hub cache, as a shared copy
    nodes = tmp / "nodes"
    job_id = slurm.sbatch(
        f"--output={tmp}/%x-%j.out",
        "-N",
        "2",
        "slurm/stage.sbatch",
        REPO,
        "--from",
        str(shared),
        "--to",
        f"{nodes}/{{node}}/hub",
        env={"NVME_DIR": str(tmp / "nvme"), "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    return slurm.wait_job(job_id, timeout=300), nodes


def staged_params(nodes: Path) -> tuple[str, ...]:
    return ("-p", "staged_model", REPO, "-p", "staged_model_dir", f"{nodes}/{{node}}/hub")


@pytest.fixture(scope="module")
def two_nodes(slurm, tmp_path_factory, staged):
    return submit(
        slurm,
        tmp_path_factory.mktemp("ok"),
        "-N",
        "2",
        params=("-p", "expected_nodes", "2", *staged_params(staged[1])),
    )


@pytest.fixture(scope="module")
def cut_shard(staged, tmp_path_factory) -> tuple[Path, str]:
    """A copy of the staged nodes' folders where n2's copy of one shard was cut off half-way."""
    nodes = tmp_path_factory.mktemp("cut") / "nodes"
    shutil.copytree(staged[1], nodes, symlinks=True)
    folder = staging.snapshot(nodes / "n2" / "hub", REPO)
    shard = sorted(p for p in folder.iterdir() if p.name.endswith(".safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return nodes, shard.name


@pytest.fixture(scope="module")
def mistakes(slurm, tmp_path_factory, cut_shard):
    return submit(
        slurm,
        tmp_path_factory.mktemp("bad"),
        "-N",
        "2",
        "--ntasks-per-node=8",
        "--gpus-per-task=1",
        "--cpus-per-task=1",
        params=(
            "-p",
            "expected_nodes",
            "2",
            "-p",
            "shm_min_free_gib",
            "1e6",
            "-p",
            "scratch_dir",
            "/nonexistent/nvme",
            *staged_params(cut_shard[0]),
        ),
    )


# -- staging ------------------------------------------------------------------------------------------
def test_stage_job_copies_the_checkpoint_to_each_node_and_checks_it(staged):
    job, nodes = staged
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.output
    for node in ("n1", "n2"):
        assert f"{node}: {REPO}: complete" in job.output, job.output
        assert staging.check(REPO, nodes / node / "hub").complete


def test_cluster_check_passes_a_complete_copy_on_both_nodes(two_nodes):
    found = rows(two_nodes, "model staged")
    assert [(r["host"], r["status"]) for r in found] == [("n1", "pass"), ("n2", "pass")]
    assert all(f"{REPO}: complete" in r["measured"] for r in found)


def test_cluster_check_fails_naming_the_node_and_the_cut_shard(mistakes, cut_shard):
    found = {r["host"]: r for r in rows(mistakes, "model staged")}
    assert (found["n1"]["status"], found["n2"]["status"]) == ("pass", "fail")
    assert cut_shard[1] in found["n2"]["measured"] and "truncated" in found["n2"]["measured"]
    assert "slurm/stage.sbatch" in found["n2"]["fix"] and "-w n2" in found["n2"]["fix"]
    assert "FAIL model staged on n2" in (mistakes["run_dir"] / "report.html").read_text()


# -- the kit's layout -----------------------------------------------------------------------------
def test_two_node_job_completes_with_a_report_listing_both_nodes(two_nodes):
    assert (two_nodes["job"].state, two_nodes["job"].exit_code) == ("COMPLETED", "0:0"), two_nodes[
        "job"
    ].output
    assert two_nodes["status"]["status"] == "ok"
    assert two_nodes["summary"]["nodes"] == ["n1", "n2"]
    assert two_nodes["summary"]["checks_status"] in ("pass", "warn")


def test_allreduce_passes_on_both_nodes_with_a_bandwidth(two_nodes):
    assert [(r["host"], r["status"]) for r in rows(two_nodes, "all-reduce")] == [
        ("n1", "pass"),
        ("n2", "pass"),
    ]
    [bw] = rows(two_nodes, "all-reduce bus bandwidth")
    assert bw["status"] == "pass" and "GB/s" in bw["measured"] and "2 ranks" in bw["measured"]
    measured = two_nodes["summary"]["allreduce"]
    assert measured["world_size"] == 2 and all(
        r["busbw_gbps"] > 0 and r["correct"] for r in measured["results"]
    )
    assert (two_nodes["run_dir"] / "figures" / "allreduce_busbw.png").stat().st_size > 0


def test_ray_saw_both_nodes(two_nodes):
    ray = two_nodes["summary"]["ray"]
    assert [(n["ip"], n["head"]) for n in ray["nodes"]] == [("127.0.0.2", True), ("127.0.0.3", False)]
    [row] = rows(two_nodes, "ray nodes")
    assert row["status"] == "pass" and "n1 127.0.0.2 (head), n2 127.0.0.3" in row["measured"]


def test_each_node_advertises_its_own_ip_and_sees_all_its_gpus(two_nodes):
    assert [r["status"] for r in rows(two_nodes, "advertised ip")] == ["pass", "pass"]
    assert [r["host"] for r in rows(two_nodes, "gpu visibility")] == ["n1", "n2"]  # a missing row fails too
    for row in rows(two_nodes, "gpu visibility"):
        assert row["status"] == "pass" and "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in row["measured"]


def test_report_shows_checks_plot_ray_and_verdict(two_nodes):
    html = (two_nodes["run_dir"] / "report.html").read_text()
    for text in ("all-reduce bus bandwidth", "ray nodes", "127.0.0.3", "Verdict: ", "image/png"):
        assert text in html, text


def test_job_stops_ray_and_removes_its_temp_dirs(two_nodes):
    assert two_nodes["ray_tmp_left"] == []
    assert "ray stopped on n1" in two_nodes["job"].output and "ray stopped on n2" in two_nodes["job"].output


# -- the recipe's mistakes -----------------------------------------------------------------------
def test_gpus_per_task_job_fails_gpu_visibility_with_the_sbatch_fix(mistakes):
    assert mistakes["job"].state == "FAILED" and mistakes["status"]["status"] == "failed"
    assert mistakes["status"]["failed_cell"]["ename"] == "ChecksFailed"
    vis = rows(mistakes, "gpu visibility")
    assert [r["host"] for r in vis] == ["n1", "n2"]
    for row in vis:
        assert row["status"] == "fail" and "--gpus-per-task=1" in row["measured"]
        assert "`#SBATCH --gpus-per-node=8` and `#SBATCH --ntasks-per-node=1`" in row["fix"]


def test_too_small_shm_is_a_failing_row_with_a_cleanup_hint(mistakes):
    assert [r["host"] for r in rows(mistakes, "/dev/shm free")] == ["n1", "n2"]
    for row in rows(mistakes, "/dev/shm free"):
        assert row["status"] == "fail" and "ray stop --force" in row["fix"]


def test_missing_scratch_dir_is_a_failing_row_with_a_fix(mistakes):
    assert [r["host"] for r in rows(mistakes, "scratch dir")] == ["n1", "n2"]
    for row in rows(mistakes, "scratch dir"):
        assert row["status"] == "fail" and "/nonexistent/nvme does not exist" in row["measured"]
        assert "mkdir -p /nonexistent/nvme" in row["fix"]


def test_failing_checks_crash_nothing_the_report_is_complete(mistakes):
    assert [r["status"] for r in rows(mistakes, "ranks reported")] == ["pass"]
    assert [r["status"] for r in rows(mistakes, "all-reduce")] == ["pass", "pass"]
    assert [r["status"] for r in rows(mistakes, "ray nodes")] == ["pass"]
    assert "Verdict: FAIL" in (mistakes["run_dir"] / "report.html").read_text()
    assert mistakes["ray_tmp_left"] == []


# -- the time a job has left (the time plan's check) ----------------------------------------------
def test_a_slurm_job_reads_the_time_it_has_left(slurm, tmp_path):
    script = tmp_path / "left.sh"
    script.write_text(
        "#!/bin/bash\nsource slurm/prelude.sh\n"
        "python -c 'from dsr1kit.cluster.slurm import remaining_seconds; print(\"left\", remaining_seconds())'\n"
    )
    job_id = slurm.sbatch(
        f"--output={tmp_path}/%j.out",
        "--time=00:10:00",
        str(script),
        env={"NVME_DIR": str(tmp_path)},
        cwd=ROOT,
    )
    job = slurm.wait_job(job_id, timeout=120)
    assert job.state == "COMPLETED", job.output
    left = float(job.output.split("left ")[1].split()[0])
    assert 480 < left <= 600
