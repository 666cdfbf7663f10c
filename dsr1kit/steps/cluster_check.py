"""Notebook 00: this node's environment, the ranks' checks, Ray, the memory plans of the steps to come, a verdict.

Under Slurm one ``srun`` task per node has written its rows to ``rank_results_dir``; outside it,
``local_ranks`` processes run here now. Each failing row carries its fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cluster import checks
from ..cluster.rank_check import RankCheckConfig
from . import FAIL, OK, WARN, StepFailed, Verdict


class ChecksFailed(StepFailed):
    """A check failed: the allocation is not ready for the expensive steps."""


def environment_table() -> dict[str, Any]:
    """Host, Python, key packages and accelerators as this notebook's node sees them."""
    from ..run.environment import collect_environment

    env = collect_environment()
    return {
        "host": env["hostname"],
        "python": env["python"],
        "cpus": env["cpus"],
        "cuda": env["accelerators"]["cuda_available"],
        "git": env["git"]["sha"],
        "slurm job": env["slurm"].get("SLURM_JOB_ID", "-"),
        **{f"pkg {k}": v or "-" for k, v in env["packages"].items()},
    }


@dataclass
class Ranks:
    rows: list[dict[str, Any]]
    folder: Path

    @property
    def node_ips(self) -> dict[str, str]:
        return {r["node_ip"]: r["node"] for r in self.rows if r["node_ip"]}

    @property
    def nodes(self) -> list[str]:
        return sorted({r["node"] for r in self.rows})

    def describe(self) -> str:
        return f"{len(self.rows)} ranks on {len(self.nodes)} nodes, from {self.folder}"


def rank_check_config(p) -> RankCheckConfig:
    """What each rank checks, from notebook 00's parameters (also for `dsr1kit rank-check`)."""
    return RankCheckConfig(
        expected_gpus_per_node=p.expected_gpus_per_node,
        shm_min_free_gib=p.shm_min_free_gib,
        scratch_dir=p.scratch_dir,
        scratch_min_free_gib=p.scratch_min_free_gib,
        allreduce_sizes_mib=tuple(p.allreduce_sizes_mib),
        allreduce_timeout_s=p.allreduce_timeout_s,
        expected_busbw_gbps=p.expected_busbw_gbps,
        local_ranks=p.local_ranks,
        staged_model=p.staged_model,
        staged_model_dir=p.staged_model_dir,
    )


def gather_ranks(p, run_dir: Path) -> Ranks:
    """The per-rank rows written by srun, or those of `local_ranks` processes started here now."""
    from ..cluster import rank_check
    from ..run.paths import resolve

    folder = (
        resolve(p.rank_results_dir)
        if p.rank_results_dir
        else rank_check.run_local(rank_check_config(p), run_dir / "ranks")
    )
    return Ranks(checks.load_ranks(folder), Path(folder))


def ray_check(p, ranks: Ranks) -> tuple[dict | None, list[checks.Row]]:
    """The Ray cluster at ray_address: every node joined, GPUs as expected (None, [] when not asked)."""
    if not p.ray_address:
        return None, []
    from ..cluster import ray as cluster_ray

    state = cluster_ray.cluster_state(p.ray_address)
    rows = cluster_ray.ray_rows(
        state,
        p.expected_nodes,
        p.ray_expected_gpus,
        expected=[(name, ip) for ip, name in ranks.node_ips.items()],
    )
    return state, rows


def step_plans(p) -> list[tuple[str, Any]]:
    """Each plan_files entry planned against the GPUs, host memory and filesystems found here."""
    from ..plan import Machine
    from .plans import plans_for_files

    return plans_for_files(p.plan_files, Machine.detect())


def plans_summary(plans) -> dict[str, list[dict]]:
    """summary.json's memory_plans and disk_plans."""
    return {
        f"{kind}_plans": [plan.to_dict() for _, plan in plans if plan.kind == kind]
        for kind in ("memory", "disk")
    }


def plans_view(plans):
    """The plans of plan_files as tables in the report (text in the job log)."""
    from ..run.viz import plans_view as view

    return view(*(plan for _, plan in plans), empty="no plan_files given: no step planned")


def check_rows(p, ranks: Ranks, ray_rows: list[checks.Row], plans) -> list[checks.Row]:
    """Every row of the report: the ranks' checks, Ray's, and one per memory plan."""
    return (
        checks.gathered_rows(ranks.rows, p.expected_nodes)
        + ray_rows
        + checks.plan_rows(plans, checks.node_name())
    )


def verdict(rows: list[checks.Row]) -> Verdict:
    """fail when any check fails (each with its fix), warn when one warns, else ok."""
    status, lines = checks.verdict(rows)
    return Verdict({checks.PASS: OK, checks.WARN: WARN}.get(status, FAIL), lines[0], lines[1:], ChecksFailed)
