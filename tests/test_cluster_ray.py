"""A real two-node Ray cluster on loopback aliases (head 127.0.0.2, worker 127.0.0.3), started
through slurm/ray_cluster.sh as jobs do. Ray rewrites 127.0.0.1, hence the aliases; each node
has its own temp dir and dashboard-agent port, and a small object store."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import pytest
from ray_support import start_head, start_worker

from dsr1kit.cluster import ray as R
from dsr1kit.cluster.rendezvous import free_port

HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"
STORE = 100 * 10**6  # bytes; /dev/shm is shared with everything else on the CI machine


def _free_port_block(n: int = 4) -> int:
    """A port P with P..P+n-1 free (head: GCS, client server, dashboard, agent)."""
    for _ in range(50):
        base = free_port()
        if base + n < 65535 and all(_free(base + i) for i in range(1, n)):
            return base
    raise RuntimeError("no free port block")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture(scope="module")
def cluster():
    """Head + one worker; stopped (every process, both temp dirs) after the module, also on failure."""
    root = Path(tempfile.mkdtemp(prefix="rt"))  # short: Ray's socket paths must stay < 108 chars
    port = _free_port_block()
    nodes = []
    try:
        nodes.append(start_head(HEAD_IP, port, root / "head", "--num-cpus=1", object_store_bytes=STORE))
        nodes.append(
            start_worker(
                f"{HEAD_IP}:{port}",
                WORKER_IP,
                root / "worker",
                "--num-cpus=1",
                agent_port=free_port(),
                object_store_bytes=STORE,
                log=root / "worker.log",
            )
        )
        yield {
            "address": f"{HEAD_IP}:{port}",
            "root": root,
            "state": R.wait_for_cluster(f"{HEAD_IP}:{port}", 2, timeout=180),
        }
    finally:
        for node in reversed(nodes):
            R.stop(node.temp_dir)
            if node.proc:
                node.proc.wait(30)
        (root / "worker.log").unlink(missing_ok=True)
        root.rmdir()


def test_both_nodes_join_with_their_explicit_ips(cluster):
    state = cluster["state"]
    assert [(n["ip"], n["head"]) for n in state["nodes"]] == [(HEAD_IP, True), (WORKER_IP, False)]
    assert state["cpus"] == 2


def test_ray_rows_pass_when_every_node_joined(cluster):
    rows = R.ray_rows(cluster["state"], 2, expected=[("n1", HEAD_IP), ("n2", WORKER_IP)])
    assert [r.status for r in rows] == ["pass"]
    assert f"n1 {HEAD_IP} (head), n2 {WORKER_IP}" in rows[0].measured


def test_wait_times_out_naming_the_missing_node(cluster):
    expected = [("n1", HEAD_IP), ("n2", WORKER_IP), ("n3", "127.0.0.4")]
    with pytest.raises(R.RayClusterIncomplete, match=r"2 of 3 nodes joined.*missing: n3 \(127\.0\.0\.4\)"):
        R.wait_for_cluster(cluster["address"], 3, expected=expected, timeout=1, poll=0.5)


def test_missing_gpus_fail_with_a_fix(cluster):
    rows = R.ray_rows(cluster["state"], 2, gpus=16)
    gpu = next(r for r in rows if r.name == "ray gpus")
    assert gpu.status == "fail" and "0 GPUs" in gpu.measured and "--gpus-per-node" in gpu.fix


def test_unreachable_head_is_a_failing_row_not_a_crash():
    state = R.cluster_state("127.0.0.9:9", timeout=5)
    rows = R.ray_rows(state, 2)
    assert (
        rows[0].status == "fail"
        and "127.0.0.9:9" in rows[0].measured
        and "slurm/ray_cluster.sh" in rows[0].fix
    )


def test_stop_ends_only_that_node_and_removes_its_temp_dir(cluster):
    """A third, separate head on 127.0.0.4 is stopped; the module's cluster keeps both nodes."""
    temp = cluster["root"] / "other"
    start_head("127.0.0.4", _free_port_block(), temp, "--num-cpus=1", object_store_bytes=STORE)
    try:
        assert R._holders(temp)
    finally:
        pids = R.stop(temp)
    assert pids and not temp.exists() and not R._holders(temp)
    assert len(R.cluster_state(cluster["address"])["nodes"]) == 2


def _fake_ray(tmp_path: Path, script: str) -> dict[str, str]:
    """PATH with a `ray` that logs its calls and runs `script` (bash; $n is this call's number)."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ray"
    fake.write_text(
        f"#!/bin/bash\nn=$(( $(wc -l < {tmp_path}/calls 2>/dev/null || echo 0) + 1 ))\n"
        f'echo "$*" >> {tmp_path}/calls\n{script}\n'
    )
    fake.chmod(0o755)
    import sys

    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable}


def _worker(tmp_path: Path, env: dict[str, str]):
    import subprocess

    root = Path(__file__).resolve().parent.parent
    return subprocess.run(
        ["bash", "slurm/ray_cluster.sh", "worker", WORKER_IP, f"{HEAD_IP}:1", str(tmp_path / "t")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_worker_that_fails_to_register_is_started_again(tmp_path):
    """Ray's raylet has a fixed 30 s to register with the head; on a loaded host it can miss it and
    `ray start` exits at once. The worker role stops its leftovers and starts it again."""
    proc = _worker(
        tmp_path, _fake_ray(tmp_path, '[ "$n" -ge 2 ] && exit 0; echo "raylet did not register" >&2; exit 1')
    )
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 2 and all(c.startswith(f"start --address={HEAD_IP}:1") for c in calls)
    assert "did not start (rc=1, try 1 of 3)" in proc.stderr


def test_a_worker_stopped_soon_after_it_started_is_not_started_again(tmp_path):
    """`down` stops the workers; a job that serves for less than a minute or two must not see them restart."""
    proc = _worker(tmp_path, _fake_ray(tmp_path, 'echo "Ray runtime started."; exit 1'))
    assert proc.returncode == 1
    assert len((tmp_path / "calls").read_text().splitlines()) == 1
    assert "did not start" not in proc.stderr and "Ray runtime started." in proc.stdout


def test_a_worker_that_never_starts_gives_up_with_rays_exit_code(tmp_path):
    env = {**_fake_ray(tmp_path, "exit 3"), "DSR1KIT_RAY_WORKER_TRIES": "2"}
    proc = _worker(tmp_path, env)
    assert proc.returncode == 3
    assert len((tmp_path / "calls").read_text().splitlines()) == 2
