"""Start Ray nodes for the tests through slurm/ray_cluster.sh, the helper jobs run, so the flags tested are
the flags used. Stopping goes through dsr1kit.cluster.ray.stop, as in jobs."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dsr1kit.run.paths import PROJECT_ROOT

HELPER = PROJECT_ROOT / "slurm" / "ray_cluster.sh"


@dataclass
class RayNode:
    """One node this process started; `proc` is the blocking worker process (None for a head)."""

    ip: str
    temp_dir: Path
    address: str
    proc: subprocess.Popen | None = field(default=None, repr=False)


def _helper_env(agent_port: int | None, object_store_bytes: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this env's `ray`
    env["PYTHON"] = sys.executable
    if agent_port:
        env["RAY_AGENT_PORT"] = str(agent_port)
    if object_store_bytes:
        env["DSR1KIT_RAY_OBJECT_STORE_BYTES"] = str(object_store_bytes)
    return env


def start_head(
    ip: str,
    port: int,
    temp_dir: str | Path,
    *extra: str,
    agent_port: int | None = None,
    object_store_bytes: int | None = None,
    timeout: float = 120,
) -> RayNode:
    """`ray start --head` with an explicit IP; returns when the head is up."""
    proc = subprocess.run(
        [str(HELPER), "head", ip, str(port), str(temp_dir), *extra],
        capture_output=True,
        text=True,
        env=_helper_env(agent_port, object_store_bytes),
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"ray head on {ip}:{port} did not start:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        )
    return RayNode(ip, Path(temp_dir), f"{ip}:{port}")


def start_worker(
    head_address: str,
    ip: str,
    temp_dir: str | Path,
    *extra: str,
    agent_port: int | None = None,
    object_store_bytes: int | None = None,
    log: str | Path | None = None,
) -> RayNode:
    """A worker that joins `head_address`, in the background (it blocks, as under srun)."""
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen(
        [str(HELPER), "worker", ip, head_address, str(temp_dir), *extra],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=_helper_env(agent_port, object_store_bytes),
    )
    return RayNode(ip, Path(temp_dir), head_address, proc)
